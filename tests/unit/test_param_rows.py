"""This rank's rows and back: the padded shards of every rank, gathered rank-major and trimmed,
are the full tensor again (no processes: the all-gather is a concatenation here)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fshard._param import full_from_padded, local_rows, padded_shard
from fshard._placement import shard_layout
from fshard.testing import strategies as fst


@given(shape=fst.param_shapes(), size=st.integers(1, 8))
@example(shape=(3,), size=4)  # fewer rows than ranks: the last shard is empty
@example(shape=(), size=2)  # 0-d: replicated, every rank holds all of it
@example(shape=(0, 5), size=2)  # no rows at all
def test_padded_shards_gathered_are_the_full_tensor(shape: tuple[int, ...], size: int) -> None:
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    layouts = [shard_layout(shape, size, rank) for rank in range(size)]
    shards = [local_rows(full, layout) for layout in layouts]
    for layout, shard in zip(layouts, shards, strict=True):
        assert shard.shape == layout.local_shape
    if layouts[0].replicated:
        assert all(shard is full for shard in shards)
        return
    padded = [padded_shard(shard, layout, full.device) for shard, layout in zip(shards, layouts, strict=True)]
    for layout, pad in zip(layouts, padded, strict=True):
        assert pad.shape == (layout.slot_numel,)
        assert not pad[layout.local_numel :].any()  # zeros past this rank's rows
    assert torch.equal(full_from_padded(torch.cat(padded), layouts[0]), full)


def test_local_rows_is_a_view_of_torch_chunk_piece() -> None:
    full = torch.arange(30.0).reshape(10, 3)
    layout = shard_layout(full.shape, 4, 1)
    rows = local_rows(full, layout)
    assert rows.data_ptr() == full[3].data_ptr()  # a view, no copy
    assert torch.equal(rows, full.chunk(4)[1])


@pytest.mark.parametrize("size", [1, 3])
def test_padded_shard_copies(size: int) -> None:
    full = torch.ones(5, 2)
    layout = shard_layout(full.shape, size, 0)
    pad = padded_shard(local_rows(full, layout), layout, full.device)
    pad.zero_()
    assert full.all()  # the padded shard is a new tensor
