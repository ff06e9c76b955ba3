"""Communication: every byte each collective moves in a step, against the ZeRO-3 figures."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)

SPEC = TransformerSpec(vocab=29, dim=8, heads=2, layers=3, seq=6, batch_size=2)


def _padded_bytes(model, size: int, prefix: str = "") -> tuple[int, int, int, int]:
    """(padded param bytes, padded grad bytes, unpadded param bytes, gradient-flag bytes per
    rank's chunk) of the sharded model (every param here is fp32)."""
    padded = grads = full = flags = 0
    for name, p in model.named_parameters():
        if not name.startswith(prefix):
            continue
        shape = p.full_shape
        n = shape.numel()
        if len(shape) == 0:
            slot = 1
        else:
            rows = shape[0]
            slot = -(-rows // size) * (n // rows if rows else 0)
        padded += size * slot * p.element_size()
        grads += size * slot * p.element_size() if p.requires_grad else 0
        full += n * p.element_size()
        # One "got a gradient" flag per trainable param rides along in each rank's chunk.
        flags += p.element_size() if p.requires_grad and n else 0
    return padded, grads, full, flags


def _step_comm_worker(mesh_shape, reshard_after_forward, **shard_kwargs):
    rank = dist.get_rank()
    spec = SPEC
    model = build_model(spec)
    mesh = mesh_for(mesh_shape)
    shard_model(spec, model, mesh, reshard_after_forward=reshard_after_forward, **shard_kwargs)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(2):  # the second step runs with the recorded prefetch order
        with trace_collectives() as records:
            compute_loss(spec, model, make_batch(spec, step, rank)).backward()
        opt.step()
        opt.zero_grad()
        steps.append(records)
    size = mesh_shape[-1]
    shard_group = sorted(int(r) for r in mesh.mesh.reshape(-1, size)[rank // size].tolist())
    replicate_group = sorted(int(r) for r in mesh.mesh.reshape(-1, size)[:, rank % size].tolist())
    return {
        "steps": [
            [(r.op, r.group_ranks, r.input_bytes, r.output_bytes, r.label) for r in records]
            for records in steps
        ],
        "bytes": _padded_bytes(model, size),
        "block_bytes": _padded_bytes(model, size, "blocks.")[0],
        "units": 1 + SPEC.layers,
        "shard_group": tuple(shard_group),
        "replicate_group": tuple(replicate_group),
    }


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3,)], ids=str)
def test_step_traffic_is_zero3(mesh_shape, reshard_after_forward):
    world = 1
    for s in mesh_shape:
        world *= s
    for result in get_pool(world).run(_step_comm_worker, mesh_shape, reshard_after_forward):
        padded, grad_bytes, full, flag_bytes = result["bytes"]
        size = mesh_shape[-1]
        assert padded - full < size * 4 * SPEC.dim * 8  # padding: under one row per rank per param
        units = result["units"]
        for records in result["steps"]:
            gathers = [r for r in records if r[0] == "all_gather"]
            scatters = [r for r in records if r[0] == "reduce_scatter"]
            reduces = [r for r in records if r[0] == "all_reduce"]
            # ZeRO-3: parameters gathered in forward and again in backward; ZeRO-2: once. The
            # root keeps its parameters from forward to backward (it needs them first).
            blocks = result["block_bytes"]
            if reshard_after_forward:
                assert len(gathers) == 2 * units - 1
                assert sum(r[3] for r in gathers) == padded + blocks
            else:
                assert len(gathers) == units
                assert sum(r[3] for r in gathers) == padded
            assert {r[4] for r in gathers} == {"<root>", *(f"blocks.{i}" for i in range(SPEC.layers))}
            assert sum(r[2] for r in gathers) * size == sum(r[3] for r in gathers)
            # Gradients: one reduce-scatter per unit of the (padded) full gradient.
            assert len(scatters) == units
            assert sum(r[2] for r in scatters) == grad_bytes + size * flag_bytes
            assert sum(r[3] for r in scatters) == grad_bytes // size + flag_bytes
            # Collectives stay inside their groups.
            assert all(r[1] == result["shard_group"] for r in gathers + scatters)
            if len(mesh_shape) == 2:
                assert len(reduces) == units
                assert all(r[1] == result["replicate_group"] for r in reduces)
                assert sum(r[2] for r in reduces) == grad_bytes // size + flag_bytes
            else:
                assert reduces == []
        # The cross-rank model check runs once, at the first forward, never again.
        assert {r[0] for r in result["steps"][1]} <= {"all_gather", "reduce_scatter", "all_reduce"}


def test_no_shard_strategy_only_all_reduces():
    for result in get_pool(4).run(_step_comm_worker, (4, 1), False):
        _padded, grad_bytes, _, flag_bytes = result["bytes"]
        records = result["steps"][1]  # step 0 also holds the one-off root-init check
        assert {r[0] for r in records} == {"all_reduce"}  # like DDP: no gathers at all
        assert sum(r[2] for r in records) == grad_bytes + flag_bytes
