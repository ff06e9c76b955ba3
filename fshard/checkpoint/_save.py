"""``fshard.checkpoint.save``: each rank's shards through DCP, the extra state, the manifest,
then the atomic swap into place ([Note: atomic checkpoints] in ``fshard.checkpoint``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._config import StateDictType, config_of
from fshard._mesh import src_rank
from fshard._state_dict._common import gather_full, model_entries, plain_value, root_info
from fshard._state_dict._model import layout_of, state_dict
from fshard._state_dict._optim import optim_state
from fshard._state_dict._optim_checks import OPTIMIZER_CLASS_KEY
from fshard._unit._module_state_dict import local_shard
from fshard.checkpoint._manifest import (
    EXTRA_DIR,
    EXTRA_KEY,
    FORMAT,
    FULL,
    FULL_MODEL_FILE,
    MANIFEST,
    SHARDED,
    VERSION,
    CheckpointError,
    crc32,
    encode,
    fsync_dir,
    is_swap_sibling,
    list_files,
    manifest_bytes,
    read_manifest,
    write_durable,
)
from fshard.checkpoint._ranks import raise_if_any_rank_failed, require_dist
from fshard.checkpoint._safetensors import StreamWriter, TensorSpec, unstorable
from fshard.transforms import Layout

logger = logging.getLogger("fshard")


def _optim_manifest(model: nn.Module, osd: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for name, entries in osd["state"].items():
        described = {}
        for key, value in entries.items():
            if isinstance(value, DTensor):
                described[key] = {
                    "kind": "sharded",
                    "shape": list(value.shape),
                    "dtype": str(value.dtype).removeprefix("torch."),
                }
            elif isinstance(value, torch.Tensor):
                described[key] = {
                    "kind": "tensor",
                    "shape": list(value.shape),
                    "dtype": str(value.dtype).removeprefix("torch."),
                }
            else:
                described[key] = {"kind": "object"}
        state[name] = described
    return {
        "class": osd.get(OPTIMIZER_CLASS_KEY),
        "param_groups": encode(list(osd["param_groups"]), "optimizer param_groups", None),
        "state": state,
    }


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    state_dict_type: StateDictType | str | None = None,
) -> None:
    """Save a checkpoint of ``model`` (and ``optimizer``, and ``extra``) at ``path``.

    Collective: every rank calls it. Each rank writes only its shards through DCP; the write is
    atomic (written to a temporary sibling directory, then renamed), so a crash leaves the
    previous checkpoint at ``path`` loadable, and a failed save removes its partial copy. ``path``
    must be new, an empty directory or an fshard checkpoint (whose files are replaced; files
    you added to it, a ``config.json`` or a tokenizer, are kept); anything else is refused.
    Buffers are saved from rank 0. ``extra`` is per-rank user state: JSON-like
    values (None, bool, int, float, str, lists, tuples, dicts) and tensors, e.g.
    ``{"step": 100, "rng": torch.get_rng_state()}``; ``load`` gives each rank back what it saved.

    ``state_dict_type`` (``"SHARDED_STATE_DICT"``, ``"FULL_STATE_DICT"``, or the
    ``StateDictType`` enum that ``fshard.config_of(model).state_dict_type`` holds) picks how the
    model is written; ``None`` follows the model's ``fsdp_state_dict_type`` (from
    ``from_config``), and a model without a config is saved sharded. SHARDED_STATE_DICT: each rank writes its shards. FULL_STATE_DICT:
    the model's tensors go to ``path/model.safetensors``, written by rank 0 as they are gathered,
    one parameter at a time (no rank holds more than one full parameter); the optimizer and
    ``extra`` are saved sharded either way. ``load`` and ``consolidate`` read both.

    Example:
        >>> fshard.checkpoint.save("runs/step-100", model, opt, extra={"step": 100})  # doctest: +SKIP
        >>> fshard.checkpoint.save("runs/final", model, state_dict_type="FULL_STATE_DICT")  # doctest: +SKIP
    """
    where = "fshard.checkpoint.save"
    require_dist(where)
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_json = ""
    error = None
    try:
        extra_json = json.dumps(encode(extra, "extra", extra_tensors))
    except TypeError as exc:
        error = str(exc)
    except Exception as exc:  # agreed on below, so no rank is left waiting
        error = f"extra cannot be stored ({type(exc).__name__}: {exc})"
    raise_if_any_rank_failed(error, where, "checkpoint.save", TypeError)
    kind = saved_as(model, state_dict_type, where)
    layout = layout_of(model)
    sd: dict[str, Any] = {"model": state_dict(model)}
    model_keys = list(sd["model"])
    if kind == FULL:
        # The tensors go to model.safetensors; modules' extra state (objects) through DCP.
        sd["model"] = {k: v for k, v in sd["model"].items() if not isinstance(v, torch.Tensor)}
    optim_desc = None
    if optimizer is not None:
        # What the optimizer holds: before its first step, nothing (the resumed run's first
        # step starts its state as this one's would).
        osd = optim_state(model, optimizer, full=False, rank0_only=False, placeholder=False)
        sd["optim"] = osd["state"]
        optim_desc = _optim_manifest(model, osd)

    if rank != 0:
        # Buffers (and ignored params) are plain tensors each rank holds whole, not always
        # alike (BatchNorm statistics): rank 0's are saved, as full_state_dict gives them.
        # Left to DCP, it would spread the duplicates over the ranks to balance the writes.
        sd = _without_plain_tensors(sd)
    token, chosen, chosen_kind = _collectives.broadcast_objects(
        (uuid.uuid4().hex[:12], path, kind) if rank == 0 else None, 0, None, label="checkpoint.save"
    )
    tmp = f"{path}.tmp-{token}"
    error = _first_unloadable(sd, "")
    if error is None and kind == FULL:
        error = _unstorable_problem(layout)
    if error is None and path != chosen:  # a timestamp or a rank in the name: each rank would write its own part
        error = (
            f"every rank must pass the same path: rank 0 passed {chosen!r}, rank {rank} "
            f"passed {path!r}"
        )
    elif error is None and kind != chosen_kind:
        error = (
            f"every rank must save the same state_dict_type: rank 0 saves {chosen_kind}, rank "
            f"{rank} {kind}"
        )
    elif error is None and rank == 0:
        error = _target_problem(path)
        if error is None:
            try:
                os.makedirs(os.path.join(tmp, EXTRA_DIR))
            except OSError as exc:
                error = f"cannot create {tmp}: {exc}"
    try:
        raise_if_any_rank_failed(error, where, "checkpoint.save")
    except CheckpointError:
        if rank == 0:  # another rank's problem: nothing is written, the new directory goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _write_and_publish(
            sd, tmp, path, token, extra_tensors, extra_json, layout, optim_desc,
            model=model if kind == FULL else None, model_keys=model_keys,
        )
    except BaseException:
        # Every rank has stopped writing (each failure in there is agreed on). Not once the
        # swap moved the previous checkpoint aside: then this one is what loading recovers.
        if rank == 0 and not os.path.lexists(f"{path}.old-{token}"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("fshard: saved checkpoint %s (%s)", path, kind)


def saved_as(model: nn.Module, state_dict_type: StateDictType | str | None, where: str) -> str:
    """``SHARDED`` or ``FULL``: the keyword if given, else the model's config, else SHARDED."""
    if state_dict_type is None:
        config = config_of(model)
        state_dict_type = config.state_dict_type if config is not None else SHARDED
    name = state_dict_type.value if isinstance(state_dict_type, StateDictType) else state_dict_type
    if name not in (SHARDED, FULL):
        raise ValueError(
            f"{where}: state_dict_type={state_dict_type!r}; expected 'SHARDED_STATE_DICT', "
            "'FULL_STATE_DICT' (or fshard.StateDictType), or None to follow the model's config"
        )
    return str(name)


