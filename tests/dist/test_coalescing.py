"""Coalesced collectives (``fshard.set_coalescing``): adjacent small units share one all-gather
and one reduce-scatter, and train exactly as with a collective per unit.

See [Note: coalesced all-gathers] in ``fshard._unit._group`` and [Note: coalesced
reduce-scatters] in ``fshard._unit._reduce``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives

BLOCKS = 8
WIDTH = 16
STEPS = 3


class _Stack(nn.Module):
    """Eight small blocks (272 parameters each) and a head: units far below 1 MiB."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sharded(mesh_shape: tuple[int, ...], max_bytes: int | None) -> nn.Module:
    model = _Stack()
    mesh = mesh_for(mesh_shape)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    if max_bytes is not None:
        fshard.set_coalescing(model, max_bytes)
    return model


def _train(model: nn.Module, rank: int):
    """STEPS AdamW steps; the last step's collectives and peak gathered bytes."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        fshard.reset_peak_memory_stats()
        with trace_collectives() as records:
            loss = model(x).square().mean()
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    params = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    peak = fshard.memory_stats().peak_gathered_bytes
    return losses, params, records, peak


def _coalescing_worker(mesh_shape, max_bytes):
    rank = dist.get_rank()
    alone = _train(_sharded(mesh_shape, 0), rank)
    together = _train(_sharded(mesh_shape, max_bytes), rank)
    return alone, together


def _ops(records, op):
    return [r for r in records if r.op == op]


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_small_units_share_one_all_gather_and_one_reduce_scatter_and_train_the_same(mesh_shape):
    """With the default 1 MiB the eight blocks are gathered in one all-gather in forward and
    one in backward (the root, first and alone, keeps its parameters to the end of the
    backward), and every unit's gradients go in one reduce-scatter (and on 2x2 one all-reduce
    across replicas): 3 all-gathers and 1 reduce-scatter a step where units alone take 17 and 9,
    for the same bytes. Training is the
    same: to the bit where two ranks sum (a + b is a + b in any layout), to rounding on four."""
    world = 1
    for size in mesh_shape:
        world *= size
    for (losses, params, records, peak), (c_losses, c_params, c_records, c_peak) in get_pool(
        world
    ).run(_coalescing_worker, mesh_shape, None):
        gathers, reduces = _ops(records, "all_gather"), _ops(records, "reduce_scatter")
        c_gathers, c_reduces = _ops(c_records, "all_gather"), _ops(c_records, "reduce_scatter")
        assert (len(gathers), len(reduces)) == (1 + 2 * BLOCKS, 1 + BLOCKS)
        assert [r.label for r in c_gathers] == ["<root>", "blocks.0..blocks.7", "blocks.7..blocks.0"]
        # (The root's gradients are ready before blocks.0's: its reduce goes between them.)
        assert [r.label for r in c_reduces] == ["blocks.7..blocks.0"]
        if len(mesh_shape) == 2:  # and one cross-replica all-reduce of the shared output
            assert len(_ops(records, "all_reduce")) == 1 + BLOCKS
            assert [r.label for r in _ops(c_records, "all_reduce")] == ["blocks.7..blocks.0"]
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            assert sum(r.input_bytes for r in _ops(records, op)) == sum(
                r.input_bytes for r in _ops(c_records, op)
            ), op
        # Held from the issue of one all-gather: at most the 1 MiB more, here eight small units.
        assert peak < c_peak <= peak + (1 << 20)
        if mesh_shape[-1] == 2:
            assert c_losses == losses
            for name, value in params.items():
                assert torch.equal(c_params[name], value), name
        else:
            torch.testing.assert_close(c_losses, losses, rtol=1e-5, atol=1e-6)
            for name, value in params.items():
                torch.testing.assert_close(c_params[name], value, rtol=1e-5, atol=1e-6)


def test_coalescing_stops_at_max_bytes():
    """A cap of three blocks' reduce-scatter input gathers the blocks three by three and reduces
    them three by three, in the recorded order forward and backward."""
    # A block's reduce-scatter input: 272 values and a flag per parameter on each of 2 ranks
    # (its all-gather output, 272 values, fits in the same).
    block_bytes = 2 * ((WIDTH * WIDTH + WIDTH) // 2 + 2) * 4
    results = get_pool(2).run(_coalescing_worker, (2,), 3 * block_bytes)
    for _, (_, _, records, _) in results:
        assert [r.label for r in _ops(records, "all_gather")] == [
            "<root>",
            "blocks.0..blocks.2",
            "blocks.3..blocks.5",
            "blocks.6..blocks.7",
            "blocks.7..blocks.5",
            "blocks.4..blocks.2",
            "blocks.1..blocks.0",
        ]
        reduces = _ops(records, "reduce_scatter")
        assert [r.label for r in reduces] == [
            "blocks.7..blocks.5",
            "blocks.4..blocks.2",
            "blocks.1..blocks.0",  # and the root, whose gradients are ready before blocks.0's
        ]
        assert all(r.input_bytes <= 3 * block_bytes for r in reduces)


def _argument_worker():
    model = _sharded((2,), None)
    errors = []
    for bad in (-1, True, 1.5, "1MiB"):
        try:
            fshard.set_coalescing(model, bad)
        except TypeError as exc:
            errors.append(str(exc))
    model(torch.ones(2, WIDTH)).sum().backward()
    try:  # after the model ran, the ranks compare their settings
        fshard.set_coalescing(model, 1 << (20 + dist.get_rank()))
    except fshard.RankMismatchError as exc:
        errors.append(str(exc))
    return errors


def test_set_coalescing_refuses_bad_sizes_and_ranks_that_disagree():
    for errors in get_pool(2).run(_argument_worker):
        assert len(errors) == 5, errors
        assert all("set_coalescing: max_bytes must be an int >= 0" in e for e in errors[:4])
        assert "fshard.set_coalescing: the ranks' prefetch settings differ" in errors[4]
        assert "coalescing=1048576" in errors[4] and "coalescing=2097152" in errors[4]


def test_units_alone_keep_their_collectives_counted_per_unit():
    """``set_coalescing(model, 0)``: a collective per unit and step, as FSDP2 issues."""
    for (_, _, records, _), _ in get_pool(2).run(_coalescing_worker, (2,), None):
        counts = Counter(r.label for r in _ops(records, "all_gather"))
        assert counts == Counter({"<root>": 1, **{f"blocks.{i}": 2 for i in range(BLOCKS)}})
