"""The ranks agree on state-dict errors: a problem that one rank finds is raised on every rank,
with the same message, before anything is loaded or any other collective is issued, so no rank
is left waiting in a collective or holding other weights ([Note: ranks agree on errors])."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
import fshard.checkpoint
from fshard import transforms
from fshard.testing import RanksFailed, get_pool, mesh_for

# A task that hangs on one rank fails here instead of waiting for the pool's default timeout.
_TIMEOUT_S = 30


def _every_rank_raises(fn, *args, patterns, error=ValueError) -> str:
    """Run ``fn`` on 2 ranks: every rank raises ``error``, with one message holding ``patterns``."""
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(fn, *args, timeout=_TIMEOUT_S)
    errors = info.value.errors
    assert sorted(errors) == [0, 1], f"every rank must raise, only {sorted(errors)} did: {errors}"
    messages = {str(exc) for exc in errors.values()}
    assert len(messages) == 1, f"the ranks raised different errors: {errors}"
    [message] = messages
    for rank, exc in errors.items():
        assert type(exc) is error, (rank, exc)
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    return message


def _linear() -> nn.Module:
    """``Linear(3, 1)`` on 2 ranks: rank 0's weight shard (1, 3) has the full shape, rank 1's is
    (0, 3), so a dict of local shards looks full on rank 0 alone."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    return model


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _linear()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _shifted(tree):
    """``tree`` with 1 added to every tensor of more than one dimension (so a load shows)."""
    if isinstance(tree, dict):
        return {k: _shifted(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.dim() > 1:
        return tree + 1
    return tree


def _load_local_model_shards_task():
    model = _linear()
    before = fshard.full_state_dict(model, rank0_only=False)
    local = _shifted(transforms.to_local(fshard.state_dict(model)))
    try:
        fshard.load_state_dict(model, local)
    finally:  # raised or not, no rank loaded anything (rank 0 would take its shard as full)
        after = fshard.full_state_dict(model, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before), "a rank loaded"


def test_local_model_shards_are_refused_on_every_rank():
    _every_rank_raises(
        _load_local_model_shards_task,
        patterns=[
            "fshard.load_state_dict",
            "key 'weight': shape mismatch",
            "this rank's shard shape on rank 1",
            "fshard.transforms.to_local",
            "found on rank 1;",
        ],
    )


def _load_local_optimizer_shards_task():
    model, opt = _trained()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    local = _shifted(transforms.to_local(fshard.optim_state_dict(model, opt)))
    try:
        fshard.load_optim_state_dict(model, opt, local)
    finally:  # no rank loaded anything
        after = opt.state[model.weight]
        assert all(torch.equal(before[k], after[k]) for k in before), "a rank loaded"


def test_local_optimizer_shards_are_refused_on_every_rank():
    _every_rank_raises(
        _load_local_optimizer_shards_task,
        patterns=[
            "fshard.load_optim_state_dict",
            "state['weight']['exp_avg'] is a plain tensor of this rank's shard shape [0, 3] on "
            "rank 1",
            "fshard.transforms.to_local",
            "found on rank 1;",
        ],
    )


class _ColumnStats(torch.optim.Optimizer):
    """Factored state as Adafactor keeps it: one statistic per column, reduced over all rows, so
    no shard of rows can hold it. A (3, 1) parameter on 2 ranks has shards (2, 1) and (1, 1): the
    (1, 1) statistic looks like rank 1's shard, and only rank 0 can tell it is not one."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):  # torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["col_var"] = p.grad.square().sum(0, keepdim=True)
                    p.sub_(group["lr"] * p.grad)


def _factored_state_task(api, path):
    torch.manual_seed(0)
    model = nn.Linear(1, 3, bias=False)  # weight (3, 1)
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    opt = _ColumnStats(model.parameters())
    model(torch.ones(2, 1)).sum().backward()
    opt.step()
    if api == "checkpoint":
        fshard.checkpoint.save(path, model, opt)  # a broadcast follows optim_state_dict
    else:
        fshard.optim_state_dict(model, opt, full=api == "full")  # full gathers each tensor


@pytest.mark.parametrize("api", ["sharded", "full", "checkpoint"])
def test_factored_optimizer_state_is_refused_on_every_rank(api, tmp_path):
    _every_rank_raises(
        _factored_state_task,
        api,
        os.fspath(tmp_path / "ckpt"),
        patterns=[
            "fshard.optim_state_dict: state['weight']['col_var'] of _ColumnStats has shape [1, 1], "
            "neither this rank's shard of the parameter [2, 1] on rank 0 nor a scalar",
            "factored state",
            "found on rank 0;",
        ],
    )
    assert not os.path.exists(tmp_path / "ckpt")


def _one_rank_differs_task(case):
    model, opt = _trained()
    sd = fshard.full_state_dict(model, rank0_only=False)
    osd = fshard.optim_state_dict(model, opt, full=True)
    rank = dist.get_rank()
    if case == "model_key_missing_on_rank_1":
        if rank == 1:
            del sd["bias"]
        fshard.load_state_dict(model, sd)
    elif case == "model_not_a_mapping_on_rank_1":
        fshard.load_state_dict(model, sd if rank == 0 else [sd])  # type: ignore[arg-type]
    elif case == "optimizer_class_on_rank_1":
        if rank == 1:
            osd["optimizer_class"] = "torch.optim.sgd.SGD"
        fshard.load_optim_state_dict(model, opt, osd)
    elif case == "different_problems":
        del sd["weight" if rank == 0 else "bias"]
        fshard.load_state_dict(model, sd)


@pytest.mark.parametrize(
    ("case", "error", "patterns"),
    [
        (
            "model_key_missing_on_rank_1",
            ValueError,
            ["fshard.load_state_dict: missing key(s): ['bias']", "found on rank 1;"],
        ),
        (
            "model_not_a_mapping_on_rank_1",
            TypeError,
            ["state_dict must be a mapping, got list", "found on rank 1;"],
        ),
        (
            "optimizer_class_on_rank_1",
            ValueError,
            ["saved from a torch.optim.sgd.SGD", "torch.optim.adam.Adam", "found on rank 1;"],
        ),
        (
            "different_problems",
            ValueError,
            [
                "fshard.load_state_dict: the ranks found different problems",
                "on rank 0: missing key(s): ['weight']",
                "on rank 1: missing key(s): ['bias']",
            ],
        ),
    ],
)
def test_a_problem_that_one_rank_finds_is_raised_on_every_rank(case, error, patterns):
    _every_rank_raises(_one_rank_differs_task, case, patterns=patterns, error=error)
