"""``fully_shard``: make a module (or a list of modules) one unit of sharded parameters.

The controls that act on a sharded module live in ``_controls``, gradient clipping in ``_clip``
and the read-only queries (``units``, ``memory_stats``) in ``_introspect``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._checksum import value_checksum
from fshard._clip import track_unit
from fshard._errors import ProblemList, first_few
from fshard._mesh import MeshInfo, default_mesh, mesh_info
from fshard._options import CPUOffload, MixedPrecision
from fshard._param import ParamSlot, ShardedParameter, is_sharded, local_rows
from fshard._placement import shard_layout
from fshard._runtime._hooks import register_unit
from fshard._unit._group import ParamGroup, group_of
from fshard._unit._registry import unit_of, units_under

__all__ = ["fully_shard"]

M = TypeVar("M", bound=nn.Module)


def ignored_param_list(ignored: Iterable[nn.Parameter] | None, where: str) -> list[nn.Parameter]:
    """``ignored_params`` as a list; one tensor is an error (``list()`` would iterate its rows,
    which are not the parameter, so it would be sharded after all)."""
    if isinstance(ignored, torch.Tensor):
        raise TypeError(
            f"{where}: ignored_params takes an iterable of parameters, got one tensor; pass "
            "[param] (or a module's .parameters())"
        )
    found = list(ignored) if ignored is not None else []
    for i, param in enumerate(found):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"{where}: ignored_params[{i}] is a {type(param).__name__}, not a parameter; "
                "pass the module's parameters to leave unsharded"
            )
    return found


@overload
def fully_shard(
    module: M,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecision | None = None,
    offload_policy: CPUOffload | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    sync_module_states: bool = False,
) -> M: ...


@overload
def fully_shard(
    module: list[M],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecision | None = None,
    offload_policy: CPUOffload | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    sync_module_states: bool = False,
) -> list[M]: ...


def fully_shard(
    module: M | list[M],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecision | None = None,
    offload_policy: CPUOffload | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    sync_module_states: bool = False,
) -> M | list[M]:
    """Shard ``module``'s parameters over ``mesh`` and make it one unit; returns ``module``.

    The unit owns every parameter of ``module`` not already owned by a unit below it. Call it
    bottom-up: on each block first, then on the root, which takes everything left. Each parameter
    is cut along dim 0 with ``torch.chunk`` semantics and keeps its name, ``requires_grad`` and
    identity (it becomes a ``ShardedParameter`` in place). Before the unit's forward its
    parameters are all-gathered; after it they are freed (``reshard_after_forward=True``, ZeRO-3)
    or kept until backward (``False``, ZeRO-2); after backward the gradients are reduce-scattered
    (and all-reduced across the replicate dimension of a 2D mesh) and averaged like DDP. The root
    unit (the outermost one) keeps its parameters from forward to backward, which needs them
    first, instead of freeing and re-gathering them; a forward without grad frees every unit.
    Outside a forward or backward the modules always hold the shards (what is kept for
    backward is held aside), and the next forward frees and gathers afresh what a forward
    without a backward kept.

    Parameters and buffers on the CPU move to the mesh's device, parameters only as this rank's
    rows (under ``CPUOffload`` the shards stay on the CPU), so a model built on the CPU never
    needs a full copy on the accelerator; meta parameters wait for ``fshard.materialize``.

    A list of modules (``fully_shard([model.norm, model.output])``, as torchtitan shards the
    final norm and the output head) makes them one unit: one all-gather before the first of
    them runs, freed after the last (``reshard_after_forward=True``), and one reduce-scatter
    for all their gradients; the list is returned. The modules must not contain each other,
    and a unit containing them all (the root) is still needed, as the model's forward is the
    root's.

    Args:
        module: the module to shard, or a list of modules to shard as one unit; none may
            already be a unit.
        mesh: a 1D ``DeviceMesh`` (shard) or 2D ``(replicate, shard)`` mesh; ``None`` means a 1D
            mesh over the default process group (cuda if available and the group's backend
            runs on it, e.g. NCCL; else cpu).
        reshard_after_forward: free gathered parameters after forward (``True``) or keep them
            until backward (``False``); an int ``N`` dividing the size of the mesh's shard
            dimension keeps 1/N of them, shared by N consecutive ranks (one host's), so that
            the backward all-gathers over those N ranks only (FSDP2's int).
        mp_policy: a ``MixedPrecision`` policy for this unit.
        offload_policy: ``CPUOffload()`` to keep shards and gradients in CPU memory.
        ignored_params: parameters to leave alone (not sharded, gradients not reduced).
        sync_module_states: broadcast the values of mesh rank 0 (the rank at mesh coordinate
            ``(0, ...)``) to every rank of the mesh before sharding: the unit's parameters
            (those it shards and its ``ignored_params``) and the buffers of its modules, as DDP
            does at construction (accelerate's ``fsdp_sync_module_states``). For models whose
            ranks built different values (a different seed per rank). Collective over the mesh;
            meta tensors are skipped (``fshard.materialize`` initialises them later).

    Example:
        >>> import torch, fshard
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (4,))  # doctest: +SKIP
        >>> for block in model.blocks:  # doctest: +SKIP
        ...     fshard.fully_shard(block, mesh=mesh)
        >>> fshard.fully_shard([model.norm, model.output], mesh=mesh)  # doctest: +SKIP
        >>> fshard.fully_shard(model, mesh=mesh)  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> # ranks seeded differently: start from rank 0's weights, as DDP does
        >>> fshard.fully_shard(other, mesh=mesh, sync_module_states=True)  # doctest: +SKIP
    """
    modules, where = _unit_modules(module)
    _check_arguments(modules, where, reshard_after_forward, mp_policy, offload_policy, sync_module_states)
    info = mesh_info(mesh if mesh is not None else default_mesh(where), where)
    reshard_after_forward = post_forward_setting(reshard_after_forward, info, where)
    ignored_list = ignored_param_list(ignored_params, where)
    managed = _params_to_shard(modules, {id(p) for p in ignored_list}, info, where)
    if sync_module_states:
        _sync_module_states(modules, managed, ignored_list, info, where)
    group = _make_unit(modules, managed, info, reshard_after_forward, mp_policy, offload_policy)
    for param in ignored_list:
        if isinstance(param, torch.Tensor):
            param._fshard_ignored = True  # type: ignore[attr-defined]  # an ad-hoc tensor attribute: the optimizer check skips it
    if info.device.type != "cpu":  # the forward computes there (units below moved theirs)
        for _, sub in _named_modules(modules):
            for attr, buffer in sub._buffers.items():
                if buffer is not None and buffer.device.type == "cpu":
                    sub._buffers[attr] = buffer.to(info.device)
    track_unit(group)
    register_unit(group)
    return module


def _check_arguments(
    modules: list[nn.Module],
    where: str,
    reshard_after_forward: object,
    mp_policy: object,
    offload_policy: object,
    sync_module_states: object,
) -> None:
    """``fully_shard``'s arguments have the right types, and none of ``modules`` is a unit."""
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"{where}: sync_module_states must be a bool, got {sync_module_states!r}")
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"{where}: reshard_after_forward must be a bool, or an int (the number of ranks to "
            f"reshard to after forward), got {reshard_after_forward!r}"
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError(f"{where}: mp_policy must be fshard.MixedPrecision or None, got {mp_policy!r}")
    if offload_policy is not None and not isinstance(offload_policy, CPUOffload):
        raise TypeError(
            f"{where}: offload_policy must be fshard.CPUOffload or None, got {offload_policy!r}"
        )
    for i, m in enumerate(modules):
        if unit_of(m) is not None:
            which = "this module is" if len(modules) == 1 else f"module [{i}] ({type(m).__name__}) is"
            raise ValueError(
                f"{where}: {which} already sharded (fully_shard was called on it before); "
                "call fully_shard once per module"
            )


def _params_to_shard(
    modules: list[nn.Module], ignored: set[int], info: MeshInfo, where: str
) -> list[tuple[str, nn.Parameter]]:
    """The parameters the unit of ``modules`` shards, by name: those no unit below owns and
    ``ignored_params`` leaves out. Every problem found is raised at once (``ValueError``)."""
    problems = ProblemList(where)
    for m in modules:
        problems.extend(_foreign_wrappers(m))
    for name, sub in _named_modules(modules):
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            params = list(sub.parameters(recurse=False))
            if not any(id(p) in ignored or getattr(p, "_fshard_ignored", False) for p in params):
                problems.add(
                    f"module {name or '<root>'!r} ({type(sub).__name__}) makes sparse gradients "
                    "(sparse=True), and fshard reduce-scatters dense ones: build it with "
                    "sparse=False (and a dense optimizer instead of SparseAdam), or pass its "
                    "weight in ignored_params"
                )
    problems.raise_if_any(ValueError)
    managed: list[tuple[str, nn.Parameter]] = []
    inner_units = {id(g) for m in modules for g in units_under(m)}
    for name, param in _named_parameters(modules):
        if id(param) in ignored:
            continue
        if is_sharded(param):
            owner = group_of(param._fshard_slot)
            if owner is not None and id(owner) not in inner_units:
                if any(m is mine for top in owner.modules for m in top.modules() for mine in modules):
                    problems.add(
                        f"parameter {name!r} is already sharded by a unit above this module "
                        f"({type(owner.module).__name__}); apply fully_shard bottom-up: blocks "
                        "first, then the root"
                    )
                # Otherwise it is shared with a sibling unit: root init places it.
            continue
        if isinstance(param, DTensor):
            problems.add(
                f"parameter {name!r} is already a DTensor (distributed by torch's FSDP2 or "
                "tensor parallelism); fshard shards plain parameters: apply fshard to the "
                "module before any other parallelism, or pass it in ignored_params"
            )
            continue
        if type(param) is not nn.Parameter:
            problems.add(
                f"parameter {name!r} is a {type(param).__name__}; fully_shard shards plain "
                "nn.Parameter objects (run a forward first for lazy modules, or pass it in "
                "ignored_params)"
            )
            continue
        problem = device_problem(name, param.device, info.device)
        if problem:
            problems.add(problem)
            continue
        managed.append((name, param))
    on_meta = [repr(n) for n, p in managed if p.is_meta]
    if on_meta and len(on_meta) < len(managed):
        # One flat shard per dtype: a meta one would take the real values with it (and
        # materialize would draw new ones), a real one cannot copy the meta values.
        real = [repr(n) for n, p in managed if not p.is_meta]
        problems.add(
            f"the unit's parameters {first_few(on_meta)} are on the meta device but "
            f"{first_few(real)} hold values; a unit's parameters must all be on meta "
            "(fshard.materialize initialises them after sharding) or all hold values. Initialise "
            "the meta ones first (module.to_empty(device=...), then reset_parameters()), or "
            "call fully_shard on the modules holding them before this one, so that they make "
            "units of their own"
        )
    problems.raise_if_any(ValueError)
    return managed


def _make_unit(
    modules: list[nn.Module],
    managed: list[tuple[str, nn.Parameter]],
    info: MeshInfo,
    reshard_after_forward: bool | int,
    mp_policy: MixedPrecision | None,
    offload_policy: CPUOffload | None,
) -> ParamGroup:
    """Turn ``managed`` into sharded parameters (in place: same objects) of a new unit over
    ``modules``; gradients they hold already keep this rank's rows."""
    slots: list[ParamSlot] = []
    checksums = [value_checksum(param) for _, param in managed]  # while the full values are here
    for name, param in managed:
        layout = shard_layout(param.shape, info.shard_size, info.shard_rank)
        slot = ParamSlot(param, name, layout, info)  # type: ignore[arg-type]  # a plain Parameter until its class changes on the next lines
        grad = param.grad
        param.__class__ = ShardedParameter
        param._fshard_slot = slot  # type: ignore[attr-defined]  # mypy still sees nn.Parameter: the class changed on the line above
        if grad is not None:
            param.grad = None
            slot.pending_grad = local_rows(grad, layout)
        slots.append(slot)
    locals_ = [local_rows(p.detach(), s.layout) for s, (_, p) in zip(slots, managed, strict=True)]
    group = ParamGroup(
        modules[0],
        slots,
        info,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        locals_=locals_,
    )
    for slot, checksum in zip(slots, checksums, strict=True):
        if checksum is not None:
            slot.value_checksum = (checksum, slot.sharded_param._version)
        if slot.pending_grad is not None:
            slot.sharded_param.grad = slot.pending_grad.to(slot.sharded_param.device).clone()
            slot.pending_grad = None
    group.modules = modules
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, sub in _named_modules(modules):
        for attr, registered in sub._parameters.items():
            if registered is not None:
                sites.setdefault(id(registered), []).append((sub, attr))
    for slot in slots:
        slot.registrations = sites.get(id(slot.sharded_param), [])
    return group


def _sync_module_states(
    modules: list[nn.Module],
    managed: list[tuple[str, nn.Parameter]],
    ignored: list[nn.Parameter],
    info: MeshInfo,
    where: str,
) -> None:
    """Copy mesh rank 0's values of the unit's parameters and its modules' buffers to every
    rank of the mesh (``fully_shard(..., sync_module_states=True)``), before sharding.

    The ranks first compare what they would broadcast (names, shapes, dtypes), over the shard
    then the replicate dimension (equality carries over), and all raise if any differ: a
    broadcast of tensors that do not pair up would exchange wrong bytes or hang.
    """
    ignored_ids = {id(p) for p in ignored}
    tensors: list[tuple[str, torch.Tensor]] = [(f"parameter {n!r}", p) for n, p in managed]
    tensors += [
        (f"parameter {n!r}", p) for n, p in _named_parameters(modules) if id(p) in ignored_ids
    ]
    tensors += [(f"buffer {n!r}", b) for n, b in _named_buffers(modules)]
    plan = [(what, tuple(t.shape), str(t.dtype), t.is_meta) for what, t in tensors]
    groups = [(info.shard_group, info.shard_size)]
    if info.replicate_group is not None:
        groups.insert(0, (info.replicate_group, info.replicate_size))
    problem: str | None = None
    for group, size in groups:
        if size == 1:
            continue
        label = f"{where}: sync_module_states"
        for theirs, their_problem in _collectives.all_gather_objects((plan, problem), group, label=label):
            problem = problem or their_problem
            if problem is None and theirs != plan:
                differ = [f"{a} vs {b}" for a, b in zip(plan, theirs, strict=False) if a != b]
                problem = (
                    f"{where}: sync_module_states broadcasts rank 0's parameters and buffers, but "
                    f"the ranks of the mesh hold different ones ({len(plan)} vs {len(theirs)} "
                    f"tensors{'; first difference: ' + differ[0] if differ else ''}); build the "
                    "same model on every rank (values may differ, names, shapes and dtypes not)"
                )
    if problem is not None:
        raise ValueError(f"{problem}\n(every rank of the mesh raises this error)")
    # Replicate dimension first ((r, s) takes (0, s)), then shard ((r, s) takes (r, 0)): every
    # rank ends with the values of mesh coordinate (0, 0).
    for group, size in groups:
        if size == 1:
            continue
        src = dist.get_global_rank(group, 0)
        for what, tensor in tensors:
            if tensor.is_meta:
                continue
            local = tensor.detach()
            wire = local.to(info.device).contiguous()  # (NCCL broadcasts from the accelerator)
            _collectives.broadcast_(wire, src, group, label=f"{where}: sync_module_states {what}")
            if wire is not local:
                local.copy_(wire)


def _named_buffers(modules: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_buffers()`` of each of a unit's modules, each buffer once."""
    seen: set[int] = set()
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, buffer in top.named_buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                yield prefix + name, buffer


def post_forward_setting(value: bool | int, info: MeshInfo, where: str) -> bool | int:
    """``reshard_after_forward`` checked against the mesh: a bool, or an int dividing the shard
    dimension's size (its size is ``True``, 1 is ``False``)."""
    if isinstance(value, bool):
        return value
    size = info.shard_size
    if value < 1 or size % value:
        choices = [d for d in range(2, size) if size % d == 0]
        among = f"{', '.join(map(str, choices))}, " if choices else ""
        raise ValueError(
            f"{where}: reshard_after_forward={value} must divide the size of the mesh's shard "
            f"dimension ({size} ranks): the parameters are resharded to that many ranks after "
            f"forward. Use one of {among}{size} (True: all of them) or 1 (False: keep them "
            "gathered)"
        )
    return True if value == size else False if value == 1 else value


def _unit_modules(module: object) -> tuple[list[nn.Module], str]:
    """The modules of the unit ``fully_shard(module)`` makes (one, or those of a list), and how
    its messages name the call."""
    if isinstance(module, nn.Module):
        _refuse_container(module, f"fully_shard({type(module).__name__})")
        return [module], f"fully_shard({type(module).__name__})"
    if not isinstance(module, (list, tuple)):
        raise TypeError(
            f"fully_shard expects an nn.Module (or a list of them, to make one unit), got "
            f"{type(module).__name__}"
        )
    where = "fully_shard([" + ", ".join(type(m).__name__ for m in module) + "])"
    if not module:
        raise ValueError("fully_shard([]): the list of modules is empty; pass at least one module")
    problems = ProblemList(where)
    seen: dict[int, int] = {}
    for i, m in enumerate(module):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where}: item [{i}] is a {type(m).__name__}, not an nn.Module")
        if id(m) in seen:
            problems.add(f"module [{i}] is module [{seen[id(m)]}] again; pass each module once")
        seen[id(m)] = i
    for i, m in enumerate(module):
        for j, other in enumerate(module):
            if i != j and any(sub is other for sub in m.modules()):
                problems.add(
                    f"module [{j}] ({type(other).__name__}) is inside module [{i}] "
                    f"({type(m).__name__}); list modules that do not contain each other (the "
                    "outer one takes the inner one's parameters anyway)"
                )
    problems.raise_if_any(ValueError)
    for m in module:
        _refuse_container(m, where)
    return list(module), where


def _refuse_container(module: nn.Module, where: str) -> None:
    if isinstance(module, _CONTAINERS):  # never called: its unit would never gather
        raise ValueError(
            f"{where}: a {type(module).__name__} has no forward, so its unit would never be "
            "gathered before its modules run; call fully_shard on each module inside it "
            "(for block in model.blocks: fshard.fully_shard(block, ...)), or pass them "
            "as a list (fully_shard(list(model.blocks), ...)) to make them one unit"
        )


def _named_modules(modules: list[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules()`` of each of a unit's modules, each module once; the names of a list's
    modules start with their position (``[1].attn``), for messages before the root names them."""
    seen: set[int] = set()
    for i, top in enumerate(modules):
        prefix = f"[{i}]" if len(modules) > 1 else ""
        for name, sub in top.named_modules():
            if id(sub) not in seen:  # (a submodule shared by two of them: once)
                seen.add(id(sub))
                yield (f"{prefix}.{name}" if prefix and name else prefix or name), sub


def _named_parameters(modules: list[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """``named_parameters()`` of each of a unit's modules, each parameter once (a weight tied
    between two of them is named by the first)."""
    seen: set[int] = set()
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, param in top.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param


# Containers have no forward: code reaches their contents through the parent's forward
# (fully_shard refuses them; policies never select them).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _foreign_wrappers(module: nn.Module) -> list[str]:
    """Other data-parallel wrappers in ``module``'s tree: their hooks would fight fshard's."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    problems = []
    for name, sub in module.named_modules():
        where = f"module {name!r}" if name else "the module"
        if isinstance(sub, DistributedDataParallel):
            problems.append(
                f"{where} is a DistributedDataParallel wrapper; fshard replaces DDP: call "
                "fully_shard on the module it wraps (its .module) and drop the wrapper"
            )
        elif isinstance(sub, (FSDPModule, FullyShardedDataParallel)):
            problems.append(
                f"{where} is already sharded by torch's FSDP ({type(sub).__name__}); shard a "
                "model with one of the two, not both"
            )
    return problems


def device_problem(name: str, device: torch.device, mesh_device: torch.device) -> str | None:
    """Why parameter ``name`` on ``device`` cannot be sharded for ``mesh_device`` (or None).

    The mesh's device, the meta device (``fshard.materialize`` allocates later) and the CPU
    (``fully_shard`` copies this rank's rows to the mesh's device, or keeps them there under
    ``CPUOffload``) are fine; another accelerator is not.

    Example:
        >>> device_problem("w", torch.device("cpu"), torch.device("cuda", 0)) is None
        True
        >>> print(device_problem("w", torch.device("cuda", 1), torch.device("cuda", 0)))
        ... # doctest: +ELLIPSIS
        parameter 'w' is on cuda:1, but the mesh computes on cuda:0; ...
    """
    if device.type in ("meta", "cpu") or device == mesh_device:
        return None
    return (
        f"parameter {name!r} is on {device}, but the mesh computes on {mesh_device}; move the "
        f"module there first (module.to({str(mesh_device)!r})) or build it under "
        "torch.device('meta') and call fshard.materialize(model) after sharding"
    )


