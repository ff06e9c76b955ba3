"""Root initialisation: see [Note: root init]."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._checksum import value_checksum
from fshard._errors import ProblemList, RankMismatchError, internal_error, warn_user
from fshard._options import debug_checks
from fshard._runtime._root import RootState
from fshard._unit._group import ParamGroup, ShardedState
from fshard._unit._registry import units_under

logger = logging.getLogger("fshard")

def init_root(group: ParamGroup) -> None:
    """Make ``group`` the root of the units below it: see [Note: root init]. The runtime then
    hooks what root init found (ensure_root_initialised in _hooks)."""
    _refuse_root_of_several(group)
    module = group.module
    groups = units_under(module)
    # Units gathered by a blocking fshard.unshard before this (of a block, which made it a
    # root of its own then): the modules show their gathered copies, and what root init reads
    # off the modules (where each parameter is registered, its name) must be the shards.
    shown = [g for g in groups if g.sharded_state is ShardedState.UNSHARDED and g.unsharded_registered]
    for g in shown:
        g.hide_unsharded()
    try:
        _init_root(group, module, groups)
    finally:
        for g in shown:
            g.register_unsharded()


def _init_root(group: ParamGroup, module: nn.Module, groups: list[ParamGroup]) -> None:
    names = {m: name for name, m in module.named_modules()}
    problems = ProblemList(f"fshard root {group.label}")
    for g in groups:
        outside = [type(m).__name__ for m in g.modules if m not in names]
        if outside:
            problems.add(
                f"the unit made of modules {[type(m).__name__ for m in g.modules]} has "
                f"{outside} outside the root model; list modules of one model, inside the "
                "module the root unit is made of"
            )
            continue
        g.fqns = [names[m] for m in g.modules]
    problems.raise_if_any(ValueError)
    _check_meshes(group, groups)
    _check_units_are_called(module, groups)
    unchanged = _unchanged_checksums(groups)  # (before placement rebuilds any unit's shards)
    _place_shared_params(module, groups)
    param_names = {id(p): name for name, p in module.named_parameters()}
    for g in groups:
        for slot in g.slots:
            slot.fqn = param_names.get(id(slot.sharded_param), slot.fqn)
    _validate_across_ranks(group, groups)
    _check_values_across_ranks(group, module, unchanged)
    state = RootState(group, groups)
    for g in groups:
        g.root = state
        g.own_modules = None  # units made since may own some of its modules
    logger.debug("fshard: root %s initialised with %d units", group.label, len(groups))


def _refuse_root_of_several(group: ParamGroup) -> None:
    """A unit of several modules cannot be the root: the root's forward is the model's."""
    if len(group.modules) > 1:
        raise ValueError(
            f"fshard: the unit of modules {group.label} ran (or was used: fshard.unshard, "
            "set_prefetch, a state dict of it) before the model's first forward, so it would "
            "become a root, and a root is one module (the model's forward is the root's). Run "
            "the model's forward first, or use the model itself (fshard.unshard(model)); call "
            "fully_shard on the model too, after its blocks, if you have not "
            "(fshard.fully_shard(model, mesh=mesh))."
        )


def _check_meshes(root: ParamGroup, groups: list[ParamGroup]) -> None:
    problems = ProblemList(f"fshard root {root.label}")
    expected = root.mesh_info
    for g in groups:
        info = g.mesh_info
        if info.ranks != expected.ranks or info.device != expected.device:
            problems.add(
                f"unit {g.label} uses a mesh over ranks {list(info.ranks)} on {info.device}, but "
                f"the root's mesh covers ranks {list(expected.ranks)} on {expected.device}"
            )
    problems.raise_if_any(
        ValueError,
        hint="All units of one model must shard over the same ranks and device (a 1D mesh and a "
        "2D mesh over the same ranks may be mixed); pass the same mesh to every fully_shard call.",
    )


# Modules whose forward passes their children's parameters to a function instead of calling
# the children: a unit made of such a child is never gathered before its parameters are read.
READS_CHILDREN: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _check_units_are_called(module: nn.Module, groups: list[ParamGroup]) -> None:
    """Refuse a unit inside an ``nn.MultiheadAttention`` (``fully_shard(attn.out_proj)``):
    the attention reads ``out_proj.weight`` without calling ``out_proj``, so the unit's hooks
    never run and the attention would compute with this rank's shard."""
    problems = ProblemList("fully_shard")
    for g in groups:
        for fqn in g.fqns:
            parts = fqn.split(".") if fqn else []
            found = False
            for depth in range(len(parts) - 1, 0, -1):
                where = ".".join(parts[:depth])
                outer = module.get_submodule(where)
                if isinstance(outer, READS_CHILDREN):
                    problems.add(
                        f"unit {g.label} is inside {type(outer).__name__} {where!r}, whose "
                        "forward reads its submodules' parameters without calling them, so the "
                        f"unit would never be gathered; call fully_shard on {where!r} (or a "
                        "module above it) instead"
                    )
                    found = True
                    break
            if found:
                break
    problems.raise_if_any(ValueError)


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def _holds(group: ParamGroup, users: list[str]) -> bool:
    """Whether the modules named ``users`` are all inside ``group``'s modules."""
    return all(any(_contains(fqn, u) for fqn in group.fqns) for u in users)


