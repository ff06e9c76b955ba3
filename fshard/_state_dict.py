"""State dicts of sharded models: sharded (DTensor), full (gathered), loading, optimizer state.

Keys are always the unsharded model's ``state_dict()`` keys: fshard renames nothing, and a tied
parameter appears under every key that ``model.state_dict()`` gives it. Collectives go through
``fshard._collectives``; the slicing math lives in ``fshard.transforms`` and ``_placement``.

[Note: one parameter at a time]
``full_state_dict`` and ``load_state_dict(..., broadcast_from_rank0=True)`` move one parameter at
a time, so the extra memory they need is about one full parameter, never the full model. With
``rank0_only`` the full parameter is *gathered* to rank 0 (not all-gathered), and only the ranks
of rank 0's shard group take part, so no other rank ever holds a full parameter. Loading from
rank 0 is the mirror image: rank 0 scatters each parameter's padded chunks over its shard group,
and on a 2D mesh each shard is then broadcast along the replicate dim.

[Note: rank 0]
"Rank 0" is the first rank of the root's mesh (``mesh.mesh.flatten()[0]``), which is global
rank 0 for a mesh over all ranks.

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
scatter, while the others wait in it. In the model, a parameter or buffer on meta cannot be
written: loads copy into the model's tensors (``assign`` is never used), and a copy into a meta
tensor does nothing (torch only warns), so the load would report success and the forward fail.
So both are problems of the agreed checks, naming the keys, before anything is sent or loaded.
Only non-persistent buffers, which ``broadcast_from_rank0`` copies from rank 0's model, are
replaced by the received tensor where they are on meta, as ``fshard.materialize`` allocates them.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._collectives import on_any_rank
from fshard._errors import ProblemList, first_few, internal_error
from fshard._mesh import MeshInfo
from fshard._param import ParamSlot
from fshard._runtime._optim_hooks import SHARDS_KEY, check_optimizer_state, never_stepped
from fshard._unit._group import ParamGroup, ShardedState, TrainingState, group_of
from fshard._unit._registry import unit_of, units_or_error
from fshard.transforms import Layout, TensorLayout

__all__ = [
    "LoadResult",
    "full_state_dict",
    "layout_of",
    "load_optim_state_dict",
    "load_state_dict",
    "optim_state_dict",
    "state_dict",
]

logger = logging.getLogger("fshard")


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
class _Entry:
    """One ``model.state_dict()`` entry: the live tensor, and its slot if it is a sharded param."""

    key: str
    value: Any  # the parameter, buffer or extra state (keep_vars=True)
    slot: ParamSlot | None


# ----------------------------------------------------------------------------------- helpers


def _root_info(model: nn.Module, where: str) -> MeshInfo:
    group = unit_of(model)
    return (group if group is not None else units_or_error(model, where)[0]).mesh_info


def _entries(model: nn.Module, where: str) -> list[_Entry]:
    by_id: dict[int, ParamSlot] = {}
    for group in units_or_error(model, where):
        for slot in group.slots:
            by_id[id(slot.sharded_param)] = slot
            if slot.unsharded_param is not None:  # the unit may be unsharded right now
                by_id[id(slot.unsharded_param)] = slot
    return [
        _Entry(key, value, by_id.get(id(value)) if isinstance(value, torch.Tensor) else None)
        for key, value in model.state_dict(keep_vars=True).items()
    ]


def _reshard_for_load(model: nn.Module, where: str) -> list[ParamGroup]:
    """Writes go to the shards: free gathered params first (only between steps).

    Returns the units that were unsharded (``fshard.unshard``), to gather again after loading
    so that they hold the new values.
    """
    return _free_for_load(units_or_error(model, where), where)


def _free_for_load(groups: list[ParamGroup], where: str) -> list[ParamGroup]:
    """Reshard ``groups`` so that loads reach the shards; returns those the modules showed
    gathered (``fshard.unshard``), to gather again. Units only kept for a backward (hidden) or
    prefetched by a forward that had none are freed for good: gathered again, the modules
    would show full parameters between steps."""
    busy = [g for g in groups if g.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"{where}: unit {busy[0].label} is in {busy[0].training_state.value}; load state "
            "dicts between training steps, not during forward or backward"
        )
    shown = [
        g for g in groups if g.sharded_state is ShardedState.UNSHARDED and g.unsharded_registered
    ]
    for group in groups:
        group.reshard()
    return shown


def _local(slot: ParamSlot) -> torch.Tensor:
    return slot.sharded_param.detach()


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _at_offset_zero(local: torch.Tensor) -> torch.Tensor:
    """The same memory as ``local``, as a tensor whose storage starts where ``local`` does.

    A unit's shards are views into one flat buffer per bucket, so most have a storage offset;
    ``torch.save`` of a DTensor whose local tensor has one fails in torch ("invalid python
    storage": the wrapper's data pointer is not 0, so it is pickled as a plain tensor). A slice
    of the storage aliases the same bytes (and keeps the buffer alive), so DCP still loads in
    place and nothing is copied.
    """
    if local.storage_offset() == 0 or local.is_meta or not local.is_contiguous():
        return local
    if local.numel() == 0:
        return local.new_empty(local.shape)
    start = local.storage_offset() * local.element_size()
    storage = local.untyped_storage()[start : start + local.numel() * local.element_size()]
    return local.new_empty(0).set_(storage, 0, local.shape, local.stride())


def _as_dtensor(slot: ParamSlot, local: torch.Tensor) -> DTensor:
    """``local`` (shaped like the slot's shard) as a DTensor with the param's placements."""
    info = slot.mesh_info
    shape = slot.layout.full_shape
    return DTensor.from_local(
        _at_offset_zero(local),
        info.mesh,
        info.placements(slot.layout.replicated),
        run_check=False,
        shape=shape,
        stride=_contiguous_stride(shape),
    )


def _src_rank(info: MeshInfo) -> int:
    """See [Note: rank 0]."""
    return int(info.mesh.mesh.flatten()[0].item())


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _in_src_row(info: MeshInfo, src: int) -> bool:
    """True on the ranks of ``src``'s shard group (the only ones that talk to ``src`` first)."""
    return src in _group_ranks(info.shard_group)


def _replicate_src(info: MeshInfo, src: int) -> int | None:
    """The member of this rank's replicate group that sits in ``src``'s shard group."""
    if info.replicate_group is None or info.replicate_size == 1:
        return None
    row = set(_group_ranks(info.shard_group))
    src_row = _row_of(info, src)
    for rank in _group_ranks(info.replicate_group):
        if _row_of(info, rank) == src_row:
            return rank
    raise RuntimeError(f"no rank of replicate group {_group_ranks(info.replicate_group)} in {row}")


def _row_of(info: MeshInfo, rank: int) -> int:
    coords = (info.mesh.mesh == rank).nonzero()
    return int(coords[0, 0].item())


def _mesh_all_gather_objects(info: MeshInfo, obj: Any, label: str) -> list[Any]:
    """One object from every rank of the mesh, on every rank (shard group, then replicate)."""
    items = [(dist.get_rank(), obj)]
    if info.shard_size > 1:
        parts = _collectives.all_gather_objects(items, info.shard_group, label=label)
        items = [item for part in parts for item in part]
    if info.replicate_group is not None and info.replicate_size > 1:
        parts = _collectives.all_gather_objects(items, info.replicate_group, label=label)
        items = [item for part in parts for item in part]
    return [o for _, o in sorted(items, key=lambda item: item[0])]


@contextmanager
def _ranks_agree(info: MeshInfo, where: str) -> Iterator[None]:
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
    everyone = _mesh_all_gather_objects(info, (dist.get_rank(), failure), label=f"{where}: checks")
    failed = [(rank, f) for rank, f in everyone if f is not None]
    if not failed:
        return
    kind = failed[0][1][0]  # the lowest failing rank's, so that every rank raises the same type
    message = _agreed_message([(rank, text) for rank, (_, text) in failed], len(everyone), where)
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


def _agreed_message(failed: list[tuple[int, str]], mesh_size: int, where: str) -> str:
    """One message for every rank from each failing rank's ``(rank, message)``.

    Example:
        >>> print(_agreed_message([(1, "f: key 'w': bad")], 2, "f"))
        f: key 'w': bad
        (found on rank 1; every rank of the mesh (2) raises this error)
        >>> print(_agreed_message([(0, "f: a"), (1, "f: b")], 2, "f"))
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
        return f"{text}\n(found on {_rank_list(ranks)}; {everyone})"
    prefix = f"{where}: "
    parts = [
        f"  on {_rank_list(ranks)}: {text.removeprefix(prefix)}".replace("\n", "\n    ")
        for text, ranks in ranks_of.items()
    ]
    return f"{where}: the ranks found different problems ({everyone}):\n" + "\n".join(parts)


def _rank_list(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 0-3, 6`` (runs of consecutive ranks shortened)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _gather_full(
    slot: ParamSlot, local: torch.Tensor, *, rank0_only: bool, label: str
) -> torch.Tensor | None:
    """The full tensor of a shard-shaped ``local`` (a param or its optimizer state).

    With ``rank0_only`` it is gathered to rank 0 only and other ranks get ``None``; ranks
    outside rank 0's shard group do not communicate at all ([Note: one parameter at a time]).
    """
    info = slot.mesh_info
    layout = slot.layout
    src = _src_rank(info)
    if rank0_only and not _in_src_row(info, src):
        return None
    is_src = dist.get_rank() == src
    if layout.replicated or info.shard_size == 1:
        if rank0_only and not is_src:
            return None
        return local.detach().clone().view(layout.full_shape)
    size = info.shard_size
    device = info.device
    padded = torch.zeros(layout.slot_numel, dtype=local.dtype, device=device)
    padded[: layout.local_numel].copy_(local.detach().reshape(-1))
    if rank0_only:
        output = torch.empty(size * layout.slot_numel, dtype=local.dtype, device=device) if is_src else None
        _collectives.gather_into(output, padded, src, info.shard_group, label=label)
        del padded
        if output is None:
            return None
    else:
        output = torch.empty(size * layout.slot_numel, dtype=local.dtype, device=device)
        _collectives.all_gather_into(output, padded, info.shard_group, label=label)
        del padded
    if output.numel() != layout.full_numel:
        return output[: layout.full_numel].view(layout.full_shape)
    return output.view(layout.full_shape)


def _local_rows(full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    layout = slot.layout
    if layout.replicated:
        return full
    return full.narrow(0, layout.row_offset, layout.local_shape[0])


def _on_slot_mesh(value: DTensor, slot: ParamSlot) -> bool:
    """Whether ``value`` has the param's mesh and placements."""
    info = slot.mesh_info
    return value.device_mesh == info.mesh and tuple(value.placements) == info.placements(
        slot.layout.replicated
    )


def _same_layout(value: DTensor, slot: ParamSlot) -> bool:
    return _on_slot_mesh(value, slot) and value.to_local().shape == slot.layout.local_shape


def _foreign_shard(what: str, value: torch.Tensor, slot: ParamSlot) -> str | None:
    """Why a DTensor laid out like ``slot`` cannot be loaded here: it holds another rank's
    shard (``None`` if it is this rank's, or not such a DTensor).

    A DTensor keeps the mesh coordinate of the rank that made it, also through ``torch.save``
    and ``torch.load`` on another rank: a sharded state dict saved by rank 0 and loaded on every
    rank would give each rank rank 0's rows, silently.
    """
    if not isinstance(value, DTensor) or not _on_slot_mesh(value, slot):
        return None  # (laid out otherwise: gathered whole, with its own mesh's collectives)
    theirs = value.device_mesh.get_coordinate()
    mine = slot.mesh_info.mesh.get_coordinate()
    if theirs is None or mine is None:
        return None
    sharded = [i for i, p in enumerate(value.placements) if p.is_shard()]
    if all(theirs[i] == mine[i] for i in sharded):
        return None
    return (
        f"{what} is a DTensor holding the shard of mesh coordinate {tuple(theirs)}, not this "
        f"rank's {tuple(mine)} (rank {dist.get_rank()}): a sharded state dict saved by one rank "
        "(torch.save of fshard.state_dict, model.state_dict() or fshard.optim_state_dict) holds "
        "that rank's rows only. Save and load each rank's own file, or use "
        "torch.distributed.checkpoint / fshard.checkpoint, or a full state dict "
        "(fshard.full_state_dict, fshard.optim_state_dict(..., full=True))"
    )


def _shard_of(value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """This rank's shard of a full tensor or of a DTensor from any mesh.

    A DTensor laid out like the param is used as it is; any other DTensor is gathered with
    ``full_tensor()`` (a collective over its own mesh) and then sliced.
    """
    if isinstance(value, DTensor):
        if _same_layout(value, slot):
            return value.to_local()
        return _local_rows(_full_tensor(value), slot).clone()
    return _local_rows(value, slot)


def _full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also for a DTensor whose local tensor is not on its mesh's
    device (a CPU-offloaded model's state on a CUDA mesh: NCCL cannot gather CPU tensors);
    the result is on the local tensor's device."""
    local = value.to_local()
    mesh = value.device_mesh
    if local.device.type == mesh.device_type:
        return value.full_tensor()
    moved = DTensor.from_local(
        local.to(mesh.device_type),
        mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )
    return moved.full_tensor().to(local.device)


def _global_shape(value: torch.Tensor) -> torch.Size:
    return value.shape  # a DTensor's shape is its global shape


def _plain(value: Any) -> Any:
    """A buffer value as a plain tensor (DTensors are replicated or gathered)."""
    if isinstance(value, DTensor):
        if all(p.is_replicate() for p in value.placements):
            return value.to_local()
        return _full_tensor(value)
    return value


# --------------------------------------------------------------------------------- layout


def layout_of(model: nn.Module) -> Layout:
    """The picklable layout of a sharded model's state dict (see ``fshard.transforms``).

    Per key of ``model.state_dict()``: full shape, dtype, mesh shape and placements
    (``"S(0)"`` or ``"R"`` per mesh dim; buffers are replicated). No process group inside.

    Example:
        >>> layout = fshard.layout_of(model)            # doctest: +SKIP
        >>> layout["layers.0.weight"].placements        # doctest: +SKIP
        ('S(0)',)
        >>> local = fshard.transforms.shard(full_sd, layout, mesh.get_coordinate())  # doctest: +SKIP
    """
    info = _root_info(model, "fshard.layout_of")
    mesh_shape = tuple(info.mesh.shape)
    entries: dict[str, TensorLayout] = {}
    for e in _entries(model, "fshard.layout_of"):
        if e.slot is not None:
            s_info = e.slot.mesh_info
            placements = tuple(str(p) for p in s_info.placements(e.slot.layout.replicated))
            entries[e.key] = TensorLayout(
                full_shape=tuple(e.slot.layout.full_shape),
                dtype=e.slot.sharded_param.dtype,  # type: ignore[arg-type]  # normalised to a name
                mesh_shape=tuple(s_info.mesh.shape),
                placements=placements,
            )
        elif isinstance(e.value, torch.Tensor):
            entries[e.key] = TensorLayout(
                full_shape=tuple(e.value.shape),
                dtype=e.value.dtype,  # type: ignore[arg-type]  # normalised to a name
                mesh_shape=mesh_shape,
                placements=tuple("R" for _ in mesh_shape),
            )
    return Layout(mesh_shape, entries)


# ----------------------------------------------------------- nn.Module.state_dict() integration

# [Note: model.state_dict() on a sharded model]
# A unit's parameters hold plain local shards (no DTensor dispatch on the hot path), so without
# help `model.state_dict()` would return bare shards: `torch.save(model.state_dict())` on one rank
# would silently write a fraction of the model, and `model.load_state_dict(full_sd)` would fail
# on every shape. So every module that registers a sharded parameter hooks its state_dict() to
# give the same DTensors as `fshard.state_dict` (sharing storage, no communication), and its
# load_state_dict() to take this rank's shard of a DTensor (any mesh) or of a full tensor. The
# hooks sit on the modules that own the parameters, not on the units, so that the state dict of
# any submodule (one layer's attention, the output head tied to a unit's embedding) is right.


def on_module_state_dict(
    owned: dict[str, ParamSlot], destination: dict[str, Any], prefix: str
) -> None:
    """``module.state_dict()`` post-hook: ``owned`` (the module's own sharded parameters by
    attribute name) become DTensors (see the Note).

    Also while the unit is gathered (``fshard.unshard``): the entries are then the gathered
    copies, in the compute dtype, and are replaced by the master shards all the same.
    """
    for name, slot in owned.items():
        key = prefix + name
        value = destination.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, (nn.Parameter, DTensor)):
            continue  # keep_vars=True gives the parameters themselves; leave those alone
        destination[key] = _as_dtensor(slot, _local(slot))


def on_module_load_state_dict(
    module: nn.Module,
    owned: dict[str, ParamSlot],
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    error_msgs: list[str],
) -> None:
    """``module.load_state_dict()`` pre-hook: replace the entries of ``owned`` (the module's
    own sharded parameters by attribute name) by this rank's shard.

    DTensors (any mesh) and full-shaped tensors become local shards. Any other tensor is a size
    mismatch reported against the *full* shape (``nn.Module`` would name the local one) through
    ``error_msgs``, so it is raised with the other errors of the load: a plain tensor shaped
    like this rank's shard is one too, since nothing tells it from a wrong-sized full tensor (a
    checkpoint from before a vocabulary resize), which every rank would load into its own rows
    (or, with uneven shards, some ranks only). ``state_dict`` is ``load_state_dict``'s own copy
    of the caller's dict.
    """
    where = "load_state_dict"  # the hooked module may be a child of the one called
    keys = [(prefix + name, slot) for name, slot in owned.items() if prefix + name in state_dict]
    if not keys:
        return
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            f"{where}(assign=True) would replace fshard's sharded parameters "
            f"({keys[0][0]!r}, ...); load without assign (after fshard.materialize(model) for a "
            "model built on the meta device), or use fshard.load_state_dict(model, state_dict)"
        )
    groups = {id(g): g for _, slot in keys if (g := group_of(slot)) is not None}
    _free_for_load(list(groups.values()), where)  # the units gather again on their next use
    foreign = {key: _foreign_shard(f"key {key!r}", state_dict[key], slot) for key, slot in keys}
    on_mesh = [
        slot
        for key, slot in keys
        if isinstance(state_dict[key], DTensor) and _on_slot_mesh(state_dict[key], slot)
    ]
    # Each rank sees only its own DTensors: rank 0's file loaded by every rank fails on the
    # others while rank 0 would load it and go on alone, into a collective no one else joins.
    # So the ranks agree (one small all-reduce per module loading DTensors laid out like its
    # params; the same on every rank, as the same keys are loaded).
    refused = bool(on_mesh) and on_any_rank(
        any(m is not None for m in foreign.values()), on_mesh[0].mesh_info, "load_state_dict"
    )
    for key, slot in keys:
        value = state_dict[key]
        message = foreign[key]
        if message is not None:
            error_msgs.append(message)
            state_dict[key] = _local(slot)  # copied onto itself: nothing changes
        elif refused and isinstance(value, DTensor) and _on_slot_mesh(value, slot):
            error_msgs.append(
                f"key {key!r}: another rank of the mesh was given DTensors holding the shards of "
                "other ranks (a sharded state dict saved by one rank and loaded by all). Every "
                "rank of the mesh refuses the load, so that none goes on with it alone"
            )
            state_dict[key] = _local(slot)
        elif isinstance(value, DTensor):
            state_dict[key] = _shard_of(value, slot)
        elif isinstance(value, torch.Tensor) and value.shape == slot.layout.full_shape:
            state_dict[key] = _local_rows(value, slot)
        elif isinstance(value, torch.Tensor):
            hint = ""
            if value.shape == slot.sharded_param.shape:
                hint = (
                    " A plain tensor is taken as the full parameter; to load this rank's shard, "
                    "pass it as a DTensor (fshard.state_dict(model) gives them)."
                )
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {slot.layout.full_shape} (sharded "
                f"by fshard; this rank holds {tuple(slot.sharded_param.shape)}).{hint}"
            )
            state_dict[key] = _local(slot)  # copied onto itself: nothing changes


# ------------------------------------------------------------------------------ state dicts


def state_dict(model: nn.Module) -> dict[str, Any]:
    """The sharded state dict: DTensors of this rank's shards, under the model's own keys.

    No communication. Parameters are ``DTensor``s with the parameter's mesh and placements
    (``Shard(0)``, or ``(Replicate(), Shard(0))`` on a 2D mesh; uneven and empty shards
    included), sharing storage with the parameters, so ``torch.distributed.checkpoint.load``
    into this dict loads the model in place. Buffers are plain tensors, as in FSDP2.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save(fshard.state_dict(model), checkpoint_id="ckpt/")  # doctest: +SKIP
        >>> sd = fshard.state_dict(model)                              # doctest: +SKIP
        >>> dcp.load(sd, checkpoint_id="ckpt/")                        # doctest: +SKIP
        >>> fshard.load_state_dict(model, sd)                          # doctest: +SKIP
    """
    out: dict[str, Any] = {}
    made: dict[int, DTensor] = {}
    for e in _entries(model, "fshard.state_dict"):
        if e.slot is None:
            out[e.key] = e.value.detach() if isinstance(e.value, torch.Tensor) else e.value
            continue
        dtensor = made.get(id(e.slot))
        if dtensor is None:
            dtensor = made[id(e.slot)] = _as_dtensor(e.slot, _local(e.slot))
        out[e.key] = dtensor
    return out


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The full state dict (plain tensors, the unsharded model's keys), one param at a time.

    Collective: every rank of the mesh must call it. Each parameter is gathered on its own and
    moved to the CPU right away, so peak memory is about one full parameter plus the result
    (one gather per parameter, never the whole model). With ``rank0_only`` (default) only rank 0
    gets the tensors and other ranks get ``{}``; ``cpu_offload=False`` keeps them on the compute
    device. The values are copies: later training does not change them.

    Example:
        >>> full = fshard.full_state_dict(model)       # every rank calls it  # doctest: +SKIP
        >>> if dist.get_rank() == 0:                    # doctest: +SKIP
        ...     torch.save(full, "model.pt")
    """
    where = "fshard.full_state_dict"
    info = _root_info(model, where)
    keep = not rank0_only or dist.get_rank() == _src_rank(info)
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor | None] = {}
    for e in _entries(model, where):
        if e.slot is None:
            if keep:
                value = e.value
                if isinstance(value, torch.Tensor):  # a copy, like the gathered params
                    value = value.detach().to("cpu" if cpu_offload else value.device, copy=True)
                out[e.key] = value
            continue
        if id(e.slot) not in done:
            full = _gather_full(
                e.slot, _local(e.slot), rank0_only=rank0_only, label=f"full_state_dict({e.key})"
            )
            if full is not None and cpu_offload:
                full = full.cpu()
            done[id(e.slot)] = full
        full = done[id(e.slot)]
        if keep and full is not None:
            out[e.key] = full
    return out


def _check_keys(
    entries: list[_Entry], sd: Mapping[str, Any], strict: bool, problems: ProblemList
) -> tuple[list[str], list[str]]:
    expected = {e.key for e in entries}
    missing = [e.key for e in entries if e.key not in sd]
    unexpected = [k for k in sd if k not in expected]
    if strict:
        if missing:
            problems.add(f"missing key(s): {missing}")
        if unexpected:
            problems.add(f"unexpected key(s): {unexpected}")
    for e in entries:
        if e.key not in sd:
            continue
        value = sd[e.key]
        if e.slot is not None:
            if not isinstance(value, torch.Tensor):
                problems.add(f"key {e.key!r}: expected a tensor, got {type(value).__name__}")
                continue
            want = e.slot.layout.full_shape
            got = _global_shape(value)
            foreign = _foreign_shard(f"key {e.key!r}", value, e.slot)
            if foreign is not None:
                problems.add(foreign)
            if got != want:
                hint = ""
                if not isinstance(value, DTensor) and got == e.slot.layout.local_shape:
                    hint = (
                        f" (it has this rank's shard shape on rank {dist.get_rank()}: a dict of "
                        "plain local shards, such as fshard.transforms.to_local's, cannot be "
                        "loaded; pass DTensors from fshard.state_dict or full tensors)"
                    )
                problems.add(
                    f"key {e.key!r}: shape mismatch, the model's parameter has shape {list(want)} "
                    f"but the state dict has {list(got)}{hint}"
                )
        elif isinstance(e.value, torch.Tensor) and not isinstance(value, torch.Tensor):
            problems.add(f"key {e.key!r}: expected a tensor, got {type(value).__name__}")
        elif isinstance(e.value, torch.Tensor):
            if _global_shape(value) != e.value.shape:
                problems.add(
                    f"key {e.key!r}: shape mismatch, the model's buffer has shape "
                    f"{list(e.value.shape)} but the state dict has {list(_global_shape(value))}"
                )
    return missing, unexpected


def _meta_problems(entries: list[_Entry]) -> list[str]:
    """The model's parameters and buffers left on the meta device, which no load can fill.

    See [Note: meta tensors in a load].
    """
    params: set[str] = set()
    buffers: set[str] = set()
    for e in entries:
        if e.slot is not None:
            if _local(e.slot).is_meta:
                params.add(e.key)
        elif isinstance(e.value, nn.Parameter):  # one fshard does not manage (ignored)
            if e.value.is_meta:
                params.add(e.key)
        elif isinstance(e.value, torch.Tensor) and e.value.is_meta:
            buffers.add(e.key)
    problems = []
    if params:
        problems.append(
            f"{len(params)} parameter(s) are on the meta device ({first_few([repr(k) for k in sorted(params)])}); call "
            "fshard.materialize(model) before loading weights into it"
        )
    if buffers:
        problems.append(
            f"{len(buffers)} buffer(s) are on the meta device ({first_few([repr(k) for k in sorted(buffers)])}): a load "
            "copies into the model's buffers, which leaves a meta buffer without data; call "
            "fshard.materialize(model) (it allocates meta buffers too) before loading weights "
            "into it"
        )
    return problems


def _on_meta(value: Any) -> bool:
    """Whether ``value`` is a tensor without data (on the meta device; a DTensor's local too)."""
    return isinstance(value, torch.Tensor) and value.is_meta


def _meta_value_problems(whats: list[str]) -> list[str]:
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


def load_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any] | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> LoadResult:
    """Load a full or sharded state dict into a sharded model; each rank keeps its rows.

    ``state_dict`` values may be full plain tensors (an unsharded model's ``state_dict()``) or
    DTensors from any mesh shape (``fshard.state_dict`` or FSDP2, possibly of another run).
    Every problem (missing or unexpected keys under ``strict``, shape mismatches) is reported
    at once, naming the keys. With ``broadcast_from_rank0=True`` only rank 0 needs the (full)
    state dict; other ranks pass ``{}`` or ``None`` and never hold a full parameter. Buffers
    that no state dict holds (non-persistent ones: rotary tables, position ids) are then copied
    from rank 0's model too, so ranks that built the model on the meta device get them.

    Example:
        >>> full = torch.load("model.pt") if dist.get_rank() == 0 else {}   # doctest: +SKIP
        >>> fshard.load_state_dict(model, full, broadcast_from_rank0=True)  # doctest: +SKIP
    """
    where = "fshard.load_state_dict"
    regather = _reshard_for_load(model, where)
    entries = _entries(model, where)
    if broadcast_from_rank0:
        result = _load_from_rank0(model, entries, state_dict, strict=strict, where=where)
    else:
        result = _load_everywhere(model, entries, state_dict, strict=strict, where=where)
    for group in regather:
        group.unshard()
    return result


def _load_everywhere(
    model: nn.Module,
    entries: list[_Entry],
    state_dict: Mapping[str, Any] | None,
    *,
    strict: bool,
    where: str,
) -> LoadResult:
    """Every rank holds the (full or sharded) state dict and keeps its rows.

    The ranks agree on the checks before anything is loaded ([Note: ranks agree on errors]).
    """
    with _ranks_agree(_root_info(model, where), where):
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{where}: state_dict must be a mapping, got {type(state_dict).__name__}"
            )
        problems = ProblemList(where)
        problems.extend(_meta_problems(entries))
        missing, unexpected = _check_keys(entries, state_dict, strict, problems)
        problems.extend(
            _meta_value_problems(
                [f"key {e.key!r}" for e in entries if _on_meta(state_dict.get(e.key))]
            )
        )
        problems.raise_if_any(ValueError)
    loaded: set[int] = set()
    rest: dict[str, Any] = {}
    with torch.no_grad():
        # Last key first: a tied parameter takes the value under its last key, as it does in
        # nn.Module.load_state_dict.
        for e in reversed(entries):
            if e.key not in state_dict:
                continue
            value = state_dict[e.key]
            if e.slot is None:
                rest[e.key] = _plain(value)
                continue
            if id(e.slot) in loaded:
                continue
            loaded.add(id(e.slot))
            source = _shard_of(value, e.slot)
            target = _local(e.slot)
            if source.data_ptr() == target.data_ptr() and source.dtype == target.dtype and target.numel():
                continue  # loaded in place already (DCP into fshard.state_dict)
            target.copy_(source.reshape(target.shape))
    if rest:
        model.load_state_dict(rest, strict=False)
    return LoadResult(missing, unexpected)


def _load_from_rank0(
    model: nn.Module,
    entries: list[_Entry],
    state_dict: Mapping[str, Any] | None,
    *,
    strict: bool,
    where: str,
) -> LoadResult:
    """[Note: one parameter at a time]: rank 0 scatters, replicas broadcast."""
    info = _root_info(model, where)
    src = _src_rank(info)
    is_src = dist.get_rank() == src
    local_problems = _meta_problems(entries)
    described: dict[str, Any] | None = None
    missing: list[str] = []
    unexpected: list[str] = []
    if is_src:
        if not isinstance(state_dict, Mapping):
            local_problems.append(
                f"rank {src} must pass the full state dict as a mapping, got "
                f"{type(state_dict).__name__}"
            )
        else:
            problems = ProblemList(where)
            missing, unexpected = _check_keys(entries, state_dict, strict, problems)
            local_problems.extend(problems.items)
            described = {}
            on_meta: list[str] = []
            for e in entries:
                if e.key not in state_dict:
                    continue
                meta = _broadcast_meta(f"key {e.key!r}", state_dict[e.key], local_problems, on_meta)
                if meta is not None:
                    described[e.key] = meta
            local_problems.extend(_meta_value_problems(on_meta))
        empty = [key for key, _, _, buffer in _non_persistent_buffers(model) if buffer.is_meta]
        if empty:
            local_problems.append(
                f"{len(empty)} non-persistent buffer(s) are on the meta device on rank {src} "
                f"({first_few([repr(k) for k in empty])}): broadcast_from_rank0 copies them from rank {src}'s model "
                f"(they are in no state dict), so rank {src} must hold their values; build the "
                f"model on rank {src} without torch.device('meta') (the other ranks may use it)"
            )
    everyone = _mesh_all_gather_objects(
        info, (dist.get_rank(), local_problems, described, missing, unexpected), label=where
    )
    found_on: dict[str, list[int]] = {}  # each problem once (a meta model is so on every rank)
    for rank, rank_problems, *_ in everyone:
        for p in rank_problems:
            found_on.setdefault(p, []).append(rank)
    problems = ProblemList(where)
    for text, ranks in found_on.items():
        plain = ranks == [src] or len(ranks) == len(everyone)
        problems.add(text if plain else f"({_rank_list(ranks)}) {text}")
    problems.raise_if_any(ValueError)
    _, _, described, missing, unexpected = next(item for item in everyone if item[0] == src)
    assert_described: dict[str, Any] = described or {}
    in_row = _in_src_row(info, src)
    rep_src = _replicate_src(info, src)
    loaded: set[int] = set()
    rest: dict[str, Any] = {}
    with torch.no_grad():
        for e in reversed(entries):  # a tied parameter takes its last key's value (as above)
            meta = assert_described.get(e.key)
            if meta is None:
                continue
            source = state_dict[e.key] if is_src and state_dict is not None else None
            if meta[0] == "object":
                rest[e.key] = meta[1]
                continue
            if e.slot is None:
                rest[e.key] = _broadcast_full(info, src, in_row, rep_src, source, meta, e.key)
                continue
            if id(e.slot) in loaded:
                continue
            loaded.add(id(e.slot))
            _receive_shard(e.slot, src, in_row, rep_src, source, e.key)
        # Non-persistent buffers (rotary tables, position ids) are in no state dict: take rank
        # 0's, so ranks that built the model on the meta device get real values too.
        received: dict[int, torch.Tensor] = {}
        for key, module, name, buffer in _non_persistent_buffers(model):
            meta = ("tensor", tuple(buffer.shape), buffer.dtype)
            value = _broadcast_full(info, src, in_row, rep_src, buffer if is_src else None, meta, key)
            if buffer.is_meta:  # a copy into it would do nothing ([Note: meta tensors in a load])
                module._buffers[name] = received.setdefault(id(buffer), value)  # shared: once
            else:
                buffer.copy_(value)
    if rest:
        model.load_state_dict(rest, strict=False)
    return LoadResult(list(missing), list(unexpected))


def _broadcast_meta(
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


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(key, owning module, attribute name, buffer)`` of each non-persistent buffer."""
    found = []
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, module, name, buffer))
    return found


def _broadcast_full(
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


def _receive_shard(
    slot: ParamSlot,
    src: int,
    in_row: bool,
    rep_src: int | None,
    source: torch.Tensor | None,
    key: str,
) -> None:
    target = _local(slot)
    rows = _scatter_rows(slot, src, in_row, rep_src, source, target.dtype, f"load_state_dict({key})")
    target.copy_(rows)


def _scatter_rows(
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


# -------------------------------------------------------------------------------- optimizer

# [Note: optimizer class on load]
# torch's Optimizer.load_state_dict takes any optimizer's state: AdamW's moments load into RAdam
# (same keys, other meaning) and train silently, and into Adamax (other keys) to fail at the first
# step with a bare KeyError. fshard.optim_state_dict (and the checkpoint manifest) record the
# optimizer's class, and a load into another class is an error naming both. A state dict without
# the record (a plain opt.state_dict()) is checked as well as its content allows: hyperparameters
# that differ both ways, then each parameter's state keys against a one-step probe of this
# optimizer's class with the loaded hyperparameters (amsgrad adds max_exp_avg_sq, momentum adds
# momentum_buffer). A key whose saved value is None may be absent from the probe (older torch
# saved SGD's momentum_buffer as None), and a probe key may hold None in the state dict (a
# checkpoint's non-tensor state before it is read).

OPTIMIZER_CLASS_KEY = "optimizer_class"

STRICT_HINT = (
    "For a model that gained or lost parameters, pass strict=False to load the state of the "
    "parameters both sides hold."
)

# Group entries that are not hyperparameters: the optimizer's own parameters and their names
# (torch records ``param_names`` for optimizers built from ``named_parameters()``).
_NOT_HYPERPARAMETERS = frozenset({"params", "param_names", SHARDS_KEY})

_OTHER_CLASS_HINT = (
    "Build the optimizer with the class (and param groups) of the run that saved the state, or "
    "do not load this optimizer state and start the optimizer fresh (for a checkpoint: "
    "fshard.checkpoint.load(path, model) without the optimizer)."
)


def _class_name(optim: torch.optim.Optimizer) -> str:
    cls = type(optim)
    return f"{cls.__module__}.{cls.__qualname__}"


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def _param_names(entries: list[_Entry]) -> dict[int, tuple[str, ParamSlot | None]]:
    """``id(param) -> (canonical name, slot)``; a tied param is named by its first key."""
    names: dict[int, tuple[str, ParamSlot | None]] = {}
    for e in entries:
        if e.slot is not None:
            names.setdefault(id(e.slot.sharded_param), (e.key, e.slot))
        elif isinstance(e.value, nn.Parameter):
            names.setdefault(id(e.value), (e.key, None))
    return names


def _optim_params(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [list(group["params"]) for group in optim.param_groups]


def _is_shard_shaped(value: Any, slot: ParamSlot | None) -> bool:
    return (
        slot is not None
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == slot.layout.local_shape
        and value.dim() == len(slot.layout.full_shape)
    )


def _is_unsupported_state(value: Any, slot: ParamSlot | None) -> bool:
    """A non-scalar state tensor of a sharded param that is not shaped like its shard."""
    return (
        slot is not None
        and not slot.layout.replicated
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() > 0
    )


def _check_saved_state(
    optim: torch.optim.Optimizer, by_param: dict[int, tuple[str, ParamSlot | None]], where: str
) -> None:
    """Refuse state that ``optim_state_dict`` cannot save: tensors of a sharded parameter that
    are neither shaped like this rank's shard nor scalars (factored state, such as Adafactor's).

    Some of it is shaped like the shard on some ranks only (Adafactor's ``(1, 1)`` column
    statistics of a ``(3, 1)`` parameter, on the rank whose shard is ``(1, 1)``), so the caller
    makes the ranks agree ([Note: ranks agree on errors]).
    """
    problems = ProblemList(where)
    seen: set[str] = set()
    for params in _optim_params(optim):
        for p in params:
            name, slot = by_param[id(p)]
            if p not in optim.state or name in seen or slot is None:
                continue
            seen.add(name)
            for key, value in optim.state[p].items():
                if not _is_shard_shaped(value, slot) and _is_unsupported_state(value, slot):
                    problems.add(
                        f"state[{name!r}][{key!r}] of {type(optim).__name__} has shape "
                        f"{list(value.shape)}, neither this rank's shard of the parameter "
                        f"{list(slot.layout.local_shape)} on rank {dist.get_rank()} nor a scalar"
                    )
    problems.raise_if_any(
        ValueError,
        hint=(
            "fshard saves optimizer state shaped like the parameter plus scalars (factored state "
            "such as Adafactor's is not supported on sharded parameters): use an elementwise "
            "optimizer (SGD, Adam, AdamW, ...) for sharded parameters."
        ),
    )


def _named_params(
    model: nn.Module, optim: torch.optim.Optimizer, where: str
) -> tuple[list[list[tuple[str, ParamSlot | None]]], list[_Entry]]:
    entries = _entries(model, where)
    names = _param_names(entries)
    problems = ProblemList(where)
    groups: list[list[tuple[str, ParamSlot | None]]] = []
    for g_index, params in enumerate(_optim_params(optim)):
        group = []
        for p_index, p in enumerate(params):
            named = names.get(id(p))
            if named is None:
                problems.add(
                    f"param_groups[{g_index}]['params'][{p_index}] (shape {list(p.shape)}) is not a "
                    "parameter of the model"
                )
                continue
            group.append(named)
        groups.append(group)
    problems.raise_if_any(
        ValueError, hint="Build the optimizer from model.parameters() of the sharded model."
    )
    return groups, entries


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    full: bool = False,
    rank0_only: bool = False,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, ``{"state": {name: {...}}, "param_groups"}``.

    Tensors shaped like a parameter's shard (Adam's ``exp_avg``, SGD's ``momentum_buffer``) are
    DTensors laid out like the parameter; other state (Adam's ``step``) is kept as it is, as
    replicated values. ``param_groups`` keep their hyperparameters, with ``params`` listing
    parameter names. With ``full=True`` shard-shaped state is gathered (one tensor at a time) into
    full CPU tensors, on every rank or, with ``rank0_only``, on rank 0 only (``{}`` elsewhere).
    A third key, ``"optimizer_class"``, names the optimizer's class
    (``"torch.optim.adamw.AdamW"``), so that ``load_optim_state_dict`` refuses to load the state
    into another kind of optimizer (torch's ``Optimizer.load_state_dict`` ignores the key).

    Collective, in both forms: every rank of the mesh calls it (the ranks agree on any error
    before returning), so not under ``if rank == 0:``. In the sharded form every trainable
    parameter has state: one the optimizer has no state for yet (none has, before the first
    step; a parameter that never got a gradient) gets the state a fresh optimizer starts its
    first step from (``step`` 0), as torch's ``get_optimizer_state_dict`` gives one step's. So
    a fresh run's dict serves as the template ``torch.distributed.checkpoint.load`` reads a
    checkpoint into, and checkpoints have every key such a template asks for. The optimizer
    itself is left as it is.

    Example:
        >>> osd = fshard.optim_state_dict(model, opt)          # doctest: +SKIP
        >>> osd["state"]["layers.0.weight"]["exp_avg"]         # doctest: +SKIP
        DTensor(local_tensor=..., placements=(Shard(dim=0),))
        >>> osd["optimizer_class"]                             # doctest: +SKIP
        'torch.optim.adamw.AdamW'
    """
    return _optim_state_dict(model, optim, full=full, rank0_only=rank0_only, placeholder=True)


def _optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    full: bool,
    rank0_only: bool,
    placeholder: bool,
) -> dict[str, Any]:
    """``optim_state_dict``; without ``placeholder`` an optimizer that has not stepped gives
    an empty state (what a checkpoint saves: the next step starts it as a fresh one would)."""
    where = "fshard.optim_state_dict"
    info = _root_info(model, where)
    # The ranks agree before any gather, and before the caller's next collective (a checkpoint's
    # broadcast): see [Note: ranks agree on errors].
    with _ranks_agree(info, where):
        named_groups, entries = _named_params(model, optim, where)
        check_optimizer_state(optim)  # state made before fully_shard: sharded now, or an error
        by_param: dict[int, tuple[str, ParamSlot | None]] = {}
        for params, named in zip(_optim_params(optim), named_groups, strict=True):
            for p, n in zip(params, named, strict=True):
                by_param[id(p)] = n
        _check_saved_state(optim, by_param, where)
    keep = not rank0_only or dist.get_rank() == _src_rank(info)
    states: Mapping[torch.Tensor, Mapping[str, Any]] = optim.state
    if placeholder and not full:
        made = _placeholder_state(optim)
        if made:
            states = {**optim.state, **made}
    state: dict[str, dict[str, Any]] = {}
    # In the model's order, not the param groups' (which may differ between ranks: a
    # set of parameters): with ``full`` the ranks gather one tensor at a time, in step.
    position = {e.key: i for i, e in enumerate(entries)}
    held = [p for params in _optim_params(optim) for p in params if p in states]
    held.sort(key=lambda p: position.get(by_param[id(p)][0], len(position)))
    for p in held:
        name, slot = by_param[id(p)]
        if name in state:
            continue
        out: dict[str, Any] = {}
        for key, value in states[p].items():
            if _is_shard_shaped(value, slot):
                assert_slot: ParamSlot = slot  # type: ignore[assignment]  # checked above
                if full:
                    gathered = _gather_full(
                        assert_slot,
                        value,
                        rank0_only=rank0_only,
                        label=f"optim_state_dict({name}.{key})",
                    )
                    if gathered is not None:
                        out[key] = gathered.cpu()
                else:
                    out[key] = _as_dtensor(assert_slot, value)
            elif isinstance(value, torch.Tensor) and full:
                out[key] = value.detach().to("cpu", copy=True)  # a snapshot, as gathered ones
            else:
                out[key] = value
        state[name] = out
    if not keep:
        return {}
    param_groups = []
    for group, named in zip(optim.param_groups, named_groups, strict=True):
        copy = {k: v for k, v in group.items() if k != "params"}
        copy["params"] = [n for n, _ in named]
        param_groups.append(copy)
    return {"state": state, "param_groups": param_groups, OPTIMIZER_CLASS_KEY: _class_name(optim)}


def _placeholder_state(optim: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The state of a fresh optimizer for each trainable parameter ``optim`` holds no state
    for, leaving ``optim`` as it is: tensors for ``torch.distributed.checkpoint.load`` to read
    a checkpoint into.

    An empty state would make the DCP resume recipe (template, ``dcp.load``, then
    ``load_optim_state_dict``) load no optimizer state at all, silently: Adam's moments and step
    start again. So the optimizer's own step (not its hooks: an EMA post-hook must not see it)
    runs once over those parameters only, with zero gradients, the learning rates and weight
    decays at 0 (the params do not change); the state it made is taken out again, with the
    gradients and the groups restored, and set back to what the first step starts from
    (``_as_fresh``), so a checkpoint saved before any step resumes as a fresh run would. A run
    whose optimizer has stepped gets such entries for the parameters that never had a
    gradient (a pooler an MLM loss does not use), so its checkpoints have the keys a fresh
    run's template asks for. An optimizer without ``lr`` in every group, or whose step needs a
    closure (LBFGS), gets none.
    """
    groups = optim.param_groups
    chosen = [[p for p in g["params"] if p.requires_grad and p not in optim.state] for g in groups]
    if not any(chosen) or any("lr" not in g for g in groups):
        return {}
    saved_params: list[list[torch.Tensor]] = []
    saved_hyper: list[dict[str, Any]] = []
    saved_grads = []
    for group, params in zip(groups, chosen, strict=True):
        saved_params.append(group["params"])
        group["params"] = params
        saved_hyper.append({k: group[k] for k in ("lr", "weight_decay") if k in group})
        for k, v in saved_hyper[-1].items():
            if isinstance(v, torch.Tensor):
                group[k] = torch.zeros_like(v)
            elif isinstance(v, (int, float)):
                group[k] = 0.0
        for p in params:
            saved_grads.append((p, p.grad))
            p.grad = torch.zeros_like(p)
    step = type(optim).step
    step = getattr(step, "__wrapped__", step)  # torch's wrapper runs the step hooks
    made: dict[torch.Tensor, dict[str, Any]] = {}
    failed = False
    try:
        step(optim)
    except Exception as exc:  # a step that needs a closure (LBFGS): no placeholder
        logger.debug("fshard: no placeholder optimizer state (%s: %s)", type(exc).__name__, exc)
        failed = True
    finally:
        for group, params, hyper in zip(groups, saved_params, saved_hyper, strict=True):
            for p in group["params"]:  # only these can have state made here
                per = optim.state.pop(p, None)
                if per and not failed:
                    made[p] = _as_fresh(optim, per, hyper)
            group["params"] = params
            group.update(hyper)
        for p, grad in saved_grads:
            p.grad = grad
    return made


def _as_fresh(
    optim: torch.optim.Optimizer, state: Mapping[str, Any], hyper: Mapping[str, Any]
) -> dict[str, Any]:
    """One step's state, with zero gradients at learning rate 0, set back to what the first
    step starts from: ``step`` 0 (Adam, RMSprop, Adadelta, Adamax, RAdam, Adagrad then step
    exactly as fresh ones), and for torch's optimizers whose state starts from the learning
    rate or from 1, those values (Rprop's ``step_size``, ASGD's ``eta``, ``mu`` and ``ax``,
    NAdam's ``mu_product``). SGD's momentum buffer stays zeros: a fresh SGD copies the first
    gradient instead, which is the same unless ``dampening`` is set."""
    out = dict(state)
    if "step" in out:
        value = out["step"]
        out["step"] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
    lr = float(hyper.get("lr", 0.0))
    kind = type(optim)
    fresh: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    if kind is torch.optim.Rprop:
        fresh = {"step_size": lambda t: torch.full_like(t, lr), "prev": torch.zeros_like}
    elif kind is torch.optim.ASGD:
        fresh = {
            "eta": lambda t: torch.full_like(t, lr),
            "mu": torch.ones_like,
            "ax": torch.zeros_like,
        }
    elif kind is torch.optim.NAdam:
        fresh = {"mu_product": torch.ones_like}
    for key, make in fresh.items():
        if isinstance(out.get(key), torch.Tensor):
            out[key] = make(out[key])
    return out


def load_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> LoadResult:
    """Load an optimizer state dict (sharded or full, from any mesh) into ``optim``.

    ``state_dict`` is keyed by parameter name (``fshard.optim_state_dict``, of this run or of
    another mesh), or it is a plain ``opt.state_dict()`` of an unsharded run, keyed by position
    (state ``0..n-1``, ``param_groups[i]["params"]`` lists of ints). Positions are mapped to this
    optimizer's parameters in param-group order, as ``torch.optim.Optimizer.load_state_dict``
    does, so build the optimizer with the same groups, in the same order, as the run that saved
    it; the group count and sizes must match.

    The saved ``param_groups`` must hold the same parameter names as ``optim``'s groups (in any
    order); their hyperparameters are restored. DTensor state is resharded to this rank's shard,
    full tensors shaped like a parameter are sliced, other values are loaded as they are. State
    of another optimizer class is refused, naming both classes: by the ``"optimizer_class"`` that
    ``fshard.optim_state_dict`` records, and, for state dicts without it, by comparing each
    parameter's state keys with the ones this optimizer makes (for ``torch.optim``'s classes).

    With ``strict=False`` (for a model that gained or lost parameters) only the state of the
    parameters both sides hold is loaded: saved state of parameters the optimizer does not hold
    is skipped, and parameters that no saved group lists keep their current state (none, for a
    fresh optimizer). Each of ``optim``'s groups takes the hyperparameters of the saved group
    that lists its parameters; a group none of whose parameters were saved keeps its own, and a
    group whose parameters were saved in different groups is an error. Shape mismatches and
    another optimizer class are errors either way. The skipped names come back in a
    ``LoadResult``: ``missing_keys`` (held, not saved) and ``unexpected_keys`` (saved, not held).

    A saved state of zero steps (``step`` 0: the entry ``optim_state_dict`` makes for a
    parameter without state) is not loaded for a parameter the optimizer holds no state for:
    its first step starts it as a fresh optimizer would, from the learning rate of then.

    The optimizer gets its own copies: it never shares a tensor with ``state_dict`` (or with
    the optimizer that produced it), so stepping one cannot change the other.

    With ``broadcast_from_rank0=True`` only rank 0 (of the mesh) needs the state dict, a full
    one (``fshard.optim_state_dict(model, opt, full=True, rank0_only=True)``, or an unsharded
    run's ``opt.state_dict()``); other ranks pass anything (``{}``). Rank 0 sends each tensor
    in turn, scattering the rows of those shaped like their parameter, so no rank holds more
    than one full tensor of it at a time.

    Example:
        >>> osd = fshard.optim_state_dict(model, opt)         # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, osd)     # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> plain = unsharded_opt.state_dict()                # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, plain)   # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> full = fshard.optim_state_dict(model, opt, full=True, rank0_only=True)  # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, full, broadcast_from_rank0=True)  # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
    """
    if broadcast_from_rank0:
        where = "fshard.load_optim_state_dict(broadcast_from_rank0=True)"
        received = _optim_from_rank0(model, optim, state_dict, where)
        return _load_optim(model, optim, received, copy=False, strict=strict, where=where)
    return _load_optim(model, optim, state_dict, copy=True, strict=strict)


def _optim_from_rank0(
    model: nn.Module, optim: torch.optim.Optimizer, state_dict: Any, where: str
) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank, name-keyed, parameter-shaped state as
    DTensors of this rank's rows (the load then takes them without communication)."""
    info = _root_info(model, where)
    src = _src_rank(info)
    is_src = dist.get_rank() == src
    problems: list[str] = []
    skeleton: dict[str, Any] | None = None
    saved: _SavedOptim | None = None
    if is_src:
        try:
            if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
                raise ValueError(
                    f"{where}: rank {src} must pass a full optimizer state dict (a mapping with "
                    "'state' and 'param_groups'), got "
                    f"{type(state_dict).__name__}"
                )
            saved = _by_name(state_dict, _named_params(model, optim, where)[0], where)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            described: dict[str, Any] = {}
            on_meta: list[str] = []
            for name, entries in saved.state.items():
                if not isinstance(entries, Mapping):
                    problems.append(f"{where}: the state of {name!r} is not a mapping")
                    continue
                described[name] = {}
                for key, value in entries.items():
                    meta = _broadcast_meta(f"state[{name!r}][{key!r}]", value, problems, on_meta)
                    if meta is not None:
                        described[name][key] = meta
            problems.extend(_meta_value_problems(on_meta))
            skeleton = {"param_groups": [dict(g) for g in saved.groups], "state": described}
            if OPTIMIZER_CLASS_KEY in state_dict:
                skeleton[OPTIMIZER_CLASS_KEY] = state_dict[OPTIMIZER_CLASS_KEY]
    everyone = _mesh_all_gather_objects(info, (dist.get_rank(), problems, skeleton), label=where)
    failed = ProblemList(where)
    for _, rank_problems, _ in everyone:
        failed.extend(p.removeprefix(f"{where}: ") for p in rank_problems)
    failed.raise_if_any(ValueError)
    skeleton = next(item[2] for item in everyone if item[0] == src)
    if skeleton is None:  # rank src had no problems, so it described its state dict
        raise internal_error(f"{where}: rank {src} sent no description of its state dict")
    slots = {name: slot for name, slot in _param_names(_entries(model, where)).values() if slot is not None}
    in_row = _in_src_row(info, src)
    rep_src = _replicate_src(info, src)
    state: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, entries in skeleton["state"].items():
            state[name] = {}
            for key, meta in entries.items():
                if meta[0] == "object":
                    state[name][key] = meta[1]
                    continue
                source = saved.state[name][key] if saved is not None else None
                slot = slots.get(name)
                label = f"{where}: {name}.{key}"
                if slot is not None and not slot.layout.replicated and meta[1] == tuple(slot.layout.full_shape):
                    rows = _scatter_rows(slot, src, in_row, rep_src, source, meta[2], label)
                    state[name][key] = _as_dtensor(slot, rows)
                else:
                    state[name][key] = _broadcast_full(info, src, in_row, rep_src, source, meta, label)
    return {**skeleton, "state": state}


class _SavedOptim(NamedTuple):
    """A state dict's groups and state, keyed by parameter name."""

    groups: list[Mapping[str, Any]]
    state: Mapping[str, Mapping[str, Any]]


def _by_name(
    state_dict: Mapping[str, Any],
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    where: str,
) -> _SavedOptim:
    """``state_dict`` keyed by parameter name; a position-keyed one is mapped like torch does.

    A plain ``opt.state_dict()`` numbers the parameters: ``param_groups[g]["params"][j]`` is the
    ``j``-th parameter of group ``g``, and ``state`` is keyed by those numbers. As in
    ``Optimizer.load_state_dict``, the ``j``-th number of saved group ``g`` stands for the ``j``-th
    parameter of this optimizer's group ``g``.
    """
    groups = list(state_dict["param_groups"])
    state: Mapping[Any, Mapping[str, Any]] = state_dict.get("state", {})
    listed = [p for group in groups for p in group.get("params", [])]
    if all(isinstance(p, str) for p in listed) and all(isinstance(k, str) for k in state):
        return _SavedOptim(groups, state)
    problems = ProblemList(where)
    if any(isinstance(p, str) for p in listed) or any(isinstance(k, str) for k in state):
        problems.add(
            "the state dict mixes parameter names and positions in its 'params' lists or 'state' "
            "keys; pass fshard.optim_state_dict's dict (names) or an unsharded opt.state_dict() "
            "(positions)"
        )
    elif len(groups) != len(named_groups):
        problems.add(
            f"the state dict numbers parameters by position (a plain opt.state_dict()) and has "
            f"{len(groups)} param group(s), but the optimizer has {len(named_groups)}"
        )
    else:
        for g_index, (saved, current) in enumerate(zip(groups, named_groups, strict=True)):
            positions = list(saved.get("params", []))
            if len(positions) != len(current):
                problems.add(
                    f"param_groups[{g_index}] of the state dict holds {len(positions)} "
                    f"parameter position(s), but the optimizer's group holds {len(current)} "
                    f"parameter(s) ({[n for n, _ in current][:3]}...)"
                )
    problems.raise_if_any(
        ValueError,
        hint=(
            "A plain opt.state_dict() loads by position: build the optimizer with the same param "
            "groups, holding the same parameters in the same order, as the run that saved it "
            "(e.g. torch.optim.AdamW(model.parameters()) on both sides)."
        ),
    )
    name_of: dict[Any, str] = {}
    named: list[Mapping[str, Any]] = []
    for saved, current in zip(groups, named_groups, strict=True):
        for position, (name, _) in zip(saved.get("params", []), current, strict=True):
            name_of[position] = name
        named.append({**saved, "params": [n for n, _ in current]})
    unknown = sorted((k for k in state if k not in name_of), key=repr)
    if unknown:
        raise ValueError(
            f"{where}: the state dict has state for position(s) {unknown} that no param group "
            "lists; pass a state dict made by opt.state_dict()"
        )
    return _SavedOptim(named, {name_of[k]: v for k, v in state.items()})


def _match_groups(
    saved: _SavedOptim,
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    strict: bool,
    problems: ProblemList,
) -> tuple[list[int | None], list[str], list[str]]:
    """For each of the optimizer's groups, the saved group it loads from (or ``None``).

    Also returns the parameter names the optimizer holds but no saved group lists (missing) and
    those saved but not held (unexpected); under ``strict`` any of either is a problem.
    """
    known = {n for group in named_groups for n, _ in group}
    group_of: dict[str, int] = {}
    for s_index, group in enumerate(saved.groups):
        for name in group.get("params", []):
            group_of.setdefault(name, s_index)
    missing = [n for group in named_groups for n, _ in group if n not in group_of]
    unexpected = sorted((set(group_of) | set(saved.state)) - known)
    if strict:
        # Groups holding the same parameters match in any order (names, not positions).
        by_names: dict[frozenset[str], list[int | None]] = {}
        for s_index, group in enumerate(saved.groups):  # equal sets (empty groups) in order
            by_names.setdefault(frozenset(group.get("params", [])), []).append(s_index)
        by_set = [
            (by_names.get(frozenset(n for n, _ in current)) or [None]).pop(0) for current in named_groups
        ]
        if (
            len(saved.groups) == len(named_groups)
            and None not in by_set
            and len(set(by_set)) == len(by_set)
            and not set(saved.state) - known
        ):
            return by_set, [], []
        if len(saved.groups) != len(named_groups):
            problems.add(
                f"the state dict has {len(saved.groups)} param group(s) but the optimizer has "
                f"{len(named_groups)}"
            )
        for g_index, (group, current) in enumerate(zip(saved.groups, named_groups, strict=False)):
            saved_names = set(group.get("params", []))
            current_names = {n for n, _ in current}
            if saved_names != current_names:
                problems.add(
                    f"param_groups[{g_index}] holds different parameters: only in the state dict "
                    f"{sorted(saved_names - current_names)}, only in the optimizer "
                    f"{sorted(current_names - saved_names)}"
                )
        only_state = sorted(set(saved.state) - known)
        if only_state:
            problems.add(f"state for parameter(s) the optimizer does not hold: {only_state}")
        matched: list[int | None] = [
            g if g < len(saved.groups) else None for g in range(len(named_groups))
        ]
        return matched, [], []
    matched = []
    for g_index, current in enumerate(named_groups):
        sources = sorted({group_of[n] for n, _ in current if n in group_of})
        if len(sources) > 1:
            problems.add(
                f"param_groups[{g_index}] holds parameters that the state dict keeps in "
                f"different groups {sources} (e.g. "
                f"{[next(n for n, _ in current if group_of.get(n) == s) for s in sources[:2]]}), "
                "so strict=False cannot tell whose hyperparameters it takes; group the "
                "optimizer's parameters as the run that saved it did"
            )
        matched.append(sources[0] if sources else None)
    return matched, missing, unexpected


def _check_state_shapes(
    saved: _SavedOptim,
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    problems: ProblemList,
) -> None:
    slots = {n: s for group in named_groups for n, s in group}
    for name, st in saved.state.items():
        slot = slots.get(name)
        if slot is None or not isinstance(st, Mapping):
            continue
        want = slot.layout.full_shape
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                continue
            foreign = _foreign_shard(f"state[{name!r}][{key!r}]", value, slot)
            if foreign is not None:
                problems.add(foreign)
                continue
            if isinstance(value, DTensor):
                bad = value.shape != want
            else:  # full, or a scalar; not this rank's shard (see [Note: ranks agree on errors])
                bad = value.dim() > 0 and value.shape != want
            if not bad:
                continue
            if not isinstance(value, DTensor) and value.shape == slot.layout.local_shape:
                problems.add(
                    f"state[{name!r}][{key!r}] is a plain tensor of this rank's shard shape "
                    f"{list(value.shape)} on rank {dist.get_rank()}, not of the parameter's "
                    f"shape {list(want)}: "
                    "a state dict of plain local shards (such as fshard.transforms.to_local's) "
                    "cannot be loaded; pass DTensors (fshard.optim_state_dict) or full tensors "
                    "(fshard.optim_state_dict(..., full=True))"
                )
            else:
                problems.add(
                    f"state[{name!r}][{key!r}]: shape mismatch, the parameter has shape "
                    f"{list(want)} but the state has {list(value.shape)}"
                )


def _meta_state(
    saved: _SavedOptim, named_groups: list[list[tuple[str, ParamSlot | None]]]
) -> list[str]:
    """The saved state tensors on the meta device that the load would read, as
    ``state['name']['key']`` ([Note: meta tensors in a load])."""
    held = {n for group in named_groups for n, _ in group}
    return [
        f"state[{name!r}][{key!r}]"
        for name, st in saved.state.items()
        if name in held and isinstance(st, Mapping)
        for key, value in st.items()
        if _on_meta(value)
    ]


def _check_recorded_class(
    optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], where: str
) -> bool:
    """Refuse state saved from another optimizer class; returns whether a class was recorded.

    See [Note: optimizer class on load].
    """
    recorded = state_dict.get(OPTIMIZER_CLASS_KEY)
    if recorded is None:
        return False
    mine = _class_name(optim)
    if recorded != mine:
        raise ValueError(
            f"{where}: the optimizer state was saved from a {recorded} (its "
            f"{OPTIMIZER_CLASS_KEY!r}), but this optimizer is a {mine}: another optimizer class "
            f"keeps other state, or the same state with another meaning.\n{_OTHER_CLASS_HINT}"
        )
    return True


def _check_unrecorded_kind(
    optim: torch.optim.Optimizer,
    saved: _SavedOptim,
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    matched: list[int | None],
    problems: ProblemList,
) -> None:
    """Without a recorded class, tell another optimizer's state by its content (see the Note)."""
    mine = _class_name(optim)
    for g_index, s_index in enumerate(matched):
        if s_index is None:
            continue
        saved_keys = set(_hyperparameters(saved.groups[s_index]))
        current_keys = set(_hyperparameters(optim.param_groups[g_index]))
        if saved_keys - current_keys and current_keys - saved_keys:
            problems.add(
                f"param_groups[{g_index}] has hyperparameters {sorted(saved_keys - current_keys)} "
                f"that {mine} does not take and lacks its {sorted(current_keys - saved_keys)}: "
                "the state dict comes from another kind of optimizer"
            )
            return
    made: dict[tuple[int, int, torch.dtype, torch.device], frozenset[str] | None] = {}
    for g_index, (current, s_index) in enumerate(zip(named_groups, matched, strict=True)):
        hyper = _hyperparameters(optim.param_groups[g_index])
        if s_index is not None:
            hyper.update(_hyperparameters(saved.groups[s_index]))
        params = optim.param_groups[g_index]["params"]
        for (name, _), param in zip(current, params, strict=True):
            st = saved.state.get(name)
            if not isinstance(st, Mapping):
                continue
            probe_key = (g_index, param.dim(), param.dtype, param.device)
            if probe_key not in made:
                made[probe_key] = _state_keys_made(optim, hyper, param)
            keys = made[probe_key]
            present = {k for k, v in st.items() if v is not None}
            if keys is None or present <= keys <= set(st):
                continue
            problems.add(
                f"state[{name!r}] has keys {sorted(st)}, but {mine} with param_groups[{g_index}]'s "
                f"hyperparameters makes {sorted(keys)}: the state dict comes from another kind "
                "of optimizer"
            )
            return


def _state_keys_made(
    optim: torch.optim.Optimizer, hyperparameters: Mapping[str, Any], param: torch.Tensor
) -> frozenset[str] | None:
    """The state keys ``optim``'s class makes for a parameter like ``param`` in one step.

    Known only for ``torch.optim``'s own classes, whose constructors take their ``defaults`` and
    have no side effects: a one-element probe parameter takes one step. ``None`` when unknown
    (another class, or one that cannot step a probe: LBFGS needs a closure, SparseAdam sparse
    gradients).
    """
    cls = type(optim)
    if not cls.__module__.startswith("torch.optim"):
        return None
    try:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optim.defaults.items() if k in accepted}
        probe = torch.zeros(
            (1,) * param.dim(), dtype=param.dtype, device=param.device, requires_grad=True
        )
        probe.grad = torch.ones_like(probe)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = cls([{**hyperparameters, "params": [probe]}], **kwargs)
            other.step()
    except Exception as exc:  # the check is a courtesy: skip it when the probe cannot run
        logger.debug("fshard: cannot probe %s's optimizer state keys: %s", cls.__name__, exc)
        return None
    return frozenset(other.state[probe])


