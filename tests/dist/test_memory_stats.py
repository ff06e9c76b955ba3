"""``fshard.memory_stats(model, optimizer)``: this rank's persistent bytes (sharded params, their
grads, optimizer state) next to the gathered-bytes fields, counted through the public API."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.testing import get_pool, mesh_for
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)

SPEC = TransformerSpec(vocab=29, dim=8, heads=2, layers=2, seq=6, batch_size=2)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _persistent_worker(mesh_shape):
    rank = dist.get_rank()
    model = build_model(SPEC)
    full_bytes = _nbytes(model.parameters())
    shard_model(SPEC, model, mesh_for(mesh_shape))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    local = _nbytes(p.to_local() if fshard.is_sharded(p) else p for p in params)
    before = fshard.memory_stats(model, opt)
    compute_loss(SPEC, model, make_batch(SPEC, 0, rank)).backward()
    after_backward = fshard.memory_stats(model, opt)
    opt.step()
    after_step = fshard.memory_stats(model, opt)
    opt.zero_grad()
    after_zero = fshard.memory_stats(model, opt)
    return {
        "full": full_bytes,
        "local": local,
        "n_params": len(params),
        "before": tuple(before),
        "after_backward": tuple(after_backward),
        "after_step": tuple(after_step),
        "after_zero": tuple(after_zero),
        "no_model": tuple(fshard.memory_stats()),
        "persistent": after_step.persistent_bytes,
    }


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_memory_stats_counts_this_ranks_shards_grads_and_optimizer_state(mesh_shape):
    world = 2 if len(mesh_shape) == 1 else 4
    shard_size = mesh_shape[-1]
    results = get_pool(world).run(_persistent_worker, mesh_shape)
    assert sum(r["local"] for r in results[:shard_size]) == results[0]["full"]  # shards tile it
    for r in results:
        assert r["before"][2:] == (r["local"], 0, 0)  # no grads, no state yet
        assert r["after_backward"][2:] == (r["local"], r["local"], 0)
        # AdamW: exp_avg and exp_avg_sq of the shard's shape, and a float32 step scalar each.
        step_bytes = 4 * r["n_params"]
        assert r["after_step"][2:] == (r["local"], r["local"], 2 * r["local"] + step_bytes)
        assert r["persistent"] == 4 * r["local"] + step_bytes
        assert r["after_zero"][3] == 0
        assert r["no_model"][2:] == (0, 0, 0)
        assert r["after_step"][:2] == r["no_model"][:2]  # the gathered fields as before


def test_memory_stats_keeps_its_old_shape():
    stats = fshard.memory_stats()
    assert stats._fields[:2] == ("gathered_bytes", "peak_gathered_bytes")
    assert fshard.MemoryStats(1, 2) == (1, 2, 0, 0, 0)  # old call sites still build it
    with pytest.raises(TypeError, match="optimizer"):
        fshard.memory_stats(None, object())  # type: ignore[arg-type]  # the wrong type on purpose
