"""What the model and optimizer state dicts share: the model's entries, the ranks' agreement
on errors, and moving one tensor at a time (gather to full, scatter from rank 0, broadcast).

[Note: one parameter at a time]
``full_state_dict`` and ``load_state_dict(..., broadcast_from_rank0=True)`` move one parameter at
a time, so the extra memory they need is about one full parameter, never the full model. With
``rank0_only`` the full parameter is *gathered* to rank 0 (not all-gathered), and only the ranks
of rank 0's shard group take part, so no other rank ever holds a full parameter. Loading from
rank 0 is the mirror image: rank 0 scatters each parameter's padded chunks over its shard group,
and on a 2D mesh each shard is then broadcast along the replicate dim.

[Note: ranks agree on errors]
Each rank checks its own arguments against its own shards, and the ranks can disagree: a dict of
plain local shards (``fshard.transforms.to_local``) passes on a rank whose shard happens to have
the full shape (rank 0 of a ``(1, 3)`` weight on 2 ranks) and fails on the others, and factored
optimizer state (Adafactor's) looks shard-shaped on some ranks only. A rank that raised alone
leaves the others waiting in the next collective (a hang until the timeout) or in another state
(loaded on some ranks, not on others). So each public call that communicates, or that loads,
runs all of its checks first, then all-gathers one small object over the mesh (this rank's
error or ``None``), and if any rank failed, every rank raises the same error naming the ranks,
before anything is loaded or any other collective is issued. A plain tensor of this rank's
shard shape that equals the full shape cannot be told from a full tensor on its own rank; the
ranks whose shard differs from the full shape refuse it, and the agreement brings their error
to the others.

[Note: meta tensors in a load]
A tensor on the meta device has a shape and no data. In the state dict, one cannot be read:
copying out of it fails in torch ("Cannot copy out of meta tensor") in the middle of the load,
on the ranks that hold it only, and with ``broadcast_from_rank0`` in the middle of rank 0's
scatter, while the others wait in it. So it is a problem of the agreed checks, naming the key,
before anything is sent or loaded. In the model, see the next note.

[Note: loading into a meta model]
A model built under ``torch.device("meta")`` (on some ranks or on all) and sharded can be loaded
into without ``fshard.materialize``: once the ranks agreed on the checks, each rank gives its
meta tensors storage and no values (``fshard._materialize.allocate_for_load``: this rank's
shards only, no ``reset_parameters()``), and the load fills them as it fills any model, one
parameter at a time. A meta parameter or persistent buffer that the load does not fill (its
key is not in the state dict, under ``strict=False``) would keep garbage: that is a problem of
the agreed checks, naming the keys. Non-persistent buffers (rotary tables, position ids) are in
no state dict: ``broadcast_from_rank0`` copies them from rank 0's model (which must hold them)
into the ranks whose model has them on meta; the other loads cannot fill them, so a meta
non-persistent buffer is a problem of their checks (build that module off the meta device, as
its own ``__init__`` computes them, or load with ``broadcast_from_rank0``). torch's
``set_model_state_dict`` asks ``load_state_dict`` for ``assign=True`` on the ranks whose model
is on meta: the owners' hooks then give the shards (and the module's own meta tensors the state
dict fills) storage, and the load copies into them as on the other ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._errors import first_few
from fshard._mesh import MeshInfo, in_src_row, src_rank
from fshard._param import ParamSlot, all_gather_full, full_from_padded, padded_shard
from fshard._unit._module_state_dict import full_tensor
from fshard._unit._registry import unit_of, units_or_error


class LoadResult(NamedTuple):
    """Keys that ``load_state_dict(..., strict=False)`` skipped (like ``nn.Module``'s result).

    Example:
        >>> result = fshard.load_state_dict(model, sd, strict=False)  # doctest: +SKIP
        >>> result.missing_keys, result.unexpected_keys                # doctest: +SKIP
        ([], ['old_head.weight'])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(frozen=True)
class Entry:
    """One ``model.state_dict()`` entry: the live tensor, and its slot if it is a sharded param."""

    key: str
    value: Any  # the parameter, buffer or extra state (keep_vars=True)
    slot: ParamSlot | None


def root_info(model: nn.Module, where: str) -> MeshInfo:
    group = unit_of(model)
    return (group if group is not None else units_or_error(model, where)[0]).mesh_info


def model_entries(model: nn.Module, where: str) -> list[Entry]:
    by_id: dict[int, ParamSlot] = {}
    for group in units_or_error(model, where):
        for slot in group.slots:
            by_id[id(slot.sharded_param)] = slot
            if slot.unsharded_param is not None:  # the unit may be unsharded right now
                by_id[id(slot.unsharded_param)] = slot
    return [
        Entry(key, value, by_id.get(id(value)) if isinstance(value, torch.Tensor) else None)
        for key, value in model.state_dict(keep_vars=True).items()
    ]


def param_names(entries: list[Entry]) -> dict[int, tuple[str, ParamSlot | None]]:
    """``id(param) -> (canonical name, slot)``; a tied param is named by its first key."""
    names: dict[int, tuple[str, ParamSlot | None]] = {}
    for e in entries:
        if e.slot is not None:
            names.setdefault(id(e.slot.sharded_param), (e.key, e.slot))
        elif isinstance(e.value, nn.Parameter):
            names.setdefault(id(e.value), (e.key, None))
    return names


@contextmanager
def ranks_agree(info: MeshInfo, where: str) -> Iterator[None]:
    """Run the checks in the ``with`` body on every rank; raise on all if any rank failed.

    See [Note: ranks agree on errors]. Costs one object all-gather over the mesh. The body must
    issue no collective and change nothing, so that the error leaves every rank as it was.
    """
    failure: tuple[str, str] | None = None
    cause: Exception | None = None
    try:
        yield
    except Exception as exc:  # any failure of one rank must reach the others, or they hang
        cause = exc
        failure = (_error_kind(exc), str(exc))
    everyone = _collectives.all_gather_objects_by_rank(
        (dist.get_rank(), failure), info, label=f"{where}: checks"
    )
    failed = [(rank, f) for rank, f in everyone if f is not None]
    if not failed:
        return
    kind = failed[0][1][0]  # the lowest failing rank's, so that every rank raises the same type
    message = agreed_message([(rank, text) for rank, (_, text) in failed], len(everyone), where)
    raise _ERROR_KINDS[kind](message) from cause


_ERROR_KINDS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
}


