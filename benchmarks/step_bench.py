"""Step-time, memory and traffic of fshard next to DDP and torch's FSDP2, on the demo GPT.

Run it under torchrun (CPU ranks talk over gloo, GPUs over NCCL):

    torchrun --standalone --nproc-per-node 4 benchmarks/step_bench.py --mesh 4
    torchrun --standalone --nproc-per-node 4 benchmarks/step_bench.py --mesh 2x2 --json out.json

Every variant gets its own copy of ``examples/train_gpt.py``'s GPT (same seed, so the same
initial weights) and its own ``torch.optim.AdamW``, and all of them train on the same batches.
After ``--warmup`` untimed steps and one untimed traced step, the variants take turns, step by
step, for ``--steps`` measured steps (the order rotates every step), so a noisy neighbour on the
machine slows every variant alike instead of whichever happened to run at that moment.
The traced step is steady-state from ``--warmup 2`` on (DDP rebuilds its buckets on its second
step).

Variants (``--variants`` picks a subset, comma separated):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over all ranks.
- ``fshard``: ``fshard.fully_shard`` on every block, then the root (default prefetch).
- ``fshard-noprefetch``: the same with ``set_prefetch(model, forward=False, backward="NO_PREFETCH")``.
- ``fshard-zero2``: the same with ``reshard_after_forward=False`` (ZeRO-2 / SHARD_GRAD_OP).
- ``fshard-int``: the same with ``reshard_after_forward=S // 2`` on the blocks (S: the shard
  dimension's size): each block keeps half of its parameters from forward to backward, gathered
  back over S / 2 ranks (with S = 2 that is 1: ZeRO-2).
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then the root.

On a 2D mesh (``--mesh RxS``) the sharded variants are hybrid (replicate over R, shard over S);
DDP always replicates over every rank, which gives the same averaged gradients.

What the table shows, per variant:

- ``step ms``: forward + backward + ``optimizer.step()`` (and ``zero_grad``). Each measured step
  starts after a barrier; a step's time is that of the slowest rank (they finish together anyway,
  the collectives see to that); the table gives the median and the 25th-75th percentiles.
- ``state MiB``: this rank's bytes of parameters + gradients + AdamW state after the last step,
  counted from the storages of the actual tensors (the local shards for fshard and FSDP2, padding
  included); the largest over ranks. DDP's reducer buckets are not counted.
- ``gathered peak``: fshard's ``memory_stats().peak_gathered_bytes`` in a step (reset before each
  step): full parameters and all-gather buffers alive at once. Largest over steps and ranks.
- ``comm``: the collectives of one steady-state step on one rank and the bytes they move. fshard's
  come from ``fshard.testing.trace_collectives``; DDP's and FSDP2's from a ``TorchDispatchMode``
  on the ``c10d`` ops (the interception torch's ``CommDebugMode`` uses, which counts calls but not
  bytes); fshard's are measured that way too, and the JSON says whether the two agree.
  ``payload`` is the size of the collective buffers (all-gather output, reduce-scatter input,
  all-reduce tensor); ``sent`` is what one rank sends with ring algorithms:
  ``(n-1)/n`` of it for all-gather and reduce-scatter, ``2(n-1)/n`` for all-reduce.
- ``loss``: the mean over ranks of the last step's loss, and the largest difference from DDP's
  loss at any step on any rank (all variants compute the same thing up to rounding).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

import fshard
from fshard.testing import CollectiveRecord, trace_collectives

# The demo model and data come from the example itself, so the benchmark measures what users run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_args, mib, no_gc, parse_with_variants, print_columns, set_up
from train_gpt import GPT, GPTConfig, synthetic_batch

VARIANTS = ("ddp", "fshard", "fshard-noprefetch", "fshard-zero2", "fshard-int", "fsdp2")


# ------------------------------------------------------------------------------------ variants


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    is_fshard: bool
    times: list[float] = field(default_factory=list)  # this rank's measured step times, seconds
    losses: list[float] = field(default_factory=list)  # this rank's loss at every step
    gathered_peaks: list[int] = field(default_factory=list)  # fshard only, per measured step
    gathered_baseline: int = 0  # fshard gathered bytes at a step's start (should be 0)
    comm: dict[str, Any] = field(default_factory=dict)
    state: dict[str, int] = field(default_factory=dict)


def build_variant(
    name: str, cfg: GPTConfig, mesh: DeviceMesh, device: torch.device, args: argparse.Namespace
) -> Variant:
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    is_fshard = name.startswith("fshard")
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    elif is_fshard:
        reshard = name != "fshard-zero2"
        blocks: bool | int = reshard
        if name == "fshard-int":
            blocks = max(1, mesh.size(mesh.ndim - 1) // 2)
        for block in model.blocks:
            fshard.fully_shard(block, mesh=mesh, reshard_after_forward=blocks)
        fshard.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        if name == "fshard-noprefetch":
            fshard.set_prefetch(model, forward=False, backward="NO_PREFETCH")
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        for block in model.blocks:
            fsdp2_fully_shard(block, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
    else:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return Variant(name, model, optimizer, is_fshard)


def train_step(variant: Variant, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    variant.optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(variant.model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    variant.optimizer.step()
    return loss.detach()


# ---------------------------------------------------------------------------------- measuring


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds (a DTensor's local shard, else itself)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()
    return t


def storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(variant: Variant) -> dict[str, int]:
    params = list(variant.model.parameters())
    optim = [
        v
        for s in variant.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "params": storage_bytes(iter(params)),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optim": storage_bytes(iter(optim)),
    }


@dataclass
class Collective:
    op: str  # all_gather, reduce_scatter, all_reduce, broadcast, ...
    group_size: int
    payload: int  # bytes of the collective's buffer (see the module docstring)

    @property
    def sent(self) -> float:
        """Bytes one rank sends with a ring algorithm."""
        n = self.group_size
        if n <= 1:
            return 0.0
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return factor * self.payload


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class C10dTraffic(TorchDispatchMode):
    """Records every ``c10d`` collective op dispatched on this thread, with its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "c10d":
            name = func._opname
            size = next(
                (
                    dist.ProcessGroup.unbox(a).size()
                    for a in args
                    if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
                ),
                1,
            )
            if name.startswith("allgather") or name.startswith("_allgather"):
                self.records.append(Collective("all_gather", size, _nbytes(args[0])))
            elif "reduce_scatter" in name:
                self.records.append(Collective("reduce_scatter", size, _nbytes(args[1])))
            elif name.startswith("allreduce"):
                self.records.append(Collective("all_reduce", size, _nbytes(args[0])))
            elif name not in ("barrier", "monitored_barrier"):
                op = name.rstrip("_").lstrip("_")
                self.records.append(Collective(op, size, _nbytes(args[0])))
        return func(*args, **(kwargs or {}))


