"""Time and rank-0 memory of full_state_dict, state_dict and checkpoint.save on the demo GPT.

Run it under torchrun (CPU ranks talk over gloo, GPUs over NCCL):

    torchrun --standalone --nproc-per-node 4 benchmarks/sd_bench.py
    torchrun --standalone --nproc-per-node 4 benchmarks/sd_bench.py --reps 9 --json sd.json

The model is ``examples/train_gpt.py``'s GPT with its defaults (what ``make demo`` trains:
vocabulary 128, 4 blocks, dim 128), one ``fshard.fully_shard`` unit per block plus the root,
and ``torch.optim.AdamW`` after one training step (so the optimizer has its state).

Variants (``--variants`` picks a subset, comma separated), each run ``--warmup`` times untimed,
then ``--reps`` timed repetitions, then once more under the profiler for its memory:

- ``full_state_dict``: ``fshard.full_state_dict(model)`` (``rank0_only=True``,
  ``cpu_offload=True``): every parameter gathered in turn, the plain full tensors on rank 0.
- ``state_dict``: ``fshard.state_dict(model)``: DTensors over the local shards, no copy.
- ``save``: ``fshard.checkpoint.save(dir, model, opt, extra={"step", "rng"})``, a new
  directory per repetition (what a training loop's ``step-N`` saves do).
- ``save-model``: ``fshard.checkpoint.save(dir, model)``: the weights only.

What the table shows, per variant:

- ``min ms`` / ``median ms``: wall time over the repetitions. Each repetition starts after a
  barrier and its time is the slowest rank's (a save is done when every rank is).
- ``alloc peak``: rank 0's high-water mark of torch's CPU allocator above its level when the
  call began, from the profiler's memory events (``profile_memory=True``) of one extra call.
  It counts tensor storage only (what torch's CPU allocator hands out on the calling thread,
  gloo's staging buffers included), not Python objects, pickles or file buffers. The result of
  the call is part of it (``full_state_dict``'s CPU copy of the model is alive at the end).
- ``x(model+largest)``: ``alloc peak`` over the full model's bytes plus its largest
  parameter's bytes, the bound ``full_state_dict`` is meant to stay near.
- ``RSS growth``: rank 0's peak resident set size (``resource.getrusage``'s ``ru_maxrss``) during
  the timed repetitions minus the RSS when they began. Before each repetition the C heap gives
  its free memory back to the OS (glibc's ``malloc_trim``), or memory an earlier call freed
  would be reused without showing. ``ru_maxrss`` is a high-water mark: on Linux it is reset to
  the current RSS before each variant (``/proc/self/clear_refs``), so each variant's figure is
  its own; where that is refused, the figures are the mark's growth over the variants in the
  order they ran (a variant that needs less than one before it shows 0), and the table says so.
  It sees everything (Python objects, pickles, gloo's and the file system's buffers in this
  process), and also what the allocator keeps cached.
- ``disk MiB``: the bytes ``checkpoint.save`` wrote (every rank's files, the manifest included).

On CUDA ranks the JSON also gives rank 0's peak of ``torch.cuda.memory_allocated`` above its
level at the start (one extra call).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fshard
import fshard.checkpoint

# The demo model and data come from the example itself, so the benchmark measures what users run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_args, mib, no_gc, parse_with_variants, print_columns, set_up
from train_gpt import GPT, GPTConfig, synthetic_batch

VARIANTS = ("full_state_dict", "state_dict", "save", "save-model")
CALLS = {
    "full_state_dict": "fshard.full_state_dict(model)",
    "state_dict": "fshard.state_dict(model)",
    "save": "checkpoint.save(dir, model, opt, extra)",
    "save-model": "checkpoint.save(dir, model)",
}


# ---------------------------------------------------------------------------------- measuring


def peak_allocated(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), bytes)``: the CPU allocator's high-water mark during ``fn`` above its start.

    From the profiler's memory events: every allocation and free of torch's CPU allocator on
    this thread while profiling carries the allocator's running total (``total_allocated``).
    The total before the first event (its total minus its size) is the baseline. The running
    total also keeps storages of earlier profiling sessions freed while not profiling, which is
    why the figure is taken relative to this session's first event rather than read as is.
    """
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not events:
        return result, 0
    events.sort()
    baseline = events[0][2] - events[0][1]
    return result, max(0, max(total for _, _, total in events) - baseline)


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def max_rss_bytes() -> int:
    """``ru_maxrss`` in bytes (kilobytes on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc's ``malloc_trim``), so that an RSS
    window starts lean: memory an earlier call freed but the heap kept resident would otherwise
    be reused unseen, and the growth would depend on what ran before."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def reset_max_rss() -> bool:
    """Reset the RSS high-water mark (``ru_maxrss``, ``VmHWM``) to the current RSS, if allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@dataclass
