"""``fshard.checkpoint.load``: check the model (and optimizer) against the manifest on every
rank, then read the shards, the optimizer state and this rank's extra state.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._errors import ProblemList
from fshard._materialize import allocate_for_load
from fshard._param import ParamSlot
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
from fshard._state_dict._optim_checks import OPTIMIZER_CLASS_KEY, STRICT_HINT
from fshard._unit._module_state_dict import as_dtensor
from fshard.checkpoint._manifest import (
    EXTRA_DIR,
    EXTRA_KEY,
    CheckpointError,
    decode,
    read_manifest,
    resolve,
    verify_files,
)
from fshard.checkpoint._ranks import raise_if_any_rank_failed, require_dist
from fshard.checkpoint._safe_read import safe_dcp_load
from fshard.transforms import Layout

logger = logging.getLogger("fshard")


def optim_template(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    desc: Mapping[str, Any],
    where: str,
    *,
    strict: bool,
) -> dict[str, dict[str, Any]]:
    """Empty tensors to load the saved optimizer state into, laid out like this run's params.

    With ``strict=False`` the state of parameters the optimizer does not hold is left out (not
    read); otherwise it is an error.
    """
    names = param_names(model_entries(model, where))
    by_name: dict[str, tuple[ParamSlot | None, torch.Tensor]] = {}
    on_device_step: set[str] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in names:
                name, slot = names[id(p)]
                by_name[name] = (slot, p)
                if group.get("capturable") or group.get("fused"):
                    on_device_step.add(name)
    problems = ProblemList(where)
    out: dict[str, dict[str, Any]] = {}
    for name, entries in desc["state"].items():
        if name not in by_name:
            if strict:
                problems.add(
                    f"the checkpoint has optimizer state for {name!r}, which the optimizer does "
                    "not hold"
                )
            continue
        slot, param = by_name[name]
        per: dict[str, Any] = {}
        for key, d in entries.items():
            if d["kind"] == "object":
                per[key] = None
                continue
            dtype = getattr(torch, d["dtype"])
            shape = tuple(d["shape"])
            if key == "step" and name not in on_device_step:
                # As torch's optimizers keep it: on the CPU unless capturable or fused (a step
                # on the GPU costs two host syncs per parameter and step). Also the step of a
                # 0-d parameter, shaped like it and so saved as its (replicated) shard.
                per[key] = torch.empty(shape, dtype=dtype, device="cpu")
            elif d["kind"] == "sharded" and slot is not None:
                if shape != tuple(slot.layout.full_shape):
                    problems.add(
                        f"optimizer state {name!r}[{key!r}]: shape mismatch, the checkpoint has "
                        f"{list(shape)} but the parameter has {list(slot.layout.full_shape)}"
                    )
                    continue
                local = torch.empty(slot.layout.local_shape, dtype=dtype, device=param.device)
                per[key] = as_dtensor(slot, local)
            else:
                per[key] = torch.empty(shape, dtype=dtype, device=param.device)
        out[name] = per
    problems.raise_if_any(ValueError, hint=STRICT_HINT if strict else "")
    return out


def _optim_to_load(desc: Mapping[str, Any], state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The name-keyed optimizer state dict of a checkpoint, for ``load_optim``."""
    osd: dict[str, Any] = {"state": state, "param_groups": decode(desc["param_groups"], None)}
    if desc.get("class") is not None:  # checkpoints of older fshard versions do not record it
        osd[OPTIMIZER_CLASS_KEY] = desc["class"]
    return osd


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
) -> Any:
    """Load a checkpoint written by ``save`` into a sharded ``model`` (and ``optimizer``).

    Collective. Works at any world size and mesh shape (each rank reads the byte ranges of its
    own shards). Returns this rank's ``extra`` (a rank that did not exist when saving gets rank
    0's). Missing or unexpected keys and shape mismatches are errors naming the keys;
    ``verify`` checks every file's size and CRC32 first, so a truncated or corrupted file is an
    error naming it. The optimizer must be of the class that saved the state (an error names
    both classes otherwise). Keys, shapes and the optimizer class are all checked before
    anything is loaded.

    ``strict=False`` (for a model that gained or lost parameters) loads the keys both sides
    have, for the model and the optimizer alike: the optimizer state of parameters both sides
    hold is loaded, a parameter the checkpoint lacks keeps its current (fresh) optimizer state,
    and each of the optimizer's param groups takes the hyperparameters of the saved group that
    holds its parameters (see ``fshard.load_optim_state_dict``). Shape mismatches are errors
    either way.

    A model built on the meta device (on some ranks or all) and sharded needs no
    ``fshard.materialize``: each rank allocates only its own shards, which the load fills (see
    ``fshard.load_state_dict``).

    Example:
        >>> extra = fshard.checkpoint.load("runs/step-100", model, opt)  # doctest: +SKIP
        >>> start = extra["step"] + 1                                    # doctest: +SKIP
    """
    where = "fshard.checkpoint.load"
    require_dist(where)
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()
    given, root, manifest = _find_on_rank0(path)
    if verify:
        verify_files(root, manifest, distributed=True)

    # Every rank checks its model against the manifest, and all raise if one finds a problem
    # (a rank that built another model would otherwise wait in DCP's load for the others).
    with ranks_agree(root_info(model, where), where):
        if path != given:  # a rank in the name: rank 0's checkpoint would load everywhere
            raise ValueError(
                f"every rank must pass the same path: rank 0 passed {given!r}, rank {rank} "
                f"passed {path!r}"
            )
        model_sd = _model_template(
            model, manifest, f"{where}({root})", strict=strict, optimizer=optimizer is not None
        )
        to_load: dict[str, Any] = {"model": model_sd}
        optim_desc = manifest.get("optimizer") if optimizer is not None else None
        optim_loader = None
        if optimizer is not None and optim_desc is not None:
            to_load["optim"] = optim_template(model, optimizer, optim_desc, where, strict=strict)
            # The template tensors are ours alone: no copy needed.
            optim_loader = functools.partial(
                load_optim, model, optimizer, copy=False, strict=strict, where=f"{where}({root})"
            )
    if optim_loader is not None and optim_desc is not None:
        # Keys, shapes and the class, before anything is read (the ranks agree in there).
        optim_loader(_optim_to_load(optim_desc, to_load["optim"]), check_only=True)
    if allocate_for_load(model):  # the templates above hold meta tensors: make them again
        model_sd = state_dict(model)
        to_load["model"] = {k: model_sd[k] for k in to_load["model"]}
        if optimizer is not None and optim_desc is not None:
            to_load["optim"] = optim_template(model, optimizer, optim_desc, where, strict=strict)
    safe_dcp_load(to_load, root, no_dist=False)
    load_state_dict(model, to_load["model"], strict=False)
    if optim_loader is not None and optim_desc is not None:
        optim_loader(_optim_to_load(optim_desc, to_load["optim"]))
    extra, error = None, None
    try:
        extra = _read_extra(root, manifest, rank)
    except CheckpointError as exc:
        error = str(exc)
    raise_if_any_rank_failed(error, where, "checkpoint.load")
    return extra


