"""Gradient accumulation with FSDP2's pattern: ``set_requires_gradient_sync`` and
``set_reshard_after_backward`` both off for the micro-batches, flipped on before the last.

The idea of PyTorch's ``test_gradient_accumulation`` (our own test): with units that keep their
parameters gathered from forward to backward, each unit is gathered once per optimizer step, in
the first micro-batch's forward. Flipping ``set_reshard_after_backward`` on before the last
micro-batch keeps what is still gathered (that micro-batch reuses it); its synchronised backward
frees it. Counted with ``trace_collectives``, and the gradients equal DDP's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)

SPEC = TransformerSpec(vocab=16, dim=8, heads=2, layers=3, seq=4, batch_size=2, dtype=torch.float64)
UNITS = SPEC.layers + 1  # one per block, and the root
MICRO_BATCHES = 4
STEPS = 3


def _accumulation_worker(mesh_shape, reshard_after_forward):
    rank = dist.get_rank()
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for(mesh_shape), reshard_after_forward=reshard_after_forward)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    ddp = nn.parallel.DistributedDataParallel(build_model(SPEC))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    counts, grad_errors = [], []
    for step in range(STEPS):
        with trace_collectives() as records:
            for micro in range(MICRO_BATCHES):
                last = micro == MICRO_BATCHES - 1
                fshard.set_requires_gradient_sync(model, last)
                fshard.set_reshard_after_backward(model, last)
                batch = make_batch(SPEC, step * MICRO_BATCHES + micro, rank)
                compute_loss(SPEC, model, batch).backward()
        counts.append(Counter(r.op for r in records))
        for micro in range(MICRO_BATCHES):
            batch = make_batch(SPEC, step * MICRO_BATCHES + micro, rank)
            if micro < MICRO_BATCHES - 1:
                with ddp.no_sync():
                    compute_loss(SPEC, ddp, batch).backward()
            else:
                compute_loss(SPEC, ddp, batch).backward()
        fshard_params = dict(model.named_parameters())
        for name, ref in ddp.module.named_parameters():
            grad = fshard_params[name].grad
            full = grad if not fshard.is_sharded(fshard_params[name]) else None
            if full is None:
                full = _full_grad(fshard_params[name])
            grad_errors.append((name, (full - ref.grad).abs().max().item()))
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
    return counts, grad_errors, fshard.memory_stats().gathered_bytes


def _full_grad(param: fshard.ShardedParameter) -> torch.Tensor:
    """The whole gradient of ``param`` from every rank's shard of it (over its shard group)."""
    mesh = param.device_mesh
    group = mesh.get_group(mesh.ndim - 1)
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, param.grad, group=group)
    return torch.cat(
        [p for p in pieces if p is not None and p.numel()] or [param.grad], dim=0
    ).reshape(param.full_shape)


@pytest.mark.parametrize(
    ("mesh_shape", "reshard_after_forward"),
    [((2,), False), ((2, 2), False), ((2,), True)],
    ids=["1d", "2x2", "1d-reshard-after-forward"],
)
def test_fsdp2_accumulation_pattern_gathers_each_unit_once_per_step(
    mesh_shape, reshard_after_forward
):
    world = 2 if len(mesh_shape) == 1 else 4
    # reshard_after_forward=False: each unit once, in the first forward (FSDP2: 4; fshard before
    # this: 8, the last micro-batch gathered everything again). True: also each block again in
    # every micro-batch's backward, freed after its forward; the root is kept for backward
    # (fshard before this: 20).
    expected = UNITS + (MICRO_BATCHES * (UNITS - 1) if reshard_after_forward else 0)
    for counts, grad_errors, gathered in get_pool(world).run(
        _accumulation_worker, mesh_shape, reshard_after_forward
    ):
        for step_counts in counts[1:]:  # (the first step also checks the ranks' values agree)
            assert step_counts["all_gather"] == expected, counts
            assert step_counts["reduce_scatter"] == UNITS, counts
            assert step_counts["all_reduce"] == (UNITS if len(mesh_shape) == 2 else 0), counts
        for name, error in grad_errors:
            assert error < 1e-12, (name, error)
        assert gathered == 0  # the synchronised last backward freed everything
