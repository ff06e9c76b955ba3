"""Reading a checkpoint through DCP without unpickling arbitrary objects ([Note: no unpickling]
in ``fshard.checkpoint``), naming the file a read fails on.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from fshard.checkpoint._manifest import CheckpointError

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


def read_metadata(root: str) -> Metadata:
    """DCP's index of the checkpoint at ``root``, read without unpickling arbitrary objects."""
    return _SafeReader(root).read_metadata()


def safe_dcp_load(
    state: dict[str, Any], root: str, *, no_dist: bool, metadata: Metadata | None = None
) -> None:
    """``dcp.load`` through the safe reader; our own errors come out as ``CheckpointError``.

    ``metadata`` (from ``read_metadata``) saves reading it again, for many small loads.
    """
    # Read (and check) the metadata here: DCP turns a failure to read it into a fallback attempt.
    if metadata is None:
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
