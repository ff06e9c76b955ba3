"""``fshard.estimate``: memory per rank of a sharded training step, before any launch.

The model is built on the meta device (or its parameters are only read for their shapes), the
units come from fshard's own policy selection (``select_modules``) and the shard sizes from its
own layout math (``shard_layout``: ``torch.chunk`` rows, padded slots), so no process group and no
parameter memory is needed: a 70B model is planned on a laptop.

[Note: what the estimate models]
Per rank it counts what fshard holds (see [Note: fshard tensors] in _param):
- persistent: every unit's flat shard (padded, the parameters' dtype), buffers (not sharded),
  the sharded gradients (the reduce-scatter output a unit's ``.grad``s view, flags included) and
  the optimizer state (AdamW: two moments of the local shard's size and a 4-byte step per
  parameter; SGD with momentum: one buffer). Ranks differ only in the optimizer state (the last
  shards of ``torch.chunk`` are shorter); the estimate reports the largest rank.
- the step, replayed unit by unit as fshard runs it: the root's parameters are gathered at the
  start of the forward and kept to the end of the backward; every other unit is gathered before
  its forward (the all-gather output and the unsharded buffer coexist while the output is copied
  out) and freed after it, while the next unit's all-gather output is in flight (prefetch); the
  backward gathers again in reverse, holds the unit's unsharded gradients, builds the
  reduce-scatter input from them and keeps one reduce-scatter in flight (on CUDA its input lives
  until it is waited for; gloo lets it go at once: [Note: how long a reduce-scatter input lives]
  in _replay).
- activations, when a batch function is given: the forward and backward of the unsharded model
  (parameters in the compute dtype) run under ``FakeTensorMode`` on one rank's micro-batch with a
  ``LiveBytes`` tracker, whose spans between unit events add to the replay above (an
  activation-checkpoint recompute in the backward is counted as it runs; it moves no unit).
- the optimizer step: its temporaries (per-tensor AdamW on CPU: ``sqrt`` and a divide of the
  largest local shard; foreach AdamW on CUDA: one ``sqrt`` of all local shards).

It is a model of fshard's runtime, not a copy of it: what it leaves out (allocator rounding and
fragmentation, NCCL's own buffers, CUDA's workspace, communication buffers inside a backend) is
for the headroom.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from fshard._options import DEFAULT_COALESCE_BYTES, CPUOffload, MixedPrecision
from fshard._placement import shard_layout
from fshard._replay import Replay, UnitBytes, default_loss, fake_step, synthetic_step
from fshard._wrap import ByClass, Policy, WrapPolicy, by_class, select_modules

__all__ = ["Estimate", "UnitEstimate", "estimate"]

_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "none")
_MP_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class UnitEstimate:
    """One unit's sizes: parameters (full), unsharded bytes (gathered, compute dtype, padded),
    this rank's flat shard bytes.

    Example:
        >>> import fshard, torch
        >>> est = fshard.estimate(lambda: torch.nn.Linear(4, 3), nproc=2)
        >>> est.units
        (UnitEstimate(name='<root>', numel=15, unsharded_bytes=80, shard_bytes=40),)
    """

    name: str  # the unit's module FQN, "<root>" for the root
    numel: int
    unsharded_bytes: int
    shard_bytes: int


@dataclass(frozen=True)
class Estimate:
    """Predicted memory per rank of one training step under fshard (see ``fshard.estimate``).

    Byte counts are for the rank with the largest peak (``rank``, its shard rank; ranks of the
    replicate dimension hold the same). ``*_by_dtype`` split persistent bytes by dtype.
    ``activation_bytes`` is ``None`` without a batch function. ``str(estimate)`` is the table
    ``fshard estimate`` prints; ``to_dict()`` is its ``--json``.

    Example:
        >>> import fshard, torch
        >>> est = fshard.estimate(lambda: torch.nn.Linear(1024, 1024), nproc=4, optimizer="sgd")
        >>> est.params_by_dtype, est.optimizer_bytes
        ({'float32': 1049600}, 0)
        >>> print(est)  # doctest: +ELLIPSIS
        fshard estimate: Linear, 1.05M params, 4 ranks (mesh 4, shard group 4), 1 units, ...
        ...
          = predicted peak ...
    """

    model: str
    nproc: int
    mesh: tuple[int, ...]
    shard_size: int
    params: int
    mp: str
    optimizer: str
    offload: bool
    device: str
    rank: int
    params_by_dtype: dict[str, int]
    grads_by_dtype: dict[str, int]
    optimizer_by_dtype: dict[str, int]
    buffer_bytes: int
    persistent_bytes: int
    host_bytes: int
    units: tuple[UnitEstimate, ...]
    largest_unit: str
    largest_unit_bytes: int
    prefetch_bytes: int
    root_bytes: int
    activation_bytes: int | None
    peak_bytes: int
    peak_phase: str
    zero_bytes: int
    notes: tuple[str, ...] = field(default=())

    @property
    def param_bytes(self) -> int:
        return sum(self.params_by_dtype.values())

    @property
    def grad_bytes(self) -> int:
        return sum(self.grads_by_dtype.values())

    @property
    def optimizer_bytes(self) -> int:
        return sum(self.optimizer_by_dtype.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (the ``--json`` schema)."""
        out = asdict(self)
        out["mesh"] = list(self.mesh)
        out["units"] = [asdict(u) for u in self.units]
        out["notes"] = list(self.notes)
        out["param_bytes"] = self.param_bytes
        out["grad_bytes"] = self.grad_bytes
        out["optimizer_bytes"] = self.optimizer_bytes
        return out

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        head = (
            f"fshard estimate: {self.model}, {_count(self.params)} params, {self.nproc} ranks "
            f"(mesh {mesh}, shard group {self.shard_size}), {len(self.units)} units, "
            f"mp {self.mp}, optimizer {self.optimizer}{', CPU offload' if self.offload else ''}"
        )
        rows: list[tuple[str, int | None, str]] = []
        for label, by_dtype, what in (
            ("sharded params", self.params_by_dtype, "flat shards, padded"),
            ("sharded grads", self.grads_by_dtype, "reduce-scatter output"),
            ("optimizer state", self.optimizer_by_dtype, self.optimizer),
        ):
            rows.append((label, sum(by_dtype.values()), _dtypes(by_dtype) or what))
        rows.append(("buffers", self.buffer_bytes, "not sharded"))
        place = "host (CPU offload)" if self.offload else "device"
        rows.append(("= persistent", self.persistent_bytes, f"on the {place}"))
        rows.append(("root, kept gathered", self.root_bytes, "forward to end of backward"))
        rows.append(("largest unit, unsharded", self.largest_unit_bytes, self.largest_unit))
        rows.append(("prefetch on top", self.prefetch_bytes, "next unit's all-gather output"))
        rows.append((
            "activations (peak)",
            self.activation_bytes,
            "fake-tensor fwd+bwd, one micro-batch" if self.activation_bytes is not None
            else "no --batch-fn: not counted",
        ))
        rows.append(("= predicted peak", self.peak_bytes, f"in the {self.peak_phase}, rank {self.rank}"))
        rows.append(("ZeRO formula", self.zero_bytes, f"params x {_zero_factor(self)} bytes / {self.shard_size}"))
        width = max(len(r[0]) for r in rows)
        lines = [head, ""]
        lines.append(f"  {'per rank':<{width}}  {'bytes':>11}  note")
        for label, nbytes, note in rows:
            shown = "-" if nbytes is None else _gib(nbytes)
            lines.append(f"  {label:<{width}}  {shown:>11}  {note}")
        if self.host_bytes:
            lines.append(f"  {'host memory':<{width}}  {_gib(self.host_bytes):>11}  offloaded shards, grads, state")
        lines.extend(f"\n  ! {note}" for note in self.notes)
        return "\n".join(lines)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _gib(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def _dtypes(by_dtype: dict[str, int]) -> str:
    return ", ".join(f"{name} {_gib(n)}" for name, n in by_dtype.items() if n)


def _zero_factor(e: Estimate) -> int:
    return _zero_bytes_per_param(e.optimizer)


def _zero_bytes_per_param(optimizer: str) -> int:
    # ZeRO paper's accounting with fp32 everything: params 4 + grads 4 + state.
    return 4 + 4 + {"adamw": 8, "adam": 8, "sgd-momentum": 4}.get(optimizer, 0)


# ------------------------------------------------------------------------------- the layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _units(
    model: nn.Module,
    fqns: list[str],
    *,
    shard_size: int,
    dp_size: int,
    mp: MixedPrecision | None,
    offload: bool,
    optimizer: str,
) -> list[UnitBytes]:
    """The root first, then the policy's units in ``fully_shard`` order."""
    owner: dict[int, int] = {}  # id(param) -> index in modules (0 = root)
    modules = [model, *(model.get_submodule(f) for f in fqns)]
    params: dict[int, nn.Parameter] = {}
    for index, module in enumerate(modules[1:], start=1):
        for p in module.parameters():
            params[id(p)] = p
            if id(p) not in owner:
                owner[id(p)] = index
            elif not any(m is modules[owner[id(p)]] for m in module.modules()):
                # Shared by two units that do not contain each other: root init moves it to the
                # lowest module containing all users; the root is the one the estimate knows.
                owner[id(p)] = 0
    for p in model.parameters():
        params[id(p)] = p
        owner.setdefault(id(p), 0)
    by_unit: list[list[nn.Parameter]] = [[] for _ in modules]
    for key, p in params.items():
        by_unit[owner[key]].append(p)
    names = ["<root>", *fqns]
    return [
        _unit_bytes(names[i], modules[i], by_unit[i], shard_size, dp_size, mp, offload, optimizer)
        for i in range(len(modules))
    ]


