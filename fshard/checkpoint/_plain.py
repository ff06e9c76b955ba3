"""Loading a plain DCP directory, written without fshard (no manifest): FSDP2's checkpoints.

[Note: plain DCP checkpoints]
A user moving from FSDP2 has directories written by ``dcp.save(model.state_dict(), ...)`` (the
model's keys at the top level) or ``dcp.save({"model": get_model_state_dict(m), "optim":
get_optimizer_state_dict(m, opt)}, ...)`` (under ``"model"``; the optimizer, keyed by parameter
FQN, under ``"optim"`` or ``"optimizer"``). DCP's metadata says which: its ``planner_data`` maps
every stored key to its path in the saved tree (``("optim", "state", "fc.weight", "exp_avg")``),
so FQNs with dots are never guessed at. Rank 0 reads it (with the restricted unpickler) and sends
each rank the summary; the ranks check the model against it (keys and shapes) and agree before
anything is read. The model is read into ``fshard.state_dict(model)``'s DTensors (DCP reshards
from any world size) and loaded with ``fshard.load_state_dict``; the optimizer is read into
templates laid out like this run's shards and loaded as ``fshard.load_optim_state_dict`` does.
There is no ``extra``: ``load`` returns ``None``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fshard._errors import ProblemList
from fshard._materialize import allocate_for_load
from fshard._state_dict._common import (
    meta_tensors,
    model_entries,
    non_persistent_meta_problems,
    param_names,
    ranks_agree,
    root_info,
    unfilled_meta_problems,
)
from fshard._state_dict._model import load_state_dict, state_dict
from fshard._state_dict._optim import load_optim
from fshard.checkpoint._manifest import EXTRA_DIR, MANIFEST, SWAP_SIBLING
from fshard.checkpoint._safe_read import read_metadata, safe_dcp_load
from fshard.checkpoint._templates import optim_template

# The keys an optimizer state dict may be saved under, as torch's examples and recipes use.
OPTIM_ROOTS = ("optim", "optimizer")


class Stored(NamedTuple):
    """One stored key of a DCP checkpoint: its path in the saved tree, and for a tensor its
    full shape and dtype (``None`` for a pickled value)."""

    path: tuple[str | int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None


def is_plain_dcp(path: str) -> bool:
    """A DCP directory that fshard did not write (an fshard one lacking its manifest, a crash's
    leftover, is not: that is an incomplete checkpoint)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return False
    if os.path.exists(os.path.join(path, MANIFEST)) or os.path.isdir(os.path.join(path, EXTRA_DIR)):
        return False
    return SWAP_SIBLING.fullmatch(os.path.basename(path)) is None


def summary(root: str) -> dict[str, Stored]:
    """Every stored key of the DCP checkpoint at ``root`` (read safely, on one rank)."""
    metadata = read_metadata(root)
    paths: Mapping[str, Any] = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(paths.get(key, (key,)))
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            out[key] = Stored(path, tuple(md.size), dtype)
        else:
            out[key] = Stored(path, None, None)
    return out


def model_root(stored: Mapping[str, Stored], model_keys: list[str]) -> tuple[str, ...]:
    """Where the model's keys are: ``()`` (top level) or ``("model",)``, whichever holds more of
    them (the top level on a tie). Pure."""
    paths = {s.path for s in stored.values()}
    top = sum((k,) in paths for k in model_keys)
    nested = sum(("model", k) in paths for k in model_keys)
    return ("model",) if nested > top else ()


