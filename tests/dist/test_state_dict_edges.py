"""State-dict edge cases: snapshots that stay snapshots, wrong shapes and optimizers named at
load time, tied keys, and ``model.state_dict()`` while a unit is gathered."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fshard
from fshard.testing import get_pool, mesh_for


def _linear_pair(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()


def _snapshot_task():
    model = _linear_pair()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    osd = fshard.optim_state_dict(model, opt, full=True)
    full = fshard.full_state_dict(model, rank0_only=False)
    local = fshard.full_state_dict(model, rank0_only=False, cpu_offload=False)
    before = copy.deepcopy((osd["state"], full, local))
    _train(model, opt, steps=2)
    for now, then in zip((osd["state"], full, local), before, strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0)
    return True


def test_full_state_dicts_are_snapshots():
    """Buffers and scalar optimizer state (Adam's ``step``) are copies too, not live tensors."""
    assert all(get_pool(2).run(_snapshot_task))


def _module_state_dict_while_gathered_task():
    mp = fshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = _linear_pair(mp_policy=mp)
    fshard.unshard(model)
    sd = model.state_dict()
    want = fshard.state_dict(model)
    fshard.reshard(model)
    for key in ("0.weight", "0.bias"):
        assert isinstance(sd[key], DTensor) and sd[key].dtype == torch.float32, key
        torch.testing.assert_close(sd[key].full_tensor(), want[key].full_tensor())
    return True


def test_module_state_dict_while_gathered_is_the_fp32_shards():
    assert all(get_pool(2).run(_module_state_dict_while_gathered_task))


def _optim_errors_task(case):
    model = _linear_pair()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    osd = copy.deepcopy(fshard.optim_state_dict(model, opt, full=True))
    if case == "wrong_shape":
        osd["state"]["0.weight"]["exp_avg"] = torch.zeros(7, 6)
        osd["state"]["0.bias"]["exp_avg"] = torch.zeros(1)
        target = opt
    else:  # another optimizer class
        target = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError) as info:
        fshard.load_optim_state_dict(model, target, osd)
    torch.testing.assert_close(target.state_dict()["state"], before["state"])  # nothing loaded
    return str(info.value)


@pytest.mark.parametrize(
    "case, patterns",
    [
        ("wrong_shape", ["state['0.weight']['exp_avg']: shape mismatch", "state['0.bias']['exp_avg']"]),
        ("other_optimizer", ["param_groups[0] has hyperparameters", "another kind of optimizer", "momentum"]),
    ],
)
def test_load_optim_state_dict_errors_name_the_key(case, patterns):
    for message in get_pool(2).run(_optim_errors_task, case):
        for pattern in patterns:
            assert pattern in message, message


def _unsupported_state_task():
    model = _linear_pair()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)  # factored (row/column) state
    _train(model, opt)
    with pytest.raises(ValueError, match=r"state\['0.weight'\]\['row_var'\] of Adafactor"):
        fshard.optim_state_dict(model, opt)
    return True


def test_optim_state_dict_refuses_state_not_shaped_like_the_param():
    assert all(get_pool(2).run(_unsupported_state_task))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _tied_last_key_task(broadcast):
    sd = {"emb.weight": torch.zeros(8, 4), "head.weight": torch.ones(8, 4)}
    plain = _Tied()
    plain.load_state_dict(sd)
    model = _Tied()
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    given = sd if not broadcast or dist.get_rank() == 0 else {}
    fshard.load_state_dict(model, given, broadcast_from_rank0=broadcast)
    torch.testing.assert_close(model.emb.weight.full_tensor(), plain.emb.weight.detach())
    return True


@pytest.mark.parametrize("broadcast", [False, True], ids=["everywhere", "from_rank0"])
def test_tied_param_takes_its_last_keys_value_like_nn_module(broadcast):
    assert all(get_pool(2).run(_tied_last_key_task, broadcast))


def _module_load_wrong_shape_task():
    model = _linear_pair()
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({**model.state_dict(), "0.weight": torch.zeros(7, 6)})
    return str(info.value)


def test_module_load_state_dict_size_mismatch_names_the_full_shape():
    for message in get_pool(2).run(_module_load_wrong_shape_task):
        assert "size mismatch for 0.weight" in message
        assert "torch.Size([6, 6])" in message and "this rank holds (3, 6)" in message
