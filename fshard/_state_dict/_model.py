"""Model state dicts of sharded models: sharded (DTensor), full (gathered), loading, layout.

Keys are always the unsharded model's ``state_dict()`` keys: fshard renames nothing, and a tied
parameter appears under every key that ``model.state_dict()`` gives it. Collectives go through
``fshard._collectives``; the slicing math lives in ``fshard.transforms`` and ``_placement``. See
``_common`` for the notes on moving one parameter at a time, the ranks' agreement on errors,
and meta tensors in a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._errors import ProblemList, first_few
from fshard._materialize import allocate_for_load
from fshard._mesh import MeshInfo, in_src_row, replicate_src, src_rank
from fshard._param import ParamSlot
from fshard._state_dict._common import (
    Entry,
    LoadResult,
    broadcast_full,
    broadcast_meta,
    gather_full,
    is_meta_value,
    meta_tensors,
    meta_value_problems,
    model_entries,
    non_persistent_buffers,
    non_persistent_meta_problems,
    plain_value,
    rank_list,
    ranks_agree,
    root_info,
    scatter_rows,
    unfilled_meta_problems,
)
from fshard._unit._group import ParamGroup
from fshard._unit._module_state_dict import (
    as_dtensor,
    foreign_shard,
    free_for_load,
    local_shard,
    shard_of,
)
from fshard._unit._registry import units_or_error
from fshard.transforms import Layout, TensorLayout

__all__ = ["full_state_dict", "layout_of", "load_state_dict", "state_dict"]


def _reshard_for_load(model: nn.Module, where: str) -> list[ParamGroup]:
    """Writes go to the shards: free gathered params first (only between steps).

    Returns the units that were unsharded (``fshard.unshard``), to gather again after loading
    so that they hold the new values.
    """
    return free_for_load(units_or_error(model, where), where)


def _global_shape(value: torch.Tensor) -> torch.Size:
    return value.shape  # a DTensor's shape is its global shape


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
    info = root_info(model, "fshard.layout_of")
    mesh_shape = tuple(info.mesh.shape)
    entries: dict[str, TensorLayout] = {}
    for e in model_entries(model, "fshard.layout_of"):
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
    for e in model_entries(model, "fshard.state_dict"):
        if e.slot is None:
            out[e.key] = e.value.detach() if isinstance(e.value, torch.Tensor) else e.value
            continue
        dtensor = made.get(id(e.slot))
        if dtensor is None:
            dtensor = made[id(e.slot)] = as_dtensor(e.slot, local_shard(e.slot))
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
    info = root_info(model, where)
    keep = not rank0_only or dist.get_rank() == src_rank(info)
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor | None] = {}
    for e in model_entries(model, where):
        if e.slot is None:
            if keep:
                value = e.value
                if isinstance(value, torch.Tensor):  # a copy, like the gathered params
                    value = value.detach().to("cpu" if cpu_offload else value.device, copy=True)
                out[e.key] = value
            continue
        if id(e.slot) not in done:
            full = gather_full(
                e.slot, local_shard(e.slot), rank0_only=rank0_only, label=f"full_state_dict({e.key})"
            )
            if full is not None and cpu_offload:
                full = full.cpu()
            done[id(e.slot)] = full
        full = done[id(e.slot)]
        if keep and full is not None:
            out[e.key] = full
    return out


def _check_keys(
    entries: list[Entry], sd: Mapping[str, Any], strict: bool, problems: ProblemList
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
            foreign = foreign_shard(f"key {e.key!r}", value, e.slot)
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

    A model built on the meta device (on some ranks or all) and sharded needs no
    ``fshard.materialize``: once the ranks agreed on the checks, each allocates only its own
    shards (no ``reset_parameters()`` runs) and the load fills them. Its meta weights and
    buffers must all be in the state dict, and its non-persistent buffers off the meta device
    unless ``broadcast_from_rank0`` (else every rank raises the same error, naming them).

    Example:
        >>> full = torch.load("model.pt") if dist.get_rank() == 0 else {}   # doctest: +SKIP
        >>> fshard.load_state_dict(model, full, broadcast_from_rank0=True)  # doctest: +SKIP
    """
    where = "fshard.load_state_dict"
    regather = _reshard_for_load(model, where)
    entries = model_entries(model, where)
    if broadcast_from_rank0:
        result = _load_from_rank0(model, entries, state_dict, strict=strict, where=where)
    else:
        result = _load_everywhere(model, entries, state_dict, strict=strict, where=where)
    for group in regather:
        group.unshard()
    return result


def _load_everywhere(
    model: nn.Module,
    entries: list[Entry],
    state_dict: Mapping[str, Any] | None,
    *,
    strict: bool,
    where: str,
) -> LoadResult:
    """Every rank holds the (full or sharded) state dict and keeps its rows.

    The ranks agree on the checks before anything is loaded ([Note: ranks agree on errors]).
    """
    with ranks_agree(root_info(model, where), where):
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{where}: state_dict must be a mapping, got {type(state_dict).__name__}"
            )
        problems = ProblemList(where)
        metas = meta_tensors(entries)
        problems.extend(unfilled_meta_problems(metas, state_dict))
        problems.extend(non_persistent_meta_problems(model))
        missing, unexpected = _check_keys(entries, state_dict, strict, problems)
        problems.extend(
            meta_value_problems(
                [f"key {e.key!r}" for e in entries if is_meta_value(state_dict.get(e.key))]
            )
        )
        problems.raise_if_any(ValueError)
    if metas:
        allocate_for_load(model)  # [Note: loading into a meta model]
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
                rest[e.key] = plain_value(value)
                continue
            if id(e.slot) in loaded:
                continue
            loaded.add(id(e.slot))
            source = shard_of(value, e.slot)
            target = local_shard(e.slot)
            if source.data_ptr() == target.data_ptr() and source.dtype == target.dtype and target.numel():
                continue  # loaded in place already (DCP into fshard.state_dict)
            target.copy_(source.reshape(target.shape))
    if rest:
        model.load_state_dict(rest, strict=False)
    return LoadResult(missing, unexpected)


