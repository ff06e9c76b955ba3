"""No growth over a long run: 300 optimizer steps on 2 ranks hold the same memory and the same
fshard objects after warm-up as at its end (byte and object counts, not time).

What is counted at every checkpoint, after ``gc.collect()``: the live tensor bytes made since
warm-up (``LiveBytes``, by storage) and the peak within each span; ``fshard.memory_stats`` of the
model and optimizer (gathered, params, grads, optimizer state); the objects of fshard's classes
and the tensors alive; and the bookkeeping that lives as long as the process: the async
collectives awaiting their wait (``_collectives._ISSUED``), the hang check's sequence counters
and store keys, and the default store's key count (less the hang check's heartbeat key per rank)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard import _collectives, _hang
from fshard._memtrack import LiveBytes
from fshard.testing import get_pool, mesh_for
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)

SPEC = TransformerSpec(vocab=16, dim=8, heads=2, layers=2, seq=4, batch_size=2)
STEPS = 300
WARMUP = 50
EVERY = 50


def _objects() -> Counter[str]:
    """Live objects of fshard's classes by class name, and the number of live tensors."""
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        module = kind.__dict__.get("__module__")
        if isinstance(module, str) and module.startswith("fshard"):
            counts[f"{module}.{kind.__qualname__}"] += 1
        elif issubclass(kind, torch.Tensor):  # (not isinstance: it reads __class__)
            counts["torch.Tensor"] += 1
    return counts


def _long_run_worker(accumulate: bool) -> list[dict[str, object]]:
    rank = dist.get_rank()
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for((2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = dist.distributed_c10d._get_default_store()
    heartbeats = [f"{_hang._KEY}{r}" for r in range(dist.get_world_size())]
    live = LiveBytes()
    snapshots: list[dict[str, object]] = []
    span_peaks: list[int] = []
    for step in range(1, STEPS + 1):
        if step == WARMUP + 1:
            live.__enter__()  # counts every storage made from here on while it lives
        for micro in range(2 if accumulate else 1):
            last = micro == (1 if accumulate else 0)
            if accumulate:  # FSDP2's pattern: keep the units gathered through the micro-batches
                fshard.set_requires_gradient_sync(model, last)
                fshard.set_reshard_after_backward(model, last)
            compute_loss(SPEC, model, make_batch(SPEC, 2 * step + micro, rank)).backward()
        fshard.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        if step > WARMUP:
            span_peaks.append(live.take_peak())  # this step's peak
        if step >= WARMUP and step % EVERY == 0:
            gc.collect()
            snapshots.append(
                {
                    "live": live.current,
                    "step_peaks": Counter(span_peaks),
                    "stats": tuple(fshard.memory_stats(model, opt)),
                    "objects": _objects(),
                    "issued": len(_collectives._ISSUED),
                    "seq_groups": len(_hang._SEQ),
                    "hang_keys": len(_hang._MY_KEYS),
                    # (less the heartbeat's key per rank, written once a wait lasts: timing)
                    "store_keys": store.num_keys()
                    - sum(store.check([heartbeat]) for heartbeat in heartbeats),
                }
            )
            span_peaks = []
    live.__exit__(None, None, None)
    return snapshots


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
def test_three_hundred_steps_hold_steady_memory_and_objects(accumulate):
    for snapshots in get_pool(2).run(_long_run_worker, accumulate, timeout=600):
        first = snapshots[0]
        assert first["live"] == 0  # nothing made after warm-up outlives its step
        # Every span of steps peaks at the same bytes in most of its steps, and none lower. A
        # few peak higher, at other steps in every run: a collective's buffers live until gloo's
        # thread finishes with them, later when the machine is busy (timing, not growth).
        spans = [s["step_peaks"] for s in snapshots[1:]]
        assert len({span.most_common(1)[0][0] for span in spans}) == 1, spans
        assert len({min(span) for span in spans}) == 1, spans
        assert all(span.most_common(1)[0][1] >= EVERY // 2 for span in spans), spans
        for later in snapshots[1:]:
            assert later["live"] == first["live"]
            assert later["stats"] == first["stats"]
            grown = later["objects"] - first["objects"]  # (Counter subtraction keeps growth only)
            assert not grown, grown
            for key in ("issued", "seq_groups", "hang_keys", "store_keys"):
                assert later[key] == first[key], (key, first[key], later[key])
        assert first["stats"][2] > 0 and first["issued"] == 0
