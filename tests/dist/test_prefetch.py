"""Prefetch: the next unit's all-gather is in flight while the current unit computes."""

from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import fshard
from fshard.testing import assert_equivalent_to_ddp, get_pool, mesh_for, trace_collectives
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)
from tests.dist.probes import GatherProbe

SPEC = TransformerSpec(vocab=31, dim=12, heads=3, layers=4, seq=6, batch_size=2)


def _configure(model, prefetch):
    blocks = list(model.blocks)
    if prefetch == "explicit":
        fshard.set_prefetch(blocks[0], forward=[blocks[2]])
        fshard.set_prefetch(blocks[3], backward=[blocks[1]])
    elif prefetch == "forward-off":
        fshard.set_prefetch(model, forward=False)
    elif prefetch == "none":
        fshard.set_prefetch(model, forward=False, backward="NO_PREFETCH")
    elif prefetch is not None:
        fshard.set_prefetch(model, backward=prefetch)


class _Mark(torch.autograd.Function):
    """The identity; its backward calls ``record(event)``, the moment autograd gets there."""

    @staticmethod
    def forward(ctx, x, record, event):
        ctx.record, ctx.event = record, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.record(ctx.event)
        return grad, None, None


def _mark_compute(block, label, record):
    """Record, from inside ``block``'s own forward (after fshard's pre-forward hook, before its
    post-forward hook), ``("compute", label)`` as its forward compute starts; in backward,
    ``("backward_compute", label)`` as its backward compute starts (its output's gradient came
    and fshard's pre-backward hook on that output ran) and ``("backward_done", label)`` once
    it is done (its input's gradient computed, before fshard learns so)."""
    body = block.forward

    def body_with_marks(x):
        record(("compute", label))
        out = body(_Mark.apply(x, record, ("backward_done", label)))
        return _Mark.apply(out, record, ("backward_compute", label))

    block.forward = body_with_marks


def _events_worker(prefetch, reshard_after_forward=True):
    rank = dist.get_rank()
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)), reshard_after_forward=reshard_after_forward)
    fshard.set_coalescing(model, 0)  # per-unit collectives (these tests order them): no coalescing
    _configure(model, prefetch)
    probe = GatherProbe(model)
    events: list[tuple] = []
    for i, block in enumerate(model.blocks):  # registered after fshard's hooks: run after them
        block.register_forward_pre_hook(lambda m, a, i=i: events.append(("start", f"blocks.{i}")))
        block.register_forward_hook(lambda m, a, o, i=i: events.append(("end", f"blocks.{i}")))
        _mark_compute(block, f"blocks.{i}", events.append)
    wait = fshard._collectives.wait

    def recorded_wait(work, *, op, label):  # when fshard waits for a collective it issued
        if work is not None:
            events.append(("wait", op, label))
        wait(work, op=op, label=label)

    def units_alive() -> int:
        units = set()
        for fqn in _alive_params(probe):
            parts = fqn.split(".")
            units.add(".".join(parts[:2]) if parts[0] == "blocks" else "<root>")
        return len(units)

    peaks = []
    for step in range(2):  # step 0 records the order; step 1 prefetches
        events.clear()
        peak = [0]
        fshard.reset_peak_memory_stats()

        def sample(record, peak=peak):
            peak[0] = max(peak[0], units_alive())
            events.append((record.op, record.label, record.async_op))

        waits = mock.patch.object(fshard._collectives, "wait", recorded_wait)
        with trace_collectives(on_record=sample), waits:
            loss = compute_loss(SPEC, model, make_batch(SPEC, step, rank))
            events.append(("backward",))
            loss.backward()
        peaks.append(peak[0])
    largest_gather = max(
        sum(math.ceil(p.full_shape[0] / 2) * 2 * math.prod(p.full_shape[1:]) * 4 for p in block.parameters())
        for block in model.blocks
    )  # a block's all-gather output in bytes: 2 ranks' padded fp32 shards
    return events, peaks, fshard.memory_stats().peak_gathered_bytes, largest_gather


