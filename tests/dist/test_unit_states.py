"""A unit's named transitions check their preconditions and fail naming the unit and its state.

These are fshard's own invariants (an internal error means a bug in fshard), so the test reaches
the unit object itself: no public API hands it out.
"""

from __future__ import annotations

import torch
from torch import nn

import fshard
from fshard._unit._group import ParamGroup, group_of
from fshard.testing import get_pool, mesh_for


def _unit(module: nn.Module) -> ParamGroup:
    group = group_of(next(module.parameters())._fshard_slot)
    assert group is not None
    return group


def _raises(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _states_worker() -> dict[str, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mesh = mesh_for((2,))
    fshard.fully_shard(model[0], mesh=mesh, reshard_after_forward=True)
    fshard.fully_shard(model, mesh=mesh)
    block = _unit(model[0])
    before_init = _raises(block.pre_forward)
    model(torch.randn(3, 4)).sum().backward()
    seen = {
        "before_init": before_init,
        "idle": block.describe_state(),
        "release_parked": _raises(block.release_parked),
        "wait_for_unshard": _raises(block.wait_for_unshard),
        "reshard_post_forward": _raises(block.reshard_post_forward),
    }
    fshard.unshard(model[0])
    seen["unsharded"] = block.describe_state()
    seen["set_slots"] = _raises(lambda: block.set_slots(block.slots, [s.sharded_param.detach() for s in block.slots]))
    fshard.reshard(model[0])
    return seen


def test_transitions_fail_with_the_unit_and_its_state() -> None:
    for seen in get_pool(2).run(_states_worker):
        assert "pre_forward on unit" in seen["before_init"], seen
        assert seen["idle"] == "sharded, idle"
        assert seen["unsharded"] == "unsharded, idle"
        for transition in ("release_parked", "wait_for_unshard", "reshard_post_forward", "set_slots"):
            message = seen[transition]
            assert message.startswith("[rank "), message
            assert f"fshard internal error: {transition} on unit '0' in state" in message, message
        assert "in state unsharded, idle; expected a sharded unit" in seen["set_slots"]
