"""torch's own gradient-norm functions on fshard parameters (``torch.nn.utils.clip_grad_norm_``,
``get_total_norm`` followed by ``clip_grads_with_norm_``): the true norm of the full gradient
and the same clipping as ``fshard.clip_grad_norm_`` and as the unsharded model, on every rank,
or an error on every rank. See [Note: torch's clip_grad_norm_ on sharded parameters]."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_ as torch_clip_bound_early  # bound as a user would

import fshard
from fshard.testing import get_pool, mesh_for

NORM_TYPES = (2.0, float("inf"), 1.0, 3.0)
MAX_NORM = 0.05


def _full_grad(param: torch.Tensor) -> torch.Tensor:
    """The full gradient of a sharded parameter, gathered by torch.chunk rows over its shard
    dimension (collective on that dimension)."""
    local = param.grad
    mesh = param.device_mesh
    size = mesh.size(mesh.ndim - 1)
    if local.dim() == 0 or size == 1:
        return local.clone().reshape(param.full_shape)
    rows = param.full_shape[0]
    padded = local.new_zeros((-(-rows // size), *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=mesh.get_group(mesh.ndim - 1))
    return torch.cat(gathered)[:rows]


def _build() -> nn.Module:
    torch.manual_seed(0)
    # 5 rows over 2 or 4 shard ranks: uneven shards, and an empty one on 4 ranks.
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))


def _sharded(reference: nn.Module, mesh_shape: tuple[int, ...]) -> nn.Module:
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[2], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    return model


def _backward(model: nn.Module) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()


def _torch_clip_worker(mesh_shape: tuple[int, ...], foreach: bool) -> dict[str, object]:
    """Per norm type: the norms of DDP + torch, fshard.clip_grad_norm_, torch's clip_grad_norm_
    (the module attribute and a reference bound before), get_total_norm; and the full clipped
    gradients of each way, to compare with DDP's."""
    reference = _build()
    found: dict[str, object] = {}
    for norm_type in NORM_TYPES:
        ddp = DDP(copy.deepcopy(reference))
        ways = {name: _sharded(reference, mesh_shape) for name in ("fshard", "torch", "early", "split")}
        _backward(ddp)
        for model in ways.values():
            _backward(model)
        want = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM, norm_type, foreach=foreach)
        norms = {
            "fshard": fshard.clip_grad_norm_(ways["fshard"].parameters(), MAX_NORM, norm_type, foreach=foreach),
            "torch": torch.nn.utils.clip_grad_norm_(ways["torch"].parameters(), MAX_NORM, norm_type, foreach=foreach),
            "early": torch_clip_bound_early(ways["early"].parameters(), MAX_NORM, norm_type, foreach=foreach),
        }
        grads = [p.grad for p in ways["split"].parameters() if p.grad is not None]
        norms["split"] = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        torch.nn.utils.clip_grads_with_norm_(ways["split"].parameters(), MAX_NORM, norms["split"], foreach=foreach)
        found[str(norm_type)] = {
            "want": float(want),
            "norms": {name: float(n) for name, n in norms.items()},
            "ref_grads": {n: p.grad.clone() for n, p in ddp.module.named_parameters()},
            "grads": {
                name: {n: _full_grad(p) for n, p in model.named_parameters()} for name, model in ways.items()
            },
        }
    # The norm of the weights themselves (get_total_norm of sharded parameters, not gradients).
    model = _sharded(reference, mesh_shape)
    found["weights"] = (
        float(torch.nn.utils.get_total_norm(list(model.parameters()), 2.0)),
        float(torch.nn.utils.get_total_norm(list(reference.parameters()), 2.0)),
    )
    return found


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_torch_clip_grad_norm_equals_fshard_and_unsharded(mesh_shape, foreach):
    results = get_pool(4).run(_torch_clip_worker, mesh_shape, foreach)
    for rank, found in enumerate(results):
        for norm_type in NORM_TYPES:
            case = found[str(norm_type)]
            for name, norm in case["norms"].items():
                assert norm == pytest.approx(case["want"], rel=1e-5), (rank, norm_type, name)
                assert norm == results[0][str(norm_type)]["norms"][name], "ranks clip alike"
                for param, grad in case["grads"][name].items():
                    torch.testing.assert_close(
                        grad, case["ref_grads"][param], rtol=1e-5, atol=1e-7, msg=f"{rank} {norm_type} {name} {param}"
                    )
        got, want = found["weights"]
        assert got == pytest.approx(want, rel=1e-6)


def _nonfinite_worker(mesh_shape: tuple[int, ...], norm_type: float, nan_shard: int) -> list[str]:
    model = _sharded(_build(), mesh_shape)
    _backward(model)
    if dist.get_rank() % mesh_shape[-1] == nan_shard:
        # An overflow lands in one shard (in each replica of it, as replicas hold one gradient).
        model[0].weight.grad.view(-1)[0] = float("nan")
    messages = []
    for call in (
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True),
        lambda: torch_clip_bound_early(model.parameters(), 1.0, norm_type, error_if_nonfinite=True),
        lambda: torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters()], norm_type, error_if_nonfinite=True
        ),
    ):
        with pytest.raises(RuntimeError) as caught:
            call()
        messages.append(str(caught.value))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    messages.append(f"norm {float(norm)}")
    return messages


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_torch_clip_grad_norm_error_if_nonfinite_raises_on_every_rank(mesh_shape, norm_type):
    # Shard 1 holds a NaN: on today's code only the ranks holding that shard would see a
    # non-finite norm (the others clip by a finite one).
    for messages in get_pool(4).run(_nonfinite_worker, mesh_shape, norm_type, 1):
        for message in messages[:3]:
            assert "the total norm of order" in message and "is nan" in message, message
        assert math.isnan(float(messages[3].split()[1]))


def _plain_worker() -> tuple[float, float]:
    """Tensors fshard does not shard go to torch's own function, unchanged."""
    model = _build()
    _backward(model)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, 3.0)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return float(got), float(grads.norm(3.0))


def test_torch_clip_grad_norm_of_plain_parameters_is_torchs():
    for got, after in get_pool(2).run(_plain_worker):
        assert got > 0.01 and after == pytest.approx(0.01, rel=1e-4)
