"""Gradient accumulation: all-gathers and step time with and without keeping units gathered.

Run it under torchrun (CPU ranks talk over gloo):

    torchrun --standalone --nproc-per-node 4 benchmarks/accum_bench.py --micro 4

Every variant trains its own copy of ``examples/train_gpt.py``'s GPT (same seed, same batches)
with ``torch.optim.AdamW``; an optimizer step accumulates ``--micro`` micro-batches, all but the
last under ``fshard.no_sync``. Variants: ``reshard_after_forward`` True (ZeRO-3) or False
(ZeRO-2) for the blocks, each with ``fshard.set_reshard_after_backward(model, False)`` (keep:
the next micro-batch reuses the gathered parameters while the shards are unchanged) or not.
The variants take turns step by step, so a noisy machine slows them alike.

Printed per variant: the median optimizer-step time (slowest rank), the all-gathers one
steady optimizer step issues on rank 0 and the bytes they gather, and the final loss (the same
for every variant: keeping changes what is communicated, not what is computed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fshard
from fshard.testing import trace_collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, GPTConfig  # (the example is not a package)

VARIANTS = (("zero3", True, False), ("zero3-keep", True, True), ("zero2", False, False), ("zero2-keep", False, True))


def build(cfg: GPTConfig, mesh, reshard_after_forward: bool, keep: bool) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_reshard_after_backward(model, not keep)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def optimizer_step(model: GPT, opt: torch.optim.Optimizer, cfg: GPTConfig, args: argparse.Namespace, step: int) -> float:
    total = 0.0
    for micro in range(args.micro):
        gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
        tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=gen)
        last = micro == args.micro - 1
        with fshard.no_sync(model) if not last else torch.enable_grad():
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) / args.micro
            loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad()
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    args = parser.parse_args(argv)
    if args.micro < 1 or args.steps < 1:
        parser.error("--micro and --steps must be at least 1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig(vocab=128, seq=args.seq, dim=args.dim, heads=4, layers=args.layers)
    variants = {name: build(cfg, mesh, raf, keep) for name, raf, keep in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in variants}
    traffic: dict[str, tuple[int, int]] = {}
    losses: dict[str, float] = {}
    for step in range(args.warmup + 1 + args.steps):
        names = list(variants)
        names = names[step % len(names) :] + names[: step % len(names)]
        for name in names:
            model, opt = variants[name]
            if step == args.warmup:  # one traced step, untimed
                with trace_collectives() as records:
                    losses[name] = optimizer_step(model, opt, cfg, args, step)
                gathers = [r for r in records if r.op == "all_gather"]
                traffic[name] = (len(gathers), sum(r.output_bytes for r in gathers))
                continue
            dist.barrier()
            start = time.perf_counter()
            losses[name] = optimizer_step(model, opt, cfg, args, step)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step > args.warmup:
                times[name].append(elapsed.item())
    if rank == 0:
        print(
            f"GPT ({args.layers} blocks, dim {args.dim}, seq {args.seq}) on {world} gloo ranks; "
            f"{args.micro} micro-batches of {args.batch} per optimizer step, {args.steps} measured steps"
        )
        print(f"{'variant':<11} {'step ms':>8} {'all-gathers':>12} {'gathered MiB':>13} {'final loss':>11}")
        for name in variants:
            count, nbytes = traffic[name]
            print(
                f"{name:<11} {statistics.median(times[name]) * 1e3:8.1f} {count:12d} "
                f"{nbytes / 2**20:13.2f} {losses[name]:11.6f}"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
