"""The sharding API: ``fully_shard`` and the controls that act on a sharded module."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._bucket import GATHERED
from fshard._errors import ProblemList, RankMismatchError, first_few
from fshard._mesh import MeshInfo, default_mesh, mesh_info
from fshard._options import BackwardPrefetch, CPUOffload, MixedPrecision
from fshard._param import ParamSlot, ShardedParameter, is_sharded
from fshard._placement import ShardLayout, shard_layout
from fshard._runtime._hooks import ensure_root_initialised, hook_forward_method, register_unit
from fshard._runtime._root import check_prefetch_targets
from fshard._runtime._root_init import check_prefetch_alike
from fshard._unit._group import ParamGroup, ShardedState, TrainingState, group_of
from fshard._unit._registry import unit_of, units_or_error, units_under

__all__ = [
    "fully_shard",
    "no_sync",
    "set_requires_gradient_sync",
    "register_forward_method",
    "set_gradient_divide_factor",
    "set_reshard_after_forward",
    "unshard",
    "reshard",
    "UnshardHandle",
    "clip_grad_norm_",
    "set_prefetch",
    "MemoryStats",
    "memory_stats",
    "reset_peak_memory_stats",
    "UnitInfo",
    "units",
]

logger = logging.getLogger("fshard")

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
) -> list[M]: ...


def fully_shard(
    module: M | list[M],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecision | None = None,
    offload_policy: CPUOffload | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
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

    Example:
        >>> import torch, fshard
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (4,))  # doctest: +SKIP
        >>> for block in model.blocks:  # doctest: +SKIP
        ...     fshard.fully_shard(block, mesh=mesh)
        >>> fshard.fully_shard([model.norm, model.output], mesh=mesh)  # doctest: +SKIP
        >>> fshard.fully_shard(model, mesh=mesh)  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
    """
    modules, where = _unit_modules(module)
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
    info = mesh_info(mesh if mesh is not None else default_mesh(where), where)
    reshard_after_forward = _post_forward_setting(reshard_after_forward, info, where)
    ignored_list = ignored_param_list(ignored_params, where)
    ignored = {id(p) for p in ignored_list}

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

    slots: list[ParamSlot] = []
    for name, param in managed:
        layout = shard_layout(param.shape, info.shard_size, info.shard_rank)
        slot = ParamSlot(param, name, layout, info)  # type: ignore[arg-type]  # becomes sharded below
        grad = param.grad
        param.__class__ = ShardedParameter
        param._fshard_slot = slot  # type: ignore[attr-defined]  # ShardedParameter attribute
        if grad is not None:
            param.grad = None
            slot.pending_grad = _local_rows(grad, layout)
        slots.append(slot)
    locals_ = [_local_rows(p.detach(), s.layout) for s, (_, p) in zip(slots, managed, strict=True)]
    group = ParamGroup(
        modules[0],
        slots,
        info,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        locals_=locals_,
    )
    for slot in slots:
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
    for param in ignored_list:
        if isinstance(param, torch.Tensor):
            param._fshard_ignored = True  # type: ignore[attr-defined]  # the optimizer check skips it
    if info.device.type != "cpu":  # the forward computes there (units below moved theirs)
        for _, sub in _named_modules(modules):
            for attr, buffer in sub._buffers.items():
                if buffer is not None and buffer.device.type == "cpu":
                    sub._buffers[attr] = buffer.to(info.device)
    register_unit(group)
    return module


def _post_forward_setting(value: bool | int, info: MeshInfo, where: str) -> bool | int:
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


