"""Pure layout math: shards are exactly torch.chunk's, padding is internal only."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fshard._placement import chunk_sizes, divide_factors, shard_layout
from fshard.testing import strategies as fst

# Corner cases in the style of optree's TREES corpus: (shape, shard_size).
CORNER_SHAPES = [
    ((), 1), ((), 4),  # 0-d: replicated
    ((1,), 4), ((3,), 4), ((4,), 4), ((5,), 4),  # fewer rows than ranks, uneven, even
    ((0,), 3), ((0, 5), 2), ((7, 0), 2),  # empty
    ((10, 3), 4), ((9, 2, 3), 2), ((1, 1), 3),
]


def _torch_chunk_rows(rows: int, size: int) -> list[int]:
    chunks = torch.arange(rows).chunk(size) if rows else ()
    sizes = [c.numel() for c in chunks]
    return sizes + [0] * (size - len(sizes))


@pytest.mark.parametrize(("shape", "size"), CORNER_SHAPES, ids=str)
def test_corner_cases_match_torch_chunk(shape: tuple[int, ...], size: int) -> None:
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    layouts = [shard_layout(shape, size, r) for r in range(size)]
    if not shape:
        assert all(lay.replicated and lay.local_shape == torch.Size([]) for lay in layouts)
        return
    pieces = [full.narrow(0, lay.row_offset, lay.local_shape[0]) for lay in layouts]
    expected = list(full.chunk(size)) if shape[0] else []
    for r, piece in enumerate(pieces):
        if r < len(expected):
            assert torch.equal(piece, expected[r])
        else:
            assert piece.shape[0] == 0
    assert torch.equal(torch.cat(pieces), full)


@given(rows=st.integers(0, 50), size=st.integers(1, 8))
def test_chunk_sizes_are_torch_chunk_sizes(rows: int, size: int) -> None:
    assert chunk_sizes(rows, size) == _torch_chunk_rows(rows, size)


@given(shape=fst.param_shapes(), size=st.integers(1, 8))
def test_layouts_tile_the_tensor(shape: tuple[int, ...], size: int) -> None:
    layouts = [shard_layout(shape, size, r) for r in range(size)]
    numel = math.prod(shape)
    if not shape:
        assert all(lay.slot_numel == 1 and lay.local_numel == 1 for lay in layouts)
        return
    # Shards are contiguous row ranges that cover the tensor exactly once, in rank order.
    offset = 0
    for lay in layouts:
        assert lay.row_offset == min(offset, shape[0])
        offset += lay.local_shape[0]
        assert lay.local_numel <= lay.slot_numel  # padding only at the end of a slot
        assert lay.local_shape[1:] == torch.Size(shape[1:])
    assert sum(lay.local_numel for lay in layouts) == numel
    # Padding is less than one slot per rank in total.
    assert size * layouts[0].slot_numel - numel < max(1, size * math.prod(shape[1:]))


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        chunk_sizes(3, 0)
    with pytest.raises(ValueError, match=r"shard_rank must be in \[0, 2\)"):
        shard_layout((3,), 2, 2)


@given(n=st.integers(1, 1024), dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_divide_factors_average(n: int, dtype: torch.dtype) -> None:
    pre, post = divide_factors(n, dtype)
    assert pre * post == n
    if dtype in (torch.float32, torch.float64):
        assert (pre, post) == (n, 1)
    else:  # a power of two dividing first, no smaller than what is left to divide after
        assert pre == 2 ** math.ceil(math.log2(n) / 2) and pre >= post > pre / 4


@given(
    n=st.integers(1, 1024),
    factor=st.floats(1e-3, 1e30),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_divide_factors_of_another_factor(n: int, factor: float, dtype: torch.dtype) -> None:
    pre, post = divide_factors(n, dtype, factor)
    assert math.isclose(pre * post, factor, rel_tol=1e-12)
    # The half-precision division before the sum depends on the number of ranks alone.
    assert pre == (factor if dtype in (torch.float32, torch.float64) else divide_factors(n, dtype)[0])