def _error_kind(exc: Exception) -> str:
    """The built-in class that every rank raises for ``exc`` (a name, to pickle safely)."""
    if isinstance(exc, TypeError):
        return "TypeError"
    if isinstance(exc, ValueError):
        return "ValueError"
    return "RuntimeError"


def agreed_message(failed: list[tuple[int, str]], mesh_size: int, where: str) -> str:
    """One message for every rank from each failing rank's ``(rank, message)``.

    Example:
        >>> print(agreed_message([(1, "f: key 'w': bad")], 2, "f"))
        f: key 'w': bad
        (found on rank 1; every rank of the mesh (2) raises this error)
        >>> print(agreed_message([(0, "f: a"), (1, "f: b")], 2, "f"))
        f: the ranks found different problems (every rank of the mesh (2) raises this error):
          on rank 0: a
          on rank 1: b
    """
    ranks_of: dict[str, list[int]] = {}
    for rank, text in failed:
        ranks_of.setdefault(text, []).append(rank)
    everyone = f"every rank of the mesh ({mesh_size}) raises this error"
    if len(ranks_of) == 1:
        [(text, ranks)] = ranks_of.items()
        return f"{text}\n(found on {rank_list(ranks)}; {everyone})"
    prefix = f"{where}: "
    parts = [
        f"  on {rank_list(ranks)}: {text.removeprefix(prefix)}".replace("\n", "\n    ")
        for text, ranks in ranks_of.items()
    ]
    return f"{where}: the ranks found different problems ({everyone}):\n" + "\n".join(parts)


