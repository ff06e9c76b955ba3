"""Writing a safetensors file one tensor at a time (the library's ``save_file`` needs them all).

[Note: streamed safetensors]
The format is an 8-byte little-endian header length, a JSON header (per key: dtype code, shape
and ``data_offsets`` [begin, end) into the data section; ``__metadata__``: str -> str), padded
with spaces to a multiple of 8 bytes, then the tensors' bytes back to back with no gaps. The
header only needs every key's dtype and shape, known before any data (from a checkpoint's
metadata or a model's layout), so ``StreamWriter`` writes it first and then takes the tensors
one by one, in header order, checking each against what the header promised: the caller holds
one tensor at a time, never the model. Every key gets its own bytes (tied weights are written
under each of their keys, as ``model.state_dict()`` lists them). The result is read by
``safetensors.safe_open`` / ``load_file`` like any other file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NamedTuple

import torch

# torch dtype -> safetensors dtype code (the codes safetensors 0.4+ reads).
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


class TensorSpec(NamedTuple):
    """What the header promises for one key."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def unstorable(specs: Sequence[TensorSpec]) -> dict[str, list[str]]:
    """The keys whose dtype safetensors has no code for, by dtype name (empty if none)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        if spec.dtype not in DTYPE_CODES:
            out.setdefault(str(spec.dtype).removeprefix("torch."), []).append(spec.key)
    return out


def header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and the JSON header for ``specs``, data in their order. Pure."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.key in header or spec.key == "__metadata__":
            raise ValueError(f"safetensors header: key {spec.key!r} given twice or reserved")
        if spec.dtype not in DTYPE_CODES:
            raise TypeError(f"safetensors cannot store {spec.dtype} ({spec.key!r})")
        end = offset + spec.nbytes
        header[spec.key] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamWriter:
    """Write ``specs``' tensors to ``path`` one at a time ([Note: streamed safetensors]).

    ``write`` must be called once per spec, in order; ``close`` checks they all came. Used as a
    context manager, a failure removes the partial file.
    """

    def __init__(
        self, path: str | os.PathLike[str], specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = os.fspath(path)
        self._specs = list(specs)
        self._next = 0
        self.nbytes = 0
        header = header_bytes(self._specs, metadata)
        self._file = open(self.path, "wb")  # closed in close()
        self._file.write(header)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path}: {key!r} is one tensor more than the header holds")
        spec = self._specs[self._next]
        if key != spec.key or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path}: expected {spec.key!r} {spec.dtype} {list(spec.shape)} next, got "
                f"{key!r} {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            self._file.write(data.numpy().data)  # no copy: the tensor's own bytes
        self.nbytes += data.numel()
        self._next += 1

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._next != len(self._specs):
            missing = [s.key for s in self._specs[self._next :]]
            os.remove(self.path)
            raise ValueError(f"{self.path}: {len(missing)} tensor(s) never written, from {missing[0]!r}")

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
            return
        self._file.close()
        try:
            os.remove(self.path)
        except OSError:
            pass


_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Stored(NamedTuple):
    """Where one tensor's bytes are in a safetensors file (``begin``: from the file's start)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str) -> tuple[dict[str, Stored], dict[str, str]]:
    """The tensors of a safetensors file (in data order) and its metadata, from its header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    stored = {}
    for key, entry in header.items():
        if entry["dtype"] not in _DTYPES_BY_CODE:
            raise ValueError(f"{path}: {key!r} has dtype {entry['dtype']}, which fshard does not read")
        begin, end = entry["data_offsets"]
        stored[key] = Stored(_DTYPES_BY_CODE[entry["dtype"]], tuple(entry["shape"]), start + begin, start + end)
    return dict(sorted(stored.items(), key=lambda item: item[1].begin)), metadata


def read_tensor(path: str, stored: Stored) -> torch.Tensor:
    """One tensor of a safetensors file, read straight into its own memory (no mmap: the
    process's memory holds this tensor and nothing else of the file)."""
    out = torch.empty(stored.shape, dtype=stored.dtype)
    raw = out.reshape(-1).view(torch.uint8)
    if raw.numel() != stored.end - stored.begin:
        raise ValueError(f"{path}: the header's offsets do not match the shape {list(stored.shape)}")
    if raw.numel():
        with open(path, "rb") as f:
            f.seek(stored.begin)
            if f.readinto(raw.numpy().data) != raw.numel():
                raise ValueError(f"{path} is truncated")
    return out
