"""Train a small HuggingFace BERT with fshard, configured by an accelerate FSDP config file.

How to run (CPU with gloo, or GPUs with NCCL; needs `transformers`: pip install -e ".[hf]"):

    fshard launch --config_file examples/accelerate_config.yaml examples/hf_bert.py
    fshard launch --nproc 2 examples/hf_bert.py --config_file examples/accelerate_config.yaml --steps 5
    torchrun --standalone --nproc-per-node 2 examples/hf_bert.py --config_file examples/accelerate_config.yaml

The model is transformers' `BertForSequenceClassification` (a `BertModel` plus a classifier head)
built from a small `BertConfig` with random weights: nothing is downloaded. The script calls
`fshard.from_config(model)`, which applies the config exactly as in the HuggingFace FSDP guide
(examples/accelerate_config.yaml is that guide's sample file): each `BertLayer` becomes an fshard
unit (TRANSFORMER_BASED_WRAP), then the root; FULL_SHARD (strategy 1); CPU offload; bf16
mixed precision; BACKWARD_PRE prefetch; rank 0's weights broadcast to every rank. Under
`fshard launch --config_file F` the script finds F through $FSHARD_CONFIG_FILE; `--config_file`
after the script names it directly; with neither, examples/accelerate_config.yaml is used.

The task is synthetic and learnable: label-1 sequences draw their tokens from the upper half of
the vocabulary, label-0 sequences from the lower half.
Rank 0 prints the units the sharded model has (read from the model after `from_config`, each
with its mesh, `reshard_after_forward`, offload and mixed-precision settings), then the loss of
every step. `--save DIR` writes a checkpoint at the end in the config's `fsdp_state_dict_type`:
SHARDED_STATE_DICT -> `fshard.checkpoint.save` (a directory of shards; `fshard consolidate DIR
model.safetensors` makes one file of it), FULL_STATE_DICT -> `DIR/model.safetensors` written by
rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fshard

try:
    from transformers import BertConfig, BertForSequenceClassification
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("examples/hf_bert.py needs transformers: pip install 'fshard[hf]' (or -e '.[hf]')")

DEFAULT_CONFIG = Path(__file__).with_name("accelerate_config.yaml")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config_file", "--config-file", default=None,
                        help="accelerate config (default: $FSHARD_CONFIG_FILE, else accelerate_config.yaml here)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="BERT's hidden and attention dropout (0 makes runs comparable step by step)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, metavar="DIR", help="write a checkpoint here at the end")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> BertForSequenceClassification:
    """The small random-weight BERT classifier of ``args`` (the same weights for the same seed)."""
    bert_config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(64, args.seq_len),
        num_labels=2,
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
    )
    torch.manual_seed(args.seed)  # the same random weights everywhere (rank 0's win anyway)
    return BertForSequenceClassification(bert_config)


def describe_units(model: torch.nn.Module) -> list[str]:
    """One line per fshard unit of ``model``, in module order, with the settings it runs with
    (read back from the sharded model by ``fshard.units``)."""

    def dtype_name(dtype: torch.dtype | None) -> str:
        return "-" if dtype is None else str(dtype).removeprefix("torch.")

    lines = []
    for unit in fshard.units(model):
        mp = unit.mp_policy
        precision = (
            "none" if mp is None
            else f"param {dtype_name(mp.param_dtype)}, reduce {dtype_name(mp.reduce_dtype)}, "
                 f"output {dtype_name(mp.output_dtype)}"
        )  # fmt: skip
        kinds = "+".join(type(m).__name__ for m in unit.modules)
        lines.append(
            f"unit {unit.fqn or '(root)'} [{kinds}]: "
            f"mesh {'x'.join(map(str, unit.mesh.shape))}, "
            f"reshard_after_forward={unit.reshard_after_forward}, "
            f"offload={unit.offload_policy is not None}, mixed precision: {precision}"
        )
    return lines


def make_batch(args: argparse.Namespace, step: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Label-1 sequences use the upper half of the vocabulary, label-0 ones the lower half."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 1_009 + rank)
    labels = torch.randint(0, 2, (args.batch_size,), generator=gen)
    half = args.vocab // 2
    ids = torch.randint(1, half, (args.batch_size, args.seq_len), generator=gen) + labels[:, None] * half
    ids[:, 0] = 0  # [CLS]
    mask = torch.ones_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def main() -> None:
    args = parse_args()
    config_source = args.config_file or os.environ.get("FSHARD_CONFIG_FILE") or str(DEFAULT_CONFIG)
    cfg = fshard.load_config(config_source)  # validates the file before any process starts work

    # A GPU per local rank (NCCL needs one each), unless the config says use_cpu; a machine
    # with fewer GPUs than ranks runs CPU ranks over gloo.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = not cfg.launch.use_cpu and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    model = build_model(args)
    model.to(device)  # buffers compute here too; with CPU offload fshard keeps the shards on the CPU

    fshard.from_config(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        params = list(model.parameters())
        n_params = sum(p.full_shape.numel() if fshard.is_sharded(p) else p.numel() for p in params)
        print(
            f"BERT: {args.layers} layers, {n_params / 1e6:.2f}M parameters, {world} rank(s) on {device.type}; "
            f"config {config_source}: {cfg.sharding_strategy.name}, offload={cfg.offload_params}, "
            f"mixed_precision={cfg.mixed_precision.value}",
            flush=True,
        )
        # What from_config built, read back from the model (not from the config).
        print(f"sharded parameters: {sum(fshard.is_sharded(p) for p in params)} of {len(params)}", flush=True)
        for line in describe_units(model):
            print(line, flush=True)

    start = time.perf_counter()
    loss = torch.zeros(())
    for step in range(args.steps):
        batch = make_batch(args, step, rank, device)
        loss = model(**batch).loss
        loss.backward()
        fshard.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().reshape(1).to(device)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {mean.item() / world:.4f}", flush=True)
    if not torch.isfinite(loss.detach()).all():
        raise SystemExit(f"rank {rank}: the loss is not finite: {loss.item()}")

    if args.save:
        save(args.save, model, opt, cfg, rank)
    if rank == 0:
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
    dist.destroy_process_group()


def save(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: fshard.FSDPConfig, rank: int) -> None:
    """Honour fsdp_state_dict_type, as accelerate's save_state would."""
    if cfg.state_dict_type == "SHARDED_STATE_DICT":
        fshard.checkpoint.save(path, model, opt)
        where = path
    else:
        from safetensors.torch import save_file

        full = fshard.full_state_dict(model)  # collective; plain tensors on rank 0 only
        where = os.path.join(path, "model.safetensors")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            save_file({k: v.contiguous() for k, v in full.items()}, where, metadata={"format": "pt"})
    if rank == 0:
        print(f"saved {cfg.state_dict_type.value} to {where}", flush=True)


if __name__ == "__main__":
    main()