def _unit_bytes(
    name: str,
    module: nn.Module,
    params: list[nn.Parameter],
    shard_size: int,
    dp_size: int,
    mp: MixedPrecision | None,
    offload: bool,
    optimizer: str,
) -> UnitBytes:
    buckets: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault(p.dtype, []).append(p)
    shard_bytes: dict[torch.dtype, int] = {}
    sharded_grads: dict[torch.dtype, int] = {}
    unsharded = ag_out = ag_in = grads = reduce_in = reduce_out = 0
    separate = False
    optim: list[dict[torch.dtype, int]] = [{} for _ in range(shard_size)]
    largest = [0] * shard_size
    state_tensors = {"adamw": 2, "adam": 2, "sgd-momentum": 1}.get(optimizer, 0)
    for dtype, members in buckets.items():
        layouts = [shard_layout(p.shape, shard_size, 0) for p in members]
        total = sum(layout.slot_numel for layout in layouts)
        compute = dtype
        if mp is not None and mp.param_dtype is not None and dtype.is_floating_point:
            compute = mp.param_dtype
        size_c = _itemsize(compute)
        shard_bytes[dtype] = total * _itemsize(dtype)
        aliased = shard_size == 1 and compute == dtype and not offload
        if not aliased:
            unsharded += shard_size * total * size_c
            if shard_size > 1:
                ag_out += shard_size * total * size_c
            if compute != dtype or offload:
                ag_in += total * size_c
        with_grad = [(p, lay) for p, lay in zip(members, layouts, strict=True) if p.requires_grad]
        grads += sum(p.numel() for p, _ in with_grad) * size_c
        reduced = [(p, lay) for p, lay in with_grad if lay.slot_numel > 0]
        if reduced:
            reduce_dtype = compute
            if mp is not None and mp.reduce_dtype is not None and compute.is_floating_point:
                reduce_dtype = mp.reduce_dtype
            grad_total = sum(dp_size if lay.replicated else lay.slot_numel for _, lay in reduced)
            grad_total += len(reduced)  # one "got a gradient" flag per parameter
            reduce_in += shard_size * grad_total * _itemsize(reduce_dtype)
            if shard_size > 1:
                reduce_out += grad_total * _itemsize(reduce_dtype)
            if reduce_dtype != dtype or offload:
                separate = True
            sharded_grads[dtype] = sharded_grads.get(dtype, 0) + grad_total * _itemsize(dtype)
        for rank in range(shard_size):
            for p, _ in with_grad:
                local = shard_layout(p.shape, shard_size, rank).local_numel * _itemsize(dtype)
                largest[rank] = max(largest[rank], local)
                if state_tensors:
                    got = optim[rank]
                    got[dtype] = got.get(dtype, 0) + state_tensors * local
                    if optimizer in ("adamw", "adam"):
                        got[torch.float32] = got.get(torch.float32, 0) + 4  # the step count
    return UnitBytes(
        name, module, params, sum(p.numel() for p in params), shard_bytes, unsharded, ag_out,
        ag_in, grads, reduce_in, reduce_out, sharded_grads, separate, optim, largest,
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


# ------------------------------------------------------------------------------ the API


def estimate(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    *,
    nproc: int,
    mesh: int | tuple[int, ...] | None = None,
    policy: Policy | None = None,
    mp: MixedPrecision | str | None = None,
    offload: bool | CPUOffload = False,
    optimizer: str = "adamw",
    batch_fn: Callable[[], Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    reshard_after_forward: bool = True,
    device: str = "cuda",
    name: str | None = None,
    suggest: bool = True,
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
) -> Estimate:
    """Predict the memory per rank of a training step of ``model_or_factory`` under fshard.

    No process group, no parameter memory: a factory (a callable returning the model) is
    called under ``torch.device("meta")``; a model passed as a module is only read (its
    parameters are swapped for fake tensors during the activation run and put back).
    ``policy`` picks the units as ``fshard.auto_shard`` would (``None``: the model's
    ``_no_split_modules`` classes for a Transformers model, else the root alone). ``mesh`` is
    ``nproc`` (1D) or ``(replicate, shard)``. ``mp`` is a ``MixedPrecision`` or ``"bf16"`` /
    ``"fp16"`` (accelerate's: params and reduce in that dtype, fp32 master shards).
    ``optimizer``: ``"adamw"``/``"adam"`` (two fp32 moments and a step), ``"sgd"`` (no state),
    ``"sgd-momentum"``, ``"none"``. ``batch_fn()`` returns one rank's micro-batch (run under
    fake tensors: create it with torch factory functions), ``loss_fn(model, batch)`` its loss
    (default: ``model(*batch)``, its ``.loss`` or the sum of its output). ``device`` says which
    optimizer implementation torch picks: ``"cuda"`` (foreach) or ``"cpu"`` (per tensor).
    ``coalesce_bytes`` is ``fshard.set_coalescing``'s limit (units below it are gathered and
    reduced together, held a little longer; ``0``: a collective per unit).

    Example:
        >>> import fshard, torch
        >>> from fshard.testing.models import Block, TinyTransformer, TransformerSpec
        >>> spec = TransformerSpec(vocab=1000, dim=64, heads=4, layers=4, seq=32)
        >>> est = fshard.estimate(lambda: TinyTransformer(spec), nproc=8,
        ...                       policy=fshard.by_class(Block), mp="bf16")
        >>> est.shard_size, est.largest_unit, len(est.units)
        (8, 'blocks.0', 5)
        >>> est.peak_bytes > est.persistent_bytes
        True
    """
    where = "fshard.estimate"
    shape = _mesh_shape(nproc, mesh, where)
    mp_policy = _mp_policy(mp, where)
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"{where}: optimizer must be one of {', '.join(_OPTIMIZERS)}, got {optimizer!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"{where}: device must be 'cuda' or 'cpu', got {device!r}")
    if isinstance(coalesce_bytes, bool) or not isinstance(coalesce_bytes, int) or coalesce_bytes < 0:
        raise ValueError(f"{where}: coalesce_bytes must be an int >= 0, got {coalesce_bytes!r}")
    offloaded = offload is not False and offload is not None
    model = _as_model(model_or_factory, where)
    if policy is None:
        policy = _default_policy(model)
    fqns = select_modules(model, policy) if policy is not None else []
    units = _units(
        model, fqns, shard_size=shape[-1], dp_size=math.prod(shape), mp=mp_policy,
        offload=offloaded, optimizer=optimizer,
    )
    held = _persistent(units, shape[-1], sum(b.numel() * b.element_size() for b in model.buffers()))
    base = held.buffers if offloaded else held.buffers + held.params + held.optimizer
    replay = Replay(
        units,
        base,
        offload=offloaded,
        reshard=reshard_after_forward,
        virtual_grads=batch_fn is None,
        holds_reduce_input=device == "cuda",
        coalesce_bytes=coalesce_bytes,
    )
    if batch_fn is None:
        synthetic_step(replay)
    else:
        fake_step(model, units, replay, batch_fn, loss_fn or default_loss, mp_policy)
    peak, phase = replay.peak, replay.peak_phase
    step_peak = _optimizer_step_peak(units, held, optimizer, device, offloaded)
    if step_peak > peak:
        peak, phase = step_peak, "optimizer step"
    others = units[1:]
    largest = max(others, key=lambda u: u.unsharded) if others else units[0]
    after = _next_unit(units, largest)
    estimate_ = Estimate(
        model=name or type(model).__name__,
        nproc=nproc,
        mesh=shape,
        shard_size=shape[-1],
        params=sum(p.numel() for p in model.parameters()),
        mp=_mp_name(mp_policy),
        optimizer=optimizer,
        offload=offloaded,
        device=device,
        rank=held.rank,
        params_by_dtype={_dtype_name(k): v for k, v in held.params_by.items()},
        grads_by_dtype={_dtype_name(k): v for k, v in held.grads_by.items()},
        optimizer_by_dtype={_dtype_name(k): v for k, v in held.optimizer_by.items()},
        buffer_bytes=held.buffers,
        persistent_bytes=held.total,
        host_bytes=held.total - held.buffers if offloaded else 0,
        units=tuple(UnitEstimate(u.name, u.numel, u.unsharded, sum(u.shard_bytes.values())) for u in units),
        largest_unit=largest.name,
        largest_unit_bytes=largest.unsharded,
        prefetch_bytes=after.ag_out + after.ag_in if after is not None else 0,
        root_bytes=units[0].unsharded,
        activation_bytes=None if batch_fn is None else replay.activation_peak,
        peak_bytes=peak,
        peak_phase=phase,
        zero_bytes=sum(p.numel() for p in model.parameters() if p.requires_grad)
        * _zero_bytes_per_param(optimizer) // shape[-1],
    )
    if not suggest:
        return estimate_
    notes = _advice(
        estimate_, units, model, fqns,
        lambda extra: estimate(
            model, nproc=nproc, mesh=shape, policy=_with_units(policy, model, extra), mp=mp_policy,
            offload=offload, optimizer=optimizer, batch_fn=batch_fn, loss_fn=loss_fn,
            reshard_after_forward=reshard_after_forward, device=device, suggest=False,
        ),
    )
    return dataclasses.replace(estimate_, notes=tuple(notes))


def _as_model(model_or_factory: nn.Module | Callable[[], nn.Module], where: str) -> nn.Module:
    """The module itself, or the factory's, built on the meta device."""
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if not callable(model_or_factory):
        raise TypeError(f"{where}: expects an nn.Module or a callable returning one, got {model_or_factory!r}")
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


class _Held(NamedTuple):
    """Persistent bytes of the largest rank."""

    rank: int
    params_by: dict[torch.dtype, int]
    grads_by: dict[torch.dtype, int]
    optimizer_by: dict[torch.dtype, int]
    buffers: int

    @property
    def params(self) -> int:
        return sum(self.params_by.values())

    @property
    def optimizer(self) -> int:
        return sum(self.optimizer_by.values())

    @property
    def total(self) -> int:
        return self.params + sum(self.grads_by.values()) + self.optimizer + self.buffers


def _persistent(units: list[UnitBytes], shard_size: int, buffers: int) -> _Held:
    """Ranks differ only in optimizer state (``torch.chunk`` gives the last ranks shorter
    shards; flat shards and grads are padded alike), so the largest is rank 0."""
    by_rank = [_sum_dtypes(u.optim_by_rank[r] for u in units) for r in range(shard_size)]
    rank = max(range(shard_size), key=lambda r: (sum(by_rank[r].values()), -r))
    return _Held(
        rank,
        _sum_dtypes(u.shard_bytes for u in units),
        _sum_dtypes(u.sharded_grads for u in units),
        by_rank[rank],
        buffers,
    )


def _optimizer_step_peak(units: list[UnitBytes], held: _Held, optimizer: str, device: str, offloaded: bool) -> int:
    """Every sharded grad has landed; AdamW adds its temporaries: per tensor (CPU) a ``sqrt``
    and a divide of one local shard, foreach (CUDA) a ``sqrt`` of all of them at once."""
    if offloaded:
        return held.buffers  # the step runs on the host
    peak = held.total
    if optimizer in ("adamw", "adam"):
        if device == "cpu":
            peak += 2 * max(u.optim_largest_param[held.rank] for u in units)
        else:
            peak += held.optimizer // 2
    return peak


def _next_unit(units: list[UnitBytes], unit: UnitBytes) -> UnitBytes | None:
    order = units[1:]
    for i, u in enumerate(order[:-1]):
        if u is unit:
            return order[i + 1]
    return None


def _sum_dtypes(parts: Any) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for part in parts:
        for dtype, n in part.items():
            out[dtype] = out.get(dtype, 0) + n
    return out


def _mesh_shape(nproc: int, mesh: int | tuple[int, ...] | None, where: str) -> tuple[int, ...]:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"{where}: nproc must be an int >= 1, got {nproc!r}")
    shape = (nproc,) if mesh is None else (mesh,) if isinstance(mesh, int) else tuple(mesh)
    if not 1 <= len(shape) <= 2 or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"{where}: mesh must be N or (replicate, shard), got {mesh!r}")
    if math.prod(shape) != nproc:
        raise ValueError(
            f"{where}: mesh {'x'.join(map(str, shape))} has {math.prod(shape)} ranks but "
            f"nproc is {nproc}"
        )
    return shape


