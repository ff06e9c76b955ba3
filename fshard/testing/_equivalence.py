"""``assert_equivalent_to_ddp``: train a model with fshard and with DDP side by side, compare."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fshard._mesh import default_device_type, register_mesh_cache
from fshard.testing._pool import RankPool, RanksFailed, get_pool

__all__ = ["assert_equivalent_to_ddp", "EquivalenceReport", "mesh_for", "default_shard"]

_MESHES: dict[tuple[str, tuple[int, ...], int], DeviceMesh] = register_mesh_cache({})


def mesh_for(shape: Sequence[int], device_type: str | None = None) -> DeviceMesh:
    """A cached mesh of ``shape`` over this rank's default group (for code running on a pool).

    1D meshes are named ``("shard",)``, 2D meshes ``("replicate", "shard")``.

    Example:
        >>> mesh = mesh_for((2, 2))  # on each rank of a 4-rank pool  # doctest: +SKIP
    """
    shape = tuple(int(s) for s in shape)
    if device_type is None:
        device_type = default_device_type()
    key = (device_type, shape, id(dist.group.WORLD))
    mesh = _MESHES.get(key)
    if mesh is None:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return mesh


def default_shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` every direct child that has parameters, then the root.

    A child that is an ``nn.ModuleList`` or ``nn.ModuleDict`` (which has no forward of its
    own) is looked into: each module in it that has parameters is sharded instead (the blocks of
    ``self.blocks = nn.ModuleList(...)``). The ``shard_fn`` that ``assert_equivalent_to_ddp``
    uses unless given another.

    Example:
        >>> default_shard(model, mesh_for((2,)))  # on every rank of a 2-rank pool  # doctest: +SKIP
    """
    import fshard

    def shard_children(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                shard_children(child)
            elif any(True for _ in child.parameters()):
                fshard.fully_shard(child, mesh=mesh)

    shard_children(model)
    fshard.fully_shard(model, mesh=mesh)


class _LossInputError(TypeError):
    """The default loss got a model output that is not a tensor (re-raised as a ``TypeError``)."""


def _square_mean(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs = batch if isinstance(batch, tuple) else (batch,)
    out = model(*inputs)
    if not isinstance(out, torch.Tensor):
        raise _LossInputError(
            f"assert_equivalent_to_ddp: the model returned a {type(out).__name__}, not a tensor, "
            "so the default loss (model(*batch).pow(2).mean()) cannot use it; pass "
            "loss_fn=f where f(model, batch) returns a scalar loss tensor (for example "
            "model(*batch)['logits'].pow(2).mean())"
        )
    if out.dtype != torch.float64:  # (a float64 model keeps its precision)
        out = out.float()
    return out.pow(2).mean()


@dataclass(frozen=True)
class EquivalenceReport:
    """What ``assert_equivalent_to_ddp`` compared (all checks passed if you hold one).

    Example:
        >>> report = assert_equivalent_to_ddp(make, batch_fn=batch)  # doctest: +SKIP
        >>> report.max_param_diff < 1e-6, report.params_compared, report.params_sharded  # doctest: +SKIP
        (True, 4, 4)
    """

    losses: list[list[float]]  # [rank][step], fshard
    ddp_losses: list[list[float]]  # [rank][step], DDP
    max_param_diff: float
    params_compared: int
    params_sharded: int  # parameters that shard_fn sharded (fshard.is_sharded), each rank alike


@dataclass(frozen=True)
class _Config:
    model_fn: Callable[[], nn.Module]
    shard_fn: Callable[[nn.Module, DeviceMesh], Any]
    batch_fn: Callable[[int, int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    optim_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    mesh_shape: tuple[int, ...]
    steps: int
    grad_accum: int
    reduce_scatter_accumulation: bool
    clip_grad_norm: float | None
    optimizer_before_shard: bool
    ddp_kwargs: dict[str, Any]


# [Note: one random stream for both copies]
# Dropout (and any other random op in forward) must draw the same numbers in the DDP copy and
# in the fshard copy, or equivalent models differ. The two copies run one after the other on
# each rank, from the one global generator, so each micro-step runs DDP's forward and backward
# under torch.random.fork_rng (which restores the CPU, and CUDA, state after it): fshard's copy
# then draws the same stream, and leaves the state where DDP's micro-step would have.


def _equivalence_worker(config: _Config) -> dict[str, Any]:
    import fshard

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = mesh_for(config.mesh_shape)
    reference = config.model_fn().to(device)
    model = config.model_fn().to(device)
    ddp = nn.parallel.DistributedDataParallel(
        reference, device_ids=[device] if device.type == "cuda" else None, **config.ddp_kwargs
    )
    ref_opt = config.optim_fn(ddp.parameters())
    opt = config.optim_fn(model.parameters()) if config.optimizer_before_shard else None
    config.shard_fn(model, mesh)
    # Every rank learns every rank's count, so all of them stop here together when shard_fn
    # sharded nothing (or sharded differently), instead of some training on alone and waiting.
    sharded = sum(1 for p in model.parameters() if fshard.is_sharded(p))
    counts: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(counts, sharded)
    if min(counts) == 0 or len(set(counts)) > 1:
        return {"sharded": counts, "parameters": sum(1 for _ in model.parameters())}
    if opt is None:
        opt = config.optim_fn(model.parameters())
    losses: list[float] = []
    ddp_losses: list[float] = []
    for step in range(config.steps):
        total = torch.zeros((), dtype=torch.float64)
        ddp_total = torch.zeros((), dtype=torch.float64)
        for micro in range(config.grad_accum):
            batch = config.batch_fn(step * config.grad_accum + micro, rank)
            last = micro == config.grad_accum - 1
            ddp_ctx = contextlib.nullcontext() if last else ddp.no_sync()
            # [Note: one random stream for both copies]
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), ddp_ctx:
                loss = config.loss_fn(ddp, batch) / config.grad_accum
                loss.backward()
            ddp_total += loss.detach().double().cpu()
            ctx = (
                contextlib.nullcontext()
                if last
                else fshard.no_sync(model, reduce_scatter=config.reduce_scatter_accumulation)
            )
            with ctx:
                loss = config.loss_fn(model, batch) / config.grad_accum
                loss.backward()
            total += loss.detach().double().cpu()
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.clip_grad_norm)
            fshard.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
        ddp_losses.append(float(ddp_total))
    params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if fshard.is_sharded(param) else param.detach()
        params[name] = (ref_params[name].detach().cpu(), full.detach().cpu())
    return {
        "sharded": counts,
        "losses": losses,
        "ddp_losses": ddp_losses,
        "params": params if rank == 0 else None,
    }


def _check_arguments(
    *,
    world_size: int,
    shape: tuple[int, ...],
    steps: int,
    grad_accum: int,
    pool: RankPool | None,
) -> None:
    """Raise one ``ValueError`` naming every problem with ``assert_equivalent_to_ddp``'s
    arguments."""
    from fshard._errors import ProblemList

    problems = ProblemList("assert_equivalent_to_ddp")
    if world_size < 1:
        problems.add(f"world_size must be >= 1, got {world_size}")
    if len(shape) not in (1, 2):
        problems.add(f"mesh_shape must be 1D (shard,) or 2D (replicate, shard), got {shape}")
    if math.prod(shape) != world_size:
        problems.add(f"mesh_shape {shape} has {math.prod(shape)} ranks but world_size is {world_size}")
    if steps < 1:
        problems.add(f"steps must be >= 1 (optimizer steps to compare), got {steps}")
    if grad_accum < 1:
        problems.add(f"grad_accum must be >= 1 (micro-batches per step), got {grad_accum}")
    if pool is not None and pool.world_size != world_size:
        problems.add(
            f"pool has {pool.world_size} ranks but world_size is {world_size}; pass "
            f"world_size={pool.world_size} or a pool of {world_size} rank(s)"
        )
    problems.raise_if_any(ValueError)


def assert_equivalent_to_ddp(
    model_fn: Callable[[], nn.Module],
    *,
    batch_fn: Callable[[int, int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _square_mean,
    shard_fn: Callable[[nn.Module, DeviceMesh], Any] = default_shard,
    optim_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    world_size: int = 2,
    mesh_shape: Sequence[int] | None = None,
    steps: int = 2,
    grad_accum: int = 1,
    reduce_scatter_accumulation: bool = False,
    clip_grad_norm: float | None = None,
    optimizer_before_shard: bool = False,
    ddp_kwargs: dict[str, Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    pool: RankPool | None = None,
    timeout: float | None = None,
) -> EquivalenceReport:
    """Train ``model_fn()`` with fshard and with DDP on the same data; assert they agree.

    Runs on every rank of a persistent ``RankPool`` (``get_pool(world_size)`` unless ``pool`` is
    given). Each rank builds two copies of the model (``model_fn`` must be deterministic), wraps
    one in ``DistributedDataParallel`` and shards the other with ``shard_fn(model, mesh)``, then
    for ``steps`` optimizer steps computes ``loss_fn(model, batch_fn(micro_step, rank))`` on both
    and steps (gradient accumulation over ``grad_accum`` micro-batches through ``no_sync``; the
    default loss is ``model(*batch).pow(2).mean()``, computed in float32 unless the output is
    float64; a batch that is not a tuple is passed as one argument; a model whose output is not
    a tensor needs its own ``loss_fn``), and compares every step's loss on every rank (a NaN or
    infinite loss fails) and the final full parameters within ``rtol``/``atol``. Both copies
    draw the same random numbers in each micro-step, so models with dropout compare exactly.
    ``shard_fn`` must shard at least one parameter (``fshard.is_sharded``), or the check fails
    rather than pass without testing fshard; ``steps`` and ``grad_accum`` must be >= 1, and a
    ``pool`` must have ``world_size`` ranks (``ValueError`` before anything runs).
    ``ddp_kwargs`` go to ``DistributedDataParallel`` (``find_unused_parameters=True`` for models
    that skip layers). ``optimizer_before_shard`` builds fshard's optimizer before sharding, to
    check that parameter identity survives ``fully_shard``.

    All callables must pickle (module-level functions or ``functools.partial`` of them).

    Example:
        >>> from fshard.testing import assert_equivalent_to_ddp
        >>> def make():
        ...     torch.manual_seed(0)
        ...     return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        >>> def batch(step, rank):
        ...     return torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 10 + rank))
        >>> assert_equivalent_to_ddp(make, batch_fn=batch, world_size=2)  # doctest: +SKIP
    """
    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    _check_arguments(world_size=world_size, shape=shape, steps=steps, grad_accum=grad_accum, pool=pool)
    config = _Config(
        model_fn=model_fn,
        shard_fn=shard_fn,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        optim_fn=optim_fn or functools.partial(torch.optim.AdamW, lr=1e-2),
        mesh_shape=shape,
        steps=steps,
        grad_accum=grad_accum,
        reduce_scatter_accumulation=reduce_scatter_accumulation,
        clip_grad_norm=clip_grad_norm,
        optimizer_before_shard=optimizer_before_shard,
        ddp_kwargs=dict(ddp_kwargs or {}),
    )
    pool = pool or get_pool(world_size)
    try:
        results = pool.run(_equivalence_worker, config, timeout=timeout)
    except RanksFailed as failed:
        errors = list(failed.errors.values())
        if len(errors) == world_size and all(isinstance(e, _LossInputError) for e in errors):
            raise TypeError(str(errors[0])) from failed
        raise
    counts = results[0]["sharded"]
    if min(counts) == 0 or len(set(counts)) > 1:
        fn_name = getattr(shard_fn, "__qualname__", None) or repr(shard_fn)
        if len(set(counts)) > 1:
            what = f"sharded different numbers of parameters on different ranks ({dict(enumerate(counts))})"
        elif results[0]["parameters"] == 0:
            what = "ran on a model without parameters"
        else:
            total = results[0]["parameters"]
            what = f"left all {total} parameters of the model unsharded (fshard.is_sharded is False)"
        raise AssertionError(
            f"assert_equivalent_to_ddp: shard_fn ({fn_name}) {what}, so there is nothing to compare "
            "with DDP; shard_fn(model, mesh) must call fshard.fully_shard on the model (and "
            "the same modules on every rank)"
        )
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], result["ddp_losses"], strict=True)):
            if not (math.isfinite(got) and math.isfinite(want)):
                raise AssertionError(
                    f"loss is not finite at step {step} on rank {rank}: fshard {got!r}, DDP "
                    f"{want!r}; a NaN or infinite loss cannot show that the two agree"
                )
            if abs(got - want) > atol + rtol * abs(want):
                raise AssertionError(
                    f"loss differs from DDP at step {step} on rank {rank}: fshard {got!r}, "
                    f"DDP {want!r} (rtol={rtol}, atol={atol})"
                )
    params = results[0]["params"]
    worst = 0.0
    for name, (want, got) in params.items():
        if want.shape != got.shape:
            raise AssertionError(
                f"parameter {name!r}: fshard's full shape {tuple(got.shape)} != DDP's {tuple(want.shape)}"
            )
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"parameter {name!r} differs from DDP after {steps} steps: {exc}") from None
        if want.numel():
            worst = max(worst, float((got.double() - want.double()).abs().max()))
    return EquivalenceReport(
        losses=[r["losses"] for r in results],
        ddp_losses=[r["ddp_losses"] for r in results],
        max_param_diff=worst,
        params_compared=len(params),
        params_sharded=counts[0],
    )
