"""Sharded training checkpoints through ``torch.distributed.checkpoint`` (DCP).

``save(path, model, optimizer, extra)`` writes each rank's shards with DCP, ``load`` reads them
back at any world size or mesh shape (DCP reshards DTensors on read), ``consolidate`` turns a
checkpoint into one full state dict in a single process with no process group, and ``latest``
finds the newest complete checkpoint under a directory, for resuming after a crash.

A checkpoint is a directory::

    path/
      .metadata                 DCP's index (read with a restricted unpickler)
      __<rank>_<n>.distcp       DCP's data files (one per rank)
      extra/rank-<rank>.safetensors   each rank's ``extra`` (tensors + JSON, no pickle)
      fshard.json               the manifest: layout, optimizer groups, file sizes and CRCs

[Note: atomic checkpoints]
Every rank writes into ``path.tmp-<token>``; after a barrier rank 0 writes ``fshard.json`` last
(write, fsync, rename), then swaps the directory into place: an existing ``path`` is renamed to
``path.old-<token>``, ``path.tmp-<token>`` to ``path``, what the user added to the old one is
moved into the new one, and the old one is deleted. A crash at
any point leaves a loadable checkpoint: before the swap ``path`` is untouched; inside the swap
``load`` finds the complete ``.tmp-``/``.old-`` sibling (a directory is complete iff its manifest
exists and checks out). A directory without a manifest is refused with a clear message.

[Note: no unpickling]
Loading never unpickles arbitrary objects. DCP's ``.metadata`` is a pickle, so it is read with an
unpickler that only builds DCP's own dataclasses and enums, ``torch.Size`` and dtypes; tensor
data goes through ``torch.load(weights_only=True)`` (DCP's default) and any non-tensor value
through ``torch.load(weights_only=True)`` too (DCP's default would unpickle it freely).
``extra`` and optimizer hyperparameters are JSON, with tensors stored in safetensors files.
Every file's size and CRC32 are recorded in the manifest and checked before reading, so a
truncated or corrupted file is an error that names it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.futures import Future

from fshard import _collectives
from fshard._errors import ProblemList
from fshard._param import ParamSlot
from fshard._state_dict import (
    OPTIMIZER_CLASS_KEY,
    STRICT_HINT,
    _as_dtensor,
    _entries,
    _load_optim,
    _optim_state_dict,
    _param_names,
    _ranks_agree,
    _root_info,
    layout_of,
    load_state_dict,
    state_dict,
)
from fshard.transforms import Layout

__all__ = ["CheckpointError", "consolidate", "is_complete", "latest", "load", "save"]

logger = logging.getLogger("fshard")

MANIFEST = "fshard.json"
FORMAT = "fshard-checkpoint"
VERSION = 1
_EXTRA_DIR = "extra"
_EXTRA_KEY = "fshard_extra"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted; the message names the file.

    Example:
        >>> try:                                                  # doctest: +SKIP
        ...     fshard.checkpoint.load("runs/step-100", model)
        ... except fshard.checkpoint.CheckpointError as err:
        ...     print(err)  # e.g. names the truncated shard file
    """


# ------------------------------------------------------------------------------------ encoding
# `extra` and optimizer hyperparameters as tagged JSON: tuples, non-string-keyed dicts and
# tensors get a one-key object whose key starts with "__", which plain keys may not use.


# What safetensors stores natively; other dtypes go in as their bytes.
_SAFETENSORS_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16}
    | {torch.bfloat16, torch.float32, torch.float64, torch.complex64}
)