def _alive_params(probe):
    return [fqn for fqn, ref in probe.params.values() if ref() is not None and ref().untyped_storage().nbytes() > 0]


def _index(events, *match):
    return next(i for i, e in enumerate(events) if e[: len(match)] == match)


def test_forward_prefetch_issues_the_next_gather_before_the_current_unit_ends():
    events, *_ = get_pool(2).run(_events_worker, None)[0]
    for k in range(SPEC.layers - 1):
        gather_next = _index(events, "all_gather", f"blocks.{k + 1}")
        assert events[gather_next][2] is True  # asynchronous
        assert gather_next > _index(events, "all_gather", f"blocks.{k}")
        # In flight while unit k computes: issued before its forward compute starts (not in its
        # post-forward, which overlaps nothing), waited on only after that compute.
        compute = _index(events, "compute", f"blocks.{k}")
        assert gather_next < compute, events
        assert compute < _index(events, "wait", "all_gather", f"blocks.{k + 1}"), events


def test_backward_prefetch_pre_issues_before_the_current_unit_reduces():
    events, *_ = get_pool(2).run(_events_worker, "BACKWARD_PRE")[0]
    backward = events[_index(events, "backward") :]
    for k in range(SPEC.layers - 1, 0, -1):
        gather_prev = _index(backward, "all_gather", f"blocks.{k - 1}")
        assert backward[gather_prev][2] is True
        assert gather_prev < _index(backward, "reduce_scatter", f"blocks.{k}")
        # BACKWARD_PRE: issued at unit k's pre-backward, before its backward compute starts
        # (BACKWARD_POST's moment is after it), and waited on once that compute is done.
        assert gather_prev > _index(backward, "all_gather", f"blocks.{k}"), backward
        assert gather_prev < _index(backward, "backward_compute", f"blocks.{k}"), backward
        waited = _index(backward, "wait", "all_gather", f"blocks.{k - 1}")
        assert _index(backward, "backward_done", f"blocks.{k}") < waited, backward
        assert waited < _index(backward, "backward_compute", f"blocks.{k - 1}"), backward


@pytest.mark.parametrize("policy", ["BACKWARD_POST", "NO_PREFETCH"])
def test_backward_prefetch_post_and_none(policy):
    events, *_ = get_pool(2).run(_events_worker, policy)[0]
    backward = events[_index(events, "backward") :]
    for k in range(SPEC.layers - 1, 0, -1):
        gather_prev = _index(backward, "all_gather", f"blocks.{k - 1}")
        # Both: not before unit k's backward compute is done (BACKWARD_PRE's moment is
        # before it starts), and before unit k-1's backward compute, which needs it.
        assert _index(backward, "backward_done", f"blocks.{k}") < gather_prev, backward
        assert gather_prev < _index(backward, "backward_compute", f"blocks.{k - 1}"), backward
        if policy == "BACKWARD_POST":
            # Issued once unit k is freed (which is before its gradients are reduced, as in
            # FSDP1), not when its backward starts.
            assert _index(backward, "all_gather", f"blocks.{k}") < gather_prev
            assert gather_prev < _index(backward, "reduce_scatter", f"blocks.{k}"), backward
        else:
            assert gather_prev > _index(backward, "reduce_scatter", f"blocks.{k}")
        assert backward[gather_prev][2] is (policy == "BACKWARD_POST")


