"""fshard's Python work per training step depends only on the number of units and parameters:
not on the step count (nothing accumulates), nor on the batch or the tensors' sizes."""

from __future__ import annotations

import os
import sys
from types import FrameType

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

_PACKAGE = os.path.dirname(fshard.__file__)


def _count_fshard_calls(fn) -> int:
    """Python function calls made inside the fshard package while ``fn`` runs."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _calls_per_step(spec: TransformerSpec, mesh_shape: tuple[int, ...], steps: int) -> list[int]:
    model = shard_model(spec, build_model(spec), mesh_for(mesh_shape))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        compute_loss(spec, model, make_batch(spec, i, dist.get_rank())).backward()
        fshard.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return [_count_fshard_calls(lambda i=i: step(i)) for i in range(steps)]


def _overhead_worker(mesh_shape):
    small = TransformerSpec(vocab=11, dim=6, heads=2, layers=2, seq=3, batch_size=1)
    large = TransformerSpec(vocab=97, dim=24, heads=2, layers=2, seq=9, batch_size=4)  # same units and params
    deeper = TransformerSpec(vocab=11, dim=6, heads=2, layers=4, seq=3, batch_size=1)
    return {
        "small": _calls_per_step(small, mesh_shape, 4),
        "large": _calls_per_step(large, mesh_shape, 3),
        "deeper": _calls_per_step(deeper, mesh_shape, 2),
    }


def test_python_work_per_step_depends_only_on_units_and_parameters():
    for counts in get_pool(2).run(_overhead_worker, (2,)):
        small, large, deeper = counts["small"], counts["large"], counts["deeper"]
        # From the second step on (the first records the order and checks the ranks agree),
        # every step makes the same calls: nothing grows with the number of steps taken ...
        assert len(set(small[1:])) == 1, small
        # ... nor with the batch, the sequence or the tensors' sizes ...
        assert large[1:] == small[1:3], (large, small)
        # ... and doubling the blocks (units and parameters) at most doubles it.
        assert small[1] < deeper[1] <= 2 * small[1], (small, deeper)