def _unstorable_problem(layout: Layout) -> str | None:
    specs = [TensorSpec(k, e.torch_dtype, tuple(e.full_shape)) for k, e in layout.items()]
    bad = unstorable(specs)
    if not bad:
        return None
    what = "; ".join(f"{dtype} ({', '.join(map(repr, keys))})" for dtype, keys in bad.items())
    return (
        f"FULL_STATE_DICT writes {FULL_MODEL_FILE}, and safetensors cannot store {what}; save "
        "with state_dict_type='SHARDED_STATE_DICT'"
    )


def _write_full_model(model: nn.Module, layout: Layout, path: str) -> str | None:
    """Gather the model one parameter at a time and write it to ``path`` from the mesh's rank 0
    ([Note: streamed safetensors]). Collective; returns this rank's problem, if any.

    Every rank takes part in every gather even once the writer failed (a full disk), so that
    none is left waiting; the failure is reported after the last one.
    """
    where = "fshard.checkpoint.save"
    writes = dist.get_rank() == src_rank(root_info(model, where))
    entries = [e for e in model_entries(model, where) if e.key in layout]
    writer = None
    error = None
    if writes:
        specs = [TensorSpec(e.key, layout[e.key].torch_dtype, tuple(layout[e.key].full_shape)) for e in entries]
        try:
            writer = StreamWriter(path, specs, {"format": "pt"})
        except OSError as exc:
            error = f"cannot write {path}: {exc}"
    for e in entries:
        if e.slot is not None:
            full = gather_full(e.slot, local_shard(e.slot), rank0_only=True, label=f"checkpoint.save({e.key})")
        else:
            full = plain_value(e.value) if writes else None
        if writer is not None and error is None and full is not None:
            try:
                writer.write(e.key, full)
            except (OSError, ValueError) as exc:
                error = f"writing {path}: {type(exc).__name__}: {exc}"
        del full  # one full parameter at a time
    if writer is not None:
        try:
            writer.close()
        except (OSError, ValueError) as exc:
            error = error or f"writing {path}: {type(exc).__name__}: {exc}"
    return error


