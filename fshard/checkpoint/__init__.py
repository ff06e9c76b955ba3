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

from fshard.checkpoint._consolidate import Consolidated, consolidate, consolidate_to, latest
from fshard.checkpoint._load import load
from fshard.checkpoint._manifest import FORMAT as FORMAT
from fshard.checkpoint._manifest import MANIFEST as MANIFEST
from fshard.checkpoint._manifest import VERSION as VERSION
from fshard.checkpoint._manifest import CheckpointError, is_complete
from fshard.checkpoint._save import save

# MANIFEST (the manifest's file name), FORMAT and VERSION are public too; constants carry no
# docstring of their own, so the API docs (which read ``__all__``) leave them out.
__all__ = ["CheckpointError", "Consolidated", "consolidate", "consolidate_to", "is_complete", "latest", "load", "save"]