def rank_list(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 0-3, 6`` (runs of consecutive ranks shortened)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def gather_full(
    slot: ParamSlot, local: torch.Tensor, *, rank0_only: bool, label: str
) -> torch.Tensor | None:
    """The full tensor of a shard-shaped ``local`` (a param or its optimizer state).

    With ``rank0_only`` it is gathered to rank 0 only and other ranks get ``None``; ranks
    outside rank 0's shard group do not communicate at all ([Note: one parameter at a time]).
    """
    info = slot.mesh_info
    layout = slot.layout
    src = src_rank(info)
    if rank0_only and not in_src_row(info, src):
        return None
    is_src = dist.get_rank() == src
    if layout.replicated or info.shard_size == 1:
        if rank0_only and not is_src:
            return None
        return local.detach().clone().view(layout.full_shape)
    if not rank0_only:
        return all_gather_full(local, layout, info, label=label)
    padded = padded_shard(local, layout, info.device)
    output = torch.empty(info.shard_size * layout.slot_numel, dtype=local.dtype, device=info.device) if is_src else None
    _collectives.gather_into(output, padded, src, info.shard_group, label=label)
    del padded
    return None if output is None else full_from_padded(output, layout)


def plain_value(value: Any) -> Any:
    """A buffer value as a plain tensor (DTensors are replicated or gathered)."""
    if isinstance(value, DTensor):
        if all(p.is_replicate() for p in value.placements):
            return value.to_local()
        return full_tensor(value)
    return value


def is_meta_value(value: Any) -> bool:
    """Whether ``value`` is a tensor without data (on the meta device; a DTensor's local too)."""
    return isinstance(value, torch.Tensor) and value.is_meta


def meta_tensors(entries: list[Entry]) -> list[tuple[str, list[str]]]:
    """``(kind, keys)`` of each parameter (``"parameter"``) and persistent buffer
    (``"buffer"``) of the model on the meta device, with all the keys it has (a tied one has
    several). See [Note: loading into a meta model]."""
    found: dict[int, tuple[str, list[str]]] = {}
    for e in entries:
        if e.slot is not None:
            meta, ident, kind = e.slot.sharded_param.is_meta, id(e.slot), "parameter"
        elif isinstance(e.value, torch.Tensor):
            meta, ident = e.value.is_meta, id(e.value)
            kind = "parameter" if isinstance(e.value, nn.Parameter) else "buffer"  # (ignored)
        else:
            continue
        if meta:
            found.setdefault(ident, (kind, []))[1].append(e.key)
    return list(found.values())


def unfilled_meta_problems(metas: list[tuple[str, list[str]]], filled: Any) -> list[str]:
    """A problem for the meta parameters and for the meta buffers (``meta_tensors``) none of
    whose keys is in ``filled`` (the keys the load fills): they would keep garbage."""
    problems = []
    for kind in ("parameter", "buffer"):
        keys = [keys[0] for k, keys in metas if k == kind and not any(key in filled for key in keys)]
        if keys:
            problems.append(
                f"{len(keys)} {kind}(s) are on the meta device and the state dict does not hold "
                f"them ({first_few([repr(k) for k in sorted(keys)])}): a load gives meta tensors "
                "storage and fills them, and these would keep no values; pass them, or call "
                "fshard.materialize(model) before loading"
            )
    return problems


def non_persistent_meta_problems(model: nn.Module) -> list[str]:
    """A problem naming the model's non-persistent buffers on the meta device (``[]`` if none),
    which only ``broadcast_from_rank0`` can fill ([Note: loading into a meta model])."""
    keys = [key for key, _, _, buffer in non_persistent_buffers(model) if buffer.is_meta]
    if not keys:
        return []
    return [
        f"{len(keys)} non-persistent buffer(s) are on the meta device "
        f"({first_few([repr(k) for k in keys])}): no state dict holds them, so this load cannot "
        "fill them; build the modules that hold them off the meta device (their __init__ "
        "computes them), load with fshard.load_state_dict(..., broadcast_from_rank0=True) from "
        "a rank 0 that holds them, or call fshard.materialize(model) before loading"
    ]


def non_persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(key, owning module, attribute name, buffer)`` of each non-persistent buffer."""
    found = []
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, module, name, buffer))
    return found


def meta_value_problems(whats: list[str]) -> list[str]:
    """One problem naming the state dict's tensors on the meta device (``[]`` if none).

    See [Note: meta tensors in a load].
    """
    if not whats:
        return []
    return [
        f"{len(whats)} tensor(s) of the state dict are on the meta device ({first_few(whats)}): a meta "
        "tensor holds no data (a weight that an empty-weights load, such as init_empty_weights "
        "or low_cpu_mem_usage, left unfilled), so it cannot be loaded; pass a state dict whose "
        "tensors hold their values"
    ]


def broadcast_meta(
    what: str, value: Any, problems: list[str], on_meta: list[str]
) -> tuple[Any, ...] | None:
    """How rank 0 announces a value it will send: ``("tensor", shape, dtype)`` (sent next) or
    ``("object", value)``; a DTensor is a problem, and a meta tensor (which rank 0 could not
    send: [Note: meta tensors in a load]) is added to ``on_meta`` (both ``None``)."""
    if isinstance(value, DTensor):
        problems.append(
            f"{what} is a DTensor; broadcast_from_rank0 loads a full state dict of plain tensors "
            "(load sharded state dicts on every rank instead)"
        )
        return None
    if isinstance(value, torch.Tensor) and value.is_meta:
        on_meta.append(what)
        return None
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("object", value)


def broadcast_full(
    info: MeshInfo,
    src: int,
    in_row: bool,
    rep_src: int | None,
    source: torch.Tensor | None,
    meta: tuple[str, tuple[int, ...], torch.dtype],
    key: str,
) -> torch.Tensor:
    """A replicated tensor (a buffer): every rank gets the whole value."""
    _, shape, dtype = meta
    if source is not None:
        buf = source.detach().to(info.device, copy=True).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=info.device)
    if in_row and info.shard_size > 1:
        _collectives.broadcast_(buf, src, info.shard_group, label=f"load_state_dict({key})")
    if rep_src is not None:
        _collectives.broadcast_(buf, rep_src, info.replicate_group, label=f"load_state_dict({key})")
    return buf


def scatter_rows(
    slot: ParamSlot,
    src: int,
    in_row: bool,
    rep_src: int | None,
    source: torch.Tensor | None,
    dtype: torch.dtype,
    label: str,
) -> torch.Tensor:
    """This rank's rows (shaped like the slot's shard) of ``source``, a full tensor on ``src``."""
    info = slot.mesh_info
    layout = slot.layout
    buf = torch.empty(layout.slot_numel, dtype=dtype, device=info.device)
    if layout.replicated or info.shard_size == 1:
        if source is not None:
            buf.copy_(source.detach().reshape(-1))
        if in_row and info.shard_size > 1:
            _collectives.broadcast_(buf, src, info.shard_group, label=label)
    elif in_row:
        full_padded = None
        if source is not None:
            full_padded = torch.zeros(info.shard_size * layout.slot_numel, dtype=dtype, device=info.device)
            full_padded[: layout.full_numel].copy_(source.detach().reshape(-1))
        _collectives.scatter_into(buf, full_padded, src, info.shard_group, label=label)
        del full_padded
    if rep_src is not None:
        _collectives.broadcast_(buf, rep_src, info.replicate_group, label=label)
    return buf[: layout.local_numel].view(layout.local_shape)
