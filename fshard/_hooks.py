"""Module and autograd hooks, the unit registry and the root of each sharded tree.

This is the only module that registers hooks. Each unit gets a forward pre-hook (gather), a
forward hook (free, and arm the backward), a gradient hook on its outputs (gather for backward)
and post-accumulate-grad hooks on its unsharded params (reduce once all gradients are in; see
[Note: when a unit's backward is done]). The root of a tree queues one callback per backward that
finishes whatever the per-unit triggers left open.

[Note: root init]
On the first forward of a tree's root (the outermost unit), the root collects every unit below
it, gives units and parameters their FQNs, moves a parameter shared by several modules to the
unit of the lowest module that contains all of them (tied embeddings), and checks across ranks,
with two small object all-gathers, that every rank built the same units with the same
parameters. Only then can any gradient collective run, so a divergent rank fails with a clear
error instead of hanging. The root also starts recording the collectives its units issue, and
compares them across ranks after the first backward (see [Note: Ranks must issue the same
collectives] in _collectives).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import functools
import hashlib
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, SupportsIndex

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fshard import _collectives
from fshard._errors import ProblemList, RankMismatchError, first_few, internal_error
from fshard._group import (
    KEPT_GATHERED,
    ParamGroup,
    PendingAllReduce,
    PendingReduce,
    ShardedState,
    TrainingState,
)
from fshard._mesh import MeshInfo
from fshard._options import BackwardPrefetch
from fshard._profiling import phase
from fshard._sharded import is_sharded

__all__ = [
    "BackwardPrefetch",
    "RootState",
    "register_unit",
    "unit_of",
    "units_under",
    "units_or_error",
    "in_backward",
    "on_any_rank",
]

logger = logging.getLogger("fshard")

# The unit lives on its module (not in a global registry: a unit refers to its module, so a
# registry entry would keep every sharded model alive for the whole process).
_UNIT_ATTR = "_fshard_unit"


def unit_of(module: nn.Module) -> ParamGroup | None:
    return module.__dict__.get(_UNIT_ATTR)


def units_under(module: nn.Module) -> list[ParamGroup]:
    """The units in ``module``'s subtree (itself included), in module order."""
    group = module.__dict__.get(_UNIT_ATTR)
    root = group.root if group is not None else None
    if isinstance(root, RootState) and root.root is group and root.units_made == _UNITS_MADE[0]:
        return list(root.groups)  # an initialised root, no unit made since: no module walk
    found: dict[int, ParamGroup] = {}  # (a unit of several modules is met once per module)
    for m in module.modules():
        unit = m.__dict__.get(_UNIT_ATTR)
        if unit is not None:
            found.setdefault(id(unit), unit)
    return list(found.values())


