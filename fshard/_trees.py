"""Pytree helpers that also look inside dataclasses (no process group, no state)."""

from __future__ import annotations

import copy as copy_module
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree


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
