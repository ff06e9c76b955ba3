"""Which unit a module belongs to: the unit lives on its module (``module.__dict__``).

Not in a global registry: a unit refers to its module, so a registry entry would keep every
sharded model alive for the whole process."""

from __future__ import annotations

import torch
from torch import nn

from fshard._unit._group import ParamGroup

__all__ = [
    "attach_unit",
    "in_backward",
    "is_unit_module",
    "unit_of",
    "units_made",
    "units_or_error",
    "units_under",
]

_UNIT_ATTR = "_fshard_unit"
_UNITS_MADE = [0]  # units made in this process so far


def attach_unit(group: ParamGroup) -> None:
    """Record ``group`` as the unit of each of its modules."""
    for module in group.modules:
        module.__dict__[_UNIT_ATTR] = group
    _UNITS_MADE[0] += 1


def units_made() -> int:
    """How many units this process has made so far (a cache key: a tree's units stay those its
    root found while no unit is made)."""
    return _UNITS_MADE[0]


def is_unit_module(module: nn.Module) -> bool:
    """Whether ``module`` is (one of the modules of) a unit."""
    return _UNIT_ATTR in module.__dict__


def unit_of(module: nn.Module) -> ParamGroup | None:
    """The unit ``module`` is (one of the modules of), or None."""
    return module.__dict__.get(_UNIT_ATTR)


def units_under(module: nn.Module) -> list[ParamGroup]:
    """The units in ``module``'s subtree (itself included), in module order."""
    group = module.__dict__.get(_UNIT_ATTR)
    root = group.root if group is not None else None
    if root is not None and root.root is group and root.units_made == _UNITS_MADE[0]:
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