def _load_from_rank0(
    model: nn.Module,
    entries: list[Entry],
    state_dict: Mapping[str, Any] | None,
    *,
    strict: bool,
    where: str,
) -> LoadResult:
    """[Note: one parameter at a time]: rank 0 scatters, replicas broadcast."""
    info = root_info(model, where)
    src = src_rank(info)
    is_src = dist.get_rank() == src
    local_problems: list[str] = []
    metas = meta_tensors(entries)  # checked against what rank 0 sends, below
    described: dict[str, Any] | None = None
    missing: list[str] = []
    unexpected: list[str] = []
    if is_src:
        described, missing, unexpected = _check_on_rank0(
            model, entries, state_dict, strict, where, src, local_problems
        )
    everyone = _collectives.all_gather_objects_by_rank(
        (dist.get_rank(), local_problems, described, missing, unexpected, metas), info, label=where
    )
    _, _, described, missing, unexpected, _ = next(item for item in everyone if item[0] == src)
    if described is not None:  # (else rank src's own problem is raised)
        for _, rank_problems, *_, rank_metas in everyone:
            rank_problems.extend(unfilled_meta_problems(rank_metas, described))
    _raise_agreed(everyone, src, where)
    if metas:
        allocate_for_load(model)  # [Note: loading into a meta model]
    assert_described: dict[str, Any] = described or {}
    in_row = in_src_row(info, src)
    rep_src = replicate_src(info, src)
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
                rest[e.key] = broadcast_full(info, src, in_row, rep_src, source, meta, e.key)
                continue
            if id(e.slot) in loaded:
                continue
            loaded.add(id(e.slot))
            _receive_shard(e.slot, src, in_row, rep_src, source, e.key)
        _receive_non_persistent_buffers(model, info, src, in_row, rep_src)
    if rest:
        model.load_state_dict(rest, strict=False)
    return LoadResult(list(missing), list(unexpected))


def _check_on_rank0(
    model: nn.Module,
    entries: list[Entry],
    state_dict: Mapping[str, Any] | None,
    strict: bool,
    where: str,
    src: int,
    local_problems: list[str],
) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """Rank 0's checks of its state dict and model (added to ``local_problems``), and what it
    announces: each value's description (``broadcast_meta``), the missing and unexpected keys."""
    described: dict[str, Any] | None = None
    missing: list[str] = []
    unexpected: list[str] = []
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
            meta = broadcast_meta(f"key {e.key!r}", state_dict[e.key], local_problems, on_meta)
            if meta is not None:
                described[e.key] = meta
        local_problems.extend(meta_value_problems(on_meta))
    empty = [key for key, _, _, buffer in non_persistent_buffers(model) if buffer.is_meta]
    if empty:
        local_problems.append(
            f"{len(empty)} non-persistent buffer(s) are on the meta device on rank {src} "
            f"({first_few([repr(k) for k in empty])}): broadcast_from_rank0 copies them from rank {src}'s model "
            f"(they are in no state dict), so rank {src} must hold their values; build the "
            f"model on rank {src} without torch.device('meta') (the other ranks may use it)"
        )
    return described, missing, unexpected


def _raise_agreed(everyone: list[Any], src: int, where: str) -> None:
    """Raise on every rank the problems any rank found (``everyone``: each rank's
    ``(rank, problems, ...)``), each problem once, naming its ranks unless rank ``src`` or
    every rank found it (a meta model is so on every rank)."""
    found_on: dict[str, list[int]] = {}
    for rank, rank_problems, *_ in everyone:
        for p in rank_problems:
            found_on.setdefault(p, []).append(rank)
    problems = ProblemList(where)
    for text, ranks in found_on.items():
        plain = ranks == [src] or len(ranks) == len(everyone)
        problems.add(text if plain else f"({rank_list(ranks)}) {text}")
    problems.raise_if_any(ValueError)


def _receive_non_persistent_buffers(
    model: nn.Module, info: MeshInfo, src: int, in_row: bool, rep_src: int | None
) -> None:
    """Non-persistent buffers (rotary tables, position ids) are in no state dict: take rank
    0's, so ranks that built the model on the meta device get real values too."""
    is_src = dist.get_rank() == src
    received: dict[int, torch.Tensor] = {}
    for key, module, name, buffer in non_persistent_buffers(model):
        meta = ("tensor", tuple(buffer.shape), buffer.dtype)
        value = broadcast_full(info, src, in_row, rep_src, buffer if is_src else None, meta, key)
        if buffer.is_meta:  # a copy into it would do nothing ([Note: meta tensors in a load])
            module._buffers[name] = received.setdefault(id(buffer), value)  # shared: once
        else:
            buffer.copy_(value)


def _receive_shard(
    slot: ParamSlot,
    src: int,
    in_row: bool,
    rep_src: int | None,
    source: torch.Tensor | None,
    key: str,
) -> None:
    target = local_shard(slot)
    rows = scatter_rows(slot, src, in_row, rep_src, source, target.dtype, f"load_state_dict({key})")
    target.copy_(rows)
