"""Train a small HuggingFace Llama with the transformers Trainer on fshard.

How to run (CPU with gloo, or GPUs with NCCL; needs the hf extra: pip install -e ".[hf]"):

    fshard launch --config_file examples/hf_trainer.yaml examples/hf_trainer.py

examples/hf_trainer.yaml is the HuggingFace FSDP guide's sample accelerate config with the block
class set to LlamaDecoderLayer. Nothing is downloaded: rank 0 builds a small LlamaForCausalLM from
a config with random weights and saves it to OUTPUT/pretrained, so that `from_pretrained` has a
directory, as it would with a real checkpoint. Then, as a user's Trainer script does, with two
fshard lines:

- `fshard.hf.from_pretrained(AutoModelForCausalLM, path)`: rank 0 reads the weights, the other
  ranks build the model on the meta device, the model is sharded as the config file says and
  rank 0's weights are broadcast;
- `fshard.hf.Trainer` in place of `transformers.Trainer`: the Trainer's loop (gradient
  accumulation, clipping by the full gradient's norm, logging, evaluation, save_steps
  checkpoints) on the sharded model, and `trainer.save_model(...)` writes what
  `save_pretrained` writes.

The task is synthetic and learnable: each sequence counts up from a random token by a random
step (modulo the vocabulary). At the end rank 0 loads the saved model into a plain
`LlamaForCausalLM` and prints its evaluation loss next to the Trainer's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

try:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

    import fshard.hf
except ImportError as exc:  # pragma: no cover - depends on the environment
    sys.exit(f"examples/hf_trainer.py needs the hf extra ({exc}): pip install 'fshard[hf]'")


class Counting(torch.utils.data.Dataset):
    """Sequences ``start, start + step, start + 2 * step, ...`` modulo ``vocab``."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=gen)
        step = torch.randint(1, 4, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=16)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    output_dir = args.output_dir or os.path.join(tempfile.gettempdir(), "fshard-hf-trainer")
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=1e-2,
        max_steps=args.steps,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=15,
        save_steps=15,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available(),  # without CUDA, transformers runs distributed only so
        seed=0,
    )
    _ = training_args.device  # starts the process group (torchrun / fshard launch environment)
    rank = dist.get_rank()
    pretrained = os.path.join(output_dir, "pretrained")
    if rank == 0:  # a stand-in for a downloaded checkpoint
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(64, args.seq_len),
            tie_word_embeddings=True,
        )
        LlamaForCausalLM(config).save_pretrained(pretrained)
    dist.barrier()

    start = time.perf_counter()
    model = fshard.hf.from_pretrained(AutoModelForCausalLM, pretrained)  # the config file's sharding
    if rank == 0:
        units = [unit.fqn or "(root)" for unit in fshard.units(model)]
        print(f"loaded {pretrained} sharded over {dist.get_world_size()} ranks: units {units}")

    trainer = fshard.hf.Trainer(
        model=model,
        args=training_args,
        train_dataset=Counting(512, args.seq_len, args.vocab, seed=1),
        eval_dataset=Counting(64, args.seq_len, args.vocab, seed=2),
    )
    trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(output_dir, "final")
    trainer.save_model(final)  # every rank: fshard.hf.save_pretrained

    if rank == 0:
        print(f"saved {sorted(os.listdir(final))} to {final}")
        plain = LlamaForCausalLM.from_pretrained(final)  # an ordinary, unsharded model
        batch = Counting(64, args.seq_len, args.vocab, seed=2).ids
        with torch.no_grad():
            loss = plain(batch, labels=batch).loss.item()
        print(
            f"eval loss: Trainer (bf16 compute) {metrics['eval_loss']:.4f}, "
            f"plain model from {final} (fp32) {loss:.4f}"
        )
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
