"""What every rank of ``fshard bench`` runs: ``python -m fshard._bench._worker SPEC OUT``.

Every implementation gets its own copy of the model (same seed, same initial weights) and its
own ``torch.optim.AdamW``, and all of them train on the same batches. After ``warmup`` untimed
steps and one traced step (collectives and live bytes are measured there, outside every timer),
the implementations take turns step by step for ``steps`` measured steps, the order rotating
every step, so a noisy neighbour slows every implementation alike. Rank 0 writes every rank's
figures to OUT (JSON) for the parent process to report.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fshard
from fshard._bench._measure import CollectiveCounter, LiveTensorBytes, storage_bytes
from fshard._bench._spec import BenchSpec
from fshard._bench._theory import unit_shapes
from fshard._bench._workload import BatchFn, WrapPlan, compute_loss, load_workload, wrap_plan

__all__ = ["main"]


@dataclass
class Impl:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: torch.dtype | None  # DDP's mixed precision
    phases: list[list[float]] = field(default_factory=list)  # per measured step: fwd, bwd, opt
    losses: list[float] = field(default_factory=list)
    peak_live_bytes: int = 0
    cuda_peak_bytes: int = 0
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)


def build(name: str, spec: BenchSpec, make_model: Callable[[], nn.Module], plan: WrapPlan,
          mesh: DeviceMesh, device: torch.device) -> Impl:  # fmt: skip
    torch.manual_seed(spec.seed)
    model = make_model().to(device)
    autocast = None
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
        autocast = plan.param_dtype
    elif name == "fshard":
        mp = None
        if plan.param_dtype is not None:
            mp = fshard.MixedPrecision(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
        for fqn in plan.fqns:
            fshard.fully_shard(model.get_submodule(fqn), mesh=mesh,
                               reshard_after_forward=plan.reshard_after_forward, mp_policy=mp)  # fmt: skip
        fshard.fully_shard(model, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mp)
        if spec.coalesce is not None:
            fshard.set_coalescing(model, spec.coalesce)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
        for fqn in plan.fqns:
            fsdp2_fully_shard(model.get_submodule(fqn), mesh=mesh,
                              reshard_after_forward=plan.reshard_after_forward, mp_policy=policy)  # fmt: skip
        fsdp2_fully_shard(model, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    return Impl(name, model, optimizer, autocast)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(impl: Impl, batch: Any, device: torch.device) -> tuple[float, list[float]]:
    """One step; the loss and the seconds of forward (with the loss), backward and optimizer
    (``zero_grad`` at the start and ``step`` at the end)."""
    t0 = time.perf_counter()
    impl.optimizer.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    cast = (
        torch.autocast(device.type, dtype=impl.autocast)
        if impl.autocast is not None
        else contextlib.nullcontext()
    )
    with cast:
        loss = compute_loss(impl.model, batch, device)
    _sync(device)
    t2 = time.perf_counter()
    loss.backward()
    _sync(device)
    t3 = time.perf_counter()
    impl.optimizer.step()
    _sync(device)
    t4 = time.perf_counter()
    return loss.item(), [t2 - t1, t3 - t2, (t1 - t0) + (t4 - t3)]


def persistent_bytes(impl: Impl) -> dict[str, int]:
    params = list(impl.model.parameters())
    optim = [v for s in impl.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optim": storage_bytes(optim),
    }


def traced_step(impl: Impl, batch: Any, device: torch.device) -> float:
    """A step under the collective counter and the live-bytes tracker (not timed)."""
    live = LiveTensorBytes()
    live.track(impl.model.parameters())
    live.track(impl.model.buffers())
    live.track(p.grad for p in impl.model.parameters() if p.grad is not None)
    live.track(v for s in impl.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    with CollectiveCounter() as counter, live:
        loss, _ = train_step(impl, batch, device)
    impl.collectives = counter.as_dict()
    impl.peak_live_bytes = live.peak_bytes
    return loss


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Progress:
    """A one-line progress bar on rank 0's terminal (stderr); silent when it is not a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def advance(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            elapsed = time.perf_counter() - self.start
            sys.stderr.write(
                f"\rfshard bench [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} steps  {what:<22} {elapsed:6.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def model_info(name: str, model: nn.Module, plan: WrapPlan) -> dict[str, Any]:
    """The JSON's ``model`` entry: sizes, units and the parameter shapes each unit owns."""
    units = unit_shapes(model, plan.fqns)

    def dtype_name(dtype: torch.dtype | None) -> str | None:
        return None if dtype is None else str(dtype).removeprefix("torch.")

    return {
        "name": name,
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "param_element_bytes": next(model.parameters()).element_size(),
        "units": [u.fqn for u in units],
        "unit_shapes": {u.fqn: [list(s) for s in u.shapes] for u in units},
        "reshard_after_forward": plan.reshard_after_forward,
        "param_dtype": dtype_name(plan.param_dtype),
        "reduce_dtype": dtype_name(plan.reduce_dtype),
    }


def measure(impls: list[Impl], spec: BenchSpec, make_batch: BatchFn, device: torch.device) -> None:
    """Warm-up, the traced step, then the measured steps, the implementations taking turns."""
    rank = dist.get_rank()
    total = spec.warmup + 1 + spec.steps
    progress = Progress(total * len(impls), enabled=rank == 0)
    for step in range(total):
        batch = make_batch(step, rank, device)
        order = impls[step % len(impls) :] + impls[: step % len(impls)]
        for impl in order:
            if step < spec.warmup:
                loss, _ = train_step(impl, batch, device)
                label = "warm-up"
            elif step == spec.warmup:
                loss = traced_step(impl, batch, device)
                label = "tracing"
            else:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                dist.barrier()
                with no_gc():
                    loss, phases = train_step(impl, batch, device)
                impl.phases.append(phases)
                if device.type == "cuda":
                    impl.cuda_peak_bytes = max(impl.cuda_peak_bytes, torch.cuda.max_memory_allocated(device))
                label = "measuring"
            impl.losses.append(loss)
            progress.advance(f"{label} {impl.name}")
        gc.collect()  # between rounds, outside every timer
    progress.close()


def run(spec: BenchSpec) -> dict[str, Any] | None:
    """Every rank's figures on rank 0 (None elsewhere)."""
    device = torch.device("cpu")
    if spec.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    names = ("shard",) if len(spec.mesh) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, spec.mesh, mesh_dim_names=names)
    workload = load_workload(spec)
    torch.manual_seed(spec.seed)
    reference = workload.make_model()
    plan = wrap_plan(spec, reference)
    info = model_info(workload.name, reference, plan)
    del reference
    impls = [build(name, spec, workload.make_model, plan, mesh, device) for name in spec.impls]
    measure(impls, spec, workload.make_batch, device)
    mine = {
        impl.name: {
            "phases": impl.phases,
            "losses": impl.losses,
            "persistent": persistent_bytes(impl),
            "peak_live_bytes": impl.peak_live_bytes,
            "cuda_peak_bytes": impl.cuda_peak_bytes if device.type == "cuda" else None,
            "collectives": impl.collectives,
        }
        for impl in impls
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    # Drop DDP's reducer (it holds a process group) before the groups go: destroying a gloo group
    # from a destructor at interpreter exit can deadlock.
    del impls
    gc.collect()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "world": math.prod(spec.mesh),
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "torch": torch.__version__,
        "fshard": fshard.__version__,
        "model": info,
        "ranks": everyone,
    }


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = argv if argv is not None else sys.argv[1:3]
    spec = BenchSpec.from_json(Path(spec_path).read_text())
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # FSDP2's view-output notice
    raw = run(spec)
    if raw is not None:
        Path(out_path).write_text(json.dumps(raw) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
