"""``fshard.auto_shard`` on a real process group: the units it builds, and training like DDP.

Each case runs ``auto_shard`` as the ``shard_fn`` of ``fshard.testing.assert_equivalent_to_ddp``
on a 2-rank pool. There, on every rank, it checks that the units are exactly
``select_modules(model, policy)`` (also written out below, so the check does not rest on
``select_modules`` alone) plus the root, that ``fully_shard`` was called on them in that order
(bottom-up, the root last), that each parameter went to the first unit of that order holding it,
and that the keyword arguments reached every unit. Then the model trains next to DDP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

import fshard
import fshard._wrap
from fshard.testing import assert_equivalent_to_ddp
from fshard.testing.models import (
    Block,
    MLPSpec,
    ModelSpec,
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
)

WORLD = 2


def is_layer_norm(module: nn.Module) -> bool:
    """A plain callable policy (module level, so it pickles to the pool)."""
    return isinstance(module, nn.LayerNorm)


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    policy: Any
    units: tuple[str, ...]  # what select_modules must say, in fully_shard order, the root left out
    kwargs: dict[str, Any] = field(default_factory=dict)  # to auto_shard, so to every fully_shard


UNTIED = TransformerSpec(tie_embeddings=False)
BLOCK_0 = ("blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out")
BLOCK_1 = ("blocks.1.qkv", "blocks.1.proj", "blocks.1.fc", "blocks.1.out")
CASES = {
    "by_class-blocks": Case(TransformerSpec(layers=3), fshard.by_class(Block), ("blocks.0", "blocks.1", "blocks.2")),
    # Nested matches: the Linears of a block first, then the block (its LayerNorms), then the head.
    "by_class-nested": Case(UNTIED, fshard.by_class(Block, nn.Linear), (*BLOCK_0, "blocks.0", *BLOCK_1, "blocks.1", "head")),
    # The head holds the weight tied to the embedding: it takes it (root init moves it later).
    "by_class-tied": Case(TransformerSpec(), fshard.by_class(nn.Linear), (*BLOCK_0, *BLOCK_1, "head")),
    # qkv (108 parameters) and fc (84) reach 80, proj (42) and out (78) do not; what the block
    # has left (its norms, proj and out: 144) does. The embedding (66) and the norm stay at the root.
    "by_size-transformer": Case(
        TransformerSpec(), fshard.by_size(80),
        ("blocks.0.qkv", "blocks.0.fc", "blocks.0", "blocks.1.qkv", "blocks.1.fc", "blocks.1"),
        kwargs={"reshard_after_forward": False},
    ),
    # 42 and 56 parameters reach 40, the last layer's 24 do not; the ModuleList is never a unit.
    "by_size-mlp": Case(MLPSpec(widths=(7, 7, 3)), fshard.by_size(40), ("layers.0", "layers.1")),
    "by_size-root-only": Case(TransformerSpec(), fshard.by_size(10**6), ()),
    "callable": Case(
        TransformerSpec(), is_layer_norm, ("blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "norm")
    ),
}


def _shard_and_check(case: Case, model: nn.Module, mesh: Any) -> None:
    """The ``shard_fn``: ``auto_shard``, then check on this rank what it built."""
    rank = dist.get_rank()
    selected = fshard.select_modules(model, case.policy)
    if selected != list(case.units):
        raise AssertionError(f"rank {rank}: select_modules gave {selected}, expected {list(case.units)}")
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    aliases: dict[int, list[str]] = {}  # a tied parameter has a name per module holding it
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    calls: list[str] = []
    original = fshard._wrap.fully_shard

    def recording(module: nn.Module, **kwargs: Any) -> Any:
        calls.append(fqn_of[id(module)])
        return original(module, **kwargs)

    fshard._wrap.fully_shard = recording  # type: ignore[assignment]
    try:
        fshard.auto_shard(model, policy=case.policy, mesh=mesh, **case.kwargs)
    finally:
        fshard._wrap.fully_shard = original
    order = [*case.units, ""]
    problems = []
    if calls != order:
        problems.append(f"fully_shard was called on {calls}, expected {order} (bottom-up, the root last)")
    units = {unit.fqn: unit for unit in fshard.units(model)}
    if sorted(units) != sorted(order):
        problems.append(f"the units are {sorted(units)}, expected {sorted(order)}")
    # Each parameter belongs to the first unit in call order whose subtree holds it (by any name).
    param_of = dict(model.named_parameters(remove_duplicate=False))
    owner_of = {id(param_of[name]): fqn for fqn, unit in units.items() for name in unit.param_names}
    for name, param in model.named_parameters():
        names = aliases.get(id(param), [name])
        want = next(u for u in order if u == "" or any(n.startswith(u + ".") for n in names))
        got = owner_of.get(id(param))
        if got != want:
            problems.append(f"{name} belongs to unit {got!r}, expected {want!r}")
        if not fshard.is_sharded(param):
            problems.append(f"{name} is not sharded")
    for fqn, unit in units.items():
        want_reshard = case.kwargs.get("reshard_after_forward", True)
        if unit.reshard_after_forward != want_reshard:
            problems.append(f"unit {fqn!r} has reshard_after_forward={unit.reshard_after_forward}")
    if problems:
        raise AssertionError(f"rank {rank}: auto_shard built other units:\n" + "\n".join(problems))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_auto_shard_builds_the_selected_units_and_trains_like_ddp(case: Case) -> None:
    report = assert_equivalent_to_ddp(
        functools.partial(build_model, case.spec),
        batch_fn=functools.partial(make_batch, case.spec),
        loss_fn=functools.partial(compute_loss, case.spec),
        shard_fn=functools.partial(_shard_and_check, case),
        world_size=WORLD,
        steps=2,
    )
    n_params = len(list(build_model(case.spec).parameters()))
    assert report.params_compared == report.params_sharded == n_params