def _mp_policy(mp: MixedPrecision | str | None, where: str) -> MixedPrecision | None:
    if mp is None or isinstance(mp, MixedPrecision):
        return mp
    if mp in ("fp32", "no"):
        return None
    if mp in _MP_NAMES:
        return MixedPrecision(param_dtype=_MP_NAMES[mp], reduce_dtype=_MP_NAMES[mp])
    raise ValueError(f"{where}: mp must be fshard.MixedPrecision, 'bf16', 'fp16' or None, got {mp!r}")


def _mp_name(mp: MixedPrecision | None) -> str:
    if mp is None or mp.param_dtype is None:
        return "fp32 (none)"
    reduce = mp.reduce_dtype or mp.param_dtype
    return f"{_dtype_name(mp.param_dtype)} compute, {_dtype_name(reduce)} reduce"


def _default_policy(model: nn.Module) -> Policy | None:
    names = getattr(model, "_no_split_modules", None)
    if names:
        return by_class(*names)
    return None


class _PlusModules(WrapPolicy):
    """``inner`` plus the modules in ``chosen`` (the wrapping the advice tries)."""

    def __init__(self, inner: Policy | None, chosen: set[int]) -> None:
        self.inner = inner
        self.chosen = chosen

    def selects(self, module: nn.Module, unowned_numel: int) -> bool:
        if id(module) in self.chosen:
            return True
        if self.inner is None:
            return False
        if isinstance(self.inner, WrapPolicy):
            return self.inner.selects(module, unowned_numel)
        return bool(self.inner(module))

    def descends(self, module: nn.Module) -> bool:
        return not isinstance(self.inner, WrapPolicy) or self.inner.descends(module)