def units_or_error(module: nn.Module, where: str) -> list[ParamGroup]:
    """``units_under(module)``, or a clear error naming ``where`` if there are none."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where} expects an nn.Module, got {type(module).__name__}")
    groups = units_under(module)
    if not groups:
        owner = next(
            (
                group
                for p in module.parameters()
                if (slot := p.__dict__.get("_fshard_slot")) is not None
                and (group := slot.group_ref()) is not None
            ),
            None,
        )
        if owner is not None:
            raise ValueError(
                f"{where}: {type(module).__name__} is not a unit but part of unit {owner.label}: "
                "settings apply to whole units; pass that unit's module (or the model, for every "
                "unit)"
            )
        raise ValueError(
            f"{where}: {type(module).__name__} has no fshard units; call fshard.fully_shard on its "
            "blocks and then on the model first"
        )
    return groups


def in_backward() -> bool:
    """True while autograd executes a backward pass on this thread (checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


# Units whose last backward ran without gradient sync and kept its full gradients unreduced.
_UNSYNCED: weakref.WeakSet[ParamGroup] = weakref.WeakSet()
_STEP_HOOK: list[Any] = []  # the process-wide optimizer pre-step hook, once registered


_CHECKED_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_UNSHARDED_AT: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_UNITS_MADE = [0]  # units made in this process so far


def _check_optimizer_step(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """Process-wide ``optimizer.step()`` pre-hook (registered with the first unit)."""
    if optimizer in _CHECKED_OPTIMIZERS or _UNSHARDED_AT.get(optimizer) != _UNITS_MADE[0]:
        if not check_optimizer_state(optimizer):
            # Look again only after new units were made (its params may be sharded then).
            _UNSHARDED_AT[optimizer] = _UNITS_MADE[0]
    _check_step_sees_reduced_grads(optimizer, *args)
    if KEPT_GATHERED:
        _free_kept_before_step(optimizer)


def _free_kept_before_step(optimizer: torch.optim.Optimizer) -> None:
    """Free the units holding gathered parameters aside (kept from a forward whose backward has
    not run, or from a backward without sync) or rows kept by ``reshard_after_forward=<int>``,
    whose parameters this step updates. A fused optimizer (or ``p.data`` writes) changes the
    shards without bumping their version counters, so ``fshard.unshard``, a unit called on its
    own or the next micro-batch would reuse the old values; a step between micro-batches
    (after a reduce-scattering no_sync, whose ``.grad`` is final) must be seen. The same on
    every rank: every rank steps alike."""
    holding = []
    for group in list(KEPT_GATHERED):
        if group.is_hidden() or group.holds_kept_rows():
            holding.append(group)
        else:
            KEPT_GATHERED.discard(group)  # freed or shown since
    if not holding:
        return
    stepped = {id(p) for param_group in optimizer.param_groups for p in param_group["params"]}
    for group in holding:
        if group.training_state is TrainingState.IDLE and any(
            id(slot.sharded_param) in stepped for slot in group.slots
        ):
            group.reshard()
            KEPT_GATHERED.discard(group)


# [Note: plain optimizer state dicts of sharded parameters]
# A plain ``opt.state_dict()`` holds this rank's shards of the state. DDP's habit of rank 0
# saving it and every rank loading it would give every rank rank 0's rows, shaped like its own
# when the shards are even: silently wrong moments. So the state dict of an optimizer with
# sharded params records, in each param group that has some, which shard of which mesh size
# each of its meshes holds (``[[shard_rank, shard_size], ...]``); ``optimizer.load_state_dict``
# keeps unknown group keys, and the next step compares the record with this rank's and drops
# it. That step also checks the loaded state itself (``optimizer.load_state_dict`` makes new
# param groups, so a change of their identities means new state): full-shape tensors and
# DTensors (``fshard.optim_state_dict``'s, for ``fshard.load_optim_state_dict``) are clear
# errors, not failures deep inside the update.
SHARDS_KEY = "fshard_shards"
_GROUPS_SEEN: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)


def _shards_of(params: list[torch.Tensor]) -> list[list[int]]:
    """``[[shard_rank, shard_size], ...]`` of the meshes of the sharded ``params``, in order."""
    seen: dict[int, list[int]] = {}
    for param in params:
        slot = param.__dict__.get("_fshard_slot") if isinstance(param, torch.Tensor) else None
        if slot is not None:
            info = slot.mesh_info
            seen.setdefault(id(info.shard_group), [info.shard_rank, info.shard_size])
    return list(seen.values())


def _stamp_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.state_dict()`` post-hook: record the shards (see the Note)."""
    for group, saved in zip(optimizer.param_groups, state_dict.get("param_groups", ()), strict=False):
        shards = _shards_of(group["params"])
        if shards and isinstance(saved, dict):
            saved[SHARDS_KEY] = shards


def on_any_rank(flag: bool, info: MeshInfo, label: str) -> bool:
    """Whether ``flag`` holds on some rank of ``info``'s mesh (a ``MeshInfo``): a MAX
    all-reduce of one value over its shard and replicate groups."""
    value = torch.tensor([1.0 if flag else 0.0], device=info.device)
    for group, size in ((info.shard_group, info.shard_size), (info.replicate_group, info.replicate_size)):
        if group is not None and size > 1:
            _collectives.all_reduce_(value, group, label=label, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _check_loaded_shards(optimizer: torch.optim.Optimizer) -> None:
    """Compare the shard records that a load put in the param groups with this rank's, on
    every rank of the mesh at once (each sees only its own: rank 0's state dict loaded by all
    ranks passes on rank 0, which would step alone)."""
    problems = []
    recorded = False
    for index, group in enumerate(optimizer.param_groups):
        saved = group.get(SHARDS_KEY)
        if saved is None:
            continue
        recorded = True
        mine = _shards_of(group["params"])
        if [list(s) for s in saved] != mine:
            what = ", ".join(f"shard {r} of {n}" for r, n in saved)
            here = ", ".join(f"shard {r} of {n}" for r, n in mine) or "no sharded params"
            problems.append(f"param_groups[{index}] was saved holding {what}, but holds {here} here")
    info = next(
        (
            slot.mesh_info
            for group in optimizer.param_groups
            for param in group["params"]
            if (slot := getattr(param, "_fshard_slot", None)) is not None
        ),
        None,
    )
    if recorded and info is not None and on_any_rank(bool(problems), info, "optimizer.step") and not problems:
        problems.append("another rank of the mesh was given the optimizer state of other shards")
    if problems:
        raise ValueError(
            "optimizer.load_state_dict loaded the optimizer state of other shards: "
            + "; ".join(problems)
            + ". A plain optimizer.state_dict() holds its rank's shards only, so each rank must "
            "load its own (not rank 0's, as with DDP). To save once and load anywhere (any "
            "world size), use fshard.optim_state_dict / fshard.load_optim_state_dict or "
            "fshard.checkpoint."
        )
    for group in optimizer.param_groups:
        group.pop(SHARDS_KEY, None)


# [Note: torch's GradScaler on sharded parameters]
# torch.amp.GradScaler looks for inf/nan in this rank's gradients only, which are shards: ranks
# would skip different steps and the model would silently diverge. It must be refused on every
# rank at once, before any rank decides to skip: a check in optimizer.step() would run only on
# the ranks that step (a fused optimizer's step runs everywhere, but skips inside its kernel).
# So, once the first unit exists, GradScaler.step checks its optimizer first (ShardedGradScaler,
# a subclass, agrees across ranks and is let through).
_SCALER_PATCHED: list[Callable[..., Any]] = []  # torch's GradScaler.step, once patched
_SCALER_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = (
    weakref.WeakKeyDictionary()
)


def _refuse_unsharded_scaler(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    from fshard._amp import ShardedGradScaler  # imports this module

    if isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _SCALER_CHECKED.get(optimizer) == (_UNITS_MADE[0], len(params)):
        return  # no sharded param the last time, and nothing new since
    if not any(is_sharded(p) for p in params):
        _SCALER_CHECKED[optimizer] = (_UNITS_MADE[0], len(params))
        return
    raise TypeError(
        f"{type(scaler).__name__}.step() on fshard's sharded parameters: torch's GradScaler "
        "looks for inf/nan in this rank's gradient shards only, so ranks would skip different "
        "steps and the model would silently diverge. Use fshard.ShardedGradScaler (same "
        "arguments), which agrees across ranks."
    )


def _patch_grad_scaler() -> None:
    if _SCALER_PATCHED:
        return
    original = torch.amp.GradScaler.step

    @functools.wraps(original)
    def step(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        _refuse_unsharded_scaler(self, optimizer)
        return original(self, optimizer, *args, **kwargs)

    _SCALER_PATCHED.append(original)
    torch.amp.GradScaler.step = step  # type: ignore[method-assign]


def _check_state_is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """First step with sharded parameters: none may carry full-size state (returns whether
    the optimizer has sharded parameters at all).

    An optimizer stepped *before* ``fully_shard`` holds state shaped like the full parameter;
    torch would fail deep inside the update with a shape mismatch, or, for an optimizer that
    broadcasts, update the shard with the wrong rows. State that an optimizer made in its
    constructor (Adagrad's ``sum``, with ``step`` 0) was never stepped: it is the same on every
    rank, so this rank's rows of it are its sharded state, and they replace it.
    """
    wrong = []
    gathered = []
    dtensors: list[str] = []
    unowned: list[str] = []
    sharded = False
    split = False  # some parameter's rows are spread over ranks
    data_parallel = 1
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            of = getattr(param, "_fshard_gathered_of", None)
            if of is not None:
                gathered.append(repr(of_slot.fqn) if (of_slot := of()) is not None else "a parameter")
                continue
            slot = getattr(param, "_fshard_slot", None)
            if slot is None:
                if param.requires_grad and not getattr(param, "_fshard_ignored", False):
                    unowned.append(str(list(param.shape)))
                continue
            sharded = True
            split = split or (slot.mesh_info.shard_size > 1 and not slot.layout.replicated)
            data_parallel = max(data_parallel, slot.mesh_info.dp_size)
            if param not in optimizer.state:
                continue
            layout = slot.layout
            state = optimizer.state[param]
            if any(isinstance(value, DTensor) for value in state.values()):
                dtensors.append(slot.fqn)
                continue
            full_keys = [
                key
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
                and value.dim()
                and value.shape == layout.full_shape != layout.local_shape
            ]
            if not full_keys:
                continue
            if never_stepped(state):
                for key in full_keys:
                    rows = state[key].narrow(0, layout.row_offset, layout.local_shape[0])
                    state[key] = rows.clone()
            else:
                wrong.append(f"{slot.fqn!r} ({full_keys[0]} {list(layout.full_shape)})")
    if gathered:
        raise ValueError(
            f"the optimizer holds the gathered (full) copies of {first_few(gathered)}, which fshard puts in "
            "the modules for a unit's forward and backward, not the sharded parameters: it was "
            "built while the model was gathered (after fshard.unshard, or inside a forward), "
            "and would never update the shards. Build it over model.parameters() outside "
            "forward and backward, or call fshard.reshard(model) first."
        )
    if dtensors:
        raise ValueError(
            f"optimizer state of sharded parameter(s) {first_few(dtensors)} holds DTensors: "
            "optimizer.load_state_dict loaded a state dict of fshard.optim_state_dict (or a "
            "DTensor checkpoint). Load those with fshard.load_optim_state_dict(model, "
            "optimizer, state_dict), which takes this rank's shards."
        )
    whole = _looks_across_parameters(optimizer) if split else None
    if whole is not None:
        name, why = whole
        raise TypeError(
            f"torch.optim.{name} cannot step fshard's sharded parameters: {why}, and each rank "
            "holds only some rows, so the ranks would take steps DDP would not. Use an "
            f"elementwise optimizer (SGD, Adam, AdamW, ...), or run {name} on an unsharded model."
        )
    if sharded and unowned and data_parallel > 1:
        # [Note: parameters no unit owns] A head kept outside the sharded module (a wrapper
        # whose inner model alone was sharded) trains on this rank's gradients only; DDP of
        # the wrapper would average them. fshard cannot tell whether something else (DDP, the
        # user's own all_reduce) averages them, so it warns rather than raises.
        warnings.warn(
            f"the optimizer steps {len(unowned)} parameter(s) that no fshard unit owns (shapes "
            f"{first_few(unowned)}) beside sharded ones: their gradients are this rank's own, "
            "not averaged over the ranks as DDP's are, so the ranks' copies drift apart. Shard "
            "a module that contains them (often the wrapper, as the root: "
            "fshard.fully_shard(wrapper) after its inner model). If something else averages "
            "their gradients (DDP, your own all_reduce), pass them in fully_shard's "
            "ignored_params or filter this warning.",
            stacklevel=4,
        )
    if wrong:
        raise ValueError(
            f"optimizer state of sharded parameter(s) {first_few(wrong)} has the full parameter's shape: "
            "the optimizer was stepped before fully_shard, or optimizer.load_state_dict loaded "
            "an unsharded run's state dict (or fshard.optim_state_dict(full=True)). Build the "
            "optimizer after sharding (or before, but step it only after), and move state with "
            "fshard.optim_state_dict / fshard.load_optim_state_dict."
        )
    return sharded


# Optimizers whose update of a parameter depends on all of it, by torch.optim class name.
_WHOLE_PARAMETER_OPTIMIZERS = {
    "LBFGS": "its line search takes dot products over whole parameters",
    "Adafactor": (
        "it factors each matrix's second moment into statistics over its whole rows and columns "
        "(a rank with an empty shard divides by zero)"
    ),
    "Muon": (
        "it orthogonalises each whole weight matrix (Newton-Schulz) and scales its step by the "
        "matrix's shape"
    ),
}


def _looks_across_parameters(optimizer: torch.optim.Optimizer) -> tuple[str, str] | None:
    """``(name, why)`` if ``optimizer`` is a torch optimizer that needs whole parameters."""
    for name, why in _WHOLE_PARAMETER_OPTIMIZERS.items():
        cls = getattr(torch.optim, name, None)  # Adafactor: torch >= 2.5; Muon: later
        if cls is not None and isinstance(optimizer, cls):
            return name, why
    return None


def never_stepped(state: Mapping[str, Any]) -> bool:
    """Whether a param's optimizer state records zero steps taken (a ``step`` of 0)."""
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        return step.numel() == 1 and step.item() == 0
    return isinstance(step, (int, float)) and step == 0


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """The first-step check (``_check_state_is_sharded``), once per optimizer with sharded
    params and again after a load (new param groups; see [Note: plain optimizer state dicts
    of sharded parameters]); also run by the state dict functions. Returns whether it has
    sharded params."""
    groups = tuple(map(id, optimizer.param_groups))
    if optimizer in _CHECKED_OPTIMIZERS and _GROUPS_SEEN.get(optimizer) == groups:
        return True
    if _check_state_is_sharded(optimizer):
        _check_loaded_shards(optimizer)
        if optimizer not in _CHECKED_OPTIMIZERS:
            optimizer.register_state_dict_post_hook(_stamp_state_dict)
            _CHECKED_OPTIMIZERS.add(optimizer)
        _GROUPS_SEEN[optimizer] = groups
        return True
    return False


def _check_step_sees_reduced_grads(optimizer: torch.optim.Optimizer, *_args: Any) -> None:
    """Global ``optimizer.step()`` pre-hook: warn when the step would miss unreduced gradients.

    Under ``no_sync`` / ``set_requires_gradient_sync(False)`` a unit keeps full gradients that
    only the next synchronised backward reduces into the shards' ``.grad``. Stepping before that
    (the last micro-batch ran without sync) silently ignores them. The check costs one
    truth test per step unless such units exist.
    """
    if not _UNSYNCED:
        return
    pending = []
    for group in list(_UNSYNCED):
        if group.has_unreduced_grads():
            pending.append(group)
        else:
            _UNSYNCED.discard(group)
    stepped = {id(p) for param_group in optimizer.param_groups for p in param_group["params"]}
    missed = [g for g in pending if any(id(s.sharded_param) in stepped for s in g.slots)]
    if missed:
        names = first_few([g.label for g in missed])
        warnings.warn(
            f"optimizer.step() runs while fshard unit(s) {names} hold gradients accumulated "
            "without sync (no_sync / set_requires_gradient_sync(False)) that were never reduced: "
            "this step does not see them. Run the last micro-batch's backward with gradient sync "
            "on, then step.",
            stacklevel=3,
        )


def register_unit(group: ParamGroup) -> None:
    for module in group.modules:
        module.__dict__[_UNIT_ATTR] = group
    _UNITS_MADE[0] += 1
    if not _STEP_HOOK:
        _STEP_HOOK.append(
            register_optimizer_step_pre_hook(_check_optimizer_step)
        )
        _patch_grad_scaler()  # see [Note: torch's GradScaler on sharded parameters]
    for module in group.modules:
        module.register_forward_pre_hook(
            _UncompiledUnitHook(_pre_forward, group), prepend=True, with_kwargs=True
        )
        module.register_forward_hook(
            _UncompiledUnitHook(_post_forward, group), prepend=False, with_kwargs=True
        )
        module.register_forward_hook(_UncompiledUnitHook(_after_forward, group), always_call=True)
        index_param_owners(module)
        # What FSDP sets, and what other libraries look for: transformers' generate keeps every
        # rank stepping until all are done (synced_gpus) for such modules, and dynamo reads
        # parameters as they are when called (fshard swaps them), requiring use_orig_params
        # for FSDP1.
        module.__dict__["_is_fsdp_managed_module"] = True
        module.__dict__["_fsdp_use_orig_params"] = True
    hook_containers(group)


# [Note: calls into a unit from outside its forward]
# A unit gathers its parameters when its own forward runs. Code that calls a part of it directly
# (transformers' generate runs ``model.get_encoder()(...)`` on an encoder-decoder, whose
# embedding and final norm the root unit owns) would compute with this rank's shards. The
# modules of a unit that contain other units (encoder and decoder stacks) are the usual entry
# points, and there are few of them: each gets hooks that, outside the unit's forward, run the
# call as a forward of the unit. Leaf modules (an embedding called on its own) get none, so the
# unit's own blocks stay hook-free and compilable.
_CONTAINER_ATTR = "_fshard_container_hooked"


def hook_containers(group: ParamGroup) -> None:
    """Hook the modules below ``group``'s module that hold units but are none, and the units
    below it that read one of its parameters (a tied embedding that root init gave to the root,
    read by an encoder stack that is a unit: ``model.get_encoder()(...)`` must gather the root
    too). Idempotent."""
    stack = [child for top in group.modules for child in top.children()]
    while stack:
        module = stack.pop()
        if _UNIT_ATTR in module.__dict__:
            if _CONTAINER_ATTR not in module.__dict__ and _reads_params_of(module, group):
                _hook_container(module, group)
            continue
        children = list(module.children())
        if _CONTAINER_ATTR not in module.__dict__ and any(
            _UNIT_ATTR in m.__dict__ for m in module.modules()
        ):
            _hook_container(module, group)
        stack.extend(children)


def _hook_container(module: nn.Module, group: ParamGroup) -> None:
    """Calls of ``module`` from outside ``group``'s forward run as a forward of ``group``."""
    module.__dict__[_CONTAINER_ATTR] = True
    module.register_forward_pre_hook(
        _UncompiledUnitHook(_container_pre_forward, group), prepend=True, with_kwargs=True
    )
    module.register_forward_hook(
        _UncompiledUnitHook(_container_post_forward, group), prepend=False, with_kwargs=True
    )
    module.register_forward_hook(_UncompiledUnitHook(_container_after_forward, group), always_call=True)


def _reads_params_of(module: nn.Module, group: ParamGroup) -> bool:
    """Whether a module in ``module``'s subtree registers a parameter ``group`` owns."""
    for sub in module.modules():
        for param in sub._parameters.values():
            slot = param.__dict__.get("_fshard_slot") if param is not None else None
            if slot is not None and slot.group_ref() is group:
                return True
    return False


def _after_forward(group: ParamGroup, module: nn.Module, args: Any, output: Any) -> None:
    """Runs even when the forward raised: the root's forward raising (an out-of-memory error
    caught to retry smaller) frees what it left gathered at once, so that the modules show
    their shards again before an optimizer step, a state dict or a checkpoint load."""
    root = group.root
    if isinstance(root, RootState) and root.root is group and group.training_state is TrainingState.FORWARD:
        if group.nested_returned:
            # The root's forward called inside a method of the root that runs as its forward
            # (fshard.register_forward_method: generate's steps): the method goes on.
            group.nested_returned = False
        elif not in_backward():
            root.recover_from_aborted_forward()


def _container_pre_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if group.training_state is not TrainingState.IDLE:
        return None  # inside the unit's forward or backward: its own hooks gathered it
    if not in_backward():  # in backward (a checkpoint's recompute) it only gathers
        group.outside_calls.append(module)
    return _pre_forward(group, module, args, kwargs)


def _container_post_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    if not group.outside_calls or group.outside_calls[-1] is not module:
        return None
    group.outside_calls.pop()
    return _post_forward(group, module, args, kwargs, output)


def _container_after_forward(group: ParamGroup, module: nn.Module, args: Any, output: Any) -> None:
    """Runs even when the call raised: a call run as the unit's forward that raised (its post
    hook did not run) leaves the unit mid-forward; free what the model holds gathered, as
    after a model forward that raised (see _after_forward)."""
    if not group.outside_calls or group.outside_calls[-1] is not module:
        return  # (a call that returned: its post hook took it off)
    group.outside_calls.pop()
    root = group.root
    if isinstance(root, RootState) and not in_backward() and (
        root.root is group or root.root.training_state is not TrainingState.FORWARD
    ):
        root.recover_from_aborted_forward()  # (else the model's forward raises, and recovers)


# [Note: methods that run as a forward]
# fshard gathers a unit when its module is called. A method other than forward that reads the
# unit's parameters (generate, encode, a loss method) computes with the shards, and fails
# with a shape error deep inside torch. fshard.register_forward_method(module, name) puts a
# wrapper in the module's __dict__ that, outside the unit's forward, runs the call as one: the
# same hooks as a container's call (see [Note: calls into a unit from outside its forward]).
# A root whose method calls the root itself (generate's steps) runs those calls as nested
# forwards of the one the method began (see _pre_forward).
_METHODS_ATTR = "_fshard_forward_methods"


def hook_forward_method(group: ParamGroup, module: nn.Module, name: str) -> None:
    """Make ``module.<name>(...)`` run as a forward of ``group`` (idempotent while the method
    in place is the wrapper: a method put there since is wrapped in turn)."""
    hooked: dict[str, Callable[..., Any]] = module.__dict__.setdefault(_METHODS_ATTR, {})
    if name in hooked and module.__dict__.get(name) is hooked[name]:
        return
    original = getattr(module, name)
    ref = weakref.ref(group)

    @functools.wraps(original)
    def run_as_forward(*args: Any, **kwargs: Any) -> Any:
        unit = ref()
        if unit is None or unit.training_state is not TrainingState.IDLE:
            return original(*args, **kwargs)  # inside the unit's forward or backward
        outside = not in_backward()
        with_grad = torch.is_grad_enabled()
        changed = _method_pre_forward(unit, module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        root = unit.root
        before = (root.grad_forwards, root._grad_forward_pending) if isinstance(root, RootState) else None
        try:
            output = original(*args, **kwargs)
        except BaseException:
            if outside:
                _method_failed(unit, module, args, None)
            raise
        if not outside:
            return output
        result = _method_post_forward(unit, module, args, kwargs, output)
        output = output if result is None else result
        if with_grad and before is not None and isinstance(root, RootState):
            _release_after_gradless_call(root, before, output)
        return output

    module.__dict__[name] = run_as_forward
    hooked[name] = run_as_forward


def _release_after_gradless_call(root: RootState, before: tuple[int, bool], output: Any) -> None:
    """A registered method called with grad that ran every forward inside it without grad
    (transformers' generate is decorated with torch.no_grad) and returned nothing requiring
    grad: no backward can come for it, so free what its call kept for one, as after a forward
    without grad."""
    grad_forwards, pending = before
    if root.grad_forwards != grad_forwards or root.root.training_state is TrainingState.FORWARD:
        return  # (a forward inside ran with grad; or called inside the model's forward)
    leaves = [output] if isinstance(output, torch.Tensor) else _tensors_in(output)
    if any(t.requires_grad for t in leaves):
        return
    for group in root.groups:
        if group.training_state is TrainingState.IDLE and (group.is_hidden() or group.holds_kept_rows()):
            group.reshard()
    root._grad_forward_pending = pending


# (Eager under torch.compile, as the hooks are: see _UncompiledUnitHook.)
_method_pre_forward = torch.compiler.disable(_container_pre_forward)
_method_post_forward = torch.compiler.disable(_container_post_forward)
_method_failed = torch.compiler.disable(_container_after_forward)


_HOOKED_ATTR = "_fshard_state_dict_hooked"


def index_param_owners(module: nn.Module) -> None:
    """Hook ``state_dict()`` / ``load_state_dict()`` of every module under ``module`` that
    registers a sharded parameter, so that each gives DTensors and takes full tensors for its
    own parameters (see [Note: model.state_dict() on a sharded model] in
    _unit._module_state_dict)."""
    for sub in module.modules():
        if not sub.__dict__.get(_HOOKED_ATTR) and owned_slots(sub):
            sub.__dict__[_HOOKED_ATTR] = True
            sub.register_state_dict_post_hook(_owner_state_dict_post)
            sub.register_load_state_dict_pre_hook(_owner_load_state_dict_pre)


def owned_slots(module: nn.Module) -> dict[str, Any]:
    """The sharded parameters ``module`` registers now, by attribute name: looked up when asked,
    since a weight tied after ``fully_shard`` (``head.weight = embed.weight``) replaces the one
    there then, and a gathered unit registers its gathered copies in their place."""
    found = {}
    for name, param in module._parameters.items():
        if param is None:
            continue
        slot = param.__dict__.get("_fshard_slot")
        if slot is None and (of := param.__dict__.get("_fshard_gathered_of")) is not None:
            slot = of()
            if slot is not None and slot.unsharded_param is param:
                found[name] = slot
        elif slot is not None and slot.sharded_param is param:
            found[name] = slot
    return found


def _owner_state_dict_post(
    module: nn.Module, destination: dict[str, Any], prefix: str, _meta: Any
) -> None:
    # (lazy: that module imports on_any_rank from here)
    from fshard._unit._module_state_dict import on_module_state_dict

    on_module_state_dict(owned_slots(module), destination, prefix)


def _owner_load_state_dict_pre(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    _strict: bool,
    _missing_keys: list[str],
    _unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    from fshard._unit._module_state_dict import on_module_load_state_dict  # (lazy: as above)

    on_module_load_state_dict(
        module, owned_slots(module), state_dict, prefix, local_metadata, error_msgs
    )


def _call_hook(hook: _UnitHook, *args: Any) -> Any:
    target = hook.ref()
    if target is None:
        return None
    return hook.fn(target, *args)


class _UnitHook:
    """``fn(group, *hook_args)`` as a hook that holds the unit weakly (a no-op once it is gone).

    An object rather than a closure so that pickling or copying a module that holds it fails
    with the unit's own explanation, not pickle's "Can't pickle local object".
    """

    def __init__(self, fn: Callable[..., Any], group: ParamGroup) -> None:
        self.fn = fn
        self.ref = weakref.ref(group)
        self.__name__ = f"fshard_{fn.__name__.lstrip('_')}"

    __call__ = _call_hook

    def _refuse(self) -> TypeError:
        target = self.ref()
        if target is None:
            return TypeError("cannot copy or pickle a hook of an fshard unit that no longer exists")
        return target._refuse_copy()

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        raise self._refuse()

    def __deepcopy__(self, memo: dict[int, object]) -> _UnitHook:
        raise self._refuse()


class _UncompiledUnitHook(_UnitHook):
    """A ``_UnitHook`` for forward hooks: under torch.compile of a model that contains units,
    they run eagerly (a graph break around each), since they issue collectives and swap
    parameters, which dynamo cannot trace."""

    __call__ = torch.compiler.disable(_call_hook)


def _call_pre_backward(hook: _PreBackwardHook, grad: torch.Tensor | None) -> None:
    target = hook.ref()
    if target is not None:
        _pre_backward(target, grad, hook.versions, hook.step)


class _PreBackwardHook(_UnitHook):
    """The pre-backward hook on one forward's outputs, with the version counters of the shards
    that forward read (the backward of an earlier forward checks against its own: a later
    forward, after an edit, refilled the storage that autograd saved for it) and the step it
    ran in (``RootState.steps``: a backward of a graph kept from an earlier step)."""

    def __init__(self, group: ParamGroup, versions: tuple[int, ...] | None, step: int) -> None:
        super().__init__(_pre_backward, group)
        self.versions = versions
        self.step = step

    __call__ = torch.compiler.disable(_call_pre_backward)


# ------------------------------------------------------------------------------------ root state


class _FinalCallback:
    """What a backward runs when it ends: the root's ``_final_callback``. An object of its own
    so that a weak reference tells whether the engine still holds it."""

    __slots__ = ("__weakref__", "root")

    def __init__(self, root: RootState) -> None:
        self.root = root

    def __call__(self) -> None:
        self.root._final_callback()


class RootState:
    """Per-tree state owned by the root unit: order, prefetch, pending reductions, callback."""

    def __init__(self, root: ParamGroup, groups: list[ParamGroup]) -> None:
        self.root = root
        self.groups = groups
        self.units_made = _UNITS_MADE[0]  # units_under(root) is ``groups`` while this holds
        self.forward_order: list[ParamGroup] = []  # first forward's units, as each started
        # This step's units (forwards with grad since the last backward), as each first ran,
        # and the order the last checked step (or the first) ran them in: see _check_unit_order.
        self.step_order: list[ParamGroup] = []
        self.reference_order: list[ParamGroup] | None = None
        self.steps = 0  # backwards so far (units mark their first run in a step with it)
        self.forwards = 0  # the model's forwards so far (units mark their first run in one)
        self._order_checked = False  # in this backward
        self.finish_order: list[ParamGroup] = []  # and as each finished (the root last)
        self._recorded = False
        self._recording = False
        self._callback_queued = False
        # The callback queued: the engine holds it until its backward ends, and drops it
        # unrun when that backward raises (see recover_if_backward_aborted).
        self._callback_token: weakref.ref[_FinalCallback] | None = None
        self._parked: list[ParamGroup] = []  # see ParamGroup.release_parked
        self._pending_reduces: list[PendingReduce | PendingAllReduce] = []
        self._next_forward: dict[int, list[ParamGroup]] = {}
        self._next_backward: dict[int, list[ParamGroup]] = {}
        # See [Note: Ranks must issue the same collectives] in _collectives. FSHARD_DEBUG also
        # turns prefetch off: ranks that ran different units then issue as many collectives as
        # each other where they can, so the check names the first difference instead of the
        # step hanging until the timeout on a prefetch the other ranks never issued.
        self._check_every_step = debug_checks()
        self._checking = True  # until the first backward's check, or always with FSHARD_DEBUG
        self._grad_forward_pending = False
        self.warned_sharded_use = False  # see _used_while_sharded in _group
        self.hidden_kept = False  # some unit is kept gathered but hidden (see on_root_pre_forward)
        self.grad_forwards = 0  # unit forwards run with grad (see register_forward_method)
        self._process_groups = _process_groups_of(groups)
        for process_group in self._process_groups:
            _collectives.start_recording(process_group)
        check_prefetch_targets(groups)

    # Order and prefetch -----------------------------------------------------------------------

    def on_root_pre_forward(self) -> None:
        if self._callback_queued and not in_backward():
            self._recover_from_aborted_backward()
        self.forwards += 1
        for group in self.groups:
            group.modules_to_run.clear()  # (a module of a unit of several did not run)
            group.forward_depth = 0  # (a forward of it raised)
            group.outer_passed.clear()
        check_params_in_place(self.groups)
        if self.root.training_state is TrainingState.FORWARD:
            self.recover_from_aborted_forward()
        self.finish_reduces()
        if self.hidden_kept:
            # Units a previous forward kept (hidden) for a backward that has not run, e.g. an
            # evaluation outside torch.no_grad(): their shards may have changed since (an
            # optimizer step, in-place edits), so this forward gathers afresh. That backward, if
            # it comes, gathers them again into the storage it saved. The same on every rank:
            # it depends on the forwards and backwards run, not on what changed.
            self.hidden_kept = False
            for group in self.groups:
                if group.training_state is TrainingState.IDLE and (
                    group.is_hidden() or group.holds_kept_rows()
                ):
                    group.reshard()  # (also the rows a reshard_after_forward=<int> unit kept)
        if torch.is_grad_enabled():
            self._grad_forward_pending = True
        if not self._recorded and torch.is_grad_enabled():
            self._recording = True
            self.forward_order = []
            self.finish_order = []

    def on_root_post_forward(self) -> None:
        if self._recording:
            self._recording = False
            self._recorded = True
            self._build_prefetch_plan()
        # Free what was prefetched for a unit that then did not run (a skipped block, a wrong
        # explicit list): no backward gathers it; after an inference forward, free everything.
        inference = not torch.is_grad_enabled() and not self._grad_forward_pending
        for group in self.groups:
            if group.sharded_state is not ShardedState.SHARDED and (
                inference or not group.ran_since_backward or group.deferred_reshard
            ):
                # (deferred_reshard: a unit of several modules, one of which did not run after
                # the others, or ran again: freed now, as its last module would have; its
                # backward gathers it again.)
                if group.deferred_reshard and not inference and group.post_forward_size:
                    group.reshard_post_forward()
                    self.hidden_kept = True
                else:
                    group.reshard()
            group.deferred_reshard = False
            group.modules_to_run.clear()
            if inference:
                group.ran_since_backward = False
            elif group.sharded_state is ShardedState.UNSHARDED:
                # Kept for backward; until then the modules show the shards (hide_unsharded).
                group.hide_unsharded()
                self.hidden_kept = True
        if self._check_every_step and not self._grad_forward_pending:
            self.check_collective_order("forward")  # inference: no backward will check

    def _next_step(self) -> None:
        if self.reference_order is None and self.step_order:
            self.reference_order = self.step_order
        self.step_order = []
        self.steps += 1
        self._order_checked = False

    def record(self, group: ParamGroup) -> None:
        if self._recording and group not in self.forward_order:
            self.forward_order.append(group)

    def note_run(self, group: ParamGroup) -> None:
        """``group`` ran with grad (or as a reentrant checkpoint's segment) in this step."""
        if group.order_mark != self.steps:
            group.order_mark = self.steps
            self.step_order.append(group)

    def check_step_order(self) -> None:
        """At the start of a backward (before any of its collectives): if this step's units ran
        in another order than the last checked step's (or the first step's), check that every
        rank ran the same, in the same order.

        After the first backward nothing else compares the ranks' collectives, and ranks that ran
        as many units of one size, but different ones (LayerDrop drawing per rank, an expert per
        unit routed to per rank), would pair one unit's gathers and reductions with another's:
        wrong gradients, no error. A model whose steps run the same units never pays for this
        (nor do forwards without a backward: evaluation, generation).
        """
        if self._order_checked or not in_backward():
            return
        self._order_checked = True
        if self._check_every_step or self.reference_order is None or not self.step_order:
            # (The first backward's collectives are compared: check_collective_order. No
            # forward since the last backward, a second backward of one graph: checked then.)
            return
        if self.step_order != self.reference_order:
            self._check_unit_order()
            self.reference_order = list(self.step_order)

    def _check_unit_order(self) -> None:
        labels = [g.label for g in self.step_order]
        digest = hashlib.blake2b(repr(labels).encode(), digest_size=8).hexdigest()
        with phase("fshard::check_unit_order"):
            for process_group in self._process_groups:
                everyone = _collectives.all_gather_objects(
                    (dist.get_rank(), digest), process_group, label="check_unit_order"
                )
                if len({d for _, d in everyone}) == 1:
                    continue
                runs = _collectives.all_gather_objects(
                    (dist.get_rank(), labels), process_group, label="check_unit_order"
                )
                runs.sort()
                ref_rank, ref = runs[0]
                other_rank, other = next((r, lab) for r, lab in runs if lab != ref)
                at = next(
                    (i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
                    min(len(ref), len(other)),
                )
                nth = [run[at] if at < len(run) else "none" for run in (ref, other)]
                raise RankMismatchError(
                    f"fshard: the ranks ran different units in this step's forward: unit #{at + 1} "
                    f"to run was {nth[0]} on rank {ref_rank} but {nth[1]} on rank "
                    f"{other_rank} ({len(ref)} and {len(other)} units ran). Their gathers and "
                    "gradient reductions would pair one unit's data with another's. Every rank "
                    "must run the same units in the same order in a step: draw layer-dropping "
                    "choices from a generator seeded alike on every rank, and keep experts routed "
                    "per rank inside one unit that always runs. Do not step the optimizer."
                )

    def record_finish(self, group: ParamGroup) -> None:
        if self._recording and group not in self.finish_order:
            self.finish_order.append(group)

    def _build_prefetch_plan(self) -> None:
        """Forward: the unit that started after this one. Backward: the unit that finished
        its forward before this one (the backward runs the forward in reverse): a unit that
        contains others finishes after them, so the root, which finishes last, is first and
        prefetches the last block, and no block prefetches it again after its head's
        gradients freed it (as the start order would, where the root comes first)."""
        order = self.forward_order
        self._next_forward = {id(g): [order[i + 1]] for i, g in enumerate(order[:-1])}
        finished = self.finish_order
        self._next_backward = {id(g): [finished[i - 1]] for i, g in enumerate(finished) if i > 0}

    def forward_targets(self, group: ParamGroup) -> list[ParamGroup]:
        if self._check_every_step:
            return []  # FSHARD_DEBUG: no prefetch, see __init__
        if group.explicit_forward_prefetch is not None:
            return group.explicit_forward_prefetch
        if not group.forward_prefetch_default:
            return []
        return self._next_forward.get(id(group), [])

    def backward_targets(self, group: ParamGroup, moment: BackwardPrefetch) -> list[ParamGroup]:
        if self._check_every_step:
            return []
        if group.explicit_backward_prefetch is not None:
            return group.explicit_backward_prefetch if moment is BackwardPrefetch.BACKWARD_PRE else []
        if group.backward_prefetch_default is not moment:
            return []
        return self._next_backward.get(id(group), [])

    # Backward ---------------------------------------------------------------------------------

    def on_unit_backward_done(self, group: ParamGroup) -> None:
        """BACKWARD_POST prefetch: the next unit's gather starts once this one is freed."""
        self.prefetch_for_backward(group, BackwardPrefetch.BACKWARD_POST)

    def prefetch_for_backward(self, group: ParamGroup, moment: BackwardPrefetch) -> None:
        """Gather the units the backward reaches after ``group``'s, passing over those it has
        nothing to do with this step (``skipped_by_backward``) for the ones after them: a
        skipped unit gathered here would be held to the end of the backward, and the units
        after it would lose their prefetch."""
        seen = {id(group)}
        pending = list(self.backward_targets(group, moment))
        while pending:
            target = pending.pop(0)
            if id(target) in seen:
                continue
            seen.add(id(target))
            if target.skipped_by_backward():
                pending.extend(self.backward_targets(target, moment))
            else:
                target.prefetch_for_backward()

    def ensure_final_callback(self) -> None:
        if self._callback_queued:  # (the common case, once per gradient: one test and a weakref)
            self.recover_if_backward_aborted()
            if self._callback_queued:
                return
        if not in_backward():
            return
        self._callback_queued = True
        callback = _FinalCallback(self)
        self._callback_token = weakref.ref(callback)
        Variable._execution_engine.queue_callback(callback)

    def park(self, group: ParamGroup) -> None:
        self._parked.append(group)

    def release_parked(self, current: ParamGroup) -> None:
        """``current``'s backward begins: release the units parked before it (not ``current``
        itself, called again right after its last call's backward)."""
        parked, self._parked = self._parked, []
        for group in parked:
            if group is current:
                group.parked = False
            elif group.parked:  # (not reduced since: post_backward unparks)
                group.release_parked()

    def recover_if_backward_aborted(self) -> None:
        """In a backward: if the one whose end the queued callback waits for raised (the engine
        dropped the callback with it), recover from it now, before this backward needs the
        units (a retry of a backward through a retained graph after an out-of-memory error).
        A nested backward (a reentrant checkpoint's) finds the callback held still."""
        token = self._callback_token
        if self._callback_queued and token is not None and token() is None:
            self._recover_from_aborted_backward()

    def add_pending_reduce(self, pending: PendingReduce) -> None:
        """Issue-order pipeline: at most one reduce-scatter and one all-reduce in flight.

        Landing the previous reduce-scatter issues its cross-replica all-reduce (2D meshes),
        which in turn lands when the next reduce-scatter is issued, so both overlap backward
        compute and memory for in-flight gradients stays bounded.
        """
        previous, self._pending_reduces = self._pending_reduces, []
        for item in previous:
            follow_up = item.finish()
            if follow_up is not None:
                self._pending_reduces.append(follow_up)
        self._pending_reduces.append(pending)

    def finish_reduces(self) -> None:
        while self._pending_reduces:
            follow_up = self._pending_reduces.pop(0).finish()
            if follow_up is not None:
                self._pending_reduces.append(follow_up)

    def _final_callback(self) -> None:
        self._callback_queued = False
        try:
            self._end_backward()
        except BaseException:
            # A check, or a hook of yours on a gradient (run as it lands in .grad), raised:
            # start the next step clean, as after a backward that raised.
            self._recover_from_aborted_backward(land=False)
            raise
        if self._checking:
            self.check_collective_order("backward")

    def _end_backward(self) -> None:
        self.check_step_order()  # (if no unit's pre-backward ran in this backward)
        with phase("fshard::final_callback"):
            for group in self.groups:
                syncing = group.requires_gradient_sync or group.reduce_scatter_while_accumulating
                # Also a unit reduced already: gradients that arrived after its reduce (reentrant
                # checkpointing runs one nested backward per forward) are reduced now and added.
                # Decided by what every rank knows alike (whether the unit ran in a way that
                # may give gradients, and was reduced), not by whether gradients arrived here:
                # a param used on some ranks only.
                if syncing and (
                    group.has_unsharded_grads()
                    or (group.backward_may_come and not group._reduced)
                ):
                    group._reduced = True
                    group.reduce_grads()
                elif not syncing:
                    group.accumulate_unsynced_grads()  # units whose grads did not all arrive
            self.finish_reduces()
            for group in self.groups:
                group.flush_partials()
                if group.requires_gradient_sync:
                    _UNSYNCED.discard(group)
                else:
                    group.mark_awaiting_sync()
                    if group.has_unreduced_grads():
                        _UNSYNCED.add(group)
                group.end_backward()
            self._grad_forward_pending = False
            self._parked = []
            self._next_step()
            self.hidden_kept = False  # every unit was freed

    def _recover_from_aborted_backward(self, land: bool = True) -> None:
        """The last backward raised before its final callback ran (or in it): start clean.

        The failed backward's partial gradients are dropped: its full gradients, and its
        reductions still in flight (waited for: peers that failed at the same point issued
        them too). Those that landed before the error are in the sharded grads
        (``optimizer.zero_grad()`` clears them). But the sums of earlier ``no_sync``
        micro-batches are kept, as an unsharded model's ``.grad`` keeps them (with whatever
        the failed backward added): a unit holding one keeps its full gradients, and a
        reduction in flight that carries one lands. Every unit is freed. ``land=False`` (a hook
        of the user's raised while reductions landed) drops every reduction still in flight
        instead of running the hook again.
        """
        holding = [any(slot.awaiting_sync for slot in g.slots) for g in self.groups]
        logger.warning(
            "fshard: the previous backward of %s did not finish (it raised); freeing its units "
            "and dropping its partial gradients%s",
            self.root.label,
            " (the sums of earlier no_sync micro-batches stay)" if any(holding) else "",
        )
        self._callback_queued = False
        self._grad_forward_pending = False
        self._parked = []
        self._next_step()
        pending, self._pending_reduces = self._pending_reduces, []
        failure: BaseException | None = None
        while pending:
            item = pending.pop(0)
            if not (land and item.carries_sums) or failure is not None:
                item.discard()
                continue
            try:
                follow_up = item.finish()
            except BaseException as exc:  # a gradient hook of the user's: raised after cleaning
                failure, follow_up = exc, None
            if follow_up is not None:
                pending.append(follow_up)
        for group, keep in zip(self.groups, holding, strict=True):
            if keep:
                group.accumulate_unsynced_grads()
            else:
                group.drop_unsharded_grads()
            group.end_backward(aborted=True)
        self.hidden_kept = False
        if failure is not None:
            raise failure

    def recover_from_aborted_forward(self) -> None:
        """The model's last forward raised (an out-of-memory error caught to retry with a
        smaller batch): free the units it left gathered, those whose forward it was in and
        those it prefetched, so that this forward starts from the usual memory. None of them
        has a backward to come: their forwards produced no output."""
        for group in self.groups:
            group.outside_calls.clear()
            group.nested_returned = False
            group.modules_to_run.clear()
            group.deferred_reshard = False
            group.forward_depth = 0
            group.outer_passed.clear()
            aborted = group.training_state is TrainingState.FORWARD
            if group.training_state in (TrainingState.FORWARD, TrainingState.IDLE):
                # Also units kept from their forward (reshard_after_forward=False): an optimizer
                # step may follow, and their copy would be stale. A backward still to come
                # gathers them again into the storage it saved.
                group.reshard()
            if aborted:
                group.reset_backward()
                group.training_state = TrainingState.IDLE

    # Order checks -----------------------------------------------------------------------------

    def check_collective_order(self, moment: str) -> None:
        """Compare the collectives each rank issued on each group since the last check.

        Raises ``RankMismatchError`` naming the first differing collective and both ranks. After
        the first backward this stops, unless ``FSHARD_DEBUG`` is set.
        """
        with phase("fshard::check_collective_order"):
            for process_group in self._process_groups:
                record = _collectives.take_recording(process_group)
                if record is None:
                    continue
                mine = (dist.get_rank(), record.count, record.digest)
                everyone = _collectives.all_gather_objects(
                    mine, process_group, label="check_collective_order"
                )
                if len({(count, digest) for _, count, digest in everyone}) > 1:
                    heads = _collectives.all_gather_objects(
                        (dist.get_rank(), record.count, record.digest, record.head),
                        process_group,
                        label="check_collective_order",
                    )
                    raise RankMismatchError(_order_mismatch_message(heads, moment))
        if not self._check_every_step:
            self._checking = False
            for process_group in self._process_groups:
                _collectives.stop_recording(process_group)


# ------------------------------------------------------------------------------------- forward


class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward tells the unit those grads are ready."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.waiter = group.add_input_waiter()  # lives as long as this graph
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.on_inputs_grad_ready(ctx.waiter)
        return (None, *grads)


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``fn`` over the tensors of a pytree, also inside dataclasses pytree does not know
    (it sees those as leaves). Containers come back new (as ``tree_map`` makes them); a
    dataclass is shallow-copied only if one of its tensors changed, never changed in place."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _is_dataclass_instance(x):
            changed = {}
            for field in dataclasses.fields(x):
                value = getattr(x, field.name)
                new = _map_tensors(fn, value)
                if new is not value:
                    changed[field.name] = new
            if not changed:
                return x  # nothing cast: the caller's own object
            copy = copy_module.copy(x)
            for name, new in changed.items():
                object.__setattr__(copy, name, new)
            return copy
        return x

    return pytree.tree_map(leaf, tree)


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a pytree, also inside dataclasses (see ``_map_tensors``)."""
    out: list[torch.Tensor] = []
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif _is_dataclass_instance(x):
            out.extend(_tensors_in([getattr(x, f.name) for f in dataclasses.fields(x)]))
    return out


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


_functorch = torch._C._functorch
_PEEK_TRANSFORMS = getattr(_functorch, "peek_interpreter_stack", None)
_DIFFERENTIATING = {
    getattr(getattr(_functorch, "TransformType", None), name, None) for name in ("Grad", "Jvp")
} - {None}


def _refuse_functorch_differentiation(group: ParamGroup) -> None:
    """``torch.func.grad`` / ``vjp`` / ``jacrev`` / ``jvp`` differentiate at their own level,
    outside the autograd hooks that gather a unit for its backward."""
    stack = _functorch.get_interpreter_stack() or []
    if any(interpreter.key() in _DIFFERENTIATING for interpreter in stack):
        raise RuntimeError(
            f"fshard: unit {group.label} ran inside a torch.func transform that differentiates "
            "(grad, vjp, jacrev, jacfwd, jvp), which fshard does not support: such a transform "
            "differentiates outside the autograd hooks that gather the unit's parameters for "
            "its backward. Use torch.autograd.grad (for gradients with respect to inputs) or "
            "torch.autograd.functional.jacobian on the model instead; torch.func.vmap alone "
            "works."
        )


def check_params_in_place(groups: list[ParamGroup], *, before_init: nn.Module | None = None) -> None:
    """Each module still holds the parameter fshard manages (its shard, or its gathered
    copy). One put there since (``block.lin.weight = nn.Parameter(...)``, weights tied
    anew) would be silently replaced by the old shard at the next gather, and a tensor
    substituted for the call (``torch.func.functional_call``) would be overwritten by the
    gathered copy: refuse both. Before root init (``before_init``: the root module, which names
    them) a sharded parameter put there is a tie made since ``fully_shard``
    (``tie_weights()``), which root init places: only other tensors and unsharded parameters
    are refused."""
    for group in groups:
        for slot in group.slots:
            for module, name in slot.registrations:
                current = module._parameters.get(name)
                if current is None:
                    if before_init is not None:
                        continue  # moved (a parametrization registered since): root init finds it
                elif (
                    current is slot.sharded_param
                    or current is slot.unsharded_param
                    or (before_init is not None and is_sharded(current))
                ):
                    continue
                fqn, unit = slot.fqn, group.label
                if before_init is not None:  # no FQNs yet
                    names = {id(m): n for n, m in before_init.named_modules()}
                    fqn = f"{names[id(module)]}.{name}".lstrip(".")
                    unit = repr(names[id(group.module)]) if names[id(group.module)] else "<root>"
                if current is None:
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} was removed from its module "
                        f"after the model ran ({type(module).__name__}.{name} is no longer a "
                        "parameter there: torch.nn.utils.parametrize.register_parametrization, "
                        "parametrizations.weight_norm or prune move it); fshard would put its "
                        "gathered copy back where the module no longer reads it. Apply them "
                        "before the first forward (best, before calling fully_shard)."
                    )
                if not isinstance(current, nn.Parameter):
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} holds another "
                        f"tensor ({type(module).__name__}.{name} is a "
                        f"{type(current).__name__} of shape {list(current.shape)}), as "
                        "torch.func.functional_call and torch.nn.utils.stateless put there "
                        "for one call; fshard would overwrite it with the gathered parameter "
                        "and compute with the model's own weights. Calling a sharded model "
                        "with substituted parameters is not supported: copy the values into "
                        "the shards instead (fshard.load_state_dict, or with torch.no_grad(): "
                        "p.to_local().copy_(...)), or call an unsharded copy of the module."
                    )
                if slot.sharded_param.is_meta and not current.is_meta:
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} was replaced after "
                        f"fully_shard by a new one on {current.device} while fshard's shard is "
                        "still on the meta device: module.to_empty(device=...) after fully_shard "
                        "does this. To initialise a model built on the meta device after "
                        "sharding, call fshard.materialize(model) instead of to_empty (it gives "
                        "the shards storage in place and runs each module's reset_parameters, or "
                        "your init_fn)."
                    )
                raise ValueError(
                    f"fshard: parameter {fqn!r} of unit {unit} was replaced "
                    f"after fully_shard ({type(module).__name__}.{name} = another "
                    "Parameter); fshard manages the one it sharded and would put it back. "
                    "Change its values in place instead (with torch.no_grad(): "
                    "p.to_local().copy_(...), or fshard.load_state_dict), or replace it "
                    "before calling fully_shard."
                )


def _pre_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if _PEEK_TRANSFORMS is not None and _PEEK_TRANSFORMS() is not None:
        _refuse_functorch_differentiation(group)
    if group.root is None:
        _refuse_root_of_several(group)
        check_params_in_place(units_under(group.module), before_init=group.module)
        _lazy_init(group)
    root: RootState = group.root  # type: ignore[assignment]  # set by _lazy_init
    if in_backward():
        # Activation-checkpoint recompute inside backward: gather and cast as the forward did,
        # but arm nothing...
        group.unshard()
        args, kwargs = _cast_inputs(group, args, kwargs)
        if group.checkpointed_calls > 0 and torch.is_grad_enabled():
            # ...except, for a reentrant checkpoint's recompute of a forward that ran without
            # grad on inputs requiring it, the waiter that forward could not arm: the nested
            # backward that follows computes those inputs' gradients.
            wrapped = _wrap_inputs(group, args, kwargs)
            if wrapped is not None:
                group.consume_segment()
                return wrapped
        return args, kwargs
    if root.root is group and not (
        group.training_state is TrainingState.FORWARD and group.forward_depth > 0
    ):
        # (Not for the root's forward inside a method of the root that runs as its forward:
        # see register_forward_method.)
        root.on_root_pre_forward()
    if group.training_state is TrainingState.IDLE and not group.ran_since_backward:
        group.reset_backward()  # the first forward since the last backward
    group.training_state = TrainingState.FORWARD
    group.ran_since_backward = True
    if group.forward_depth > 0:
        # A module of this unit (of several) called inside the forward of another of them:
        # the outer call's passed inputs wait (see _post_forward).
        group.outer_passed.append(group.passed_inputs)
        group.passed_inputs = None
    group.forward_depth += 1
    if len(group.modules) > 1 and not group.modules_to_run:
        # A unit of several modules is gathered once for all of them: see _post_forward.
        group.modules_to_run = {id(m) for m in group.modules}
    root.record(group)
    group.unshard()
    if torch.is_grad_enabled():
        root.grad_forwards += 1
        group.note_forward_versions()
        if _SEQUENCE_NR is not None:
            group.forward_seq = _SEQUENCE_NR()
    if group.forward_mark != root.forwards and root.root.training_state is TrainingState.FORWARD:
        # Prefetch once per model forward, at the unit's first call: a later call (a module of
        # a unit of several, a block run twice) would gather the unit after its first call in
        # the recorded order, which ran and was freed already, and hold it to the end of the
        # backward. A unit called outside the model's forward prefetches nothing: no end of
        # a model's forward frees what it would prefetch.
        group.forward_mark = root.forwards
        for target in root.forward_targets(group):
            target.unshard(async_op=True)
    args, kwargs = _cast_inputs(group, args, kwargs)
    if not torch.is_grad_enabled():
        ctx = None
        if root._grad_forward_pending or _any_requires_grad(args, kwargs):
            ctx = _autograd_function_ctx()
        if ctx is not None:
            root.note_run(group)
            # Without grad inside a forward with grad, or on inputs requiring grad, and within
            # an autograd.Function's forward: a reentrant checkpoint's segment. Its recompute,
            # if one comes in backward, arms the waiter; until then the unit's backward is not
            # done (every rank alike). The claim lives on the Function's node, so it goes with
            # a graph no backward comes for (an evaluation with grad, a skipped step). (Under a
            # plain torch.no_grad(), a target computed by the model itself, no backward ever
            # comes: the unit is freed as after inference.)
            group.claim_segment(ctx)
            group.backward_may_come = True
        return args, kwargs
    group.grad_forward_ran = True
    group.backward_may_come = True
    root.note_run(group)
    if group.forward_depth > 1:
        # Inside another call of this unit (a unit of several modules): that call's inputs
        # tell when both are done. A waiter of its own would let the unit be freed (parked,
        # then released by a unit the outer call ran before it) while the outer call's
        # backward still reads its parameters.
        return args, kwargs
    # The inputs' gradients tell when the unit's backward is done: [Note: when a unit's
    # backward is done].
    wrapped = _wrap_inputs(group, args, kwargs)
    if wrapped is None:
        group.unwaited_forward = True
        return args, kwargs
    return wrapped


def _autograd_function_ctx() -> torch.autograd.function.FunctionCtx | None:
    """The ``ctx`` of the ``torch.autograd.Function`` whose ``forward`` the caller runs inside,
    as the segment of a reentrant checkpoint does (torch's, DeepSpeed's, Megatron's or
    FairScale's ``CheckpointFunction``): a frame named ``forward`` whose first argument is the
    Function's ``ctx``; None outside one. Only the forwards run without grad ask, so the walk
    costs nothing otherwise."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount > 0 and code.co_varnames[0] != "self":
            first = frame.f_locals.get(code.co_varnames[0])  # (modules' forwards skipped)
            if isinstance(first, torch.autograd.function.FunctionCtx):
                return first
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _cast_inputs(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The floating-point inputs in ``MixedPrecision.param_dtype`` (with cast_forward_inputs)."""
    mp = group.mp_policy
    if mp is None or mp.param_dtype is None or not mp.cast_forward_inputs:
        return args, kwargs
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call
        dtype = mp.param_dtype
        return tuple(a.to(dtype) if a.is_floating_point() else a for a in args), kwargs
    cast: tuple[tuple[Any, ...], dict[str, Any]] = _cast_floating((args, kwargs), mp.param_dtype)
    return cast


def _any_requires_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    found = False

    def note(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        found = found or t.requires_grad
        return t

    _in_tuples((*args, *kwargs.values()), note)
    return found


def _wrap_inputs(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The inputs with those requiring grad passed through ``_InputsGradReady`` (a waiter of
    ``group``), or None if none requires grad.

    Arguments, keyword arguments and tuples in them, which a unit cannot change, so giving it
    new ones is invisible (a tensor passed twice is wrapped once). Not inside lists, dicts,
    dataclasses or other objects: a unit may write into the caller's container, so it must get
    that very object (such a unit is reduced when the backward ends).
    """
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call
        positions = [i for i, a in enumerate(args) if a.requires_grad]
        if not positions:
            return None
        wrapped = _InputsGradReady.apply(group, *(args[i] for i in positions))
        new_args = list(args)
        for i, tensor in zip(positions, wrapped, strict=True):
            new_args[i] = tensor
        group.passed_inputs = {id(w): (w, args[i]) for i, w in zip(positions, wrapped, strict=True)}
        return tuple(new_args), kwargs
    needing: dict[int, torch.Tensor] = {}
    _in_tuples(
        (*args, *kwargs.values()),
        lambda t: needing.setdefault(id(t), t) if t.requires_grad else t,
    )
    if not needing:
        return None
    wrapped = _InputsGradReady.apply(group, *needing.values())
    group.passed_inputs = {id(w): (w, t) for w, t in zip(wrapped, needing.values(), strict=True)}
    by_id = {i: w for i, w in zip(needing, wrapped, strict=True)}
    args = _in_tuples(args, lambda t: by_id.get(id(t), t))
    kwargs = {k: _in_tuples(v, lambda t: by_id.get(id(t), t)) for k, v in kwargs.items()}
    return args, kwargs


def _in_tuples(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` over ``x`` if it is a tensor, or over the tensors inside it if it is a (nested)
    tuple; a tuple comes back new only if one of them changed. Other objects are left alone."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        items = [_in_tuples(item, fn) for item in x]
        if all(new is old for new, old in zip(items, x, strict=True)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _post_forward(
    group: ParamGroup,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    passed, group.passed_inputs = group.passed_inputs, None  # (also a recompute's: dropped)
    if in_backward():
        return None
    root: RootState = group.root  # type: ignore[assignment]  # set in pre-forward
    group.forward_depth = max(group.forward_depth - 1, 0)
    group.modules_to_run.discard(id(module))
    nested = group.forward_depth > 0  # inside another module's forward of this unit
    grad_enabled = torch.is_grad_enabled()
    handed_back: set[int] = set()  # inputs returned as given: no hook of this unit on them
    if passed is not None:
        output = _unwrap_returned_inputs(output, passed, handed_back)
    # The root's backward starts right after forward ends and needs its parameters first, so it
    # keeps them rather than free and re-gather them (as FSDP2 does); without grad, free all.
    keep = group is root.root or not group.reshard_after_forward
    mp = group.mp_policy
    if mp is not None and mp.output_dtype is not None:
        output = _cast_floating(output, mp.output_dtype)
    leaves = [output] if type(output) is torch.Tensor else _tensors_in(output)
    gathered = group.gathered_storage_ptrs()
    if gathered and any(_storage_ptr(t) in gathered for t in leaves):
        # A view of a gathered param (a row of the weight, weight.t(), the weight itself)
        # would outlive the memory freeing the unit takes away: return a copy, which autograd
        # differentiates like the view.
        output = _map_tensors(lambda t: t.clone() if _storage_ptr(t) in gathered else t, output)
        leaves = [output] if type(output) is torch.Tensor else _tensors_in(output)
    if grad_enabled and not keep and _PEEK_TRANSFORMS is not None and _PEEK_TRANSFORMS() is not None:
        # Inside torch.func.vmap: the outputs are batched wrappers, whose hooks the backward
        # outside the transform never runs, so nothing would gather the unit again for it.
        # Keep it gathered instead; the end of the backward reduces and frees it.
        keep = True
    if grad_enabled:
        hook = _PreBackwardHook(group, group._forward_versions, root.steps)
        for leaf in leaves:
            if leaf.requires_grad and id(leaf) not in handed_back:
                leaf.register_hook(hook)
        if not keep and _SEQUENCE_NR is not None:
            # Tensors the forward made and left in module attributes (an MoE's auxiliary loss,
            # a penalty) may reach the loss without passing the outputs: their backward needs
            # the params too, and may run first.
            returned = {id(t) for t in leaves}  # (the tensors it was handed are not its own)
            for tensor in _made_since(group, group.forward_seq):
                if id(tensor) not in returned:
                    tensor.register_hook(hook)
        if not leaves and group.may_need_params_in_backward():
            # No tensor returned to hang the re-gather on (the result went into an attribute,
            # or an object fshard cannot look into), yet autograd may have saved the gathered
            # params: keep them until the unit's gradients are reduced (or the backward ends).
            keep = True
    if nested:
        # The outer module's forward goes on with the unit gathered and its passed inputs.
        group.passed_inputs = group.outer_passed.pop() if group.outer_passed else None
        group.nested_returned = True
        return output
    if not grad_enabled or not keep:
        if group.modules_to_run and root.root.training_state is TrainingState.FORWARD:
            # A unit of several modules, some of which have not run yet in the model's
            # forward, stays gathered for them; if one does not run after all (or one runs
            # again), the end of the model's forward frees it.
            group.deferred_reshard = True
        elif grad_enabled and group.post_forward_size:
            group.reshard_post_forward()  # reshard_after_forward=<int>: keep 1/N for backward
            group.deferred_reshard = False
            root.hidden_kept = True  # (the next model forward drops what its backward did not use)
        else:
            group.reshard()
            group.deferred_reshard = False
    group.training_state = TrainingState.IDLE
    root.record_finish(group)
    if root.root is group:
        root.on_root_post_forward()
    elif grad_enabled and keep and root.root.training_state is not TrainingState.FORWARD:
        # A unit called on its own, outside the model's forward: nothing later hides its kept
        # params, so this does, as the root's post-forward does for the model's units.
        group.hide_unsharded()
        root.hidden_kept = True
    return output


def _unwrap_returned_inputs(
    output: Any, passed: dict[int, tuple[torch.Tensor, torch.Tensor]], handed_back: set[int]
) -> Any:
    """``output`` with each input the unit returned as it got it (an adapter switched off,
    ``return x``) replaced by the tensor it was given, as it would be without fshard.

    The unit got its inputs through ``_InputsGradReady``, whose outputs autograd forbids
    changing in place: the caller's ``nn.ReLU(inplace=True)`` on such an output raised torch's
    "Output 0 of _InputsGradReady is a view". The replaced tensor depends on none of the
    unit's parameters, so it needs no hook of the unit (their ids go into ``handed_back``);
    the Function's node, now unused, goes with the returned copy and its waiter with it. (A
    view of an input, ``x[:, :3]``, stays a view of the copy.)
    """

    def original(t: torch.Tensor) -> torch.Tensor:
        found = passed.get(id(t))
        if found is None or found[0] is not t:
            return t
        handed_back.add(id(found[1]))
        return found[1]

    if type(output) is torch.Tensor:
        return original(output)
    if not any(id(t) in passed for t in _tensors_in(output)):
        return output
    return _map_tensors(original, output)


# The number autograd gives the next node it creates (private; absent, attribute tensors are
# not looked for): a node made in a unit's forward has at least the number read when it began.
_SEQUENCE_NR: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 where it has none to compare: sparse, meta, ...)."""
    if t.layout is not torch.strided or t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _own_modules(group: ParamGroup) -> list[nn.Module]:
    """The unit's module and those below it that no other unit owns (cached)."""
    if group.own_modules is None:
        found = list(group.modules)
        stack = [child for top in group.modules for child in top.children()]
        while stack:
            module = stack.pop()
            if _UNIT_ATTR not in module.__dict__:
                found.append(module)
                stack.extend(module.children())
        group.own_modules = found
        group.attr_index = []
    return group.own_modules


# Public attribute values looked at on every forward: containers a tensor may sit in, and what
# an attribute may hold until a forward puts a tensor there without adding an attribute (None,
# a number: `self.aux_loss = 0.0`).
_MAY_BECOME = (list, tuple, dict, float, int)


def _made_since(group: ParamGroup, start: int) -> list[torch.Tensor]:
    """Tensors with autograd history created since sequence number ``start`` that the unit's own
    modules hold in attributes, directly or in a public list, tuple or dict attribute.

    Which attributes can hold one (or become one: None, a number) is worked out per module
    once, and again only when the module gains or loses attributes: a scan of every attribute
    of every module on every forward would cost more than the rest of the unit's hooks."""
    found: list[torch.Tensor] = []
    modules = _own_modules(group)
    index = group.attr_index
    if len(index) != len(modules):
        index[:] = [(-1, ())] * len(modules)
    for i, module in enumerate(modules):
        attrs = module.__dict__
        size, names = index[i]
        if size != len(attrs):
            names = tuple(
                name
                for name, value in attrs.items()
                if type(value) is torch.Tensor
                or (not name.startswith("_") and (value is None or type(value) in _MAY_BECOME))
            )
            index[i] = (len(attrs), names)
        for name in names:
            value = attrs.get(name)
            if type(value) is torch.Tensor:
                candidates: Any = (value,)
            elif type(value) in (list, tuple):
                candidates = value
            elif type(value) is dict:
                candidates = value.values()
            else:
                continue
            for t in candidates:
                if type(t) is torch.Tensor and t.grad_fn is not None and t.grad_fn._sequence_nr() >= start:
                    found.append(t)
    return found


def _pre_backward(
    group: ParamGroup, grad: torch.Tensor | None, versions: tuple[int, ...] | None, step: int
) -> None:
    root: RootState = group.root  # type: ignore[assignment]  # set in pre-forward
    root.recover_if_backward_aborted()  # (then this graph is one from before, as after a step)
    root.check_step_order()  # the first pre-backward of a backward: before its collectives
    group.check_unchanged_since_forward(versions)
    if torch.is_grad_enabled():
        # Autograd runs hooks with grad mode on only in a backward with create_graph=True.
        raise RuntimeError(
            f"fshard: a backward with create_graph=True reached unit {group.label} (a gradient "
            "penalty, double backward or Hessian-vector product): fshard frees the gathered "
            "parameters when the backward ends, and the graph it builds would read them later. "
            "Higher-order gradients are not supported through sharded units."
        )
    if step != root.steps:
        _pre_backward_of_earlier_graph(group, root)
        return None
    if group._reduced or group._freed_in_backward:
        # Its backward is over here: every gradient arrived (it was freed, on the ranks where
        # the count is complete) or it was reduced. A later hook (an output made before its
        # params were read, an input kept in an attribute) needs no params, and gathering
        # again only here would leave the other ranks' all-gathers unpaired.
        return None
    root.ensure_final_callback()
    if root._parked:
        root.release_parked(group)
    if group.backward_task is None:
        group.backward_task = torch._C._current_graph_task_id()
    if group.training_state is TrainingState.PRE_BACKWARD and (
        group.sharded_state is ShardedState.UNSHARDED
    ):
        return None
    group.training_state = TrainingState.PRE_BACKWARD
    group.unshard()
    root.prefetch_for_backward(group, BackwardPrefetch.BACKWARD_PRE)
    return None


def _pre_backward_of_earlier_graph(group: ParamGroup, root: RootState) -> None:
    """A backward reached the output of a forward that ran before the last backward ended: a
    graph kept with ``retain_graph=True`` and traversed again, or one the last backward did
    not reach (two forwards, the first loss's backward, then both). That backward reset the
    unit's bookkeeping, so nothing tells when this one is done with the params: gather them
    once more and keep them, with their gradients reduced (and added to the ones a reduce in
    this backward gave already) when the backward ends.

    Decided by the hook alone, which every rank reaches alike: every rank frees what it holds
    and gathers anew (whether a rank freed the unit in this backward depends on its own count
    of arrived gradients), then nothing frees or reduces the unit early.
    """
    root.ensure_final_callback()
    if group.earlier_graph and not group._reduced:
        return  # gathered for such a graph in this backward, and kept
    group.earlier_graph = True
    group.backward_may_come = True
    group._reduced = False
    group._freed_in_backward = False
    group.reshard()
    group.training_state = TrainingState.PRE_BACKWARD
    group.unshard()


def check_prefetch_targets(groups: list[ParamGroup]) -> None:
    """Explicit prefetch lists (``fshard.set_prefetch``) may name only units of the same model:
    another model's unit would be gathered by this one's steps and never freed by them."""
    members = {id(g) for g in groups}
    problems = ProblemList("fshard.set_prefetch")
    for group in groups:
        lists = (("forward", group.explicit_forward_prefetch), ("backward", group.explicit_backward_prefetch))
        for kind, targets in lists:
            for target in targets or ():
                if id(target) not in members:
                    problems.add(
                        f"unit {group.label} prefetches unit {target.label} in {kind}, which is "
                        "not part of the same sharded model"
                    )
    problems.raise_if_any(ValueError, hint="List units of the model the unit belongs to.")


def _process_groups_of(groups: list[ParamGroup]) -> list[dist.ProcessGroup]:
    """The process groups the units communicate on (more than one rank), in a fixed order."""
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for g in groups:
        info = g.mesh_info
        candidates = [(info.shard_group, info.shard_size)]
        if info.replicate_group is not None:
            candidates.append((info.replicate_group, info.replicate_size))
        for process_group, size in candidates:
            if size > 1:
                found.setdefault(tuple(dist.get_process_group_ranks(process_group)), process_group)
    return [found[ranks] for ranks in sorted(found)]


def _describe_collective(head: list[tuple[str, str, int]], issued: int, index: int) -> str:
    if index < len(head):
        op, label, numel = head[index]
        return f"the {op} of unit {label!r} ({numel} elements)"
    if index < issued:
        return "a collective past the first recorded ones"
    return "nothing more"


def _order_mismatch_message(
    heads: list[tuple[int, int, str, list[tuple[str, str, int]]]], moment: str
) -> str:
    """Name the first collective where some rank's sequence differs from the lowest rank's."""
    heads = sorted(heads, key=lambda item: item[0])
    ref_rank, ref_count, ref_digest, ref_head = heads[0]
    for rank, count, digest, head in heads[1:]:
        if (count, digest) == (ref_count, ref_digest):
            continue
        index = next(
            (i for i, (a, b) in enumerate(zip(ref_head, head, strict=False)) if a != b),
            min(len(ref_head), len(head)),
        )
        return (
            f"ranks issued different collectives in this step (checked after the {moment}): "
            f"rank {ref_rank} issued {ref_count} and rank {rank} issued {count}; collective "
            f"#{index + 1} was {_describe_collective(ref_head, ref_count, index)} on rank "
            f"{ref_rank} but {_describe_collective(head, count, index)} on rank {rank}. Every rank "
            "must run the same units in the same order (a unit called on only some ranks, e.g. by data-dependent control flow, "
            "pairs one rank's data with another unit's), so this step's gradients are not valid: "
            "do not step the optimizer on them."
        )
    raise internal_error("collective digests differ but no rank's sequence does")


# ----------------------------------------------------------------------------------- root init


def _lazy_init(group: ParamGroup) -> None:
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
            g._register_unsharded()


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
    _place_shared_params(module, groups)
    index_param_owners(module)  # modules attached since fully_shard (a head tied to a unit's)
    param_names = {id(p): name for name, p in module.named_parameters()}
    for g in groups:
        for slot in g.slots:
            slot.fqn = param_names.get(id(slot.sharded_param), slot.fqn)
    _validate_across_ranks(group, groups)
    state = RootState(group, groups)
    for g in groups:
        g.root = state
        g.own_modules = None  # units made since may own some of its modules
        hook_containers(g)  # units made after it: see [Note: calls into a unit from outside its forward]
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


def debug_checks() -> bool:
    """Whether ``FSHARD_DEBUG`` is set (to anything but ``0``): see RootState."""
    return os.environ.get("FSHARD_DEBUG", "").strip() not in ("", "0")


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
            warnings.warn(
                f"fshard: parameter {names[-1]!r} is shared by modules {users}, so it belongs to "
                f"unit {target.label} and follows that unit's mp_policy / offload_policy, not "
                f"those given to unit {source.label} (e.g. a tied output head: untie it, or set "
                "the policy on the common parent)",
                stacklevel=2,
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
        f"(default: {g.backward_prefetch_default.name})"
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


def check_prefetch_alike(root: RootState) -> None:
    """After ``fshard.set_prefetch`` on a model that has run: every rank must have the same
    prefetch settings, or the ranks issue their all-gathers in different orders, and units of
    one size exchange each other's rows without an error. Compared with one object all-gather
    (a rank that did not call ``set_prefetch`` meets it in its next collective instead: an
    error, not wrong weights). The first forward compares them the same way, in the
    fingerprint."""
    if root.root.mesh_info.dp_size == 1:
        return
    settings = [(g.label, _prefetch_setting(g)) for g in root.groups]
    everyone = _gather_over_mesh(root.root, settings, label="set_prefetch")
    ref_rank, ref = everyone[0]
    for rank, other in everyone[1:]:
        if other == ref:
            continue
        (unit, mine), (_, theirs) = next((a, b) for a, b in zip(ref, other, strict=False) if a != b)
        raise RankMismatchError(
            f"fshard.set_prefetch: the ranks' prefetch settings differ: unit {unit} has "
            f"{mine} on rank {ref_rank} but {theirs} on rank {rank}. Call set_prefetch with the "
            "same units on every rank: the order of the all-gathers follows it, and ranks "
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
                if index == 0:  # the roots differ
                    raise RankMismatchError(
                        f"the ranks' first forwards started at different units: rank {ref_rank} "
                        f"at a {mine[1]}, rank {rank} at a {theirs[1]}. The first unit to run "  # type: ignore[index]
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


def ensure_root_initialised(group: ParamGroup) -> None:
    """Run root init for APIs that need FQNs and placement before the first forward."""
    if group.root is None:
        _lazy_init(group)