def _place_shared_params(module: nn.Module, groups: list[ParamGroup]) -> None:
    """Give every registration site to its slot; move shared params to their lowest common unit."""
    sites: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for module_fqn, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or (id(sub), attr) in seen:
                continue
            seen.add((id(sub), attr))
            sites.setdefault(id(param), []).append((module_fqn, sub, attr))
    owner = {id(s.sharded_param): g for g in groups for s in g.slots}
    problems = ProblemList("fshard")
    moves: list[tuple[ParamGroup, ParamGroup, Any]] = []
    for g in groups:
        for slot in g.slots:
            where = sites.get(id(slot.sharded_param), [])
            users = [fqn for fqn, _, _ in where]
            if _holds(g, users):
                continue
            holders = [h for h in groups if _holds(h, users)]
            if not holders:
                problems.add(
                    f"parameter {slot.fqn!r} is used by modules {users} that share no unit; call "
                    "fully_shard on a module that contains all of them (usually the root model)"
                )
                continue
            target = max(holders, key=lambda h: len(h.fqn) if h.fqn else 0)
            if target.mesh_info.mesh.shape != g.mesh_info.mesh.shape:
                problems.add(
                    f"parameter {slot.fqn!r} is used by modules {users}, so it must belong to unit "
                    f"{target.label}, whose mesh {tuple(target.mesh_info.mesh.shape)} differs from "
                    f"unit {g.label}'s {tuple(g.mesh_info.mesh.shape)}; use one mesh for both"
                )
                continue
            moves.append((g, target, slot))
    for fqn, sub, attr in (site for where in sites.values() for site in where):
        param = sub._parameters[attr]
        if getattr(param, "_fshard_slot", None) is not None and id(param) not in owner:
            problems.add(
                f"parameter {fqn + '.' + attr if fqn else attr!r} belongs to a unit outside this "
                "model's tree (another sharded model uses it too); call fully_shard on a module "
                "that contains every user of it (a parent of both models), or, for a parameter "
                "that is not trained (a frozen embedding shared by teacher and student), leave "
                "it unsharded: ignored_params=[it] in every fully_shard call that would take it. "
                f"(This tree's root is the {type(module).__name__} whose forward ran first, or "
                "that was used first: if the other user is in the same model, run the model's "
                "forward before calling a part of it on its own.)"
            )
    problems.raise_if_any(ValueError)
    for source, target, slot in moves:
        logger.debug("fshard: moving shared parameter %s to unit %s", slot.fqn, target.label)
        if source.mp_policy != target.mp_policy or source.offload_policy != target.offload_policy:
            where = sites.get(id(slot.sharded_param), [])
            users = [fqn or "<root>" for fqn, _, _ in where]
            names = [f"{fqn}.{attr}" if fqn else attr for fqn, _, attr in where]
            warn_user(
                f"fshard: parameter {names[-1]!r} is shared by modules {users}, so it belongs to "
                f"unit {target.label} and follows that unit's mp_policy / offload_policy, not "
                f"those given to unit {source.label} (e.g. a tied output head: untie it, or set "
                "the policy on the common parent)",
            )
        locals_src = [s.sharded_param.detach() for s in source.slots if s is not slot]
        target.set_slots(
            [*target.slots, slot], [*(s.sharded_param.detach() for s in target.slots), slot.sharded_param.detach()]
        )
        source.set_slots([s for s in source.slots if s is not slot], locals_src)
    for g in groups:
        for slot in g.slots:
            slot.registrations = [
                (sub, attr) for _, sub, attr in sites.get(id(slot.sharded_param), [])
            ]


