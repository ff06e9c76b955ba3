"""``fully_shard(..., sync_module_states=True)``: ranks that built different values (a different
seed per rank) start from mesh rank 0's parameters and buffers, and train as DDP does (DDP
broadcasts rank 0's values when it wraps the model)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fshard
from fshard.testing import get_pool, mesh_for


class _Shifted(nn.Module):
    """A linear layer plus a buffer the forward reads (a buffer left per rank changes the loss)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) + self.shift)


def _build_seeded_by_rank() -> nn.Module:
    torch.manual_seed(1000 + dist.get_rank())  # every rank builds other values
    return nn.Sequential(_Shifted(6), _Shifted(6), nn.Linear(6, 3))


def _train_like_ddp(mesh_shape: tuple[int, ...], sync: bool) -> tuple[bool, float]:
    """(the sharded model's parameters equal DDP's after 3 steps, largest difference)."""
    model = _build_seeded_by_rank()
    ddp = DDP(copy.deepcopy(model))  # takes rank 0's parameters and buffers
    mesh = mesh_for(mesh_shape)
    for block in model[:2]:
        fshard.fully_shard(block, mesh=mesh, sync_module_states=sync)
    fshard.fully_shard(model, mesh=mesh, sync_module_states=sync)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, model)]
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for m in (ddp, model):
            m(x).square().mean().backward()
        for opt in optims:
            opt.step()
            opt.zero_grad()
    worst = 0.0
    for p, q in zip(model.parameters(), ddp.module.parameters(), strict=True):
        worst = max(worst, float((p.full_tensor() - q.detach()).abs().max()))
    for b, c in zip(model.buffers(), ddp.module.buffers(), strict=True):
        worst = max(worst, float((b - c).abs().max()))
    return worst < 1e-5, worst


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_sync_module_states_trains_like_ddp_from_rank_0s_weights(mesh_shape):
    for same, worst in get_pool(4).run(_train_like_ddp, mesh_shape, True):
        assert same, f"the sharded model drifted from DDP by {worst}"


def _first_forward_without_sync(mesh_shape: tuple[int, ...], what: str) -> str:
    """Ranks seeded differently (the parameters, or only the buffers), no sync: the first
    forward's check names the first differing tensor on every rank, before any training."""
    torch.manual_seed(0)
    model = nn.Sequential(_Shifted(6), _Shifted(6), nn.Linear(6, 3))
    if what == "parameters":
        model = _build_seeded_by_rank()
    else:
        with torch.no_grad():
            model[1].shift.copy_(torch.randn(6, generator=torch.Generator().manual_seed(dist.get_rank())))
    mesh = mesh_for(mesh_shape)
    for block in model[:2]:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    with pytest.raises(fshard.RankMismatchError) as caught:
        model(torch.randn(4, 6))
    return str(caught.value)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_without_sync_module_states_ranks_seeded_differently_are_an_error_on_every_rank(mesh_shape):
    """Issue 23, case 4: the model the ranks would train is none of theirs (DDP broadcasts rank
    0's weights); the guard for the test above, too: its model really starts from different
    values per rank."""
    for message in get_pool(4).run(_first_forward_without_sync, mesh_shape, "parameters"):
        assert "the ranks built different values: parameter '0.linear.weight' differs between rank 0" in message
        assert "sync_module_states=True" in message and "torch.manual_seed" in message
    for message in get_pool(4).run(_first_forward_without_sync, mesh_shape, "buffers"):
        assert "the ranks built different values: buffer '1.shift' differs between rank 0" in message


def _mismatched_models() -> str:
    torch.manual_seed(0)
    width = 6 if dist.get_rank() != 1 else 7  # rank 1 built another model
    model = nn.Linear(width, 3)
    with pytest.raises(ValueError) as caught:
        fshard.fully_shard(model, mesh=mesh_for((2,)), sync_module_states=True)
    return str(caught.value)


def test_sync_module_states_of_different_models_is_an_error_on_every_rank():
    for message in get_pool(2).run(_mismatched_models):
        assert "sync_module_states broadcasts rank 0's parameters and buffers" in message
        assert "parameter 'weight'" in message and "every rank of the mesh raises" in message


def test_sync_module_states_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fully_shard\(Linear\): sync_module_states must be a bool, got 1"):
        fshard.fully_shard(nn.Linear(2, 2), sync_module_states=1)