def test_backward_reduce_scatter_is_in_flight_during_the_next_units_backward():
    """Unit k's reduce-scatter is issued asynchronously once its backward compute is done,
    and waited on only after unit k-1's backward compute (when unit k-1's own is issued), not
    at once: the reduction overlaps the next unit's backward."""
    events, *_ = get_pool(2).run(_events_worker, None)[0]
    backward = events[_index(events, "backward") :]
    for k in range(SPEC.layers - 1, 0, -1):
        reduce = _index(backward, "reduce_scatter", f"blocks.{k}")
        assert backward[reduce][2] is True, backward  # asynchronous
        assert _index(backward, "backward_done", f"blocks.{k}") < reduce, backward
        assert reduce < _index(backward, "backward_compute", f"blocks.{k - 1}"), backward
        waited = _index(backward, "wait", "reduce_scatter", f"blocks.{k}")
        assert _index(backward, "backward_done", f"blocks.{k - 1}") < waited, backward
        # At most one in flight: waited on as the next one is issued.
        assert _index(backward, "reduce_scatter", f"blocks.{k - 1}") < waited, backward


def test_forward_prefetch_can_be_turned_off():
    events, *_ = get_pool(2).run(_events_worker, "forward-off")[0]
    forward = events[: _index(events, "backward")]
    assert all(not e[2] for e in forward if e[0] == "all_gather")


def test_explicit_prefetch_lists_are_honoured():
    events, *_ = get_pool(2).run(_events_worker, "explicit")[0]
    forward = events[: _index(events, "backward")]
    # blocks.0 prefetches blocks.2 (not blocks.1): it is issued before blocks.0 even starts.
    gather_2 = _index(forward, "all_gather", "blocks.2")
    assert forward[gather_2][2] is True and gather_2 < _index(forward, "start", "blocks.0")
    assert forward[_index(forward, "all_gather", "blocks.1")][2] is False
    backward = events[_index(events, "backward") :]
    gather_1 = _index(backward, "all_gather", "blocks.1")
    assert backward[gather_1][2] is True and gather_1 < _index(backward, "reduce_scatter", "blocks.3")
    # An explicit backward list is issued at the unit's pre-backward (BACKWARD_PRE), before
    # blocks.3's backward compute starts, and blocks.2 is not prefetched by anyone.
    assert gather_1 < _index(backward, "backward_compute", "blocks.3"), backward
    gather_2 = _index(backward, "all_gather", "blocks.2")
    assert backward[gather_2][2] is False, backward
    assert gather_2 > _index(backward, "backward_done", "blocks.3"), backward


def test_gathered_units_alive_at_once_are_bounded():
    # FULL_SHARD keeps the root gathered through forward and backward (it encloses the rest);
    # besides it only the current unit holds gathered params. A prefetched unit holds just its
    # all-gather output while the gather is in flight: its params are allocated when it is
    # waited on, once the current unit was freed.
    pool = get_pool(2)
    _, units_with, peak_with, largest = pool.run(_events_worker, None)[0]
    _, units_without, peak_without, _ = pool.run(_events_worker, "none")[0]
    # Sampled as each collective is issued: with prefetch, the current unit is alive when the
    # next one's gather goes out; without, a unit's gather comes after the previous unit was
    # freed, and its reduce-scatter after it was freed itself, so only the root is alive.
    assert units_with[1] == 2 and units_without[1] == 1
    assert peak_without <= peak_with <= peak_without + largest


@pytest.mark.parametrize("prefetch", [None, "BACKWARD_POST", "NO_PREFETCH", "explicit", "forward-off"])
def test_prefetch_leaves_results_unchanged(prefetch):
    assert_equivalent_to_ddp(
        functools.partial(build_model, SPEC),
        batch_fn=functools.partial(make_batch, SPEC),
        loss_fn=functools.partial(compute_loss, SPEC),
        shard_fn=functools.partial(_shard_and_configure, prefetch),
        world_size=2,
        steps=3,
    )


def _shard_and_configure(prefetch, model, mesh):
    shard_model(SPEC, model, mesh)
    _configure(model, prefetch)


def test_set_prefetch_rejects_bad_input():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not an fshard unit"):
        fshard.set_prefetch(model, forward=True)