def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor] | None) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            raise TypeError(f"{where} is a DTensor; pass its local tensor or full_tensor()")
        if value.layout is not torch.strided:
            raise TypeError(f"{where} is a {value.layout} tensor; pass a dense one (.to_dense())")
        if value.device.type == "meta":
            raise TypeError(f"{where} is on the meta device, which holds no data")
        t = value.detach()
        if tensors is None:
            return {
                "__tensor_inline__": {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "data": t.cpu().reshape(-1).tolist(),
                    "device": str(t.device),
                }
            }
        name = f"t{len(tensors)}"
        t = t.cpu().contiguous().clone()
        if t.dtype in _SAFETENSORS_DTYPES:
            tensors[name] = t
            return {"__tensor__": name, "device": str(value.device)}
        # A dtype safetensors cannot store (complex128): its bytes, and what they were.
        tensors[name] = t.reshape(-1).view(torch.uint8)
        return {
            "__tensor__": name,
            "device": str(value.device),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        return {
            "__items__": [
                [_encode(k, f"{where} key {k!r}", tensors), _encode(v, f"{where}[{k!r}]", tensors)]
                for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: fshard.checkpoint "
        "stores None, bool, int, float, str, lists, tuples, dicts and torch tensors there (convert "
        "numpy scalars with float(...) or .item(), numpy arrays with torch.from_numpy, other "
        "objects to one of these)"
    )


def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"extra state names an unknown dtype {name!r}")
    return dtype


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cpu":
        return device
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is not None and available():
        # This process's device of that type: "cuda:3" when saving may be another rank's
        # GPU, or none, when loading at another world size.
        current = getattr(module, "current_device", None)
        return torch.device(device.type, current()) if callable(current) else device
    return torch.device("cpu")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor] | None) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if len(value) == 1 and "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    if len(value) == 1 and "__tensor_inline__" in value:
        spec = value["__tensor_inline__"]
        t = torch.tensor(spec["data"], dtype=_dtype_named(spec["dtype"])).reshape(spec["shape"])
        return t.to(_device(spec["device"]))
    if set(value) in ({"__tensor__", "device"}, {"__tensor__", "device", "dtype", "shape"}):
        if tensors is None or value["__tensor__"] not in tensors:
            raise CheckpointError(f"extra state refers to a missing tensor {value['__tensor__']!r}")
        t = tensors[value["__tensor__"]]
        if "dtype" in value:  # stored as bytes
            t = t.view(_dtype_named(value["dtype"])).reshape(value["shape"])
        return t.to(_device(value["device"]))
    return {k: _decode(v, tensors) for k, v in value.items()}


# ------------------------------------------------------------------------- files and manifest


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 22)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durable(path: str, data: bytes) -> None:
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _list_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name == MANIFEST:
                continue
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def _manifest_bytes(body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, indent=1).encode()