def _fingerprint(module: nn.Module, groups: list[ParamGroup]) -> list[tuple[Any, ...]]:
    """What every rank must agree on: parameters in module order, then the units."""
    owner = {id(s.sharded_param): (g, s) for g in groups for s in g.slots}
    # First which unit's forward started the tree (see _validate_across_ranks).
    rows: list[tuple[Any, ...]] = [("root", type(module).__name__)]
    for name, p in module.named_parameters():
        if id(p) in owner:
            g, slot = owner[id(p)]
            rows.append(
                (
                    "param",
                    name,
                    g.label,
                    tuple(slot.layout.full_shape),
                    str(p.dtype),
                    p.requires_grad,
                    p.device.type == "meta",
                )
            )
    for g in groups:
        rows.append(
            (
                "unit",
                g.label,
                tuple(g.mesh_info.mesh.shape),
                g.reshard_after_forward,
                repr(g.mp_policy),  # frozen dataclasses: the repr names every field
                repr(g.offload_policy),
                _prefetch_setting(g),  # it decides which gathers each rank issues, and when
                g.gradient_divide_factor,  # differing ones mix into silently wrong gradients
            )
        )
    # FSHARD_DEBUG turns prefetch off and adds a check to every step: collectives of its own.
    rows.append(("debug", debug_checks()))
    return rows


def _prefetch_setting(g: ParamGroup) -> str:
    def labels(targets: list[ParamGroup] | None) -> str:
        return "default" if targets is None else "[" + ", ".join(t.label for t in targets) + "]"

    return (
        f"forward={labels(g.explicit_forward_prefetch)} (default on: "
        f"{g.forward_prefetch_default}), backward={labels(g.explicit_backward_prefetch)} "
        f"(default: {g.backward_prefetch_default.name}), coalescing={g.coalesce_bytes}"
    )


def _describe(row: tuple[Any, ...] | None) -> str:
    if row is None:
        return "nothing"
    if row[0] == "unit":
        return (
            f"unit {row[1]} (mesh {row[2]}, reshard_after_forward={row[3]}, mp_policy={row[4]}, "
            f"offload_policy={row[5]}, prefetch {row[6]}, gradient_divide_factor={row[7]})"
        )
    if row[0] == "debug":
        return f"FSHARD_DEBUG {'set' if row[1] else 'unset'} (set it alike on every rank)"
    return (
        f"parameter {row[1]!r} (unit {row[2]}, shape {list(row[3])}, {row[4]}, "
        f"requires_grad={row[5]}" + (", on the meta device)" if row[6] else ")")
    )


def _gather_over_mesh(root: ParamGroup, obj: Any, label: str = "root_init") -> list[tuple[int, Any]]:
    """``(global rank, obj)`` from every rank of the root's mesh: over all ranks when it spans
    them, else over its shard group, then its replicate group."""
    info = root.mesh_info
    mine = [(dist.get_rank(), obj)]
    if len(info.ranks) == dist.get_world_size() > 1:
        # The mesh spans every rank: one gather over them all, so that ranks whose meshes
        # differ in shape (and so in their shard and replicate groups) still meet in it.
        gathered = _collectives.all_gather_objects(mine, None, label=label)
        return sorted((item for part in gathered for item in part), key=lambda item: item[0])
    if info.shard_size > 1:
        gathered = _collectives.all_gather_objects(mine, info.shard_group, label=label)
        mine = [item for part in gathered for item in part]
    if info.replicate_group is not None and info.replicate_size > 1:
        gathered = _collectives.all_gather_objects(mine, info.replicate_group, label=label)
        mine = [item for part in gathered for item in part]
    return sorted(mine, key=lambda item: item[0])


def check_prefetch_alike(root: RootState, api: str = "set_prefetch") -> None:
    """After ``fshard.set_prefetch`` on a model that has run: every rank must have the same
    prefetch settings, or the ranks issue their all-gathers in different orders, and units of
    one size exchange each other's rows without an error. Compared with one object all-gather
    (a rank that did not call ``set_prefetch`` meets it in its next collective instead: an
    error, not wrong weights). The first forward compares them the same way, in the
    fingerprint."""
    if root.root.mesh_info.dp_size == 1:
        return
    settings = [(g.label, _prefetch_setting(g)) for g in root.groups]
    everyone = _gather_over_mesh(root.root, settings, label=api)
    ref_rank, ref = everyone[0]
    for rank, other in everyone[1:]:
        if other == ref:
            continue
        (unit, mine), (_, theirs) = next((a, b) for a, b in zip(ref, other, strict=False) if a != b)
        raise RankMismatchError(
            f"fshard.{api}: the ranks' prefetch settings differ: unit {unit} has "
            f"{mine} on rank {ref_rank} but {theirs} on rank {rank}. Call {api} with the "
            "same arguments on every rank: the order of the all-gathers follows it, and ranks "
            "issuing theirs in different orders would exchange one unit's rows for another's."
        )