def _backward_peak_worker(policy):
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    fshard.set_coalescing(model, 0)  # per-unit gathers (this test weighs one in flight): no coalescing
    fshard.set_prefetch(model, forward=False, backward=policy)
    at_compute = {}  # gathered bytes as each block's backward compute starts

    def sample(event):
        if event[0] == "backward_compute":
            at_compute[event[1]] = fshard.memory_stats().gathered_bytes

    for i, block in enumerate(model.blocks):
        _mark_compute(block, f"blocks.{i}", sample)
    batch = make_batch(SPEC, 0, dist.get_rank())
    compute_loss(SPEC, model, batch).backward()  # records the order
    loss = compute_loss(SPEC, model, batch)
    base = fshard.memory_stats().gathered_bytes
    fshard.reset_peak_memory_stats()
    loss.backward()
    return fshard.memory_stats().peak_gathered_bytes - base, at_compute


def test_backward_prefetch_holds_no_more_than_no_prefetch():
    """BACKWARD_POST gathers the next unit only once the current one is freed; BACKWARD_PRE
    gathers it while the current one computes, but its params get memory only when it is waited
    on, after the current unit was freed: in flight it holds its all-gather output, as large as
    the output a gather without prefetch holds beside the unit's params (equal blocks here)."""
    pool = get_pool(2)
    (pre, pre_at), (post, post_at), (none, none_at) = (
        pool.run(_backward_peak_worker, p)[0] for p in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
    )
    assert pre == post == none
    # ... and BACKWARD_PRE does have that output in flight while a block's backward computes
    # (but blocks.0, the last the backward reaches); the others have nothing in flight then.
    assert post_at == none_at, (post_at, none_at)
    in_flight = {label: pre_at[label] - post_at[label] for label in pre_at}
    assert in_flight.pop("blocks.0") == 0, (pre_at, post_at)
    assert len(set(in_flight.values())) == 1 and min(in_flight.values()) > 0, (pre_at, post_at)


class _Skippable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.skip: set[int] = set()

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return x


def _skippable(mesh):
    model = _Skippable()
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    return fshard.fully_shard(model, mesh=mesh)


def _prefetch_leak_worker():
    import gc

    mesh = mesh_for((2,))
    start = fshard.memory_stats().gathered_bytes
    # A unit of another model in a prefetch list: refused (it would be gathered, never freed).
    a, b = _skippable(mesh), _skippable(mesh)
    fshard.set_prefetch(a.blocks[0], forward=[b.blocks[1]])
    with pytest.raises(ValueError, match=r"prefetches unit .* not part of the same sharded model"):
        a(torch.randn(2, 8))
    fshard.set_prefetch(a.blocks[0], forward=[a.blocks[1]])
    a(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ValueError, match="not part of the same sharded model"):
        fshard.set_prefetch(a.blocks[0], forward=[b.blocks[1]])  # after init: checked at once
    # Inference: a prefetched unit that then does not run is freed when the forward ends.
    c = _skippable(mesh)
    c.skip = {2}
    fshard.set_prefetch(c.blocks[0], forward=[c.blocks[2]])
    with torch.no_grad():
        c(torch.randn(2, 8))
    assert fshard.memory_stats().gathered_bytes == start
    c(torch.randn(2, 8))  # and so in training (the root owns no params: nothing kept)
    assert fshard.memory_stats().gathered_bytes == start
    # A model deleted while gathered (the root keeps its params from forward to the backward
    # that never comes) no longer counts.
    d = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fshard.fully_shard(d[0], mesh=mesh)
    fshard.fully_shard(d, mesh=mesh)
    d(torch.randn(2, 8))
    assert fshard.memory_stats().gathered_bytes > start
    del a, b, c, d
    gc.collect()
    assert fshard.memory_stats().gathered_bytes == start
    return True


def test_prefetch_leaves_nothing_gathered():
    assert all(get_pool(2).run(_prefetch_leak_worker))


# ------------------------------------------------- one gather and one reduce per unit and backward


