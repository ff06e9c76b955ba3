"""An exact checksum of a tensor's values, the same on every rank for equal values.

Ranks that built a model with different values (a different seed per rank) would train a model
none of them built, where DDP broadcasts rank 0's weights. fshard compares a checksum of each
parameter's full value, taken while the full tensor is still there (at ``fully_shard``), and of
each buffer, at the first forward (see ``_runtime/_root_init.py``).

The checksum reads the bytes as integers and sums them with position weights in int64, which
wraps around: integer sums do not depend on the order of the additions, so the result is the
same on every rank whatever the reduction order, unlike a floating-point sum.
"""

from __future__ import annotations

import torch

__all__ = ["value_checksum"]

_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporaries (32 MiB)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_checksum(tensor: torch.Tensor) -> int | None:
    """The checksum of ``tensor``'s values (``None`` on the meta device: it has none).

    Example:
        >>> import torch
        >>> a = torch.arange(6.0)
        >>> value_checksum(a) == value_checksum(a.clone()), value_checksum(a) == value_checksum(a.flip(0))
        (True, False)
    """
    if tensor.is_meta:
        return None
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.element_size()
    words = flat.view(_WORDS[size]) if size in _WORDS else flat.view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device)
        total += (part * (weights % 65521 + 1)).sum() + part.sum() * 31
    return int(total) ^ (words.numel() << 1) ^ size