def _validate_across_ranks(root: ParamGroup, groups: list[ParamGroup]) -> None:
    rows = _fingerprint(root.module, groups)
    if root.mesh_info.dp_size > 1:
        digest = hashlib.sha256(repr(rows).encode()).hexdigest()
        digests = _gather_over_mesh(root, digest)
        if len({d for _, d in digests}) > 1:
            everyone = _gather_over_mesh(root, rows)
            ref_rank, ref_rows = everyone[0]
            for rank, other in everyone[1:]:
                if other == ref_rows:
                    continue
                index = next(
                    (i for i, (a, b) in enumerate(zip(ref_rows, other, strict=False)) if a != b),
                    min(len(ref_rows), len(other)),
                )
                mine = ref_rows[index] if index < len(ref_rows) else None
                theirs = other[index] if index < len(other) else None
                if index == 0 and mine is not None and theirs is not None:  # the roots differ
                    raise RankMismatchError(
                        f"the ranks' first forwards started at different units: rank {ref_rank} "
                        f"at a {mine[1]}, rank {rank} at a {theirs[1]}. The first unit to run "
                        "becomes the root of the units inside it, so a block called on its own "
                        "first (on some ranks) takes the root's place there. Run the model's "
                        "own forward first, on every rank, before calling a part of it."
                    )
                raise RankMismatchError(
                    f"ranks built different sharded models: rank {ref_rank} has "
                    f"{_describe(mine)} where rank {rank} has {_describe(theirs)}. Every rank must "
                    "build the same model and call fully_shard on the same modules with the same "
                    "arguments (and set_prefetch, set_reshard_after_forward and "
                    "set_gradient_divide_factor alike)."
                )
            raise internal_error("fingerprint digests differ but fingerprints are equal")
    on_meta = [slot.fqn for g in groups for slot in g.slots if slot.sharded_param.is_meta]
    if on_meta:
        shown = ", ".join(repr(n) for n in on_meta[:5]) + (" ..." if len(on_meta) > 5 else "")
        raise ValueError(
            f"{len(on_meta)} parameter(s) are still on the meta device at the first forward: "
            f"{shown}. Call fshard.materialize(model) after fully_shard, then load weights if "
            "you have them (fshard.load_state_dict(model, state_dict), broadcast_from_rank0=True "
            "to read them on rank 0 only)."
        )


# [Note: ranks that built different values]
# fshard shards what each rank built: ranks seeded differently would train a model none of them
# built (DDP broadcasts rank 0's weights at construction). fully_shard takes a checksum of each
# parameter's full value while it is still there (see _checksum); root init compares them, and
# checksums of the buffers, across the ranks with one object all-gather. A parameter whose shard
# changed since (a load, fshard.materialize) is skipped on every rank where it changed: its
# values now come from what was loaded, which the load paths keep alike.


def _unchanged_checksums(groups: list[ParamGroup]) -> dict[int, int]:
    """The sharding-time checksums of the parameters whose shards have not changed since."""
    out = {}
    for g in groups:
        for slot in g.slots:
            recorded = slot.value_checksum
            if recorded is not None and slot.sharded_param._version == recorded[1]:
                out[id(slot.sharded_param)] = recorded[0]
    return out


def _check_values_across_ranks(root: ParamGroup, module: nn.Module, unchanged: dict[int, int]) -> None:
    """Every rank must hold the same values: see [Note: ranks that built different values]."""
    if root.mesh_info.dp_size == 1:
        return
    rows: dict[str, int | None] = {name: unchanged.get(id(p)) for name, p in module.named_parameters()}
    for name, buffer in module.named_buffers():
        rows[name] = value_checksum(buffer)
    everyone = _gather_over_mesh(root, rows, label="root_init")
    for name in rows:
        seen: dict[int, list[int]] = {}
        for rank, theirs in everyone:
            checksum = theirs.get(name)
            if checksum is not None:
                seen.setdefault(checksum, []).append(rank)
        if len(seen) > 1:
            groups = sorted(seen.values())
            kind = "buffer" if name not in dict(module.named_parameters()) else "parameter"
            raise RankMismatchError(
                f"fshard: the ranks built different values: {kind} {name!r} differs between rank "
                f"{groups[0][0]} and rank {groups[1][0]} ({len(seen)} different values over the "
                "mesh). fshard shards what each rank built, so training would start from a model "
                "none of them built (DDP broadcasts rank 0's weights). Seed every rank alike "
                "before building the model (torch.manual_seed), or pass sync_module_states=True "
                "to fully_shard (fsdp_sync_module_states: true in an accelerate config), which "
                "broadcasts rank 0's values before sharding."
            )
