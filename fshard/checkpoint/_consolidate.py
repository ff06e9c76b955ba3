"""Reading checkpoints without a process group: ``consolidate`` (one full state dict, or a file
written one tensor at a time) and ``latest`` (the newest complete checkpoint under a directory).

[Note: streamed consolidate]
``consolidate_to`` never holds the model: the manifest (and DCP's metadata) give every key's
full shape and dtype up front, so the output's header is written first ([Note: streamed
safetensors]) and then each tensor is read on its own (DCP reads the chunks every rank saved
into one full tensor; a FULL_STATE_DICT checkpoint's ``model.safetensors`` is read with plain
file reads, no mmap), written, and dropped. Peak memory is about the largest tensor plus one of
its saved chunks, whatever the model's size. A ``.pt`` output is a ``torch.save`` file, which
needs every tensor at once: it holds the whole model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from fshard.checkpoint._manifest import (
    FULL,
    FULL_MODEL_FILE,
    SWAP_SIBLING,
    CheckpointError,
    decode,
    read_manifest,
    resolve,
    verify_files,
)
from fshard.checkpoint._safe_read import read_metadata, safe_dcp_load
from fshard.checkpoint._safetensors import (
    StreamWriter,
    TensorSpec,
    read_header,
    read_tensor,
    unstorable,
)
from fshard.transforms import Layout

# Output keys of the optimizer state: OPTIM_PREFIX + "<parameter FQN>.<state name>".
OPTIM_PREFIX = "optim.state."


PARAM_GROUPS_KEY = "optim.param_groups"


TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")


class Consolidated(NamedTuple):
    """What ``consolidate_to`` wrote: the file, how many tensors, their bytes.

    Example:
        >>> done = fshard.checkpoint.consolidate_to("runs/step-100", "model.safetensors")  # doctest: +SKIP
        >>> done.tensors, done.nbytes                                                    # doctest: +SKIP
        (42, 497721344)
    """

    path: str
    tensors: int
    nbytes: int


class _Plan(NamedTuple):
    specs: list[TensorSpec]
    read: Callable[[TensorSpec], torch.Tensor]
    param_groups: Any  # the optimizer's param groups (tagged JSON), or None


def _plan(path: str | os.PathLike[str], *, optimizer: bool, verify: bool) -> _Plan:
    root = resolve(os.path.abspath(os.fspath(path)))
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest, distributed=False)
    layout = Layout.from_json(manifest["model"])
    order = [k for k in manifest.get("model_keys", list(layout)) if k in layout]
    specs = [TensorSpec(k, layout[k].torch_dtype, tuple(layout[k].full_shape)) for k in order]
    sources: dict[str, tuple[str, ...]] = {}  # output key -> DCP path
    full_file = os.path.join(root, FULL_MODEL_FILE)
    stored = read_header(full_file)[0] if manifest.get("state_dict_type") == FULL else None
    if stored is not None:
        missing = [s.key for s in specs if s.key not in stored]
        if missing:
            raise CheckpointError(f"checkpoint model file {full_file} lacks key(s) {missing}")
    else:
        sources.update({s.key: ("model", s.key) for s in specs})
    param_groups = None
    if optimizer:
        desc = manifest.get("optimizer")
        if desc is None:
            raise CheckpointError(f"{root} has no optimizer state (it was saved without an optimizer)")
        for name, entries in desc["state"].items():
            for state_key, d in entries.items():
                if d["kind"] == "object":
                    continue
                key = f"{OPTIM_PREFIX}{name}.{state_key}"
                specs.append(TensorSpec(key, getattr(torch, d["dtype"]), tuple(d["shape"])))
                sources[key] = ("optim", name, state_key)
        param_groups = desc["param_groups"]
    metadata = read_metadata(root) if sources else None

    def read(spec: TensorSpec) -> torch.Tensor:
        if spec.key not in sources and stored is not None:
            return read_tensor(full_file, stored[spec.key])
        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        tree: dict[str, Any] = {}
        *outer, last = sources[spec.key]
        node = tree
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = tensor
        safe_dcp_load(tree, root, no_dist=True, metadata=metadata)
        return tensor

    return _Plan(specs, read, param_groups)


def _tensors(plan: _Plan) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in plan.specs:
        yield spec.key, plan.read(spec)


def consolidate(
    path: str | os.PathLike[str], *, optimizer: bool = False, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, in one process with no process group.

    Returns plain, full CPU tensors keyed like the unsharded model's ``state_dict()`` (non-tensor
    entries are skipped), ready for ``model.load_state_dict`` or ``safetensors.torch.save_file``.
    Reads sharded and FULL_STATE_DICT checkpoints alike, one tensor at a time. With
    ``optimizer=True`` the optimizer's tensors come too, under ``optim.state.<param>.<name>``
    (``optim.state.fc.weight.exp_avg``). The result holds the whole model: to write a file
    without that, use ``consolidate_to`` (what ``fshard consolidate`` runs).

    Example:
        >>> full = fshard.checkpoint.consolidate("runs/step-100")  # doctest: +SKIP
        >>> unsharded_model.load_state_dict(full)                   # doctest: +SKIP
    """
    return dict(_tensors(_plan(path, optimizer=optimizer, verify=verify)))


