"""A user's transformers Trainer script, run by tests/test_hf_trainer.py under torchrun.

``--mode ddp`` is the plain script (``transformers.Trainer``: DDP under torchrun); ``--mode
fshard`` changes the one import to ``fshard.hf.Trainer`` and adds an ``fsdp_config``;
``--mode fshard-file`` changes only the import (the config is the file $FSHARD_CONFIG_FILE
names, as ``fshard launch --config_file`` sets it). Rank 0
prints one ``LOG {json}`` line per logged step (loss, grad_norm) and ``SAVED``/``DONE`` lines.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers import Trainer as HFTrainer


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (the same on every rank, for the same seed)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def pretrained_dir(path: str) -> str:
    """A small Llama with random weights, saved once (rank 0; the others wait for the file)."""
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(
        os.path.join(path, "config.json")
    ):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        choices=["fshard", "fshard-file", "ddp"],
        required=True,
        help="fshard-file: no fsdp in TrainingArguments, the config file of $FSHARD_CONFIG_FILE",
    )
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--global-batch", type=int, default=4, help="sequences per micro-batch, all ranks"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-model", default=None)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode.startswith("fshard"):
        from fshard.hf import Trainer  # the one changed line
    else:
        Trainer = HFTrainer
    fsdp = {}
    if args.mode == "fshard":
        fsdp = {
            "fsdp": True,
            "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        }

    import torch.distributed as dist

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.global_batch // world,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=3e-3,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        **fsdp,
    )
    _ = training_args.device  # the process group, before rank 0 writes the model
    if dist.get_rank() == 0:
        pretrained_dir(args.model_dir)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(args.model_dir)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Tokens(64, 16, 96, seed=1),
        eval_dataset=Tokens(8, 16, 96, seed=2),
    )
    trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print("METRICS", metrics, flush=True)
    if args.save_model:
        trainer.save_model(args.save_model)
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(
                    "LOG " + json.dumps({k: entry[k] for k in ("step", "loss", "grad_norm")}),
                    flush=True,
                )
        print("EVAL " + json.dumps({"eval_loss": metrics["eval_loss"]}), flush=True)
        print("DONE", flush=True)
    # An exit with the process group still up can abort in gloo's threads (std::terminate).
    dist.destroy_process_group()
    # And freeing DDP's reducer when main returns can deadlock: it drops the last reference to
    # the gloo process group, whose destructor joins gloo's worker threads while holding the
    # GIL, and a worker may be freeing a finished all-gather's tensor, which needs the GIL
    # (seen once in CI, `--mode ddp`: py-spy showed ~ProcessGroupGloo in std::thread::join and
    # the worker in gil_scoped_acquire). Everything the test reads is printed: leave now.
    os._exit(0)


if __name__ == "__main__":
    main()
