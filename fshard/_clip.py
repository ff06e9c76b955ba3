"""``clip_grad_norm_``: clip gradients by the norm of the full gradient, computed across
shards; and the same norm for torch's ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` on
sharded parameters (see [Note: torch's clip_grad_norm_ on sharded parameters])."""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist

from fshard import _collectives
from fshard._errors import RankMismatchError
from fshard._mesh import MeshInfo
from fshard._param import ParamSlot, ShardedParameter, is_sharded
from fshard._unit._group import ParamGroup, group_of

__all__ = ["clip_grad_norm_"]


# [Note: torch's clip_grad_norm_ on sharded parameters]
# A sharded parameter's ``.grad`` is this rank's plain shard (the optimizer then runs without
# tensor-subclass dispatch), so torch.nn.utils.clip_grad_norm_ would compute each rank's norm
# from its own shards only and clip each rank by a different, wrong factor. All of torch's
# norm-clipping functions compute the norm in one place: torch.nn.utils.clip_grad's module-level
# ``_get_total_norm`` (public as torch.nn.utils.get_total_norm), which clip_grad_norm_ (and the
# deprecated clip_grad_norm) look up at each call; clip_grads_with_norm_ then scales each
# gradient locally by the norm it is given, which is right once that norm is. So ``import
# fshard`` replaces that one function, in clip_grad's namespace and as torch.nn.utils.
# get_total_norm: when a tensor it is given is the ``.grad`` of a sharded parameter (or a sharded
# parameter itself), it computes the norm as fshard.clip_grad_norm_ does (across shards, on every
# rank alike); otherwise it calls torch's own, unchanged. No per-op dispatch is added: the
# optimizer's hot path never meets it. A clip_grad_norm_ bound before ``import fshard`` (``from
# torch.nn.utils import clip_grad_norm_``) is covered too (it reads the module global); only a
# get_total_norm bound before ``import fshard`` stays torch's own.
_TORCH_TOTAL_NORM: list[Callable[..., torch.Tensor]] = []  # torch's _get_total_norm, once patched
# Every live unit (never the parameters themselves: a weak reference to a parameter would stop
# fshard.materialize from swapping its storage in place).
_UNITS: weakref.WeakSet[ParamGroup] = weakref.WeakSet()