def _local_rows(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    if layout.replicated:
        return full
    return full.narrow(0, layout.row_offset, layout.local_shape[0])


# --------------------------------------------------------------------------------- controls


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for every unit in ``module`` (gradient accumulation).

    With sync off, backward keeps full (unsharded) gradients and communicates nothing; the next
    backward with sync on reduces the sum, which equals DDP's ``no_sync``.

    Example:
        >>> fshard.set_requires_gradient_sync(model, False)  # doctest: +SKIP
        >>> model(x1).sum().backward()                       # doctest: +SKIP
        >>> fshard.set_requires_gradient_sync(model, True)   # doctest: +SKIP
        >>> model(x2).sum().backward()                       # doctest: +SKIP
    """
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(
            f"set_requires_gradient_sync: requires_gradient_sync must be a bool, got "
            f"{requires_gradient_sync!r}"
        )
    for group in units_or_error(module, "set_requires_gradient_sync"):
        group.requires_gradient_sync = requires_gradient_sync
        group.reduce_scatter_while_accumulating = False


@contextlib.contextmanager
def no_sync(module: nn.Module, *, reduce_scatter: bool = False) -> Iterator[None]:
    """Accumulate gradients over several backward passes without synchronising them.

    Inside the context, backward does not reduce gradients; the first backward after it reduces
    the accumulated sum (equal to DDP's ``no_sync``). With ``reduce_scatter=True`` every
    micro-batch is reduce-scattered instead, so gradients stay sharded (1/N memory) while
    accumulating; on a 2D mesh only the cross-replica all-reduce waits for the sync step.
    Until that step the accumulated sum is fshard's, not in the parameters' ``.grad`` (which
    hold shards): ``optimizer.zero_grad()`` between micro-batches does not drop it (as in
    FSDP2; under DDP it would), so run every micro-batch you start to its synchronised step.
    (With ``reduce_scatter=True`` on a 1D mesh nothing waits: each micro-batch's shard is
    added to ``.grad`` at once, and ``zero_grad()`` drops it, as in FSDP2.)

    Example:
        >>> with fshard.no_sync(model):               # doctest: +SKIP
        ...     model(micro_batch_1).sum().backward()
        >>> model(micro_batch_2).sum().backward()     # reduces both  # doctest: +SKIP
    """
    if not isinstance(reduce_scatter, bool):
        raise TypeError(f"no_sync: reduce_scatter must be a bool, got {reduce_scatter!r}")
    groups = units_or_error(module, "no_sync")
    previous = [(g.requires_gradient_sync, g.reduce_scatter_while_accumulating) for g in groups]
    for g in groups:
        g.requires_gradient_sync = False
        g.reduce_scatter_while_accumulating = reduce_scatter
    try:
        yield
    finally:
        for g, (sync, scatter) in zip(groups, previous, strict=True):
            g.requires_gradient_sync = sync
            g.reduce_scatter_while_accumulating = scatter


def set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool) -> None:
    """Keep (``False``) or free (``True``, the default) every unit's gathered parameters after
    a backward without gradient sync (a gradient accumulation micro-batch), for the units in
    ``module``.

    With ``False`` a unit's gathered parameters outlive such a backward (the modules show the
    shards meanwhile), and its next forward uses them without an all-gather. With
    ``reshard_after_forward=False`` units, a gradient accumulation loop then gathers each unit
    once: in the first micro-batch's forward. A synchronised backward (the last micro-batch,
    or any step without ``no_sync``) frees them as usual, so the forward after an optimizer
    step always gathers the new values (fused optimizers and ``p.data`` edits change the shards
    without a trace fshard could check), and an ``optimizer.step()`` between micro-batches
    frees the kept units whose parameters it updates. Edits of the shards between
    micro-batches through the parameters (``p.to_local().mul_(...)``, a state dict load,
    ``p.data = ...``) are seen, and the next forward gathers afresh; in-place writes to
    ``p.data`` (``p.data.mul_(...)``) are not. The price is memory: every unit that ran stays
    gathered through the accumulation. What FSDP2's ``module.set_reshard_after_backward(False)``
    is used for; ``fshard.reshard(model)`` frees them.

    Example:
        >>> fshard.set_reshard_after_backward(model, False)  # doctest: +SKIP
        >>> with fshard.no_sync(model):                      # doctest: +SKIP
        ...     for x in micro_batches[:-1]:
        ...         model(x).sum().backward()                # gathers only the first time
        >>> model(micro_batches[-1]).sum().backward()        # doctest: +SKIP
        >>> fshard.set_reshard_after_backward(model, True)   # doctest: +SKIP
        >>> opt.step()                                       # doctest: +SKIP
    """
    if not isinstance(reshard_after_backward, bool):
        raise TypeError(
            f"set_reshard_after_backward: reshard_after_backward must be a bool, got "
            f"{reshard_after_backward!r}"
        )
    for group in units_or_error(module, "set_reshard_after_backward"):
        group.reshard_after_backward = reshard_after_backward
        if reshard_after_backward and group.is_hidden() and group.training_state is TrainingState.IDLE:
            group.reshard()  # kept from a backward: freed now


def set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool | int) -> None:
    """Change ``reshard_after_forward`` of every unit in ``module`` after ``fully_shard``: from
    the next forward on, each frees its gathered parameters after its forward (``True``) and
    gathers them again for its backward, or keeps them until its backward (``False``). Every
    rank must set the same. FSDP2's ``module.set_reshard_after_forward(flag)``.

    Keeping them costs memory for the whole forward and saves an all-gather per unit in
    backward: worth it for the last micro-batches of a step, or for a forward with a short
    backward. The root's parameters are kept either way (its backward starts first). An int
    reshards to that many ranks, as ``fully_shard``'s does.

    Example:
        >>> fshard.set_reshard_after_forward(model, False)  # ZeRO-2 for this step  # doctest: +SKIP
        >>> model(x).sum().backward()                       # doctest: +SKIP
        >>> fshard.set_reshard_after_forward(model, True)   # doctest: +SKIP
    """
    where = "set_reshard_after_forward"
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"{where}: reshard_after_forward must be a bool, or an int (the number of ranks to "
            f"reshard to after forward), got {reshard_after_forward!r}"
        )
    groups = units_or_error(module, where)
    settings = [_post_forward_setting(reshard_after_forward, g.mesh_info, where) for g in groups]
    for group, setting in zip(groups, settings, strict=True):
        group.reshard_after_forward = setting


def set_gradient_divide_factor(module: nn.Module, factor: float | None) -> None:
    """Divide the gradients' sum over the data-parallel ranks by ``factor`` instead of their
    number, for the units in ``module``: ``factor=1.0`` gives the sum, ``None`` (the default)
    the average, as DDP. Every rank must set the same factor.

    For a loss that is already normalised globally (summed over tokens and divided by the
    global token count, as FSDP2 users do with ``set_gradient_divide_factor(1.0)``), or a
    gradient scale of your own. FSDP2's ``module.set_gradient_divide_factor(factor)``, which
    sets it for that module's unit only; here every unit under ``module`` gets it (pass a
    unit's module to set one). With half-precision reductions part of the division still
    happens before the sum (by a power of two depending on the number of ranks, not on
    ``factor``), so a sum does not overflow where the average would not.

    Example:
        >>> fshard.set_gradient_divide_factor(model, 1.0)  # doctest: +SKIP
        >>> (loss_sum / global_tokens).backward()          # doctest: +SKIP
    """
    if factor is not None and (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not math.isfinite(factor)
        or factor <= 0
    ):
        raise ValueError(
            f"set_gradient_divide_factor: factor must be a positive finite number (or None for "
            f"the average over ranks), got {factor!r}"
        )
    for group in units_or_error(module, "set_gradient_divide_factor"):
        group.gradient_divide_factor = None if factor is None else float(factor)


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run as a forward of ``module``'s unit: called from
    outside the unit's forward it gathers the parameters first and frees them after (or
    keeps them for the backward, as a forward would), so that methods other than ``forward``
    that read the unit's parameters (``generate``, ``encode``, a loss method) compute with the
    full parameters rather than this rank's shards. Called inside the unit's forward, it runs
    as it is. FSDP2's ``register_fsdp_forward_method``.

    ``module`` must be a module that ``fshard.fully_shard`` was called on (the root, for a
    method of the model). A method of the root that calls the model itself (generate's
    decoding steps) runs those calls inside the one forward it began: the root is gathered
    once for the whole method. Every rank must call the method (it is a forward: a
    collective). Registering the same method again does nothing (a method put in its place
    since is wrapped in turn). Generator functions are refused: their body runs after the call
    returns. Called with grad, a method whose model calls all run without grad (transformers'
    ``generate`` is decorated with ``torch.no_grad``) and whose result requires no grad frees
    the units, as a forward without grad does.

    Example:
        >>> fshard.fully_shard(model)                           # doctest: +SKIP
        >>> fshard.register_forward_method(model, "generate")  # doctest: +SKIP
        >>> with torch.no_grad():                              # doctest: +SKIP
        ...     tokens = model.generate(prompt, max_new_tokens=20)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_forward_method expects an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        name = getattr(method_name, "__name__", None) if callable(method_name) else None
        hint = f": pass its name, {name!r}" if isinstance(name, str) else ""
        raise TypeError(
            f"register_forward_method: method_name must be the method's name as a str, got "
            f"{method_name!r}{hint}"
        )
    group = unit_of(module)
    if group is None:
        raise ValueError(
            f"register_forward_method: {type(module).__name__} is not an fshard unit: call "
            f"fshard.fully_shard on it first (for a method of the model: on the model, the root), "
            "then register its methods"
        )
    if method_name == "forward":
        raise ValueError(
            f"register_forward_method: {type(module).__name__}.forward already runs as the unit's "
            "forward; register other methods (generate, encode, ...)"
        )
    method = getattr(module, method_name, None)
    if not callable(method) or isinstance(method, nn.Module):
        what = "has no attribute" if method is None else f"has {type(method).__name__}"
        raise ValueError(
            f"register_forward_method: {type(module).__name__} {what} {method_name!r}, not a "
            "method: name a method of the module"
        )
    if inspect.isgeneratorfunction(method) or inspect.isasyncgenfunction(method):
        raise ValueError(
            f"register_forward_method: {type(module).__name__}.{method_name} is a generator "
            "function: its body runs after the call returns, outside the forward the call ran "
            "as, and would compute with this rank's shards. Register a method that returns its "
            "result (one decoding step, say) and yield from a loop around it"
        )
    hook_forward_method(group, module, method_name)


class UnshardHandle:
    """Returned by ``fshard.unshard(module, async_op=True)``; ``wait()`` finishes the gather.

    Example:
        >>> handle = fshard.unshard(model, async_op=True)  # doctest: +SKIP
        >>> overlap_other_work()                           # doctest: +SKIP
        >>> handle.wait()                                  # full params now  # doctest: +SKIP
    """

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            if group.sharded_state is ShardedState.UNSHARDING:
                group.unshard()  # waits (or gathers afresh if the shards changed since)
        self._groups = []


def unshard(module: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """Gather the full parameters of every unit in ``module`` (collective on the mesh).

    The module then holds full parameters until ``fshard.reshard(module)`` (or the end of the
    next forward/backward, as the unit's settings say). With ``async_op=True`` the all-gathers are
    issued and a handle is returned; call ``handle.wait()`` before using the parameters.

    Every rank must call it with the same module (not under ``if rank == 0:``). A blocking call
    first checks, with one tiny all-gather, that the ranks gather the same units in the same
    state, and raises ``RankMismatchError`` where they do not (gathers of equal-sized units
    would otherwise exchange rows silently).

    Example:
        >>> fshard.unshard(model)           # doctest: +SKIP
        >>> model.fc.weight.shape           # full shape now  # doctest: +SKIP
        >>> fshard.reshard(model)           # doctest: +SKIP
    """
    groups = units_or_error(module, "unshard")
    ensure_root_initialised(groups[0])  # the outermost unit: its tree gets names and checks
    if not async_op:
        _check_same_unshard(groups)
    for group in groups:
        group.unshard(async_op=async_op)
    handle = UnshardHandle(groups)
    if async_op:
        return handle
    handle.wait()
    return None


def _check_same_unshard(groups: list[ParamGroup]) -> None:
    """Before a blocking ``fshard.unshard``: the ranks of each shard group agree on the units
    it gathers and on which of them are gathered already, with one tiny all-gather.

    Called on some ranks only (``if rank == 0: fshard.unshard(block)``), or after such a call
    left a unit gathered on one rank, the gathers would pair with the other ranks' next ones:
    units of equal size (transformer blocks) exchange each other's rows without an error. Here
    the ranks that disagree raise, and a rank elsewhere meets a collective of another size.
    (``async_op=True``, for prefetching every step, skips it: reading the result would make the
    host wait.)
    """
    by_group: dict[int, tuple[MeshInfo, list[ParamGroup]]] = {}
    for group in groups:
        by_group.setdefault(id(group.mesh_info.shard_group), (group.mesh_info, []))[1].append(group)
    for info, members in by_group.values():
        if info.shard_size == 1:
            continue
        plan = [(g.label, g.sharded_state is ShardedState.SHARDED) for g in members]
        digest = hashlib.blake2b(repr(plan).encode(), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64, device=info.device)
        everyone = torch.empty(info.shard_size, dtype=torch.int64, device=info.device)
        _collectives.all_gather_into(everyone, mine, info.shard_group, label="fshard.unshard")
        if bool((everyone != mine).any()):
            gathered = [label for label, sharded in plan if not sharded]
            raise RankMismatchError(
                f"fshard.unshard: the ranks of the shard group asked for different units, or "
                f"units gathered on some ranks only; this rank unshards {[p[0] for p in plan]}"
                + (f", of which {gathered} are gathered already" if gathered else "")
                + ". It is collective: call it with the same module on every rank (not under "
                "`if rank == 0:`), and reshard on every rank too."
            )


def reshard(module: nn.Module, *, writeback: bool = False) -> None:
    """Free the gathered parameters of every unit in ``module`` (local, no communication).

    By default changes made to the gathered (full) parameters are dropped, as they are after a
    forward. With ``writeback=True`` each rank first copies its rows of every gathered
    parameter into its shard, so edits made between ``unshard`` and ``reshard`` are kept (what
    FSDP1's ``summon_full_params(writeback=True)`` does); make the same edit on every rank.
    It refuses units that gather in a lower ``MixedPrecision.param_dtype`` than the shards.
    Where a unit's gathered parameters are its shards themselves (one rank per shard group:
    world size 1 or ``NO_SHARD``, with no dtype cast and no CPU offload) there is no copy, and
    edits are made to the shards whatever ``writeback`` says; code that must keep its edits on
    every mesh passes ``writeback=True``.

    Example:
        >>> fshard.unshard(model)                    # doctest: +SKIP
        >>> with torch.no_grad():                    # doctest: +SKIP
        ...     model.fc.weight.mul_(0.5)            # the full parameter, on every rank
        >>> fshard.reshard(model, writeback=True)    # doctest: +SKIP
    """
    if not isinstance(writeback, bool):
        raise TypeError(f"fshard.reshard: writeback must be a bool, got {writeback!r}")
    groups = units_or_error(module, "reshard")
    if writeback:
        for group in groups:  # all or nothing
            group.write_back(check_only=True)
        for group in groups:
            group.write_back()
    for group in groups:
        group.reshard()


def set_prefetch(
    module: nn.Module,
    *,
    forward: Sequence[nn.Module] | nn.ModuleList | bool | None = None,
    backward: Sequence[nn.Module] | nn.ModuleList | BackwardPrefetch | enum.Enum | str | None = None,
) -> None:
    """Choose which units' all-gathers are issued early, overriding the recorded order.

    By default each unit prefetches the next unit of the order recorded on the first forward:
    in forward when it starts, in backward when its backward starts (``BACKWARD_PRE``).

    Lists act on this unit only: ``forward=[a, b]`` issues ``a`` and ``b``'s all-gathers when this
    unit's forward starts, ``backward=[c]`` issues ``c``'s when this unit's backward starts, and
    ``[]`` disables prefetch from this unit (a tuple or ``ModuleList``, such as
    ``model.blocks[1:3]``, is a list too). A bool or a ``BackwardPrefetch`` (or its name:
    ``"BACKWARD_PRE"``, ``"BACKWARD_POST"``, ``"NO_PREFETCH"``; torch's FSDP1
    ``torch.distributed.fsdp.BackwardPrefetch`` works too) sets the default policy of every
    unit in ``module``'s subtree (call it on the root for the whole model).

    Call it alike on every rank: the order of the all-gathers follows it. Once the model has
    run, the call is collective: the ranks compare their settings with one object all-gather
    and raise ``RankMismatchError`` where they differ (ranks issuing their gathers in other
    orders would exchange the rows of units of one size without an error).

    Example:
        >>> blocks = list(model.blocks)                                    # doctest: +SKIP
        >>> fshard.set_prefetch(blocks[0], forward=blocks[1:3], backward=[])  # doctest: +SKIP
        >>> fshard.set_prefetch(model, forward=False, backward="BACKWARD_POST")  # doctest: +SKIP
    """
    where = f"set_prefetch({type(module).__name__})"
    group = unit_of(module)
    if group is None:
        raise ValueError(f"{where}: the module is not an fshard unit; call fully_shard on it first")

    def targets(name: str, modules: list[nn.Module]) -> list[ParamGroup]:
        found = []
        for m in modules:
            g = unit_of(m)
            if g is None:
                raise ValueError(
                    f"{where}: {name} contains {type(m).__name__}, which is not an fshard unit"
                )
            found.append(g)
        return found

    subtree = units_under(module)
    if isinstance(forward, (tuple, nn.ModuleList)):  # model.blocks[1:3] is a ModuleList
        forward = list(forward)
    if isinstance(backward, (tuple, nn.ModuleList)):
        backward = list(backward)
    if isinstance(backward, enum.Enum) and not isinstance(backward, BackwardPrefetch):
        # torch's FSDP1 enum (torch.distributed.fsdp.BackwardPrefetch), whose names are ours
        backward = backward.name
    if isinstance(forward, list):
        group.explicit_forward_prefetch = targets("forward", forward)
    elif isinstance(forward, bool):
        for g in subtree:
            g.forward_prefetch_default = forward
    elif forward is not None:
        raise TypeError(
            f"{where}: forward must be a list of units (modules fully_shard was called on), a "
            f"bool or None, got {forward!r}"
        )
    if isinstance(backward, list):
        group.explicit_backward_prefetch = targets("backward", backward)
    elif isinstance(backward, (BackwardPrefetch, str)):
        try:
            policy = BackwardPrefetch(backward)
        except ValueError:
            valid = ", ".join(repr(b.value) for b in BackwardPrefetch)
            raise ValueError(f"{where}: backward={backward!r} is not one of {valid}") from None
        for g in subtree:
            g.backward_prefetch_default = policy
    elif backward is not None:
        raise TypeError(
            f"{where}: backward must be a list of units (modules fully_shard was called on), "
            f"fshard.BackwardPrefetch (or torch's, or a name such as 'BACKWARD_PRE') or None, "
            f"got {backward!r}"
        )
    if group.root is not None:  # the model has run: its units are known (else checked then)
        check_prefetch_targets(group.root.groups)  # type: ignore[attr-defined]  # RootState
        check_prefetch_alike(group.root)  # type: ignore[arg-type]  # a RootState


# ----------------------------------------------------------------------------- grad clipping


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
    norm as a tensor. Use it instead of ``torch.nn.utils.clip_grad_norm_``: a sharded parameter's
    ``.grad`` is this rank's plain shard (so the optimizer runs without tensor-subclass
    dispatch), and torch's function would clip each rank by the norm of its own shards only.

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
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"clip_grad_norm_: norm_type must be a number > 0 or inf (2.0 for the 2-norm, "
            f"float('inf') for the max-norm), got {norm_type!r}"
        ) from None
    if not norm_type > 0:  # also NaN
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type} (0 does "
            "not measure a gradient's size: torch's counts the params with a non-zero gradient)"
        )
    # Every rank joins the all-reduce of each mesh whose sharded params it was given, even with
    # no gradient among them here (a peer may have some): what runs depends on the params only.
    by_group: dict[int, tuple[MeshInfo, list[torch.Tensor], list[torch.Tensor]]] = {}
    passed: dict[int, list[ParamSlot]] = {}  # per shard group: the sharded params passed
    plain: list[torch.Tensor] = []
    any_plain = False
    wide = False  # a float64 (or complex128) param: the norm in float64, as torch computes it
    params = []
    for p in parameters:
        grad = p.grad
        wide = wide or p.dtype in (torch.float64, torch.complex128)
        if is_sharded(p):
            slot = p._fshard_slot
            entry = by_group.setdefault(id(slot.mesh_info.shard_group), (slot.mesh_info, [], []))
            passed.setdefault(id(slot.mesh_info.shard_group), []).append(slot)
            if grad is not None:
                # A replicated (0-d) param is held whole by every shard rank: count it once.
                (entry[2] if slot.layout.replicated else entry[1]).append(grad)
        else:
            any_plain = True
            if grad is not None:
                plain.append(grad)
        if grad is not None:
            params.append(p)
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
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{total_norm.item()}, so they cannot be clipped; pass error_if_nonfinite=False to "
            "clip anyway"
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is not None:  # filtered above
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, clip_coef.to(device, dtype))
    return total_norm


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


# ---------------------------------------------------------------------------- memory stats


class MemoryStats(NamedTuple):
    """Gathered-parameter memory of this process (all units, all models).

    ``gathered_bytes``: full parameters (and all-gather buffers) allocated now;
    ``peak_gathered_bytes``: the most held at once since the last reset.

    Example:
        >>> stats = fshard.memory_stats()                 # doctest: +SKIP
        >>> stats.peak_gathered_bytes / 2**20             # MiB  # doctest: +SKIP
    """

    gathered_bytes: int
    peak_gathered_bytes: int


def memory_stats() -> MemoryStats:
    """How many bytes of gathered parameters this rank holds now and at most (since reset).

    On CPU, where torch keeps no allocator statistics, this is how to see what prefetch and
    ``reshard_after_forward`` cost.

    Example:
        >>> fshard.reset_peak_memory_stats()             # doctest: +SKIP
        >>> loss = model(x).sum(); loss.backward()       # doctest: +SKIP
        >>> fshard.memory_stats().peak_gathered_bytes    # doctest: +SKIP
    """
    return MemoryStats(GATHERED.current, GATHERED.peak)


def reset_peak_memory_stats() -> None:
    """Restart the peak of ``memory_stats()`` from the current value.

    Example:
        >>> fshard.reset_peak_memory_stats()  # doctest: +SKIP
    """
    GATHERED.peak = GATHERED.current


# ------------------------------------------------------------------------------ unit query


@dataclass(frozen=True)
class UnitInfo:
    """What one ``fully_shard`` call made: a unit of a sharded model, as ``fshard.units`` sees it.

    ``fqn``: the unit's module, relative to the module asked about (``""`` for that module
    itself; a unit of several modules joins their FQNs with ``+``). ``modules``: the module
    objects. ``param_names``: the parameters the unit owns (shards), by FQN relative to the
    module asked about, in the unit's order. ``mesh``, ``reshard_after_forward``,
    ``mp_policy`` and ``offload_policy``: the settings it runs with now (``fully_shard``'s
    arguments, or what ``set_reshard_after_forward`` set since).

    Example:
        >>> [u.fqn for u in fshard.units(model)]    # doctest: +SKIP
        ['', 'blocks.0', 'blocks.1']
    """

    fqn: str
    modules: tuple[nn.Module, ...]
    param_names: tuple[str, ...]
    mesh: DeviceMesh
    reshard_after_forward: bool | int
    mp_policy: MixedPrecision | None
    offload_policy: CPUOffload | None


def units(module: nn.Module) -> list[UnitInfo]:
    """The fshard units in ``module``'s subtree (``module`` itself included), in module order.

    What ``fully_shard``, ``auto_shard`` or ``from_config`` built, read back from the model: a
    script can print it, and a test can check that a wrapping policy or config made the intended
    units. A module that no ``fully_shard`` call reached gives ``[]``. Collective-free: any rank
    may call it, at any time. A parameter shared by several units (a tied embedding and head)
    moves to the unit of the lowest module containing all its users when the root initialises,
    on the first forward: until then it shows in the first unit that took it.

    Example:
        >>> for block in model.blocks:                     # doctest: +SKIP
        ...     fshard.fully_shard(block, mesh=mesh)
        >>> fshard.fully_shard(model, mesh=mesh)           # doctest: +SKIP
        >>> [(u.fqn, len(u.param_names)) for u in fshard.units(model)]  # doctest: +SKIP
        [('', 3), ('blocks.0', 4), ('blocks.1', 4)]
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fshard.units expects an nn.Module, got {type(module).__name__}")
    # Each module's FQN and place in module order (a module registered twice: its first).
    module_names: dict[int, tuple[int, str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        module_names.setdefault(id(m), (len(module_names), name))
    param_names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), name)  # a tied weight: its first name
    found: list[tuple[int, UnitInfo]] = []
    for group in units_under(module):
        inside = [module_names[id(m)] for m in group.modules if id(m) in module_names]
        if not inside:
            continue
        info = UnitInfo(
            fqn="+".join(name for _, name in inside),
            modules=tuple(group.modules),
            param_names=tuple(param_names.get(id(s.sharded_param), s.fqn) for s in group.slots),
            mesh=group.mesh_info.mesh,
            reshard_after_forward=group.reshard_after_forward,
            mp_policy=group.mp_policy,
            offload_policy=group.offload_policy,
        )
        found.append((min(at for at, _ in inside), info))
    return [info for _, info in sorted(found, key=lambda item: item[0])]