def _first_unloadable(tree: Any, key: str) -> str | None:
    """A problem naming the first value of ``tree`` that DCP would pickle (not a tensor, nor a
    plain number or string) and ``load`` would refuse to read back, None if there is none:
    ``load`` reads such values with ``torch.load(weights_only=True)``, so a checkpoint holding
    one (a module's extra state with a numpy array) would be saved, and never load."""
    if isinstance(tree, Mapping):
        for name, value in tree.items():
            found = _first_unloadable(value, f"{key}.{name}" if key else str(name))
            if found is not None:
                return found
        return None
    if isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            found = _first_unloadable(value, f"{key}[{i}]")
            if found is not None:
                return found
        return None
    if tree is None or isinstance(tree, (torch.Tensor, bool, int, float, str)):
        return None
    buffer = io.BytesIO()
    try:
        torch.save(tree, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # any failure: this value cannot come back
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # torch's weights_only refusal: its reason is on the line naming the unpickler.
        reasons = [line.split("error:", 1)[1].strip() for line in lines if "Unpickler error:" in line]
        first_line = (reasons or lines or [type(exc).__name__])[0]
        hint = " from get_extra_state" if "_extra_state" in key else ""
        return (
            f"{key!r} is a {type(tree).__name__}, which load could not read back (it reads "
            f"values that are not tensors with torch.load(weights_only=True): {first_line}); "
            f"return tensors, numbers, strings, lists or dicts{hint} (torch.from_numpy for "
            "a numpy array)"
        )
    return None


def _without_plain_tensors(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _without_plain_tensors(v) for k, v in tree.items() if not _is_plain_tensor(v)}
    return tree


def _is_plain_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _target_problem(path: str) -> str | None:
    """Why ``path`` cannot take a checkpoint: a save replaces only a checkpoint it wrote (or
    an empty directory), never a user's files."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        return f"{path} is a symbolic link; save to the directory it points to, or to a new path"
    if not os.path.isdir(path):
        return f"{path} exists and is not a directory; save to a new path or remove it"
    if os.listdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        return (
            f"{path} exists and is not an fshard checkpoint (it has files but no {MANIFEST}); "
            "a save replaces only a checkpoint: save to a new path or remove it"
        )
    return None


def _write_and_publish(
    sd: dict[str, Any],
    tmp: str,
    path: str,
    token: str,
    extra_tensors: dict[str, torch.Tensor],
    extra_json: str,
    layout: Layout,
    optim_desc: dict[str, Any] | None,
    *,
    model: nn.Module | None,
    model_keys: list[str],
) -> None:
    """``save`` from the temporary directory on: the shards, the full model (FULL_STATE_DICT:
    ``model`` is given), the extra state, the manifest, then the swap into ``path``."""
    where = "fshard.checkpoint.save"
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        dcp_save(sd, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except (Exception, CheckpointException) as exc:  # on every rank when one fails to write
        # (DCP's CheckpointException derives from BaseException.)
        raise CheckpointError(f"{where}: writing the shards to {tmp} failed: {exc}") from exc
    if model is not None:
        error = _write_full_model(model, layout, os.path.join(tmp, FULL_MODEL_FILE))
        raise_if_any_rank_failed(error, where, "checkpoint.save")

    error = None
    try:
        from safetensors.torch import save_file

        extra_path = os.path.join(tmp, EXTRA_DIR, f"rank-{rank:05d}.safetensors")
        save_file(extra_tensors, extra_path, metadata={EXTRA_KEY: extra_json})
        with open(extra_path, "rb") as f:
            os.fsync(f.fileno())
    except Exception as exc:  # reported on every rank below
        error = f"writing extra state: {type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(error, where, "checkpoint.save")

    # Every rank checksums a share of the files ([Note: no unpickling]).
    names = _collectives.broadcast_objects(
        list_files(tmp) if rank == 0 else None, 0, None, label="checkpoint.save"
    )
    mine = {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "crc32": crc32(os.path.join(tmp, rel))} for rel in names[rank::world]}
    files: dict[str, Any] = {}
    for part in _collectives.all_gather_objects_by_rank(mine, None, label="checkpoint.save"):
        files.update(part)

    error = None
    if rank == 0:
        try:
            body = {
                "format": FORMAT,
                "version": VERSION,
                "created": time.time(),
                "world_size": world,
                "model": layout.to_json(),
                "model_keys": model_keys,
                "state_dict_type": FULL if model is not None else SHARDED,
                "optimizer": optim_desc,
                "extra_ranks": world,
                "files": files,
                "torch": torch.__version__,
            }
            write_durable(os.path.join(tmp, MANIFEST), manifest_bytes(body))
            fsync_dir(tmp)
            _publish(tmp, path, token)
        except Exception as exc:  # reported on every rank below
            error = f"committing {tmp} to {path}: {type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(error, where, "checkpoint.save")


def _publish(tmp: str, path: str, token: str) -> None:
    """Swap the finished ``tmp`` into ``path`` ([Note: atomic checkpoints]).

    The checkpoint it replaces goes, but not what the user put beside fshard's files (a
    ``config.json``, a tokenizer: the Hugging Face habit of one ``ckpt/last`` directory): those
    move into the new checkpoint first, from it or from one a crash left mid-swap.
    """
    parent, base = os.path.split(path)
    replaced = f"{base}.old-{token}"
    if os.path.lexists(path):
        os.rename(path, os.path.join(parent, replaced))
    os.rename(tmp, path)
    fsync_dir(parent)
    # The replaced one first (its user files are the newest), then leftovers of interrupted
    # saves; a .tmp- directory is only ever fshard's writing, an .old- one was ``path``.
    siblings = sorted(
        (name for name in os.listdir(parent) if is_swap_sibling(name, base)),
        key=lambda name: name != replaced,
    )
    for name in siblings:
        sibling = os.path.join(parent, name)
        if ".tmp-" in name[len(base) :] or _carry_user_files(sibling, path):
            shutil.rmtree(sibling, ignore_errors=True)


# The files fshard.checkpoint.save writes (DCP's index and data, the per-rank extra state).
_OWN_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp|extra/rank-\d+\.safetensors")


def _carry_user_files(old: str, new: str) -> bool:
    """Move every file and directory in checkpoint ``old`` that fshard did not write into the
    same place in ``new``, unless ``new`` has it already (fshard's file, or the user's from a
    newer checkpoint). False, with a warning, if something could not be moved: then ``old``
    must stay."""
    try:
        owned = set(read_manifest(old).get("files", {}))
    except CheckpointError:
        owned = set()

    def is_owned(rel: str) -> bool:
        posix = rel.replace(os.sep, "/")
        return rel == MANIFEST or rel in owned or _OWN_FILE.fullmatch(posix) is not None

    complete = True

    def carry(rel_dir: str) -> None:
        nonlocal complete
        for name in sorted(os.listdir(os.path.join(old, rel_dir))):
            rel = os.path.join(rel_dir, name)
            src, dst = os.path.join(old, rel), os.path.join(new, rel)
            if is_owned(rel):
                continue
            if os.path.isdir(src) and not os.path.islink(src) and os.path.isdir(dst):
                carry(rel)  # a directory both have (extra/): what the user added inside it
                continue
            if os.path.lexists(dst):
                logger.debug("fshard.checkpoint.save: %s is in the new checkpoint already", rel)
                continue
            try:
                os.rename(src, dst)
            except OSError as exc:
                complete = False
                logger.warning(
                    "fshard.checkpoint.save: could not keep %s in the new checkpoint (%s); the "
                    "replaced checkpoint stays at %s",
                    rel,
                    exc,
                    old,
                )

    try:
        carry("")
    except OSError as exc:
        logger.warning("fshard.checkpoint.save: could not read %s (%s); it stays", old, exc)
        return False
    return complete