def _with_units(policy: Policy | None, model: nn.Module, extra: list[str]) -> Policy:
    if isinstance(policy, ByClass):
        policy = policy.resolve(model)
    return _PlusModules(policy, {id(model.get_submodule(f)) for f in extra})


def _advice(
    e: Estimate,
    units: list[UnitBytes],
    model: nn.Module,
    fqns: list[str],
    rerun: Callable[[list[str]], Estimate],
) -> list[str]:
    """Flag a unit that dominates the peak and try the wrapping that would lower it."""
    root = units[0]
    others = units[1:]
    biggest_other = max((u.unsharded for u in others), default=0)
    if root.unsharded >= max(2 * biggest_other, e.peak_bytes // 10) and root.unsharded > 0:
        # Which modules hold the root's parameters? Those owning the most, not shared.
        mine = {id(p) for p in root.params}
        users: dict[int, list[str]] = {}
        for fqn, module in model.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                if id(p) in mine:
                    users.setdefault(id(p), []).append(fqn)
        holders: dict[str, int] = {}
        for p in root.params:
            names = users.get(id(p), [""])
            if len(set(names)) == 1 and names[0]:
                holders[names[0]] = holders.get(names[0], 0) + p.numel()
        share = 100 * root.unsharded // max(e.peak_bytes, 1)
        note = (
            f"the root keeps {_gib(root.unsharded)} gathered from the start of the forward to the "
            f"end of the backward ({share}% of the peak; its largest unit below is "
            f"{_gib(biggest_other)})"
        )
        tied = [users[id(p)] for p in root.params if len(set(users.get(id(p), []))) > 1]
        candidates = [f for f, n in sorted(holders.items(), key=lambda kv: -kv[1]) if n * 10 >= root.numel][:2]
        if candidates:
            trial = rerun(candidates)
            saved = e.peak_bytes - trial.peak_bytes
            what = " and ".join(repr(c) for c in candidates)
            if saved > 0:
                note += (
                    f". Wrap {what} as units of their own (fshard.fully_shard on each before the "
                    f"root, or add them to the policy): predicted peak {_gib(trial.peak_bytes)} "
                    f"instead of {_gib(e.peak_bytes)}"
                )
        if tied:
            note += (
                f". Tied weights ({', '.join('/'.join(t) for t in tied[:2])}) belong to the unit "
                "containing all their users, here the root: untie them to shard them apart"
            )
        return [note]
    if others:
        sizes = sorted(u.unsharded for u in others)
        median = sizes[len(sizes) // 2]
        big = max(others, key=lambda u: u.unsharded)
        if median and big.unsharded >= 4 * median:
            return [
                f"unit {big.name!r} gathers {_gib(big.unsharded)}, {big.unsharded // median}x the "
                f"median unit: wrap its largest submodules as units of their own"
            ]
    return []
