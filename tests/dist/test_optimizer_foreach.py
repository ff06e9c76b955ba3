"""torch's optimizers take their multi-tensor (foreach) path for fshard's parameters: the type
check torch makes passes for ``ShardedParameter`` (see [Note: torch's foreach and fused optimizer
paths] in ``fshard._param``), and AdamW's foreach path on sharded parameters equals its loop."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer
from torch.utils import _foreach_utils

import fshard
from fshard.testing import get_pool, mesh_for
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)

SPEC = TransformerSpec(vocab=16, dim=8, heads=2, layers=2, seq=4, batch_size=2)


def _sharded_model(mesh_shape):
    model = build_model(SPEC)
    shard_model(SPEC, model, mesh_for(mesh_shape))
    return model


def _dispatch_worker():
    params = list(_sharded_model((2,)).parameters())
    assert params and all(type(p) is fshard.ShardedParameter for p in params)
    # CPU is not among the devices torch's default picks foreach for; on a device that is (CUDA),
    # the type check is what decides. Ask with CPU counted as such a device.
    original = torch_optimizer._get_foreach_kernels_supported_devices
    torch_optimizer._get_foreach_kernels_supported_devices = lambda: [*original(), "cpu"]
    try:
        fused, foreach = torch_optimizer._default_to_fused_or_foreach(
            params, differentiable=False, use_fused=False
        )
    finally:
        torch_optimizer._get_foreach_kernels_supported_devices = original
    grads_checked = _foreach_utils._has_foreach_support(params, torch.device("cpu"))
    return fused, foreach, grads_checked


def test_torch_picks_foreach_for_sharded_parameters():
    for fused, foreach, grads_checked in get_pool(2).run(_dispatch_worker):
        assert (fused, foreach) == (False, True)
        assert grads_checked


def _adamw_worker(mesh_shape):
    rank = dist.get_rank()
    results = []
    for foreach in (True, False):
        model = _sharded_model(mesh_shape)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
        for step in range(3):
            compute_loss(SPEC, model, make_batch(SPEC, step, rank)).backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def test_adamw_foreach_on_sharded_parameters_equals_its_loop():
    for with_foreach, with_loop in get_pool(2).run(_adamw_worker, (2,)):
        for a, b in zip(with_foreach, with_loop, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
