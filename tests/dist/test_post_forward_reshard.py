"""reshard_after_forward=<int>: keep 1/N of a unit's parameters after forward, shared by N ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Net(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = ckpt.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


_BLOCK_BYTES = (8 * 16 + 16 + 16 * 8 + 8) * 4  # one block's parameters, float32


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def _train_worker(setting: bool | int, checkpointed: bool) -> dict[str, object]:
    torch.manual_seed(0)
    reference = _Net(checkpointed)
    model = copy.deepcopy(reference)
    mesh = mesh_for((4,))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=setting)
    fshard.fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=setting)
    fshard.fully_shard(model, mesh=mesh)
    ddp = DDP(reference)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ddp)]
    base = fshard.memory_stats().gathered_bytes
    held, groups = [], set()
    for step in range(3):
        x = _batch(step)
        loss = model(x).pow(2).mean()
        held.append(fshard.memory_stats().gathered_bytes - base)  # between forward and backward
        with trace_collectives() as records:
            loss.backward()
        ddp(x).pow(2).mean().backward()
        groups |= {r.group_ranks for r in records if r.op == "all_gather"}
        assert fshard.memory_stats().gathered_bytes == base  # nothing left after the backward
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return {"held": held, "groups": sorted(groups)}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_int_keeps_a_part_and_gathers_it_over_that_many_ranks(checkpointed):
    """With 2 on 4 ranks, each rank holds half of each unit's parameters from its forward to its
    backward (True: none, False: all), the backward all-gathers over ranks {0, 1} and {2, 3}
    only, nothing stays after the backward, and the training equals DDP's (activation
    checkpointing included)."""
    pool = get_pool(4)
    halves = pool.run(_train_worker, 2, checkpointed)
    fulls = pool.run(_train_worker, False, checkpointed)
    nones = pool.run(_train_worker, True, checkpointed)
    for rank, (half, full, none) in enumerate(zip(halves, fulls, nones, strict=True)):
        # The units other than the root: three blocks and [norm, head].
        units = 3 * _BLOCK_BYTES + (8 + 8 + 8 * 3 + 3) * 4
        assert all(f - n >= units for f, n in zip(full["held"], none["held"], strict=True)), (full, none)
        for h, f, n in zip(half["held"], full["held"], none["held"], strict=True):
            assert h - n == pytest.approx((f - n) / 2, rel=0.1), (rank, half, full, none)
        assert half["groups"] == ([(0, 1)] if rank < 2 else [(2, 3)]), half
        assert (0, 1, 2, 3) in none["groups"], none


def _precision_worker() -> bool:
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    mesh = mesh_for((4,))
    mp = fshard.MixedPrecision(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=2, mp_policy=mp)
    fshard.fully_shard(model, mesh=mesh, mp_policy=mp)
    # Compared to the bit below with a step whose units may be coalesced: a bf16 reduce-scatter
    # over 4 ranks rounds by where an element sits in the buffer. A collective per unit.
    fshard.set_coalescing(model, 0)
    with trace_collectives() as records:
        model(_batch(0)).float().pow(2).mean().backward()
    # The kept rows are the bf16 gathered copy: the backward gathers them in bf16.
    kept = [r for r in records if r.op == "all_gather" and r.group_ranks != (0, 1, 2, 3)]
    assert kept and all(r.dtype == torch.bfloat16 for r in kept), records
    # And the gradients are what the same bf16 computation gives with True.
    grads = [p.grad.clone() for p in model.parameters()]
    fshard.set_reshard_after_forward(model, True)
    for p in model.parameters():
        p.grad = None
    model(_batch(0)).float().pow(2).mean().backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
    return True


def test_int_with_mixed_precision_keeps_the_cast_copy():
    assert get_pool(4).run(_precision_worker) == [True] * 4


def _no_backward_worker() -> bool:
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    mesh = mesh_for((4,))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fshard.fully_shard(model, mesh=mesh)
    ddp = DDP(reference)
    # A fused optimizer writes the shards without bumping their version counters.
    optims = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (model, ddp)]
    base = fshard.memory_stats().gathered_bytes
    for step in range(3):
        x = _batch(step)
        model(x).pow(2).mean().backward()
        ddp(x).pow(2).mean().backward()
        # An evaluation with grad: no backward comes, the rows stay kept until the next forward...
        model(_batch(7)).sum()
        assert fshard.memory_stats().gathered_bytes > base
        # ...while the step changes the shards: the next forward must not gather the old rows.
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    fshard.reshard(model)
    assert fshard.memory_stats().gathered_bytes == base
    # Rows kept, then a shard edited in place: fshard.unshard shows the edit, not the rows.
    model(_batch(8)).sum()
    with torch.no_grad():
        model.blocks[0].up.weight.to_local().fill_(0.5)
    fshard.unshard(model.blocks[0])
    assert bool((model.blocks[0].up.weight == 0.5).all())
    fshard.reshard(model)
    assert fshard.memory_stats().gathered_bytes == base
    return True


def test_rows_kept_by_a_forward_without_backward_are_not_reused_after_a_step():
    assert get_pool(4).run(_no_backward_worker) == [True] * 4


def _settings_worker() -> bool:
    mesh = mesh_for((4,))
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide the size of the mesh's shard dimension \(4 ranks\).*Use one of 2, 4 \(True: all of them\) or 1 \(False"):
        fshard.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"reshard_after_forward=0 must divide"):
        fshard.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=0)
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool, or an int \(the number of ranks to reshard to after forward\), got 2.0"):
        fshard.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2.0)  # type: ignore[arg-type]
    # On a 2D mesh the shard dimension counts: 2 of (2, 2) is all of it.
    fshard.fully_shard(nn.Linear(4, 4), mesh=mesh_for((2, 2)), reshard_after_forward=2)
    # The shard dimension's size is True, 1 is False; set_reshard_after_forward takes ints too.
    backward_groups = []
    for setting in (4, 1, 2):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        fshard.fully_shard(model[0], mesh=mesh)
        fshard.fully_shard(model, mesh=mesh)
        if setting == 2:
            with pytest.raises(ValueError, match=r"set_reshard_after_forward: reshard_after_forward=8 must divide"):
                fshard.set_reshard_after_forward(model, 8)
        fshard.set_reshard_after_forward(model[0], setting)
        loss = model(torch.ones(2, 4)).sum()
        with trace_collectives() as records:
            loss.backward()
        backward_groups.append([r.group_ranks for r in records if r.op == "all_gather"])
    pair = (0, 1) if dist.get_rank() < 2 else (2, 3)
    return backward_groups == [[(0, 1, 2, 3)], [], [pair]]


def test_int_settings_are_checked_against_the_mesh():
    assert get_pool(4).run(_settings_worker) == [True] * 4


def _fused_step_after_a_forward_worker(setting: bool | int) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    mesh = mesh_for((4,))
    fshard.fully_shard(model[0], mesh=mesh, reshard_after_forward=setting)
    fshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 8)).sum().backward()
    model(torch.ones(2, 8)).sum()  # with grad, no backward: model[0] keeps its copy (or rows)
    opt.step()  # fused: writes the shards without bumping their version counters
    weight, bias = model[0].weight.full_tensor(), model[0].bias.full_tensor()
    with torch.no_grad():  # the unit called on its own computes with the new values...
        called = bool(torch.allclose(model[0](torch.ones(2, 8)), nn.functional.linear(torch.ones(2, 8), weight, bias)))
    model(torch.ones(2, 8)).sum()
    opt.step()
    weight = model[0].weight.full_tensor()
    fshard.unshard(model[0])  # ...and fshard.unshard shows them
    shown = bool(torch.equal(model[0].weight.detach(), weight))
    fshard.reshard(model)
    return [called, shown]


@pytest.mark.parametrize("setting", [2, False], ids=["int", "zero2"])
def test_what_a_forward_kept_is_freed_by_an_optimizer_step(setting):
    """Rows kept by an int (or a ZeRO-2 unit's copy) from a forward whose backward never came
    outlived a fused optimizer step: fshard.unshard and a call of the unit on its own used the
    weights from before the step."""
    for result in get_pool(4).run(_fused_step_after_a_forward_worker, setting):
        assert result == [True, True], result
