"""Pure layout math for dim-0 sharding with ``torch.chunk`` semantics.

Nothing here touches a process group or allocates device memory: every function takes ints and
shapes and is property-tested without processes.

[Note: chunk layout]
A parameter with ``rows = full_shape[0]`` is cut into ``shard_size`` chunks of
``slot_rows = ceil(rows / shard_size)`` rows each, exactly like ``torch.chunk`` (and DTensor's
``Shard(0)``): shard ``r`` holds rows ``[r * slot_rows, min((r + 1) * slot_rows, rows))``, so the
last shards may be shorter or empty. For collectives every shard is padded to ``slot_rows`` rows;
the padding never reaches the user. A 0-d parameter cannot be chunked; it is *replicated* over the
shard group instead (one element per rank, ``Replicate()`` placement) and its gradient is summed
through the same reduce-scatter.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "ShardLayout",
    "shard_layout",
    "chunk_sizes",
    "divide_factors",
]


class ShardLayout(NamedTuple):
    """Where one rank's shard of one parameter lies.

    Example:
        >>> shard_layout(torch.Size([5, 3]), shard_size=4, shard_rank=2)
        ShardLayout(full_shape=torch.Size([5, 3]), local_shape=torch.Size([1, 3]), row_offset=4, slot_numel=6, local_numel=3, replicated=False)
    """

    full_shape: torch.Size
    local_shape: torch.Size  # this rank's unpadded shard
    row_offset: int  # first full-tensor row held by this rank
    slot_numel: int  # padded per-rank numel used in collectives
    local_numel: int
    replicated: bool  # 0-d parameters: every rank holds the whole value

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)


def chunk_sizes(rows: int, shard_size: int) -> list[int]:
    """Row counts of each shard of a dim of size ``rows``, as ``torch.chunk`` gives them.

    Shards past the end are empty (size 0), so the list always has ``shard_size`` entries.

    Example:
        >>> chunk_sizes(5, 4)
        [2, 2, 1, 0]
        >>> chunk_sizes(2, 4)
        [1, 1, 0, 0]
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    slot_rows = -(-rows // shard_size)
    return [max(0, min(slot_rows, rows - r * slot_rows)) for r in range(shard_size)]


def shard_layout(full_shape: torch.Size | tuple[int, ...], shard_size: int, shard_rank: int) -> ShardLayout:
    """The layout of shard ``shard_rank`` of a tensor of ``full_shape`` over ``shard_size`` ranks.

    Example:
        >>> shard_layout((), shard_size=2, shard_rank=1).replicated
        True
        >>> shard_layout((3,), shard_size=4, shard_rank=3).local_shape
        torch.Size([0])
    """
    full_shape = torch.Size(full_shape)
    if not 0 <= shard_rank < shard_size:
        raise ValueError(f"shard_rank must be in [0, {shard_size}), got {shard_rank}")
    if len(full_shape) == 0:
        return ShardLayout(full_shape, full_shape, 0, 1, 1, True)
    rows = full_shape[0]
    row_numel = math.prod(full_shape[1:])
    slot_rows = -(-rows // shard_size)
    local_rows = chunk_sizes(rows, shard_size)[shard_rank]
    row_offset = min(shard_rank * slot_rows, rows)
    local_shape = torch.Size((local_rows, *full_shape[1:]))
    return ShardLayout(
        full_shape, local_shape, row_offset, slot_rows * row_numel, local_rows * row_numel, False
    )


def divide_factors(
    dp_size: int, dtype: torch.dtype, factor: float | None = None
) -> tuple[float, float]:
    """Gradient divide factors ``(pre, post)`` with ``pre * post == factor`` (by default
    ``dp_size``: the average).

    Gradients are averaged like DDP with a SUM reduction every backend supports: divide by
    ``pre`` before the reduction and by ``post`` after it. Full precision divides everything
    before (what DDP does). Half precision divides by the smallest power of two whose square is
    at least ``dp_size`` before (exact, short of the subnormals) and by the rest after: a sum of
    ``dp_size`` values divided by ``pre >= post`` overflows only where their average is within a
    factor ``post / dp_size <= 1`` of the dtype's maximum (2 ranks never overflow where the
    average does not), while small values keep most of their bits (what FSDP2 does).

    Example:
        >>> divide_factors(4, torch.float32)
        (4.0, 1.0)
        >>> divide_factors(2, torch.float16)
        (2.0, 1.0)
        >>> divide_factors(8, torch.bfloat16)
        (4.0, 2.0)
        >>> divide_factors(6, torch.float16)
        (4.0, 1.5)

    Another ``factor`` (``fshard.set_gradient_divide_factor``) keeps the half-precision ``pre``,
    which depends on how many values are summed, and changes ``post``:

        >>> divide_factors(8, torch.bfloat16, factor=1.0)  # the sum
        (4.0, 0.25)
        >>> divide_factors(8, torch.float32, factor=2.0)
        (2.0, 1.0)
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    total = float(dp_size) if factor is None else float(factor)
    if dtype not in (torch.float16, torch.bfloat16):
        return total, 1.0
    pre = 1
    while pre * pre < dp_size:
        pre *= 2
    return float(pre), total / pre