def _nest(tree: dict[Any, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= int(part):
                node.append({} if not isinstance(nxt, int) else [])
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= int(last):
            node.append(None)
        node[int(last)] = value
    else:
        node[last] = value


def load_plain(
    root: str,
    stored: Mapping[str, Stored],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strict: bool,
) -> None:
    """``fshard.checkpoint.load`` of a plain DCP directory ([Note: plain DCP checkpoints])."""
    where = f"fshard.checkpoint.load({root})"
    entries = model_entries(model, where)
    model_sd = state_dict(model)
    keys = list(model_sd)
    prefix = model_root(stored, keys)
    by_path = {s.path: s for s in stored.values()}
    optim_root = next((r for r in OPTIM_ROOTS if any(s.path[:2] == (r, "state") or s.path[:2] == (r, "param_groups") for s in stored.values())), None)
    with ranks_agree(root_info(model, where), where):
        problems = ProblemList(where)
        found = [k for k in keys if (*prefix, k) in by_path]
        missing = [k for k in keys if (*prefix, k) not in by_path]
        if not found:
            problems.add(
                f"{root} is a DCP checkpoint without fshard's {MANIFEST}, and none of the model's "
                f"keys are in it, neither at the top level nor under 'model' (it holds "
                f"{sorted({str(s.path[0]) for s in stored.values()})[:8]}); save the model's "
                "state_dict() at the top level or under 'model'"
            )
        elif strict and missing:
            problems.add(f"the DCP checkpoint {root} lacks key(s) the model has: {missing}")
        if strict and found:
            own = set(keys)
            unexpected = [
                ".".join(map(str, s.path[len(prefix) :]))
                for s in stored.values()
                if s.shape is not None
                and s.path[: len(prefix)] == prefix
                and (not prefix or len(s.path) == 2)
                and ".".join(map(str, s.path[len(prefix) :])) not in own
                and s.path[0] not in OPTIM_ROOTS
            ]
            if unexpected:
                problems.add(f"the DCP checkpoint {root} has key(s) the model lacks: {unexpected}")
        for k in found:
            s = by_path[(*prefix, k)]
            value = model_sd[k]
            if isinstance(value, torch.Tensor) and s.shape is not None and tuple(value.shape) != s.shape:
                problems.add(
                    f"key {k!r}: shape mismatch, the checkpoint has {list(s.shape)} but the model "
                    f"has {list(value.shape)}"
                )
        if optimizer is not None and optim_root is None:
            problems.add(
                f"an optimizer was passed but the DCP checkpoint {root} has no optimizer state "
                f"(under {' or '.join(map(repr, OPTIM_ROOTS))})"
            )
        problems.extend(unfilled_meta_problems(meta_tensors(entries), set(found)))
        problems.extend(non_persistent_meta_problems(model))
        problems.raise_if_any(ValueError, hint="Load into the same model architecture, or pass strict=False.")
    if allocate_for_load(model):  # the dict above holds meta tensors: make it again
        model_sd = state_dict(model)
    to_load: dict[Any, Any] = {}
    for k in found:
        _nest(to_load, (*prefix, k), model_sd[k])
    optim_state: dict[str, dict[str, Any]] = {}
    if optimizer is not None and optim_root is not None:
        optim_state = _optim_template(model, optimizer, stored, optim_root, where, strict=strict)
        for s in stored.values():
            if s.path[:2] == (optim_root, "param_groups"):
                _nest(to_load, s.path, None)
        for name, per in optim_state.items():
            for state_key, value in per.items():
                _nest(to_load, (optim_root, "state", name, state_key), value)
    safe_dcp_load(to_load, root, no_dist=False)
    loaded = to_load["model"] if prefix else to_load
    load_state_dict(model, {k: loaded[k] for k in found}, strict=False)
    if optimizer is not None and optim_root is not None:
        saved = to_load[optim_root]
        osd = {"state": saved.get("state", {}), "param_groups": saved.get("param_groups", [])}
        load_optim(model, optimizer, osd, copy=False, strict=strict, where=where)


def _optim_template(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stored: Mapping[str, Stored],
    optim_root: str,
    where: str,
    *,
    strict: bool,
) -> dict[str, dict[str, Any]]:
    """Tensors to read the saved optimizer state into: this rank's shard (a DTensor) of state
    shaped like its parameter, whole tensors otherwise (``step`` on the CPU, as torch keeps it);
    ``None`` for pickled values."""
    names = param_names(model_entries(model, where))
    full_shapes = {name: tuple(slot.layout.full_shape) for name, slot in names.values() if slot is not None}
    desc: dict[str, dict[str, dict[str, Any]]] = {}
    for s in stored.values():
        if s.path[:2] != (optim_root, "state") or len(s.path) != 4:
            continue
        name, state_key = str(s.path[2]), str(s.path[3])
        if s.shape is None:
            entry: dict[str, Any] = {"kind": "object"}
        else:
            sharded = len(s.shape) > 0 and full_shapes.get(name) == s.shape
            entry = {"kind": "sharded" if sharded else "tensor", "shape": list(s.shape), "dtype": s.dtype}
        desc.setdefault(name, {})[state_key] = entry
    return optim_template(model, optimizer, {"state": desc}, where, strict=strict)
