"""The ``state_dict()`` / ``load_state_dict()`` hooks of the modules that own sharded parameters.

The hook bodies (installed by ``fshard._hooks``) and the tensor helpers they share with
``fshard._state_dict``: a slot's shard as a DTensor, this rank's rows of a full tensor or of a
DTensor from any mesh, and the check that a DTensor holds this rank's shard and not another's.
No collective here except the one agreement of a load of DTensors (``on_any_rank``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fshard._collectives import on_any_rank
from fshard._param import ParamSlot, local_rows, set_data
from fshard._unit._group import ParamGroup, ShardedState, TrainingState, group_of

__all__ = [
    "allocate_meta_shards",
    "as_dtensor",
    "foreign_shard",
    "free_for_load",
    "full_tensor",
    "local_shard",
    "on_module_load_state_dict",
    "on_module_state_dict",
    "on_slot_mesh",
    "same_layout",
    "shard_of",
]


def free_for_load(groups: list[ParamGroup], where: str) -> list[ParamGroup]:
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


def allocate_meta_shards(group: ParamGroup) -> bool:
    """Give a unit whose shards are on the meta device storage for them (zeros, on the unit's
    shard device), keeping the parameter objects; whether it had to."""
    if not any(bucket.flat_shard.is_meta for bucket in group.buckets):
        return False
    zeros = [
        torch.zeros(s.layout.local_shape, dtype=s.sharded_param.dtype, device=group.mesh_info.device)
        for s in group.slots
    ]
    group.set_slots(group.slots, zeros)
    return True


# Units whose shards a load into a meta model allocated (a unit's owners are loaded one module at
# a time; the first allocates the whole unit, and torch still asks the others for assign).
_ALLOCATED_FOR_ASSIGN: weakref.WeakSet[ParamGroup] = weakref.WeakSet()


def _assign_on_meta(
    keys: list[tuple[str, ParamSlot]], on_meta: bool, local_metadata: dict[str, Any], where: str
) -> bool:
    """Whether the load asked for ``assign``; turned off (the shards are copied into) where
    the model is on the meta device, refused elsewhere.

    torch's ``set_model_state_dict`` asks for ``assign`` on the ranks whose model is on meta:
    the shards get storage and are copied into instead ([Note: loading into a meta model] in
    ``_state_dict/_common``). A unit allocated so by its first owner is no longer on meta when
    its other owners are loaded.
    """
    if not local_metadata.get("assign_to_params_buffers", False):
        return False
    if not on_meta and not all(slot.group_ref() in _ALLOCATED_FOR_ASSIGN for _, slot in keys):
        raise ValueError(
            f"{where}(assign=True) would replace fshard's sharded parameters "
            f"({keys[0][0]!r}, ...); load without assign (a model built on the meta "
            "device is loaded without it, and needs no fshard.materialize(model) first), "
            "or use fshard.load_state_dict(model, state_dict)"
        )
    local_metadata["assign_to_params_buffers"] = False
    return True


def _allocate_own_meta(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, device: torch.device
) -> None:
    """Storage for ``module``'s own meta parameters (not sharded ones: ignored) and buffers
    that ``state_dict`` is about to fill, so that copying into them loads them."""
    for name, param in module._parameters.items():
        if param is not None and param.is_meta and prefix + name in state_dict:
            set_data(param, torch.empty_like(param, device=device))
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta and prefix + name in state_dict:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def local_shard(slot: ParamSlot) -> torch.Tensor:
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


def as_dtensor(slot: ParamSlot, local: torch.Tensor) -> DTensor:
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


def on_slot_mesh(value: DTensor, slot: ParamSlot) -> bool:
    """Whether ``value`` has the param's mesh and placements."""
    info = slot.mesh_info
    return value.device_mesh == info.mesh and tuple(value.placements) == info.placements(
        slot.layout.replicated
    )


def same_layout(value: DTensor, slot: ParamSlot) -> bool:
    return on_slot_mesh(value, slot) and value.to_local().shape == slot.layout.local_shape


def foreign_shard(what: str, value: torch.Tensor, slot: ParamSlot) -> str | None:
    """Why a DTensor laid out like ``slot`` cannot be loaded here: it holds another rank's
    shard (``None`` if it is this rank's, or not such a DTensor).

    A DTensor keeps the mesh coordinate of the rank that made it, also through ``torch.save``
    and ``torch.load`` on another rank: a sharded state dict saved by rank 0 and loaded on every
    rank would give each rank rank 0's rows, silently.
    """
    if not isinstance(value, DTensor) or not on_slot_mesh(value, slot):
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


def shard_of(value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """This rank's shard of a full tensor or of a DTensor from any mesh.

    A DTensor laid out like the param is used as it is; any other DTensor is gathered with
    ``full_tensor()`` (a collective over its own mesh) and then sliced.
    """
    if isinstance(value, DTensor):
        if same_layout(value, slot):
            return value.to_local()
        return local_rows(full_tensor(value), slot.layout).clone()
    return local_rows(value, slot.layout)


def full_tensor(value: DTensor) -> torch.Tensor:
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
        destination[key] = as_dtensor(slot, local_shard(slot))


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
    on_meta = any(local_shard(slot).is_meta for _, slot in keys)
    assign = _assign_on_meta(keys, on_meta, local_metadata, where)
    groups = {id(g): g for _, slot in keys if (g := group_of(slot)) is not None}
    free_for_load(list(groups.values()), where)  # the units gather again on their next use
    if on_meta:
        for group in groups.values():
            if allocate_meta_shards(group):
                _ALLOCATED_FOR_ASSIGN.add(group)  # its other owners' hooks see real shards
    if on_meta or assign:
        _allocate_own_meta(module, state_dict, prefix, keys[0][1].mesh_info.device)
    foreign = {key: foreign_shard(f"key {key!r}", state_dict[key], slot) for key, slot in keys}
    on_mesh = [
        slot
        for key, slot in keys
        if isinstance(state_dict[key], DTensor) and on_slot_mesh(state_dict[key], slot)
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
            state_dict[key] = local_shard(slot)  # copied onto itself: nothing changes
        elif refused and isinstance(value, DTensor) and on_slot_mesh(value, slot):
            error_msgs.append(
                f"key {key!r}: another rank of the mesh was given DTensors holding the shards of "
                "other ranks (a sharded state dict saved by one rank and loaded by all). Every "
                "rank of the mesh refuses the load, so that none goes on with it alone"
            )
            state_dict[key] = local_shard(slot)
        elif isinstance(value, DTensor):
            state_dict[key] = shard_of(value, slot)
        elif isinstance(value, torch.Tensor) and value.shape == slot.layout.full_shape:
            state_dict[key] = local_rows(value, slot.layout)
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
            state_dict[key] = local_shard(slot)  # copied onto itself: nothing changes
