"""Memory: shards are torch.chunk's, and nothing full-size outlives the step that needed it."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives
from fshard.testing import strategies as fst
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)
from tests.dist.probes import GatherProbe


class Params(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)


def _local_shapes_worker(shapes, mesh_shape):
    torch.manual_seed(0)
    model = Params(shapes)
    full = [p.detach().clone() for p in model.parameters()]
    fshard.fully_shard(model, mesh=mesh_for(mesh_shape))
    return [(tuple(p.shape), p.detach().clone()) for p in model.parameters()], full


@given(
    world_and_mesh=st.integers(1, 4).flatmap(
        lambda w: st.tuples(st.just(w), fst.mesh_shapes(world_size=w))
    ),
    shapes=st.lists(fst.param_shapes(max_side=7), min_size=1, max_size=4),
)
def test_local_shards_are_torch_chunk_pieces(world_and_mesh, shapes):
    world, mesh_shape = world_and_mesh
    size = mesh_shape[-1]
    results = get_pool(world).run(_local_shapes_worker, shapes, mesh_shape)
    for rank, (locals_, full) in enumerate(results):
        shard_rank = rank % size
        for (shape, local), whole in zip(locals_, full, strict=True):
            if whole.dim() == 0:
                assert shape == () and torch.equal(local, whole)
                continue
            chunks = whole.chunk(size) if whole.shape[0] else ()
            expected = chunks[shard_rank] if shard_rank < len(chunks) else whole[:0]
            assert shape == tuple(expected.shape)
            assert torch.equal(local, expected)


SPEC = TransformerSpec(vocab=29, dim=8, heads=2, layers=2, seq=6, batch_size=2)


def _step_leaves_nothing_worker(mesh_shape, reshard_after_forward, accumulation):
    rank = dist.get_rank()
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for(mesh_shape), reshard_after_forward=reshard_after_forward)
    probe = GatherProbe(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alive_between = []
    for step in range(2):
        for micro in range(2 if accumulation else 1):
            last = micro == (1 if accumulation else 0)
            ctx = contextlib.nullcontext()
            if not last:
                ctx = fshard.no_sync(model, reduce_scatter=accumulation == "reduce_scatter")
            with ctx:
                compute_loss(SPEC, model, make_batch(SPEC, step * 2 + micro, rank)).backward()
            if not last:
                alive_between.append(probe.alive())
        opt.step()
        opt.zero_grad()
    grads_local = all(p.grad is None for p in model.parameters())
    return probe.alive(), alive_between, len(probe.params), grads_local


@pytest.mark.parametrize("accumulation", [None, "no_sync", "reduce_scatter"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_no_full_size_storage_survives_a_step(mesh_shape, reshard_after_forward, accumulation):
    for alive, alive_between, seen, _ in get_pool(4).run(
        _step_leaves_nothing_worker, mesh_shape, reshard_after_forward, accumulation
    ):
        assert seen == 26  # every gathered parameter was observed
        assert alive == []
        if accumulation == "no_sync":
            # Plain no_sync keeps full gradients between micro-batches (like DDP), nothing else.
            assert alive_between and all(a and all(x.startswith("grad") for x in a) for a in alive_between)
        elif accumulation == "reduce_scatter":
            # Sharded accumulation: no full gradient survives a micro-batch.
            assert alive_between == [[], []]


def _model_is_freed_worker():
    import gc
    import weakref

    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    compute_loss(SPEC, model, make_batch(SPEC, 0, dist.get_rank())).backward()
    ref = weakref.ref(model)
    first = weakref.ref(next(model.parameters()))
    del model
    gc.collect()
    return ref() is None and first() is None


def test_a_sharded_model_is_freed_when_dropped():
    # fshard keeps no global reference to a model (units live on their modules).
    assert get_pool(2).run(_model_is_freed_worker) == [True, True]


class _MayFail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return torch.tanh(self.lin(x))


def _retry_worker(how: str, frozen: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), *(_MayFail() for _ in range(4)))
    if frozen:  # LoRA-like: the blocks' weights frozen, their biases trained
        for block in model[1:]:
            block.lin.weight.requires_grad_(False)
    for block in model[1:]:
        fshard.fully_shard(block, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    fshard.set_coalescing(model, 0)  # per-unit gathers (this test compares their peaks): no coalescing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks, after = [], []
    for step in range(4):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(step))
        fshard.reset_peak_memory_stats()
        if step == 2:
            if how == "raise":  # a unit's forward raises; the caller catches it and goes on
                model[2].fail = True
                with contextlib.suppress(RuntimeError):
                    model(x)
                model[2].fail = False
            else:  # a forward with grad whose backward never runs (a NaN loss skipped)
                model(x).sum()
            continue
        with trace_collectives() as records:
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        peaks.append(fshard.memory_stats().peak_gathered_bytes)
        after.append(fshard.memory_stats().gathered_bytes)
        # The retried forward runs the units once each, in the first step's order: nothing to
        # compare across ranks (the units that ran before the raise counted twice).
        assert not any(r.label == "check_unit_order" for r in records), records
    return peaks, after


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-weights"])
@pytest.mark.parametrize("how", ["raise", "no-backward"])
def test_the_step_after_an_abandoned_forward_uses_the_usual_memory(how, frozen):
    """A forward that raised (an out-of-memory error caught to retry smaller) or whose backward
    never ran leaves nothing gathered that the next step would hold on top of its own, also
    for units with frozen weights (which wait on their inputs' gradients)."""
    for peaks, after in get_pool(2).run(_retry_worker, how, frozen):
        assert peaks[1] == peaks[2] == peaks[0] > 0, peaks  # steps 0, 1 and 3
        assert after == [0, 0, 0], after


def _dropped_after_a_failed_forward_worker():
    import gc
    import weakref

    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    rank = dist.get_rank()
    compute_loss(SPEC, model, make_batch(SPEC, 0, rank)).backward()  # later forwards prefetch

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    model.blocks[0].forward = fail  # raises with the next unit's gather in flight
    with contextlib.suppress(RuntimeError):
        compute_loss(SPEC, model, make_batch(SPEC, 1, rank))
    del model.blocks[0].forward
    during = fshard.memory_stats().gathered_bytes
    ref = weakref.ref(model)
    del model
    gc.collect()
    return during, ref() is None, fshard.memory_stats().gathered_bytes


def test_a_failed_forward_frees_what_it_gathered_at_once():
    """The root's forward raising (the next unit's gather in flight) frees every gathered
    unit before the exception reaches the caller; the model then goes with nothing counted."""
    for during, freed, after in get_pool(2).run(_dropped_after_a_failed_forward_worker):
        assert during == 0 and freed and after == 0, (during, freed, after)


def _freed_before_reduce_worker():
    from fshard.testing import trace_collectives

    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    fshard.set_coalescing(model, 0)  # per-unit reduce-scatters (this test labels them): no coalescing
    fshard.set_prefetch(model, forward=False, backward="NO_PREFETCH")
    rank = dist.get_rank()
    loss = compute_loss(SPEC, model, make_batch(SPEC, 0, rank))
    root_only = fshard.memory_stats().gathered_bytes  # the root keeps its params for backward
    at_reduce = {}

    def sample(record):
        if record.op == "reduce_scatter":
            at_reduce[record.label] = fshard.memory_stats().gathered_bytes

    with trace_collectives(sample):
        loss.backward()
    return root_only, at_reduce


def test_a_unit_is_freed_before_its_gradients_are_reduced():
    """A unit's gathered params go before the reduce-scatter's full-size input comes: the
    backward's peak holds one of the two, not both."""
    for root_only, at_reduce in get_pool(2).run(_freed_before_reduce_worker):
        blocks = {label: held for label, held in at_reduce.items() if label.startswith("blocks.")}
        assert len(blocks) == SPEC.layers and root_only > 0
        assert all(held == root_only for held in blocks.values()), (root_only, at_reduce)
        assert at_reduce["<root>"] == 0, at_reduce


def _dropped_with_a_gather_in_flight_worker():
    import gc

    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    fshard.unshard(model.blocks[0], async_op=True)  # a handle never waited on
    during = fshard.memory_stats().gathered_bytes
    del model
    gc.collect()
    return during, fshard.memory_stats().gathered_bytes


def test_a_model_dropped_with_a_gather_in_flight_leaves_nothing_counted():
    for during, after in get_pool(2).run(_dropped_with_a_gather_in_flight_worker):
        assert during > 0 and after == 0, (during, after)


def _two_forwards_worker(mesh_shape: tuple[int, ...]):
    torch.manual_seed(0)
    blocks = 6
    reference = nn.Sequential(nn.Linear(16, 16), *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)))
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    for block in model[1:]:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    block_bytes = 4 * sum(p.numel() for p in reference[1].parameters())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    peaks = []
    for step in range(3):
        a, b = (torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank() + k)) for k in (0, 5))
        fshard.reset_peak_memory_stats()
        (reference(a).pow(2).mean() + reference(b).abs().mean()).backward()
        with trace_collectives() as records:
            (model(a).pow(2).mean() + model(b).abs().mean()).backward()  # two forwards, one backward
        peaks.append(fshard.memory_stats().peak_gathered_bytes / block_bytes)
        # One reduce-scatter per unit, as with one forward: a parameter's gradient arrives once
        # both forwards' parts are done, so a reduce between the parts would send zeros.
        assert sum(r.op == "reduce_scatter" for r in records) == blocks + 1, records
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert fshard.memory_stats().gathered_bytes == 0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    return peaks


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_two_forwards_before_one_backward_hold_few_units_gathered(mesh_shape):
    """The second forward's backward runs first, through every block, then the first's: each
    block is freed (its gradients so far reduced) once the backward moves on to the next, as
    between two steps, so the peak is about one forward's (the root and two blocks), not
    every block gathered with its full gradient until the first forward's backward reaches it
    (7 blocks' worth with 6 blocks: DDP's memory). Training equals the plain model."""
    for peaks in get_pool(math.prod(mesh_shape)).run(_two_forwards_worker, mesh_shape):
        assert max(peaks) < 3.5, peaks  # the root (a block's size) and a block, plus prefetch
