"""Optimizer and GradScaler guards: the process-wide optimizer pre-step hook and what it checks."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fshard import _collectives
from fshard._errors import first_few, warn_user
from fshard._param import is_sharded, local_rows
from fshard._unit._group import KEPT_GATHERED, ParamGroup, TrainingState
from fshard._unit._registry import units_made

logger = logging.getLogger("fshard")

# Units whose last backward ran without gradient sync and kept its full gradients unreduced.
_UNSYNCED: weakref.WeakSet[ParamGroup] = weakref.WeakSet()


_STEP_HOOK: list[Any] = []  # the process-wide optimizer pre-step hook, once registered


_CHECKED_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


_UNSHARDED_AT: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _check_optimizer_step(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """Process-wide ``optimizer.step()`` pre-hook (registered with the first unit)."""
    if optimizer in _CHECKED_OPTIMIZERS or _UNSHARDED_AT.get(optimizer) != units_made():
        if not check_optimizer_state(optimizer):
            # Look again only after new units were made (its params may be sharded then).
            _UNSHARDED_AT[optimizer] = units_made()
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
    if recorded and info is not None and _collectives.on_any_rank(bool(problems), info, "optimizer.step") and not problems:
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
    if _SCALER_CHECKED.get(optimizer) == (units_made(), len(params)):
        return  # no sharded param the last time, and nothing new since
    if not any(is_sharded(p) for p in params):
        _SCALER_CHECKED[optimizer] = (units_made(), len(params))
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
    torch.amp.GradScaler.step = step  # type: ignore[method-assign]  # the patch itself: see the Note above


@dataclasses.dataclass
class _StepScan:
    """What the first step's check found among an optimizer's parameters."""

    wrong: list[str] = dataclasses.field(default_factory=list)  # full-size state, stepped
    gathered: list[str] = dataclasses.field(default_factory=list)  # unsharded copies, not shards
    dtensors: list[str] = dataclasses.field(default_factory=list)  # DTensor state (a DCP load)
    unowned: list[torch.Tensor] = dataclasses.field(default_factory=list)  # trainable, no unit
    sharded: bool = False
    split: bool = False  # some parameter's rows are spread over ranks
    data_parallel: int = 1


def _scan_params(optimizer: torch.optim.Optimizer) -> _StepScan:
    """Look at every parameter the optimizer steps (never-stepped full-size state is cut to
    this rank's rows on the way: see _check_state_is_sharded)."""
    found = _StepScan()
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            of = getattr(param, "_fshard_gathered_of", None)
            if of is not None:
                found.gathered.append(repr(of_slot.fqn) if (of_slot := of()) is not None else "a parameter")
                continue
            slot = getattr(param, "_fshard_slot", None)
            if slot is None:
                if param.requires_grad and not getattr(param, "_fshard_ignored", False):
                    found.unowned.append(param)
                continue
            found.sharded = True
            found.split = found.split or (slot.mesh_info.shard_size > 1 and not slot.layout.replicated)
            found.data_parallel = max(found.data_parallel, slot.mesh_info.dp_size)
            if param not in optimizer.state:
                continue
            layout = slot.layout
            state = optimizer.state[param]
            if any(isinstance(value, DTensor) for value in state.values()):
                found.dtensors.append(slot.fqn)
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
                    state[key] = local_rows(state[key], layout).clone()
            else:
                found.wrong.append(f"{slot.fqn!r} ({full_keys[0]} {list(layout.full_shape)})")
    return found


def _check_state_is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """First step with sharded parameters: none may carry full-size state (returns whether
    the optimizer has sharded parameters at all).

    An optimizer stepped *before* ``fully_shard`` holds state shaped like the full parameter;
    torch would fail deep inside the update with a shape mismatch, or, for an optimizer that
    broadcasts, update the shard with the wrong rows. State that an optimizer made in its
    constructor (Adagrad's ``sum``, with ``step`` 0) was never stepped: it is the same on every
    rank, so this rank's rows of it are its sharded state, and they replace it.
    """
    found = _scan_params(optimizer)
    if found.gathered:
        raise ValueError(
            f"the optimizer holds the gathered (full) copies of {first_few(found.gathered)}, which fshard puts in "
            "the modules for a unit's forward and backward, not the sharded parameters: it was "
            "built while the model was gathered (after fshard.unshard, or inside a forward), "
            "and would never update the shards. Build it over model.parameters() outside "
            "forward and backward, or call fshard.reshard(model) first."
        )
    if found.dtensors:
        raise ValueError(
            f"optimizer state of sharded parameter(s) {first_few(found.dtensors)} holds DTensors: "
            "optimizer.load_state_dict loaded a state dict of fshard.optim_state_dict (or a "
            "DTensor checkpoint). Load those with fshard.load_optim_state_dict(model, "
            "optimizer, state_dict), which takes this rank's shards."
        )
    whole = _looks_across_parameters(optimizer) if found.split else None
    if whole is not None:
        name, why = whole
        raise TypeError(
            f"torch.optim.{name} cannot step fshard's sharded parameters: {why}, and each rank "
            "holds only some rows, so the ranks would take steps DDP would not. Use an "
            f"elementwise optimizer (SGD, Adam, AdamW, ...), or run {name} on an unsharded model."
        )
    if found.sharded and found.unowned and found.data_parallel > 1:
        # [Note: parameters no unit owns] A module outside every unit (the model's head and
        # final norm when fully_shard(model) was forgotten, or a wrapper's head around a sharded
        # inner model) trains on this rank's gradients only; DDP would average them, so the
        # ranks' copies drift apart, silently. Refused before the first update, on every rank
        # alike (each sees the same parameters); ignored_params says something else averages
        # them.
        raise ValueError(_unowned_message(optimizer, found.unowned))
    if found.wrong:
        raise ValueError(
            f"optimizer state of sharded parameter(s) {first_few(found.wrong)} has the full parameter's shape: "
            "the optimizer was stepped before fully_shard, or optimizer.load_state_dict loaded "
            "an unsharded run's state dict (or fshard.optim_state_dict(full=True)). Build the "
            "optimizer after sharding (or before, but step it only after), and move state with "
            "fshard.optim_state_dict / fshard.load_optim_state_dict."
        )
    return found.sharded


def _unowned_message(optimizer: torch.optim.Optimizer, unowned: list[torch.Tensor]) -> str:
    names = _names_of(optimizer, unowned)
    shown = [f"{name} {list(p.shape)}" if name else str(list(p.shape)) for name, p in zip(names, unowned, strict=True)]
    listed = ", ".join(shown[:10]) + (f" and {len(shown) - 10} more" if len(shown) > 10 else "")
    return (
        f"fshard: the optimizer steps {len(unowned)} trainable parameter(s) that no fshard unit "
        f"owns, beside sharded ones: {listed}. Their gradients are this rank's own, "
        "not averaged over the ranks as DDP's are, so every step would move the ranks' copies "
        "apart. Usually fully_shard(model) was not called on the root after its blocks: call "
        "fshard.fully_shard(model, mesh=mesh) last (for a wrapper around a sharded model, on "
        "the wrapper). If something else averages their gradients (DDP, your own all_reduce), "
        "pass them as fully_shard's ignored_params. Nothing was updated."
    )


def _is_module(obj: object) -> bool:
    try:
        return isinstance(obj, nn.Module)
    except ReferenceError:  # a proxy of a weakref whose object is gone
        return False


def _names_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[str]:
    """The parameters' FQNs for an error message: those the optimizer was given
    (``torch.optim`` records them when built from ``named_parameters()``), else those in the
    largest module that holds them all, found among the live modules (the error path only)."""
    given = {
        id(p): name
        for group in optimizer.param_groups
        for p, name in zip(group["params"], group.get("param_names", ()), strict=False)
    }
    if all(id(p) in given for p in params):
        return [given[id(p)] for p in params]
    wanted = {id(p) for p in params}
    best: dict[int, str] = {}
    best_size = 0
    with warnings.catch_warnings():  # (isinstance on torch's deprecated module stand-ins warns)
        warnings.simplefilter("ignore")
        modules = [obj for obj in gc.get_objects() if _is_module(obj)]
    for obj in modules:
        names = {id(p): n for n, p in obj.named_parameters() if id(p) in wanted}
        size = sum(1 for _ in obj.modules())  # the outermost of those naming as many: the model
        if (len(names), size) > (len(best), best_size):
            best, best_size = names, size
    return [best.get(id(p), "") for p in params]


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
        warn_user(
            f"optimizer.step() runs while fshard unit(s) {names} hold gradients accumulated "
            "without sync (no_sync / set_requires_gradient_sync(False)) that were never reduced: "
            "this step does not see them. Run the last micro-batch's backward with gradient sync "
            "on, then step.",
        )


def install_optimizer_hooks() -> None:
    """Once per process: the optimizer pre-step hook (every optimizer's step checks what it is
    about to update) and the GradScaler patch (see [Note: torch's GradScaler on sharded
    parameters])."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer_step))
        _patch_grad_scaler()