class RssWindow:
    """The growth of ``ru_maxrss`` over a block of code (see the module docstring)."""

    reset: bool = False
    start: int = 0
    growth: int = 0


@contextmanager
def rss_growth() -> Iterator[RssWindow]:
    trim_heap()
    window = RssWindow(reset=reset_max_rss())
    # After a reset ru_maxrss is the RSS now; without one it is the mark so far (in order).
    window.start = max_rss_bytes()
    yield window
    window.growth = max(0, max_rss_bytes() - window.start)


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
            files += 1
    return total, files


# ------------------------------------------------------------------------------------ variants


@dataclass
class Measured:
    times: list[float] = field(default_factory=list)  # this rank's, seconds
    alloc_peak: int = 0
    device_peak: int | None = None
    rss_growth: int = 0
    rss_reset: bool = False
    disk_bytes: int | None = None
    disk_files: int | None = None


def make_call(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, root: str
) -> Callable[[str], Any]:
    """The variant's call; its argument names the repetition (a save's new directory)."""
    if name == "full_state_dict":
        return lambda tag: fshard.full_state_dict(model, rank0_only=True, cpu_offload=True)
    if name == "state_dict":
        return lambda tag: fshard.state_dict(model)
    if name == "save":
        return lambda tag: fshard.checkpoint.save(
            os.path.join(root, f"{name}-{tag}"),
            model,
            optimizer,
            extra={"step": 1, "rng": torch.get_rng_state()},
        )
    if name == "save-model":
        return lambda tag: fshard.checkpoint.save(os.path.join(root, f"{name}-{tag}"), model)
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def measure(
    name: str,
    call: Callable[[str], Any],
    root: str,
    args: argparse.Namespace,
    device: torch.device,
) -> Measured:
    rank = dist.get_rank()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    saves = name.startswith("save")
    out = Measured()

    def clean(tag: str) -> None:
        """Outside the timers: rank 0 removes a save's directory once every rank is done."""
        dist.barrier()
        if saves and rank == 0:
            shutil.rmtree(os.path.join(root, f"{name}-{tag}"), ignore_errors=True)
        dist.barrier()

    for i in range(args.warmup):
        call(f"warmup{i}")
        clean(f"warmup{i}")
    gc.collect()
    dist.barrier()
    with rss_growth() as window:
        for i in range(args.reps):
            trim_heap()
            dist.barrier()
            sync()
            with no_gc():
                start = time.perf_counter()
                result = call(str(i))
                sync()
                out.times.append(time.perf_counter() - start)
            del result
            if saves and rank == 0 and i == 0:
                out.disk_bytes, out.disk_files = dir_bytes(os.path.join(root, f"{name}-{i}"))
            clean(str(i))
    out.rss_growth, out.rss_reset = window.growth, window.reset

    # One more call for the allocator's high-water mark: the profiler slows every op, so it
    # stays out of the timed repetitions.
    gc.collect()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    result, out.alloc_peak = peak_allocated(lambda: call("profiled"))
    if device.type == "cuda":
        out.device_peak = torch.cuda.max_memory_allocated(device) - before
    del result
    clean("profiled")
    return out


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per variant first")
    parser.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints go (a fresh directory under it; default: the system temp dir)",
    )
    args = parse_with_variants(parser, argv, VARIANTS)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = set_up(args)
    if setup is None:
        return 2
    device, rank, world, mesh, shape, cfg = setup

    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    inputs, targets = synthetic_batch(cfg, args.batch, 0, rank, device)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    holder: list[str | None] = [
        tempfile.mkdtemp(prefix="sd_bench-", dir=args.dir) if rank == 0 else None
    ]
    dist.broadcast_object_list(holder, src=0)
    root = str(holder[0])
    try:
        measured = {
            name: measure(name, make_call(name, model, optimizer, root), root, args, device)
            for name in args.variants
        }
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    mine = {name: vars(m) for name, m in measured.items()}
    everyone: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)

    params = list(model.parameters())  # tied weights once
    largest_name, largest = max(
        ((n, p.full_shape.numel() * p.element_size()) for n, p in model.named_parameters()),
        key=lambda item: item[1],
    )
    context = {
        "params": sum(p.full_shape.numel() for p in params),
        "model_bytes": sum(p.full_shape.numel() * p.element_size() for p in params)
        + sum(b.numel() * b.element_size() for b in model.buffers()),
        "largest_param": largest_name,
        "largest_param_bytes": largest,
        "rank0_shard_bytes": sum(p.to_local().numel() * p.element_size() for p in params),
        "rank0_optim_bytes": sum(
            v.numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ),
    }
    if rank == 0:
        results = combine(everyone, args, context)
        print_table(results, args, cfg, shape, world, device, context, root)
        if args.json:
            payload = {
                "config": {
                    **{k: v for k, v in vars(args).items() if k != "json"},
                    "mesh": list(shape),
                    "world": world,
                    "device": device.type,
                },
                "model": context,
                "results": results,
            }
            Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
            print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------ results


