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
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._errors import ProblemList
from fshard._materialize import allocate_for_load
from fshard._state_dict._common import (
    meta_tensors,
    model_entries,
    non_persistent_meta_problems,
    ranks_agree,
    root_info,
    unfilled_meta_problems,
)
from fshard._state_dict._model import load_state_dict, state_dict
from fshard._state_dict._optim import load_optim
from fshard._state_dict._optim_checks import OPTIMIZER_CLASS_KEY
from fshard.checkpoint._manifest import (
    EXTRA_DIR,
    EXTRA_KEY,
    FULL,
    FULL_MODEL_FILE,
    CheckpointError,
    decode,
    read_manifest,
    resolve,
    verify_files,
)
from fshard.checkpoint._plain import Stored, is_plain_dcp, load_plain, summary
from fshard.checkpoint._ranks import raise_if_any_rank_failed, require_dist
from fshard.checkpoint._safe_read import safe_dcp_load
from fshard.checkpoint._templates import optim_template as optim_template
from fshard.transforms import Layout

logger = logging.getLogger("fshard")


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
    """Load a checkpoint written by ``save`` (or a plain DCP directory) into a sharded
    ``model`` (and ``optimizer``).

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

    Both of ``save``'s forms load (the manifest says which): SHARDED_STATE_DICT, and
    FULL_STATE_DICT, whose ``model.safetensors`` each rank reads only its own rows of. A DCP
    directory written without fshard (no manifest; FSDP2's ``dcp.save(model.state_dict())``, or
    ``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``; the
    optimizer under ``"optim"`` or ``"optimizer"``) loads too, at any world size, and returns
    ``None`` (it has no ``extra``); see [Note: plain DCP checkpoints] in ``_plain``.

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
    found = _find_on_rank0(path)
    if len(found) == 2:  # a plain DCP directory: [Note: plain DCP checkpoints]
        given, stored = found
        if path != given:
            raise ValueError(
                f"every rank must pass the same path: rank 0 passed {given!r}, rank {rank} "
                f"passed {path!r}"
            )
        load_plain(given, stored, model, optimizer, strict=strict)
        return None
    given, root, manifest = found
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
    model_template = to_load["model"]
    if manifest.get("state_dict_type") == FULL:
        # The tensors are in model.safetensors; DCP holds the modules' extra state only.
        tensors = {k: v for k, v in model_template.items() if isinstance(v, torch.Tensor)}
        error = read_full_model(os.path.join(root, FULL_MODEL_FILE), tensors)
        raise_if_any_rank_failed(error, where, "checkpoint.load")
        to_load["model"] = {k: v for k, v in model_template.items() if k not in tensors}
    safe_dcp_load(to_load, root, no_dist=False)
    model_template.update(to_load["model"])
    load_state_dict(model, model_template, strict=False)
    if optim_loader is not None and optim_desc is not None:
        optim_loader(_optim_to_load(optim_desc, to_load["optim"]))
    extra, error = None, None
    try:
        extra = _read_extra(root, manifest, rank)
    except CheckpointError as exc:
        error = str(exc)
    raise_if_any_rank_failed(error, where, "checkpoint.load")
    return extra


def read_full_model(path: str, template: Mapping[str, torch.Tensor]) -> str | None:
    """Fill ``template`` (``fshard.state_dict``'s tensors) in place from a FULL_STATE_DICT
    checkpoint's safetensors file: each rank reads only the rows of its own shards (the file is
    memory-mapped). Returns this rank's problem, if any (the caller has the ranks agree)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            have = set(f.keys())
            missing = [k for k in template if k not in have]
            if missing:
                return f"{path} lacks key(s) {missing}"
            for key, value in template.items():
                if isinstance(value, DTensor):
                    local = value.to_local()
                    chunks = value.__create_chunk_list__()
                    if len(chunks) != 1:
                        return f"{key!r}: {len(chunks)} chunks on one rank, expected 1"
                    offsets, sizes = chunks[0].offsets, chunks[0].sizes
                else:
                    local = value
                    offsets, sizes = torch.Size([0] * value.dim()), value.shape
                if local.numel() == 0:
                    continue
                if local.dim() == 0:
                    piece = f.get_tensor(key)
                else:
                    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
                    piece = f.get_slice(key)[index]
                if tuple(piece.shape) != tuple(local.shape):
                    return (
                        f"{path}: {key!r} gave a piece of shape {list(piece.shape)}, this rank "
                        f"holds {list(local.shape)}"
                    )
                with torch.no_grad():
                    local.copy_(piece)
                del piece
    except FileNotFoundError:
        return f"checkpoint model file {path} is missing"
    except Exception as exc:  # any read failure names the file
        return f"checkpoint model file {path} is corrupted ({type(exc).__name__}: {exc})"
    return None


def _find_on_rank0(
    path: str,
) -> tuple[str, str, dict[str, Any]] | tuple[str, dict[str, Stored]]:
    """Rank 0's ``path``, the checkpoint it resolves to and its manifest, on every rank (rank
    0's error, if it found none, raised on every rank); for a plain DCP directory, rank 0's
    ``path`` and the summary of its keys."""
    found: tuple[str, str, dict[str, Any]] | tuple[str, dict[str, Stored]] | str
    if dist.get_rank() == 0:
        try:
            if is_plain_dcp(path):
                found = (path, summary(path))
            else:
                resolved = resolve(path)
                found = (path, resolved, read_manifest(resolved))
        except CheckpointError as exc:
            found = str(exc)
            if os.path.isdir(path) and not os.path.exists(os.path.join(path, ".metadata")):
                found += " (nor is it a DCP checkpoint: it has no .metadata)"
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
