"""Checks of a saved optimizer state dict against the optimizer that loads it.

Name-keyed or position-keyed state, which saved group each of the optimizer's groups loads
from, state shapes, and the optimizer class (recorded, or told by the state's content).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fshard._errors import ProblemList
from fshard._param import ParamSlot
from fshard._runtime._optim_hooks import SHARDS_KEY
from fshard._state_dict._common import is_meta_value
from fshard._unit._module_state_dict import foreign_shard

logger = logging.getLogger("fshard")


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


OTHER_CLASS_HINT = (
    "Build the optimizer with the class (and param groups) of the run that saved the state, or "
    "do not load this optimizer state and start the optimizer fresh (for a checkpoint: "
    "fshard.checkpoint.load(path, model) without the optimizer)."
)


def class_name(optim: torch.optim.Optimizer) -> str:
    cls = type(optim)
    return f"{cls.__module__}.{cls.__qualname__}"


def hyperparameters_of(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


class SavedOptim(NamedTuple):
    """A state dict's groups and state, keyed by parameter name."""

    groups: list[Mapping[str, Any]]
    state: Mapping[str, Mapping[str, Any]]


def saved_by_name(
    state_dict: Mapping[str, Any],
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    where: str,
) -> SavedOptim:
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
        return SavedOptim(groups, state)
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
    return SavedOptim(named, {name_of[k]: v for k, v in state.items()})


def match_groups(
    saved: SavedOptim,
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


def check_state_shapes(
    saved: SavedOptim,
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
            foreign = foreign_shard(f"state[{name!r}][{key!r}]", value, slot)
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


def meta_state(
    saved: SavedOptim, named_groups: list[list[tuple[str, ParamSlot | None]]]
) -> list[str]:
    """The saved state tensors on the meta device that the load would read, as
    ``state['name']['key']`` ([Note: meta tensors in a load])."""
    held = {n for group in named_groups for n, _ in group}
    return [
        f"state[{name!r}][{key!r}]"
        for name, st in saved.state.items()
        if name in held and isinstance(st, Mapping)
        for key, value in st.items()
        if is_meta_value(value)
    ]


def check_recorded_class(
    optim: torch.optim.Optimizer, state_dict: Mapping[str, Any], where: str
) -> bool:
    """Refuse state saved from another optimizer class; returns whether a class was recorded.

    See [Note: optimizer class on load].
    """
    recorded = state_dict.get(OPTIMIZER_CLASS_KEY)
    if recorded is None:
        return False
    mine = class_name(optim)
    if recorded != mine:
        raise ValueError(
            f"{where}: the optimizer state was saved from a {recorded} (its "
            f"{OPTIMIZER_CLASS_KEY!r}), but this optimizer is a {mine}: another optimizer class "
            f"keeps other state, or the same state with another meaning.\n{OTHER_CLASS_HINT}"
        )
    return True


def check_unrecorded_kind(
    optim: torch.optim.Optimizer,
    saved: SavedOptim,
    named_groups: list[list[tuple[str, ParamSlot | None]]],
    matched: list[int | None],
    problems: ProblemList,
) -> None:
    """Without a recorded class, tell another optimizer's state by its content (see the Note)."""
    mine = class_name(optim)
    for g_index, s_index in enumerate(matched):
        if s_index is None:
            continue
        saved_keys = set(hyperparameters_of(saved.groups[s_index]))
        current_keys = set(hyperparameters_of(optim.param_groups[g_index]))
        if saved_keys - current_keys and current_keys - saved_keys:
            problems.add(
                f"param_groups[{g_index}] has hyperparameters {sorted(saved_keys - current_keys)} "
                f"that {mine} does not take and lacks its {sorted(current_keys - saved_keys)}: "
                "the state dict comes from another kind of optimizer"
            )
            return
    made: dict[tuple[int, int, torch.dtype, torch.device], frozenset[str] | None] = {}
    for g_index, (current, s_index) in enumerate(zip(named_groups, matched, strict=True)):
        hyper = hyperparameters_of(optim.param_groups[g_index])
        if s_index is not None:
            hyper.update(hyperparameters_of(saved.groups[s_index]))
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
