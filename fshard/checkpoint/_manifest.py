"""The checkpoint's manifest and files: the manifest (written last, checksummed), each file's
size and CRC32, durable writes, finding a complete checkpoint, and the tagged-JSON encoding of
``extra`` and optimizer hyperparameters.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fshard import _collectives

logger = logging.getLogger("fshard")


MANIFEST = "fshard.json"


FORMAT = "fshard-checkpoint"


VERSION = 1


EXTRA_DIR = "extra"


EXTRA_KEY = "fshard_extra"


# The manifest's "state_dict_type": how the model was saved (a checkpoint of an fshard that did
# not record it is SHARDED). A FULL one holds the model's tensors in FULL_MODEL_FILE.
SHARDED = "SHARDED_STATE_DICT"


FULL = "FULL_STATE_DICT"


FULL_MODEL_FILE = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted; the message names the file.

    Example:
        >>> try:                                                  # doctest: +SKIP
        ...     fshard.checkpoint.load("runs/step-100", model)
        ... except fshard.checkpoint.CheckpointError as err:
        ...     print(err)  # e.g. names the truncated shard file
    """


# `extra` and optimizer hyperparameters as tagged JSON: tuples, non-string-keyed dicts and
# tensors get a one-key object whose key starts with "__", which plain keys may not use.


# What safetensors stores natively; other dtypes go in as their bytes.
_SAFETENSORS_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16}
    | {torch.bfloat16, torch.float32, torch.float64, torch.complex64}
)


def encode(value: Any, where: str, tensors: dict[str, torch.Tensor] | None) -> Any:
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
        return [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        return {
            "__items__": [
                [encode(k, f"{where} key {k!r}", tensors), encode(v, f"{where}[{k!r}]", tensors)]
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


def decode(value: Any, tensors: Mapping[str, torch.Tensor] | None) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and "__tuple__" in value:
        return tuple(decode(v, tensors) for v in value["__tuple__"])
    if len(value) == 1 and "__items__" in value:
        return {decode(k, tensors): decode(v, tensors) for k, v in value["__items__"]}
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
    return {k: decode(v, tensors) for k, v in value.items()}


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 22)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def fsync_dir(path: str) -> None:
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


def write_durable(path: str, data: bytes) -> None:
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def list_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name == MANIFEST:
                continue
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def manifest_bytes(body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, indent=1).encode()


def read_manifest(root: str) -> dict[str, Any]:
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
        read_manifest(os.fspath(path))
    except CheckpointError:
        return False
    return True


# The siblings a save leaves while swapping (``<base>.tmp-<token>``, ``<base>.old-<token>``,
# token: 12 hex digits): only these are fshard's to read back or delete.
SWAP_SIBLING = re.compile(r"(?P<base>.+)\.(?:tmp|old)-[0-9a-f]{12}")


def is_swap_sibling(name: str, base: str) -> bool:
    match = SWAP_SIBLING.fullmatch(name)
    return match is not None and match["base"] == base


def resolve(path: str) -> str:
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
        if is_swap_sibling(name, base):
            full = os.path.join(parent, name)
            if is_complete(full):
                candidates.append((read_manifest(full).get("created", 0.0), full))
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
        read_manifest(path)  # raises the "incomplete" error
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
        if crc32(full) != want["crc32"]:
            problems.append(f"{full} is corrupted: its CRC32 does not match the manifest")
    return problems


def verify_files(root: str, manifest: Mapping[str, Any], *, distributed: bool) -> None:
    files = manifest.get("files", {})
    names = sorted(files)
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _check_files(root, files, names[rank::world])
        problems = [p for part in _collectives.all_gather_objects_by_rank(mine, None, label="checkpoint.verify") for p in part]
    else:
        problems = _check_files(root, files, names)
    if problems:
        raise CheckpointError(
            "checkpoint files failed verification:\n  "
            + "\n  ".join(sorted(set(problems)))
            + "\nLoad an older checkpoint (fshard.checkpoint.latest finds the newest whose save "
            "finished; it does not check the files' CRCs, so pass an older one by name)."
        )