def from_fshard_record(record: CollectiveRecord) -> Collective:
    payload = record.input_bytes if record.op == "reduce_scatter" else record.output_bytes
    return Collective(record.op, record.group_size, payload)


def summarize(records: list[Collective]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.op] = counts.get(r.op, 0) + 1
    return {
        "counts": counts,
        "payload_bytes": sum(r.payload for r in records),
        "sent_bytes": round(sum(r.sent for r in records)),
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    args = parse_with_variants(parser, argv, VARIANTS)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # FSDP2's view-output notice
    setup = set_up(args)
    if setup is None:
        return 2
    device, rank, world, mesh, shape, cfg = setup

    variants = [build_variant(name, cfg, mesh, device, args) for name in args.variants]
    total_steps = args.warmup + 1 + args.steps  # warm-up, one traced step, measured steps
    batches = [synthetic_batch(cfg, args.batch, step, rank, device) for step in range(total_steps)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    for step, (inputs, targets) in enumerate(batches):
        traced = step == args.warmup
        measured = step > args.warmup
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for variant in order:
            if traced:
                with trace_collectives() as fshard_records, C10dTraffic() as c10d:
                    loss = train_step(variant, inputs, targets)
                variant.comm = {"c10d": summarize(c10d.records)}
                if variant.is_fshard:
                    variant.comm["fshard"] = summarize(
                        [from_fshard_record(r) for r in fshard_records]
                    )
            elif measured:
                if variant.is_fshard:
                    fshard.reset_peak_memory_stats()
                    variant.gathered_baseline = max(
                        variant.gathered_baseline, fshard.memory_stats().gathered_bytes
                    )
                dist.barrier()
                sync()
                with no_gc():
                    start = time.perf_counter()
                    loss = train_step(variant, inputs, targets)
                    sync()
                    variant.times.append(time.perf_counter() - start)
                if variant.is_fshard:
                    variant.gathered_peaks.append(fshard.memory_stats().peak_gathered_bytes)
            else:
                loss = train_step(variant, inputs, targets)
            variant.losses.append(loss.item())
        if measured:
            gc.collect()  # between rounds, outside every timer

    for variant in variants:
        variant.state = state_bytes(variant)  # after the last step: grads and AdamW state exist

    mine = {
        v.name: {
            "times": v.times,
            "losses": v.losses,
            "gathered_peaks": v.gathered_peaks,
            "gathered_baseline": v.gathered_baseline,
            "state": v.state,
            "comm": v.comm,
        }
        for v in variants
    }
    everyone: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)

    if rank == 0:
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        results = combine(everyone, args)
        print_table(results, args, cfg, shape, world, device, n_params)
        if args.json:
            payload = {
                "config": {
                    **{k: v for k, v in vars(args).items() if k != "json"},
                    "mesh": list(shape),
                    "world": world,
                    "device": device.type,
                    "params": n_params,
                },
                "results": results,
            }
            Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
            print(f"wrote {args.json}")

    # Drop DDP's reducer (it holds a process group) before tearing the groups down: destroying a
    # gloo group from a destructor at interpreter exit can deadlock (see examples/train_gpt.py).
    del variants
    gc.collect()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------ results


def combine(everyone: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per variant figures over all ranks (rank 0 only)."""
    results: dict[str, dict[str, Any]] = {}
    ddp_losses = [ranks["ddp"]["losses"] for ranks in everyone] if "ddp" in args.variants else None
    for name in args.variants:
        per_rank = [ranks[name] for ranks in everyone]
        step_times = [
            max(r["times"][i] for r in per_rank) for i in range(args.steps)
        ]  # slowest rank
        states = [r["state"] for r in per_rank]
        worst = max(states, key=lambda s: sum(s.values()))
        comm = per_rank[0]["comm"]
        entry: dict[str, Any] = {
            "step_ms_median": 1e3 * statistics.median(step_times),
            "step_ms_p25": 1e3 * quantile(step_times, 0.25),
            "step_ms_p75": 1e3 * quantile(step_times, 0.75),
            "step_ms_all": [1e3 * t for t in step_times],
            "state_bytes_max_rank": worst,
            "state_bytes_per_rank": states,
            "comm_per_step_rank0": comm.get("fshard", comm["c10d"]),
            "comm_source": "fshard.testing.trace_collectives"
            if "fshard" in comm
            else "TorchDispatchMode on c10d ops",
            "final_loss_mean": statistics.fmean(r["losses"][-1] for r in per_rank),
        }
        if "fshard" in comm:
            entry["comm_c10d_cross_check"] = comm["c10d"]
            entry["comm_sources_agree"] = comm["fshard"] == comm["c10d"]
        if per_rank[0]["gathered_peaks"]:
            entry["peak_gathered_bytes"] = max(max(r["gathered_peaks"]) for r in per_rank)
            entry["gathered_bytes_at_step_start"] = max(r["gathered_baseline"] for r in per_rank)
        if ddp_losses is not None:
            entry["max_abs_loss_diff_vs_ddp"] = max(
                abs(a - b)
                for r, ref in zip(per_rank, ddp_losses, strict=True)
                for a, b in zip(r["losses"], ref, strict=True)
            )
        results[name] = entry
    if "ddp" in results:
        base = results["ddp"]["step_ms_median"]
        for entry in results.values():
            entry["ratio_to_ddp"] = entry["step_ms_median"] / base
    return results


def _comm_counts(counts: dict[str, int]) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}
    return " ".join(f"{c}{short.get(op, op)}" for op, c in counts.items()) or "-"


def print_table(
    results: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    cfg: GPTConfig,
    shape: tuple[int, ...],
    world: int,
    device: torch.device,
    n_params: int,
) -> None:
    kind = (
        f"full shard over {shape[0]}"
        if len(shape) == 1
        else f"hybrid: replicate {shape[0]} x shard {shape[1]}"
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    print(
        f"GPT {n_params / 1e6:.2f}M params ({cfg.layers} blocks, dim {cfg.dim}, seq {cfg.seq}, vocab {cfg.vocab}), "
        f"batch {args.batch}/rank; mesh {'x'.join(map(str, shape))} ({kind}) on {world} ranks, {device.type}/{backend}"
    )
    print(
        f"{args.steps} measured steps per variant, round-robin, after {args.warmup} warm-up + 1 traced; "
        "step time = slowest rank, median [p25-p75] over steps"
    )
    columns = [
        ("variant", "<"), ("step ms", ">"), ("[p25-p75]", ">"), ("x DDP", ">"),
        ("state MiB/rank", ">"), ("(param/grad/optim)", ">"), ("gathered peak MiB", ">"),
        ("collectives/step", "<"), ("payload MiB", ">"), ("sent MiB", ">"),
        ("final loss", ">"), ("max|dloss| vs DDP", ">"),
    ]  # fmt: skip
    rows = []
    for name, e in results.items():
        state = e["state_bytes_max_rank"]
        comm = e["comm_per_step_rank0"]
        rows.append([
            name,
            f"{e['step_ms_median']:.1f}",
            f"[{e['step_ms_p25']:.1f}-{e['step_ms_p75']:.1f}]",
            f"{e['ratio_to_ddp']:.2f}" if "ratio_to_ddp" in e else "-",
            mib(sum(state.values())),
            "/".join(mib(state[k]) for k in ("params", "grads", "optim")),
            mib(e["peak_gathered_bytes"]) if "peak_gathered_bytes" in e else "-",
            _comm_counts(comm["counts"]),
            mib(comm["payload_bytes"]),
            mib(comm["sent_bytes"]),
            f"{e['final_loss_mean']:.4f}",
            f"{e['max_abs_loss_diff_vs_ddp']:.1e}" if "max_abs_loss_diff_vs_ddp" in e else "-",
        ])  # fmt: skip
    print_columns(columns, rows)
    print(
        "state: params+grads+AdamW state of the largest rank, from tensor storages; gathered peak: "
        "fshard.memory_stats() per step; comm: one steady step on rank 0 "
        "(fshard: trace_collectives; ddp/fsdp2: TorchDispatchMode on c10d ops), "
        "payload = collective buffer bytes, sent = ring-algorithm bytes sent per rank"
    )
    mismatched = [n for n, e in results.items() if e.get("comm_sources_agree") is False]
    if mismatched:
        print(
            f"note: trace_collectives and the c10d dispatch count differ for {mismatched} (see --json)"
        )
    baselines = {
        n: e["gathered_bytes_at_step_start"]
        for n, e in results.items()
        if e.get("gathered_bytes_at_step_start")
    }
    if baselines:
        print(f"note: gathered bytes were already held at a step's start: {baselines}")


if __name__ == "__main__":
    sys.exit(main())