class _TwoUnits(nn.Module):
    """Units ``a`` and ``b`` (each two Linears). ``first_call_without_grad``: ``a`` runs first
    on a tensor that needs no grad, then on the hidden state; ``order_changes``: ``a`` then
    ``b`` on even steps, ``b`` then ``a`` on odd ones (the recorded order is the first)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.steps = 0
        self.inp = nn.Linear(6, 6)
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.mode == "first_call_without_grad":
            side = torch.tanh(self.a(x.flip(0))) * 3  # x needs no grad
            h = self.b(self.a(h) * side)
        elif self.steps % 2 == 0:
            h = self.b(self.a(h))
        else:
            h = self.a(self.b(h))
        self.steps += 1
        return self.head(h)


def _one_gather_per_backward_worker(mode: str) -> list[list[tuple[str, str]]]:
    from tests.dist.test_usage_cases import _assert_params_equal, _batch, _beside_ddp, _sgd

    ddp, model, reference = _beside_ddp(
        functools.partial(_TwoUnits, mode), lambda m: (m.a, m.b), ddp_kwargs={"find_unused_parameters": True}
    )
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    optims = _sgd(ddp, model)
    traces = []
    for step in range(3):
        x = _batch(step, (4, 6))
        ddp(x).pow(2).mean().backward()
        loss = model(x).pow(2).mean()
        with trace_collectives() as records:
            loss.backward()
        traces.append([(r.op, r.label) for r in records])
        for opt in optims:
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)
    return traces


@pytest.mark.parametrize("mode", ["first_call_without_grad", "order_changes"])
def test_a_backward_gathers_and_reduces_each_unit_once(mode):
    """A unit called twice, once on a tensor needing no grad, is reduced when the backward
    ends (not once its other call's inputs have their gradients, then again with the rest);
    a prefetch from the recorded order skips a unit this step already reduced."""
    for traces in get_pool(2).run(_one_gather_per_backward_worker, mode):
        for backward in traces:
            for label in ("a", "b"):
                ops = [op for op, where in backward if where == label]
                assert ops.count("reduce_scatter") == 1, (label, backward)
                assert "all_gather" not in ops[ops.index("reduce_scatter"):], (label, backward)


# ---------------------------------------- units a step's backward has nothing to do with


class _PassedOver(nn.Module):
    """Blocks ``0..3`` (units) after an embedding unit, then a head. ``skipped``: block 2 does
    not run after the first step; ``teacher``: a frozen ``teacher`` unit runs under
    ``torch.no_grad()`` in the forward, its output the target (``trainable_teacher``: the
    same, its params requiring grad); ``frozen_embedding``: the embedding is frozen;
    ``own_target``: the blocks compute the target under ``torch.no_grad()`` first."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.steps = 0
        self.embed = nn.Embedding(11, 6).requires_grad_(mode != "frozen_embedding")
        self.teacher = nn.Linear(6, 6).requires_grad_(mode == "trainable_teacher")
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, 3)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (self.mode == "skipped" and i == 2 and self.steps > 0):
                x = torch.tanh(block(x))
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        target = 0
        if self.mode in ("teacher", "trainable_teacher"):
            with torch.no_grad():
                target = self.teacher(x)
        elif self.mode == "own_target":
            with torch.no_grad():
                target = self._blocks(x.flip(0))
        x = self._blocks(x)
        self.steps += 1
        return self.head(x - target)


def _passed_over_worker(mode: str) -> list[list[tuple[str, str]]]:
    from tests.dist.test_usage_cases import _assert_params_equal, _sgd

    ddp, model, reference = _beside_ddp_passed_over(mode)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    optims = _sgd(ddp, model)
    traces = []
    for step in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        ddp(ids).pow(2).mean().backward()
        loss = model(ids).pow(2).mean()
        with trace_collectives() as records:
            loss.backward()
        # (a step that skips what the last one ran starts its backward with the order check)
        records = [r for r in records if r.label != "check_unit_order"]
        traces.append([(r.op, r.label) for r in records])
        if step > 0 and mode != "own_target":
            # The root (the head's unit, its params kept from the forward) prefetches the last
            # block at its pre-backward, before the head's gradient is reduced.
            assert (records[0].op, records[0].label, records[0].async_op) == ("all_gather", "blocks.3", True)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)
    return traces