def consolidate_to(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    optimizer: bool = False,
    verify: bool = True,
) -> Consolidated:
    """Write a checkpoint's full model (and with ``optimizer=True`` its optimizer state) to
    ``out``, one tensor at a time, in one process with no process group.

    ``out`` ending in ``.safetensors`` (or anything but ``.pt``/``.pth``/``.bin``) is a single
    safetensors file written as it is read ([Note: streamed consolidate]): peak memory is near
    the largest tensor, not the model. Keys are the unsharded model's ``state_dict()`` keys,
    then ``optim.state.<param>.<name>``; the optimizer's param groups (hyperparameters) go in
    the file's metadata under ``optim.param_groups``, as JSON. ``.pt``/``.pth``/``.bin`` is a
    ``torch.save`` dict (param groups under ``optim.param_groups``), which holds everything at
    once. The file appears complete or not at all (written beside it, then renamed).

    Example:
        >>> fshard.checkpoint.consolidate_to("runs/step-100", "model.safetensors")  # doctest: +SKIP
        Consolidated(path='model.safetensors', tensors=42, nbytes=497721344)
    """
    plan = _plan(path, optimizer=optimizer, verify=verify)
    out = os.fspath(out)
    partial = f"{out}.partial"
    nbytes = sum(spec.nbytes for spec in plan.specs)
    if out.lower().endswith(TORCH_SAVE_SUFFIXES):
        state: dict[str, Any] = dict(_tensors(plan))
        if plan.param_groups is not None:
            state[PARAM_GROUPS_KEY] = decode(plan.param_groups, None)
        try:
            torch.save(state, partial)
        except BaseException:
            _remove(partial)
            raise
    else:
        bad = unstorable(plan.specs)
        if bad:
            what = "; ".join(f"{dtype} ({', '.join(map(repr, keys[:3]))}{', ...' if len(keys) > 3 else ''})" for dtype, keys in bad.items())
            raise TypeError(f"safetensors cannot store {what}")
        metadata = {"format": "pt"}
        if plan.param_groups is not None:
            groups = decode(plan.param_groups, None)  # tuples (betas) become JSON lists
            metadata[PARAM_GROUPS_KEY] = json.dumps(groups, default=lambda t: t.tolist())
        with StreamWriter(partial, plan.specs, metadata) as writer:
            for spec in plan.specs:
                tensor = plan.read(spec)
                writer.write(spec.key, tensor)
                del tensor  # one tensor at a time
    os.replace(partial, out)
    return Consolidated(out, len(plan.specs), nbytes)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


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
        match = SWAP_SIBLING.fullmatch(name)
        canonical.add(match["base"] if match is not None else name)
    best: tuple[float, str] | None = None
    for name in canonical:
        path = os.path.join(root, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            continue
        try:
            resolved = resolve(path)
        except CheckpointError:
            continue
        created = float(read_manifest(resolved).get("created", 0.0))
        if best is None or (created, path) > best:
            best = (created, path)
    return None if best is None else best[1]