def combine(
    everyone: list[dict[str, Any]], args: argparse.Namespace, context: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per variant figures over all ranks (rank 0 only)."""
    bound = context["model_bytes"] + context["largest_param_bytes"]
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants:
        per_rank = [ranks[name] for ranks in everyone]
        times = [max(r["times"][i] for r in per_rank) for i in range(args.reps)]  # slowest rank
        zero = per_rank[0]
        entry: dict[str, Any] = {
            "call": CALLS[name],
            "time_ms_min": 1e3 * min(times),
            "time_ms_median": 1e3 * statistics.median(times),
            "time_ms_all": [1e3 * t for t in times],
            "rank0_alloc_peak_bytes": zero["alloc_peak"],
            "rank0_alloc_peak_over_model_plus_largest": zero["alloc_peak"] / bound,
            "alloc_peak_bytes_per_rank": [r["alloc_peak"] for r in per_rank],
            "rank0_rss_growth_bytes": zero["rss_growth"],
            "rss_growth_bytes_per_rank": [r["rss_growth"] for r in per_rank],
            "rss_mark_reset_per_variant": all(r["rss_reset"] for r in per_rank),
        }
        if zero["device_peak"] is not None:
            entry["rank0_device_peak_bytes"] = zero["device_peak"]
        if zero["disk_bytes"] is not None:
            entry["disk_bytes"] = zero["disk_bytes"]
            entry["disk_files"] = zero["disk_files"]
        results[name] = entry
    return results


def print_table(
    results: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    cfg: GPTConfig,
    shape: tuple[int, ...],
    world: int,
    device: torch.device,
    context: dict[str, Any],
    root: str,
) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    print(
        f"GPT {context['params'] / 1e6:.2f}M params ({cfg.layers} blocks, dim {cfg.dim}, vocab {cfg.vocab}); "
        f"mesh {'x'.join(map(str, shape))} on {world} ranks, {device.type}/{backend}; "
        f"checkpoints under {os.path.dirname(root)}"
    )
    print(
        f"full model {mib(context['model_bytes'])} MiB; largest parameter "
        f"{context['largest_param']} {mib(context['largest_param_bytes'])} MiB; rank 0 holds "
        f"{mib(context['rank0_shard_bytes'])} MiB of shards + {mib(context['rank0_optim_bytes'])} MiB AdamW state"
    )
    print(
        f"{args.reps} timed repetitions per variant after {args.warmup} warm-up; time = slowest "
        "rank, barriers around each; memory = rank 0"
    )
    columns = [
        ("variant", "<"), ("call", "<"), ("min ms", ">"), ("median ms", ">"),
        ("alloc peak MiB", ">"), ("x(model+largest)", ">"), ("RSS growth MiB", ">"),
        ("disk MiB", ">"),
    ]  # fmt: skip
    rows = []
    for name, e in results.items():
        rows.append([
            name,
            e["call"],
            f"{e['time_ms_min']:.1f}",
            f"{e['time_ms_median']:.1f}",
            mib(e["rank0_alloc_peak_bytes"]),
            f"{e['rank0_alloc_peak_over_model_plus_largest']:.2f}",
            mib(e["rank0_rss_growth_bytes"]),
            mib(e["disk_bytes"]) if "disk_bytes" in e else "-",
        ])  # fmt: skip
    print_columns(columns, rows)
    print(
        "alloc peak: torch CPU allocator high-water mark above the start of the call (profiler "
        "memory events; the result included); RSS growth: ru_maxrss over the timed repetitions "
        "minus the RSS at their start"
    )
    if not all(e["rss_mark_reset_per_variant"] for e in results.values()):
        print(
            "note: the RSS high-water mark could not be reset between variants: RSS growth is "
            "the mark's growth in the order the variants ran (a later variant that needs less "
            "than an earlier one shows 0)"
        )


if __name__ == "__main__":
    sys.exit(main())