def _beside_ddp_passed_over(mode: str):
    from tests.dist.test_usage_cases import _beside_ddp

    return _beside_ddp(
        functools.partial(_PassedOver, mode),
        lambda m: (m.embed, m.teacher, *m.blocks),
        ddp_kwargs={"find_unused_parameters": True},
    )


@pytest.mark.parametrize(
    ("mode", "passed_over"),
    [
        ("skipped", "blocks.2"),
        ("teacher", "teacher"),
        ("trainable_teacher", "teacher"),
        ("frozen_embedding", "embed"),
    ],
)
def test_backward_prefetch_passes_over_units_the_backward_does_not_reach(mode, passed_over):
    """A unit that did not run this step, or a frozen one whose forward had no input needing
    grad, is not gathered for the backward (it would be held to its end, and the unit before
    it would lose its prefetch); the backward prefetches the next unit it reaches instead.
    Nor is it reduced: a trainable teacher run only under ``torch.no_grad()`` gets no gradient
    on any rank (a reduce-scatter of zeros the size of the teacher, every step, it was)."""
    # (the unit the backward reaches after the one passed over, and the unit it follows)
    successor, after = {
        "skipped": ("blocks.1", "blocks.3"),
        "teacher": ("embed", "blocks.0"),
        "trainable_teacher": ("embed", "blocks.0"),
    }.get(mode, (None, None))
    for traces in get_pool(2).run(_passed_over_worker, mode):
        for backward in traces[1:]:  # the first step records the order
            assert ("all_gather", passed_over) not in backward, backward
            assert ("reduce_scatter", passed_over) not in backward, backward
            # Nor is the root gathered again once its head's gradients freed it: the backward
            # reaches units in the reverse order their forwards finished, the root's last.
            assert ("all_gather", "<root>") not in backward, backward
            if successor is not None:  # prefetched: gathered before the unit it follows reduces
                assert backward.index(("all_gather", successor)) < backward.index(("reduce_scatter", after)), backward


def test_units_that_computed_a_target_without_grad_are_reduced_during_the_backward():
    """Blocks run under ``torch.no_grad()`` inside the training forward (a target the model
    computes itself), then with grad: no backward comes for the first calls, so each block is
    reduced and freed once its own backward is done, not all held gathered, with their full
    gradients, to the end (taken for a reentrant checkpoint's forward, which is also run
    without grad, they were: DDP's memory)."""
    for traces in get_pool(2).run(_passed_over_worker, "own_target"):
        for backward in traces:
            for i in (3, 2):  # (the block before is prefetched while this one computes)
                assert backward.index(("reduce_scatter", f"blocks.{i}")) < backward.index(
                    ("all_gather", f"blocks.{i - 2}")
                ), backward


# ------------------------------------------- a prefetch that outlives its forward