def _read_manifest(root: str) -> dict[str, Any]:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(
            f"{root} is not a complete fshard checkpoint: {MANIFEST} is missing (the save that "
            "wrote it did not finish, or the directory was not written by fshard.checkpoint.save)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint manifest {path}: {exc}") from None
    try:
        outer = json.loads(raw)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True)
        if zlib.crc32(text.encode()) != outer["crc32"]:
            raise ValueError("checksum mismatch")
        if body.get("format") != FORMAT:
            raise ValueError(f"format is {body.get('format')!r}, expected {FORMAT!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is corrupted ({exc})") from None
    if body.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path} was written by a newer fshard (format version {body['version']}, this one "
            f"reads up to {VERSION}); upgrade fshard"
        )
    return dict(body)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a checkpoint whose save finished (its manifest exists and is intact).

    Example:
        >>> fshard.checkpoint.is_complete("runs/step-100")   # doctest: +SKIP
        True
    """
    try:
        _read_manifest(os.fspath(path))
    except CheckpointError:
        return False
    return True


# The siblings a save leaves while swapping (``<base>.tmp-<token>``, ``<base>.old-<token>``,
# token: 12 hex digits): only these are fshard's to read back or delete.
_SWAP_SIBLING = re.compile(r"(?P<base>.+)\.(?:tmp|old)-[0-9a-f]{12}")


def _is_swap_sibling(name: str, base: str) -> bool:
    match = _SWAP_SIBLING.fullmatch(name)
    return match is not None and match["base"] == base


def _resolve(path: str) -> str:
    """``path`` if complete, else the newest complete sibling left by an interrupted swap."""
    if is_complete(path):
        return path
    parent, base = os.path.split(path)
    candidates = []
    try:
        names = os.listdir(parent or ".")
    except FileNotFoundError:
        names = []
    for name in names:
        if _is_swap_sibling(name, base):
            full = os.path.join(parent, name)
            if is_complete(full):
                candidates.append((_read_manifest(full).get("created", 0.0), full))
    if candidates:
        chosen = max(candidates)[1]
        logger.warning(
            "fshard.checkpoint: %s is missing or incomplete; using %s, left by a save that was "
            "interrupted while swapping it into place",
            path,
            chosen,
        )
        return chosen
    if os.path.isdir(path):
        _read_manifest(path)  # raises the "incomplete" error
    raise CheckpointError(f"no checkpoint at {path}")


def _check_files(root: str, files: Mapping[str, Any], names: list[str]) -> list[str]:
    problems = []
    for rel in names:
        want = files[rel]
        full = os.path.join(root, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            problems.append(f"{full} is missing")
            continue
        if size != want["size"]:
            problems.append(
                f"{full} is truncated or corrupted: {size} bytes, the manifest says {want['size']}"
            )
            continue
        if _crc32(full) != want["crc32"]:
            problems.append(f"{full} is corrupted: its CRC32 does not match the manifest")
    return problems


def _verify(root: str, manifest: Mapping[str, Any], *, distributed: bool) -> None:
    files = manifest.get("files", {})
    names = sorted(files)
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _check_files(root, files, names[rank::world])
        problems = [p for part in _all_gather(mine, "checkpoint.verify") for p in part]
    else:
        problems = _check_files(root, files, names)
    if problems:
        raise CheckpointError(
            "checkpoint files failed verification:\n  "
            + "\n  ".join(sorted(set(problems)))
            + "\nLoad an older checkpoint (fshard.checkpoint.latest finds the newest whose save "
            "finished; it does not check the files' CRCs, so pass an older one by name)."
        )


# --------------------------------------------------------------------------- safe DCP reading


_DCP_MODULE_PREFIX = "torch.distributed.checkpoint."
_SAFE_PATHS = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "tuple", "list", "dict"}


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata types; see [Note: no unpickling]."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_MODULE_PREFIX):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        elif module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        elif module == "pathlib" and name in _SAFE_PATHS:
            return super().find_class(module, name)
        elif module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)  # maps a layout's name to torch.strided & co
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class _SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that never unpickles freely and names the file it fails on."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None and kwargs.get("rank") is None:
            self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set when read
            return self._metadata
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _RestrictedUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint metadata file {path} is missing") from None
        except Exception as exc:  # any unpickling failure means a bad file
            raise CheckpointError(
                f"checkpoint metadata file {path} is truncated or corrupted ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint metadata file {path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            full = os.path.join(os.fspath(self.path), relative_path)
            end = max(
                self.storage_data[i.storage_index].offset + self.storage_data[i.storage_index].length
                for i in items
            )
            try:
                size = os.path.getsize(full)
            except OSError:
                raise CheckpointError(f"checkpoint data file {full} is missing") from None
            if size < end:
                raise CheckpointError(
                    f"checkpoint data file {full} is truncated: {size} bytes, needs at least {end}"
                )
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except _RefusedValue as exc:
                raise CheckpointError(f"checkpoint data file {full}: {exc}") from None
            except CheckpointError:
                raise
            except Exception as exc:  # re-raised naming the file
                raise CheckpointError(
                    f"checkpoint data file {full} is corrupted ({type(exc).__name__}: {exc})"
                ) from exc
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class _RefusedValue(CheckpointError):
    """A stored value ``torch.load(weights_only=True)`` refused; ``_SafeReader`` names its file."""


def _weights_only_reason(exc: Exception) -> str:
    """The line of a ``torch.load(weights_only=True)`` refusal that says what was refused,
    without torch's advice around it (which suggests ``weights_only=False``: not for files
    that fail here)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reasons = [line.split("error:", 1)[1].strip() for line in lines if "Unpickler error:" in line]
    reasons = [reason for reason in reasons if reason]  # the reason may be on the next line
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    reasons += [line for line in lines if not line.startswith(boilerplate)]
    return (reasons or lines or [type(exc).__name__])[0]


