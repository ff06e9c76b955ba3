"""Reading checkpoints without a process group: ``consolidate`` (one full state dict) and
``latest`` (the newest complete checkpoint under a directory).
"""

from __future__ import annotations

import os

import torch

from fshard.checkpoint._manifest import (
    SWAP_SIBLING,
    CheckpointError,
    read_manifest,
    resolve,
    verify_files,
)
from fshard.checkpoint._safe_read import safe_dcp_load
from fshard.transforms import Layout


def consolidate(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, in one process with no process group.

    Returns plain, full CPU tensors keyed like the unsharded model's ``state_dict()`` (non-tensor
    entries are skipped), ready for ``model.load_state_dict`` or ``safetensors.torch.save_file``.
    This is what ``fshard consolidate CKPT out.safetensors`` writes.

    Example:
        >>> full = fshard.checkpoint.consolidate("runs/step-100")  # doctest: +SKIP
        >>> unsharded_model.load_state_dict(full)                   # doctest: +SKIP
    """
    root = resolve(os.path.abspath(os.fspath(path)))
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest, distributed=False)
    layout = Layout.from_json(manifest["model"])
    model_sd = {k: torch.empty(e.full_shape, dtype=e.torch_dtype) for k, e in layout.items()}
    safe_dcp_load({"model": model_sd}, root, no_dist=True)
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