class _TiedProjection(nn.Module):
    """An embedding unit called again at the end as the output projection (GPT-2's tied head):
    that second call prefetches the unit recorded after it, ``blocks.0``, which does not run
    again, so a forward with no backward leaves its gather in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = _Projectable()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.emb(h, project=True)


class _Projectable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 6) * 0.5)

    def forward(self, x: torch.Tensor, project: bool = False) -> torch.Tensor:
        return x @ self.weight.t() if project else self.weight[x]


def _validation_between_backward_and_step_worker() -> None:
    from tests.dist.test_usage_cases import _assert_params_equal, _beside_ddp, _sgd

    ddp, model, reference = _beside_ddp(_TiedProjection, lambda m: (m.emb, *m.blocks))
    optims = _sgd(ddp, model)
    for step in range(3):
        tokens = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(7 * step + dist.get_rank()))
        losses = []
        for m in (ddp, model):
            loss = F.cross_entropy(m(tokens).reshape(-1, 10), tokens.reshape(-1))
            loss.backward()
            m(tokens.flip(0)).pow(2).mean()  # a validation forward, grad mode left on
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-6, (step, losses)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)


def test_a_gather_in_flight_across_an_optimizer_step_is_not_used():
    """The next forward gathers a unit afresh when its shards changed (the optimizer stepped)
    since a gather still in flight was issued: it computed with the weights from before the
    step (or a mix, read while the step wrote them), off DDP from the next step on."""
    get_pool(2).run(_validation_between_backward_and_step_worker)


class _CheckpointedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)), x, use_reentrant=True)
        return x


def _backward_after_an_abandoned_forward_worker() -> list[list[tuple[str, str]]]:
    torch.manual_seed(0)
    model = _CheckpointedBlocks()
    mesh = mesh_for((2,))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    traces = []
    for abandon in (False, True, True):
        x = torch.randn(3, 6, requires_grad=True)
        if abandon:  # a forward with grad whose backward never comes (a NaN loss skipped)
            model(x).sum()
            with torch.no_grad():
                model(x)
        loss = model(x).sum()
        with trace_collectives() as records:
            loss.backward()
        traces.append([(r.op, r.label) for r in records if r.op != "all_gather_object"])
    return traces


def test_a_reentrant_checkpoints_forward_without_backward_does_not_hold_the_next_backward():
    """A forward with grad under reentrant checkpointing whose backward never comes leaves no
    claim of a recompute to come: the next step's backward reduces and frees each unit as it
    goes (it held every unit gathered, with its full gradients, to the end: DDP's memory)."""
    for normal, *after_abandoned in get_pool(2).run(_backward_after_an_abandoned_forward_worker):
        for trace in after_abandoned:
            assert trace == normal, (trace, normal)
        assert normal.index(("reduce_scatter", "blocks.3")) < normal.index(("all_gather", "blocks.1")), normal


def _trace_with_settings(style):
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch

    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    if style == "fshard":
        fshard.set_prefetch(model, backward=fshard.BackwardPrefetch.BACKWARD_POST)
        fshard.set_prefetch(model.blocks[0], forward=list(model.blocks)[2:4])
        with pytest.raises(TypeError, match=r"backward must be .* or a name such as 'BACKWARD_PRE'"):
            fshard.set_prefetch(model, backward=3)
    elif style == "torch":  # as code ported from FSDP1 / FSDP2 writes them
        fshard.set_prefetch(model, backward=TorchBackwardPrefetch.BACKWARD_POST)
        fshard.set_prefetch(model.blocks[0], forward=model.blocks[2:4])
    traces = []
    for step in range(2):
        with trace_collectives() as records:
            compute_loss(SPEC, model, make_batch(SPEC, step, dist.get_rank())).backward()
        traces.append([(r.op, r.label, r.async_op) for r in records])
    return traces


def test_set_prefetch_takes_torchs_enum_and_a_module_list_slice():
    pool = get_pool(2)
    ours, ported = pool.run(_trace_with_settings, "fshard"), pool.run(_trace_with_settings, "torch")
    assert ours == ported
    assert ours != pool.run(_trace_with_settings, "default")  # the settings took effect


def _direct_call_worker():
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    batch = make_batch(SPEC, 0, dist.get_rank())
    compute_loss(SPEC, model, batch).backward()  # records the order
    h = torch.randn(2, SPEC.seq, SPEC.dim)
    with torch.no_grad(), trace_collectives() as records:
        model.blocks[1](h)  # a block on its own, outside the model's forward
    return [r.label for r in records if r.op == "all_gather"], fshard.memory_stats().gathered_bytes


def test_a_unit_called_outside_the_models_forward_prefetches_nothing():
    """It gathered the next unit of the recorded order, which nothing then freed (no end of a
    model's forward follows), until the model's next forward."""
    for gathers, left in get_pool(2).run(_direct_call_worker):
        assert gathers == ["blocks.1"] and left == 0, (gathers, left)