class _SafePlanner(DefaultLoadPlanner):
    """Non-tensor values go through ``torch.load(weights_only=True)``, never plain unpickling."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _RefusedValue(
                f"refusing to unpickle the value of {read_item.dest_index.fqn!r} "
                f"({_weights_only_reason(exc)}); load reads values that are not tensors with "
                "torch.load(weights_only=True), which builds only tensors, numbers, strings and "
                "containers: this file was not written by fshard.checkpoint.save, or was changed "
                "since"
            ) from None
        self.state_dict[read_item.dest_index.fqn] = obj
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)


# ------------------------------------------------------------------------------- collectives


def _require_dist(where: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where} is collective: initialise the process group first (torchrun, "
            "torch.distributed.init_process_group); use fshard.checkpoint.consolidate to read a "
            "checkpoint in one process"
        )


def _all_gather(obj: Any, label: str) -> list[Any]:
    return _collectives.all_gather_objects(obj, None, label=label)


def _raise_if_any_rank_failed(
    error: str | None, where: str, label: str, error_type: type[Exception] = CheckpointError
) -> None:
    """Every rank raises if one did, so no rank is left waiting in the next collective."""
    errors = _all_gather(error, label)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if len(set(failed.values())) == 1:
        raise error_type(f"{where}: {next(iter(failed.values()))} (on rank(s) {sorted(failed)})")
    if failed:
        body = "\n".join(f"  rank {r}: {e}" for r, e in failed.items())
        raise error_type(f"{where} failed on rank(s) {sorted(failed)}:\n{body}")


# ------------------------------------------------------------------------------ save and load


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
        "param_groups": _encode(list(osd["param_groups"]), "optimizer param_groups", None),
        "state": state,
    }


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``, and ``extra``) at ``path``.

    Collective: every rank calls it. Each rank writes only its shards through DCP; the write is
    atomic (written to a temporary sibling directory, then renamed), so a crash leaves the
    previous checkpoint at ``path`` loadable, and a failed save removes its partial copy. ``path``
    must be new, an empty directory or an fshard checkpoint (whose files are replaced; files
    you added to it, a ``config.json`` or a tokenizer, are kept); anything else is refused.
    Buffers are saved from rank 0. ``extra`` is per-rank user state: JSON-like
    values (None, bool, int, float, str, lists, tuples, dicts) and tensors, e.g.
    ``{"step": 100, "rng": torch.get_rng_state()}``; ``load`` gives each rank back what it saved.

    Example:
        >>> fshard.checkpoint.save("runs/step-100", model, opt, extra={"step": 100})  # doctest: +SKIP
    """
    where = "fshard.checkpoint.save"
    _require_dist(where)
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_json = ""
    error = None
    try:
        extra_json = json.dumps(_encode(extra, "extra", extra_tensors))
    except TypeError as exc:
        error = str(exc)
    except Exception as exc:  # agreed on below, so no rank is left waiting
        error = f"extra cannot be stored ({type(exc).__name__}: {exc})"
    _raise_if_any_rank_failed(error, where, "checkpoint.save", TypeError)
    layout = layout_of(model)
    sd: dict[str, Any] = {"model": state_dict(model)}
    optim_desc = None
    if optimizer is not None:
        # What the optimizer holds: before its first step, nothing (the resumed run's first
        # step starts its state as this one's would).
        osd = _optim_state_dict(model, optimizer, full=False, rank0_only=False, placeholder=False)
        sd["optim"] = osd["state"]
        optim_desc = _optim_manifest(model, osd)

    if rank != 0:
        # Buffers (and ignored params) are plain tensors each rank holds whole, not always
        # alike (BatchNorm statistics): rank 0's are saved, as full_state_dict gives them.
        # Left to DCP, it would spread the duplicates over the ranks to balance the writes.
        sd = _without_plain_tensors(sd)
    token, chosen = _collectives.broadcast_objects(
        (uuid.uuid4().hex[:12], path) if rank == 0 else None, 0, None, label="checkpoint.save"
    )
    tmp = f"{path}.tmp-{token}"
    error = _first_unloadable(sd, "")
    if error is None and path != chosen:  # a timestamp or a rank in the name: each rank would write its own part
        error = (
            f"every rank must pass the same path: rank 0 passed {chosen!r}, rank {rank} "
            f"passed {path!r}"
        )
    elif error is None and rank == 0:
        error = _target_problem(path)
        if error is None:
            try:
                os.makedirs(os.path.join(tmp, _EXTRA_DIR))
            except OSError as exc:
                error = f"cannot create {tmp}: {exc}"
    try:
        _raise_if_any_rank_failed(error, where, "checkpoint.save")
    except CheckpointError:
        if rank == 0:  # another rank's problem: nothing is written, the new directory goes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _write_and_publish(sd, tmp, path, token, extra_tensors, extra_json, layout, optim_desc)
    except BaseException:
        # Every rank has stopped writing (each failure in there is agreed on). Not once the
        # swap moved the previous checkpoint aside: then this one is what loading recovers.
        if rank == 0 and not os.path.lexists(f"{path}.old-{token}"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("fshard: saved checkpoint %s", path)


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
) -> None:
    """``save`` from the temporary directory on: the shards, the extra state, the manifest,
    then the swap into ``path``."""
    where = "fshard.checkpoint.save"
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        dcp_save(sd, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except (Exception, CheckpointException) as exc:  # on every rank when one fails to write
        # (DCP's CheckpointException derives from BaseException.)
        raise CheckpointError(f"{where}: writing the shards to {tmp} failed: {exc}") from exc

    error = None
    try:
        from safetensors.torch import save_file

        extra_path = os.path.join(tmp, _EXTRA_DIR, f"rank-{rank:05d}.safetensors")
        save_file(extra_tensors, extra_path, metadata={_EXTRA_KEY: extra_json})
        with open(extra_path, "rb") as f:
            os.fsync(f.fileno())
    except Exception as exc:  # reported on every rank below
        error = f"writing extra state: {type(exc).__name__}: {exc}"
    _raise_if_any_rank_failed(error, where, "checkpoint.save")

    # Every rank checksums a share of the files ([Note: no unpickling]).
    names = _collectives.broadcast_objects(
        _list_files(tmp) if rank == 0 else None, 0, None, label="checkpoint.save"
    )
    mine = {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "crc32": _crc32(os.path.join(tmp, rel))} for rel in names[rank::world]}
    files: dict[str, Any] = {}
    for part in _all_gather(mine, "checkpoint.save"):
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
                "model_keys": list(sd["model"].keys()),
                "optimizer": optim_desc,
                "extra_ranks": world,
                "files": files,
                "torch": torch.__version__,
            }
            _write_durable(os.path.join(tmp, MANIFEST), _manifest_bytes(body))
            _fsync_dir(tmp)
            _publish(tmp, path, token)
        except Exception as exc:  # reported on every rank below
            error = f"committing {tmp} to {path}: {type(exc).__name__}: {exc}"
    _raise_if_any_rank_failed(error, where, "checkpoint.save")


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
    _fsync_dir(parent)
    # The replaced one first (its user files are the newest), then leftovers of interrupted
    # saves; a .tmp- directory is only ever fshard's writing, an .old- one was ``path``.
    siblings = sorted(
        (name for name in os.listdir(parent) if _is_swap_sibling(name, base)),
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
        owned = set(_read_manifest(old).get("files", {}))
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


def _optim_template(
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
    names = _param_names(_entries(model, where))
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
                per[key] = _as_dtensor(slot, local)
            else:
                per[key] = torch.empty(shape, dtype=dtype, device=param.device)
        out[name] = per
    problems.raise_if_any(ValueError, hint=STRICT_HINT if strict else "")
    return out


def _optim_to_load(desc: Mapping[str, Any], state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The name-keyed optimizer state dict of a checkpoint, for ``_load_optim``."""
    osd: dict[str, Any] = {"state": state, "param_groups": _decode(desc["param_groups"], None)}
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

    Example:
        >>> extra = fshard.checkpoint.load("runs/step-100", model, opt)  # doctest: +SKIP
        >>> start = extra["step"] + 1                                    # doctest: +SKIP
    """
    where = "fshard.checkpoint.load"
    _require_dist(where)
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()
    found: tuple[str, str, dict[str, Any]] | str
    if rank == 0:
        try:
            resolved = _resolve(path)
            found = (path, resolved, _read_manifest(resolved))
        except CheckpointError as exc:
            found = str(exc)
    else:
        found = ""
    found = _collectives.broadcast_objects(found, 0, None, label="checkpoint.load")
    if isinstance(found, str):
        raise CheckpointError(found)
    given, root, manifest = found
    if verify:
        _verify(root, manifest, distributed=True)

    # Every rank checks its model against the manifest, and all raise if one finds a problem
    # (a rank that built another model would otherwise wait in DCP's load for the others).
    with _ranks_agree(_root_info(model, where), where):
        if path != given:  # a rank in the name: rank 0's checkpoint would load everywhere
            raise ValueError(
                f"every rank must pass the same path: rank 0 passed {given!r}, rank {rank} "
                f"passed {path!r}"
            )
        saved = Layout.from_json(manifest["model"])
        entries = _entries(model, where)
        model_sd = state_dict(model)
        problems = ProblemList(f"{where}({root})")
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
        if optimizer is not None and manifest.get("optimizer") is None:
            problems.add("an optimizer was passed but the checkpoint has no optimizer state")
        problems.raise_if_any(
            ValueError, hint="Load into the same model architecture, or pass strict=False."
        )

        to_load: dict[str, Any] = {
            "model": {
                k: v for k, v in model_sd.items() if k in saved or (k in object_keys and k in saved_keys)
            }
        }
        optim_desc = manifest.get("optimizer") if optimizer is not None else None
        load_optim = None
        if optimizer is not None and optim_desc is not None:
            to_load["optim"] = _optim_template(model, optimizer, optim_desc, where, strict=strict)
            # The template tensors are ours alone: no copy needed.
            load_optim = functools.partial(
                _load_optim, model, optimizer, copy=False, strict=strict, where=f"{where}({root})"
            )
    if load_optim is not None and optim_desc is not None:
        # Keys, shapes and the class, before anything is read (the ranks agree in there).
        load_optim(_optim_to_load(optim_desc, to_load["optim"]), check_only=True)
    _dcp_load(to_load, root, no_dist=False)
    load_state_dict(model, to_load["model"], strict=False)
    if load_optim is not None and optim_desc is not None:
        load_optim(_optim_to_load(optim_desc, to_load["optim"]))
    extra, error = None, None
    try:
        extra = _read_extra(root, manifest, rank)
    except CheckpointError as exc:
        error = str(exc)
    _raise_if_any_rank_failed(error, where, "checkpoint.load")
    return extra


def _dcp_load(state: dict[str, Any], root: str, *, no_dist: bool) -> None:
    """``dcp.load`` through the safe reader; our own errors come out as ``CheckpointError``."""
    # Read (and check) the metadata here: DCP turns a failure to read it into a fallback attempt.
    metadata = _SafeReader(root).read_metadata()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
            dcp_load(
                state,
                storage_reader=_SafeReader(root, metadata),
                planner=_SafePlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        ours = sorted(
            {str(failure[0]) for failure in exc.failures.values() if isinstance(failure[0], CheckpointError)}
        )
        if ours:
            raise CheckpointError("\n".join(ours)) from None
        raise


def _read_extra(root: str, manifest: Mapping[str, Any], rank: int) -> Any:
    from safetensors import safe_open

    source = rank if rank < int(manifest.get("extra_ranks", 0)) else 0
    if source != rank:
        logger.warning(
            "fshard.checkpoint: rank %d did not exist when %s was saved; it gets rank 0's extra",
            rank,
            root,
        )
    path = os.path.join(root, _EXTRA_DIR, f"rank-{source:05d}.safetensors")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return _decode(json.loads(meta[_EXTRA_KEY]), tensors)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint extra-state file {path} is missing") from None
    except CheckpointError:
        raise
    except Exception as exc:  # re-raised naming the file
        raise CheckpointError(
            f"checkpoint extra-state file {path} is corrupted ({type(exc).__name__}: {exc})"
        ) from None


def consolidate(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, in one process with no process group.

    Returns plain, full CPU tensors keyed like the unsharded model's ``state_dict()`` (non-tensor
    entries are skipped), ready for ``model.load_state_dict`` or ``safetensors.torch.save_file``.
    This is what ``fshard consolidate CKPT out.safetensors`` writes.

    Example:
        >>> full = fshard.checkpoint.consolidate("runs/step-100")  # doctest: +SKIP
        >>> unsharded_model.load_state_dict(full)                   # doctest: +SKIP
    """
    root = _resolve(os.path.abspath(os.fspath(path)))
    manifest = _read_manifest(root)
    if verify:
        _verify(root, manifest, distributed=False)
    layout = Layout.from_json(manifest["model"])
    model_sd = {k: torch.empty(e.full_shape, dtype=e.torch_dtype) for k, e in layout.items()}
    _dcp_load({"model": model_sd}, root, no_dist=True)
    order = [k for k in manifest.get("model_keys", list(layout)) if k in model_sd]
    return {k: model_sd[k] for k in order}


def latest(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint directly under ``root`` (by save time), or ``None``.

    Checkpoints left half-written by a crash are skipped, so a restarted job resumes from the
    last save that finished.

    Example:
        >>> ckpt = fshard.checkpoint.latest("runs/")          # doctest: +SKIP
        >>> if ckpt: extra = fshard.checkpoint.load(ckpt, model, opt)  # doctest: +SKIP
    """
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    canonical = set()
    for name in names:
        match = _SWAP_SIBLING.fullmatch(name)
        canonical.add(match["base"] if match is not None else name)
    best: tuple[float, str] | None = None
    for name in canonical:
        path = os.path.join(root, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            continue
        try:
            resolved = _resolve(path)
        except CheckpointError:
            continue
        created = float(_read_manifest(resolved).get("created", 0.0))
        if best is None or (created, path) > best:
            best = (created, path)
    return None if best is None else best[1]