def _find_on_rank0(path: str) -> tuple[str, str, dict[str, Any]]:
    """Rank 0's ``path``, the checkpoint it resolves to and its manifest, on every rank (rank
    0's error, if it found none, raised on every rank)."""
    found: tuple[str, str, dict[str, Any]] | str
    if dist.get_rank() == 0:
        try:
            resolved = resolve(path)
            found = (path, resolved, read_manifest(resolved))
        except CheckpointError as exc:
            found = str(exc)
    else:
        found = ""
    found = _collectives.broadcast_objects(found, 0, None, label="checkpoint.load")
    if isinstance(found, str):
        raise CheckpointError(found)
    return found


def _model_template(
    model: nn.Module, manifest: Mapping[str, Any], where: str, *, strict: bool, optimizer: bool
) -> dict[str, Any]:
    """The entries of ``fshard.state_dict(model)`` to read the checkpoint into (in place), after
    checking the model's keys and shapes against the manifest (and that it has optimizer state
    if ``optimizer``: one is to be loaded)."""
    saved = Layout.from_json(manifest["model"])
    entries = model_entries(model, where)
    model_sd = state_dict(model)
    problems = ProblemList(where)
    tensor_keys = [e.key for e in entries if isinstance(e.value, torch.Tensor)]
    # Modules' extra state (``get_extra_state``): saved through DCP, read back without
    # arbitrary unpickling ([Note: no unpickling]).
    saved_keys = set(manifest.get("model_keys", saved))
    object_keys = [k for k in model_sd if not isinstance(model_sd[k], torch.Tensor)]
    missing = [k for k in tensor_keys if k not in saved]
    missing += [k for k in object_keys if k not in saved_keys]
    unexpected = [k for k in saved if k not in model_sd]
    unexpected += [k for k in saved_keys if k not in saved and k not in model_sd]
    if strict and missing:
        problems.add(f"the checkpoint lacks key(s) the model has: {missing}")
    if strict and unexpected:
        problems.add(f"the checkpoint has key(s) the model lacks: {unexpected}")
    for key in tensor_keys:
        if key in saved and tuple(model_sd[key].shape) != saved[key].full_shape:
            problems.add(
                f"key {key!r}: shape mismatch, the checkpoint has {list(saved[key].full_shape)} "
                f"but the model has {list(model_sd[key].shape)}"
            )
    if optimizer and manifest.get("optimizer") is None:
        problems.add("an optimizer was passed but the checkpoint has no optimizer state")
    # A model built on the meta device: [Note: loading into a meta model].
    problems.extend(unfilled_meta_problems(meta_tensors(entries), saved_keys))
    problems.extend(non_persistent_meta_problems(model))
    problems.raise_if_any(
        ValueError, hint="Load into the same model architecture, or pass strict=False."
    )
    return {
        k: v for k, v in model_sd.items() if k in saved or (k in object_keys and k in saved_keys)
    }


def _read_extra(root: str, manifest: Mapping[str, Any], rank: int) -> Any:
    from safetensors import safe_open

    source = rank if rank < int(manifest.get("extra_ranks", 0)) else 0
    if source != rank:
        logger.warning(
            "fshard.checkpoint: rank %d did not exist when %s was saved; it gets rank 0's extra",
            rank,
            root,
        )
    path = os.path.join(root, EXTRA_DIR, f"rank-{source:05d}.safetensors")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return decode(json.loads(meta[EXTRA_KEY]), tensors)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint extra-state file {path} is missing") from None
    except CheckpointError:
        raise
    except Exception as exc:  # re-raised naming the file
        raise CheckpointError(
            f"checkpoint extra-state file {path} is corrupted ({type(exc).__name__}: {exc})"
        ) from None