def _load_optim(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    copy: bool,
    strict: bool = True,
    check_only: bool = False,
    where: str = "fshard.load_optim_state_dict",
) -> LoadResult:
    """``load_optim_state_dict``; ``copy=False`` when the caller owns fresh tensors (checkpoints).

    ``check_only`` validates ``state_dict`` (its keys, shapes and optimizer class; the values are
    not read) and loads nothing, so a checkpoint can be checked before anything is read. The
    ranks agree on the checks before anything is loaded ([Note: ranks agree on errors]).
    """
    with _ranks_agree(_root_info(model, where), where):
        if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
            raise ValueError(
                f"{where}: expected a mapping with 'state' and 'param_groups' (from "
                f"fshard.optim_state_dict, or an unsharded run's opt.state_dict()), got "
                f"{type(state_dict).__name__} with keys "
                f"{sorted(state_dict) if isinstance(state_dict, Mapping) else '-'}"
            )
        named_groups, _ = _named_params(model, optim, where)
        recorded = _check_recorded_class(optim, state_dict, where)
        saved = _by_name(state_dict, named_groups, where)
        problems = ProblemList(where)
        matched, missing, unexpected = _match_groups(saved, named_groups, strict, problems)
        _check_state_shapes(saved, named_groups, problems)
        problems.raise_if_any(ValueError, hint=STRICT_HINT if strict else "")
        if not check_only:  # (the values of a checkpoint are not read yet)
            problems.extend(_meta_value_problems(_meta_state(saved, named_groups)))
            problems.raise_if_any(ValueError)
        if not recorded:
            _check_unrecorded_kind(optim, saved, named_groups, matched, problems)
            problems.raise_if_any(ValueError, hint=_OTHER_CLASS_HINT)
    if check_only:
        return LoadResult(missing, unexpected)

    saved_names = {n for group in saved.groups for n in group.get("params", [])}
    torch_state: dict[int, dict[str, Any]] = {}
    torch_groups: list[dict[str, Any]] = []
    index = 0
    for g_index, (current, s_index) in enumerate(zip(named_groups, matched, strict=True)):
        params = optim.param_groups[g_index]["params"]
        ids = []
        for (name, slot), param in zip(current, params, strict=True):
            ids.append(index)
            if name in saved.state and never_stepped(saved.state[name]) and param not in optim.state:
                # Saved as a placeholder (fshard.optim_state_dict's entry for a parameter
                # without state: step 0), loaded into an optimizer that starts this parameter
                # without state: leave it so, and the first step starts it as a fresh optimizer
                # does, from the learning rate of then (ASGD's eta, Rprop's step size: the
                # placeholder has the one of the save).
                pass
            elif name in saved.state:
                torch_state[index] = {
                    key: _local_state(value, slot, name, key, where, copy=copy)
                    for key, value in saved.state[name].items()
                }
            elif name not in saved_names and param in optim.state:
                torch_state[index] = dict(optim.state[param])  # strict=False: not saved, kept
            index += 1
        group = dict(optim.param_groups[g_index])
        if s_index is not None:
            group.update(_hyperparameters(saved.groups[s_index]))
        group["params"] = ids
        torch_groups.append(group)
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})
    return LoadResult(missing, unexpected)


def _local_state(
    value: Any, slot: ParamSlot | None, name: str, key: str, where: str, *, copy: bool
) -> Any:
    """This rank's piece of one optimizer-state value; a copy unless ``copy`` is False."""
    shard_shaped = (
        slot is not None
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() == len(slot.layout.full_shape) > 0
    )
    if isinstance(value, DTensor):
        if slot is None:
            local = _plain(value)
        elif _same_layout(value, slot):
            local = value.to_local()
        else:
            return _local_rows(_full_tensor(value), slot).clone()  # already a fresh tensor
    elif shard_shaped and value.shape == slot.layout.full_shape:  # type: ignore[union-attr]  # shard_shaped
        # A full tensor: keep only this rank's rows, never a view of the whole.
        return _local_rows(value, slot).clone()  # type: ignore[arg-type]  # shard_shaped
    elif shard_shaped:
        # _check_state_shapes refused every other shape on every rank, before any loading.
        raise internal_error(
            f"{where}: state[{name!r}][{key!r}] of shape {list(value.shape)} passed the checks"
        )
    else:
        local = value  # replicated state (Adam's step) or a non-tensor
    if copy and isinstance(local, torch.Tensor):
        return local.detach().clone()
    return local