class _Part(NamedTuple):
    """One tensor a norm counts: ``slot`` is its sharded parameter's (None: a tensor fshard
    does not shard), ``tensor`` the local tensor (a gradient, or a parameter's shard)."""

    slot: ParamSlot | None
    tensor: torch.Tensor | None
    wide: bool  # float64 (or complex128): the norm in float64, as torch computes it


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients by the norm of the *full* gradient, computed across shards.

    Equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (``inf`` norm included).
    Every rank of the mesh must call it with the same parameters, in any order (it all-reduces
    a few scalars per mesh, which also tell when the ranks passed different ones: each then
    raises ``RankMismatchError`` instead of clipping by a wrong norm). Returns the total
    norm as a tensor. A sharded parameter's ``.grad`` is this rank's plain shard (so the
    optimizer runs without tensor-subclass dispatch); once ``fshard`` is imported, torch's
    ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` compute the norm of such
    gradients here too (see [Note: torch's clip_grad_norm_ on sharded parameters]).

    ``norm_type`` is any ``p > 0`` or ``inf``; a NaN in any rank's shard makes the norm NaN on
    every rank. The norm is computed in float32, or float64 if any parameter is float64.
    Parameters fshard does not shard (``ignored_params``), passed together with sharded ones,
    count with the mean over the mesh's ranks of their part of the norm (the max for ``inf``),
    so that every rank clips by the same factor; that is their exact part when their gradients
    agree across ranks (all-reduce them as DDP would). Without sharded parameters there is no
    mesh: the norm is this rank's, as torch's. ``foreach`` is accepted for compatibility with
    torch's signature: the clipping always uses the ``_foreach`` kernels.

    Example:
        >>> loss.backward()                                                  # doctest: +SKIP
        >>> norm = fshard.clip_grad_norm_(model.parameters(), max_norm=1.0)  # doctest: +SKIP
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    p_norm = _norm_type(norm_type, "clip_grad_norm_")
    params = list(parameters)
    parts = [
        _Part(p._fshard_slot if is_sharded(p) else None, p.grad, p.dtype in _WIDE) for p in params
    ]
    total_norm = _total_norm(parts, p_norm, error_if_nonfinite, "clip_grad_norm_")
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is not None:
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, clip_coef.to(device, dtype))
    return total_norm


_WIDE = (torch.float64, torch.complex128)


def _norm_type(norm_type: object, where: str) -> float:
    try:
        value = float(norm_type)  # type: ignore[arg-type]  # any object: refused below if not a number
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: norm_type must be a number > 0 or inf (2.0 for the 2-norm, "
            f"float('inf') for the max-norm), got {norm_type!r}"
        ) from None
    if not value > 0:  # also NaN
        raise ValueError(
            f"{where}: norm_type must be a number > 0 or inf, got {value} (0 does "
            "not measure a gradient's size: torch's counts the params with a non-zero gradient)"
        )
    return value


def _total_norm(
    parts: list[_Part], norm_type: float, error_if_nonfinite: bool, where: str
) -> torch.Tensor:
    """The norm of order ``norm_type`` of every part's full tensor, alike on every rank."""
    # Every rank joins the all-reduce of each mesh whose sharded params it was given, even with
    # no gradient among them here (a peer may have some): what runs depends on the params only.
    by_group: dict[int, tuple[MeshInfo, list[torch.Tensor], list[torch.Tensor]]] = {}
    passed: dict[int, list[ParamSlot]] = {}  # per shard group: the sharded params passed
    plain: list[torch.Tensor] = []
    any_plain = False
    wide = False
    for slot, tensor, is_wide in parts:
        wide = wide or is_wide
        if slot is not None:
            entry = by_group.setdefault(id(slot.mesh_info.shard_group), (slot.mesh_info, [], []))
            passed.setdefault(id(slot.mesh_info.shard_group), []).append(slot)
            if tensor is not None:
                # A replicated (0-d) param is held whole by every shard rank: count it once.
                (entry[2] if slot.layout.replicated else entry[1]).append(tensor)
        else:
            any_plain = True
            if tensor is not None:
                plain.append(tensor)
    if not by_group and not plain:
        return torch.tensor(0.0)
    dtype = torch.float64 if wide else torch.float32
    # The norm lives on the compute device (the mesh's), also when CPU offload keeps grads on
    # the host: the all-reduce runs there.
    device = next(iter(by_group.values()))[0].device if by_group else plain[0].device
    total = _local_norm_power(plain, norm_type, device, dtype)
    if by_group and any_plain:
        # Params fshard does not shard (ignored_params) may hold a different gradient on each
        # rank: count their mean over the mesh (max for inf), so every rank clips alike.
        total = _mesh_mean_norm_power(total, norm_type, next(iter(by_group.values()))[0])
    for key, (info, sharded, replicated) in by_group.items():
        part = _local_norm_power(sharded, norm_type, device, dtype)
        if info.shard_size > 1:
            part = _all_reduce_norm_power(part, norm_type, info.shard_group, passed[key])
        rep = _local_norm_power(replicated, norm_type, device, dtype)
        total = _combine(_combine(total, part, norm_type), rep, norm_type)
    total_norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"{where}: the total norm of order {norm_type} of the gradients is "
            f"{total_norm.item()}, so they cannot be clipped; pass error_if_nonfinite=False to "
            "clip anyway"
        )
    return total_norm


def track_unit(group: ParamGroup) -> None:
    """Remember a unit ``fully_shard`` made, so that torch's norm functions know its parameters
    and their gradients (see [Note: torch's clip_grad_norm_ on sharded parameters])."""
    _UNITS.add(group)


def patch_torch_total_norm() -> None:
    """Make torch's gradient-norm functions count sharded gradients across shards (once; see
    [Note: torch's clip_grad_norm_ on sharded parameters])."""
    if _TORCH_TOTAL_NORM:
        return
    from torch.nn.utils import clip_grad

    original = clip_grad._get_total_norm
    _TORCH_TOTAL_NORM.append(original)

    @functools.wraps(original)
    def get_total_norm(
        tensors: Iterable[torch.Tensor] | torch.Tensor,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        parts = _sharded_parts(listed)
        if parts is None:  # nothing fshard shards: torch's own
            return original(listed, norm_type, error_if_nonfinite, foreach)
        where = "torch.nn.utils.get_total_norm (via fshard)"
        with torch.no_grad():
            return _total_norm(parts, _norm_type(norm_type, where), error_if_nonfinite, where)

    clip_grad._get_total_norm = get_total_norm
    torch.nn.utils.get_total_norm = get_total_norm


def _sharded_parts(tensors: list[torch.Tensor]) -> list[_Part] | None:
    """``tensors`` as parts of a norm, with the sharded parameter each one is the gradient of
    (or is); None when none of them is."""
    if not _UNITS:
        return None
    owners: dict[int, ShardedParameter] = {}
    for group in list(_UNITS):
        for slot in group.slots:
            p = slot.sharded_param
            if is_sharded(p):
                owners[id(p)] = p
                if p.grad is not None:
                    owners[id(p.grad)] = p
    slots = [owners[id(t)]._fshard_slot if id(t) in owners else None for t in tensors]
    if all(slot is None for slot in slots):
        return None
    return [_Part(slot, t, t.dtype in _WIDE) for slot, t in zip(slots, tensors, strict=True)]


def _local_norm_power(
    grads: list[torch.Tensor], norm_type: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|`` for inf) over local tensors, in ``dtype`` (fp32 or fp64)."""
    if not grads:
        return torch.zeros((), device=device, dtype=dtype)
    if math.isinf(norm_type):
        values = [
            g.detach().abs().max().to(device, dtype) if g.numel() else torch.zeros((), device=device, dtype=dtype)
            for g in grads
        ]
        return torch.stack(values).max()
    norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
    return torch.stack([n.to(device, dtype) for n in norms]).pow(norm_type).sum()


def _all_reduce_norm_power(
    part: torch.Tensor,
    norm_type: float,
    group: dist.ProcessGroup,
    passed: list[ParamSlot] | None = None,
) -> torch.Tensor:
    """Sum (or, for inf, max) one rank's part of the norm over ``group``.

    With ``passed`` (the sharded parameters this rank was given), the same all-reduce tells
    whether every rank was given the same ones, and every rank raises if not: a rank that
    passed other parameters (say, only those of its own blocks) would otherwise add parts of
    the norm that belong to no one parameter set, and clip by a wrong factor without a word.
    """
    marks = _passed_marks(passed) if passed is not None else []
    if not math.isinf(norm_type):
        # Count and fingerprint with their squares: a SUM equals size x mine and the sum of
        # squares size x mine^2 on every rank exactly when all ranks agree (zero variance),
        # which every rank computes alike. In float64 the integers stay exact.
        extra = torch.tensor([float(v) for m in marks for v in (m, m * m)], dtype=torch.float64)
        packed = torch.cat([part.to(torch.float64).reshape(1), extra.to(part.device)])
        _collectives.all_reduce_(packed, group, label="clip_grad_norm_")  # NaN sums on
        size = dist.get_world_size(group)
        pairs = packed[1:].view(-1, 2)
        if marks and bool((pairs[:, 1] * size != pairs[:, 0] ** 2).any()):
            raise _clip_mismatch(passed)
        return packed[0].to(part.dtype)
    # A MAX all-reduce need not carry a NaN through (gloo's does not): reduce a NaN flag with
    # it, and each mark with its negation (max equals minus the max of -mark when all agree).
    nan = torch.isnan(part)
    extra = torch.tensor([float(v) for m in marks for v in (m, -m)], dtype=part.dtype)
    both = torch.cat([torch.stack([torch.where(nan, 0.0, part), nan.to(part.dtype)]), extra.to(part.device)])
    _collectives.all_reduce_(both, group, label="clip_grad_norm_", op=dist.ReduceOp.MAX)
    pairs = both[2:].view(-1, 2)
    if marks and bool((pairs[:, 0] != -pairs[:, 1]).any()):
        raise _clip_mismatch(passed)
    return torch.where(both[1] > 0, float("nan"), both[0])


def _passed_marks(passed: list[ParamSlot]) -> list[int]:
    """How many sharded parameters were passed, and a 16-bit fingerprint of which (the sum of
    each one's hash of its unit and name: any order): small integers that float32 and float64
    hold exactly."""
    return [len(passed), sum(_clip_mark(slot) for slot in passed) % 65536]


def _clip_mark(slot: ParamSlot) -> int:
    """A 16-bit hash of the parameter's unit and name, kept once the root named them."""
    if slot.clip_mark is not None:
        return slot.clip_mark
    group = group_of(slot)
    name = f"{group.trace_name if group is not None else ''}/{slot.fqn}"
    mark = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=2).digest(), "little")
    if group is not None and group.fqn is not None:  # (before root init, names are partial)
        slot.clip_mark = mark
    return mark


def _clip_mismatch(passed: list[ParamSlot] | None) -> RankMismatchError:
    count = len(passed) if passed is not None else 0
    return RankMismatchError(
        f"clip_grad_norm_: the ranks of a shard group passed different sharded parameters (this "
        f"rank passed {count}); the norm would mix parts of different parameter sets and every "
        "rank would clip by a wrong factor. Pass the same parameters on every rank (e.g. "
        "model.parameters()), in any order."
    )


def _mesh_mean_norm_power(part: torch.Tensor, norm_type: float, info: MeshInfo) -> torch.Tensor:
    """The mean (or, for inf, max) of one rank's ``part`` over every rank of ``info``'s mesh."""
    groups = [(info.shard_group, info.shard_size)]
    if info.replicate_group is not None:
        groups.append((info.replicate_group, info.replicate_size))
    for group, size in groups:
        if size > 1:
            part = _all_reduce_norm_power(part if math.isinf(norm_type) else part / size, norm_type, group)
    return part


def _combine(a: torch.Tensor, b: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.maximum(a, b) if math.isinf(norm_type) else a + b
