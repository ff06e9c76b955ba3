"""Loading into a model built on the meta device (on some ranks or on all), without
``fshard.materialize``: every load path allocates only this rank's shards, fills them, and gives
the same parameters as a load into an eagerly built model (issue 24, first bullet).

See [Note: loading into a meta model] in ``fshard/_state_dict/_common.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
import fshard.checkpoint
from fshard.testing import RanksFailed, get_pool, mesh_for
from fshard.testing.models import TinyTransformer, shard_model
from tests.dist import _sd_common as C

SOURCES = ["full", "sharded", "rank0", "checkpoint", "torch"]


def _build(mesh_shape: tuple[int, ...], meta: bool, *, scratch_on_meta: bool = False) -> nn.Module:
    """``_sd_common.build``'s model (default seed), on the meta device if ``meta``: its
    persistent buffer ``counter`` too, and its non-persistent ``scratch`` only with
    ``scratch_on_meta`` (else built as its ``__init__`` would, off the meta device)."""
    if meta:
        with torch.device("meta"):
            model = TinyTransformer(C.SPEC).to(dtype=C.SPEC.dtype)
            model.register_buffer("counter", torch.empty(3, dtype=torch.float64))
        scratch = torch.empty(2, device="meta") if scratch_on_meta else torch.zeros(2)
        model.register_buffer("scratch", scratch, persistent=False)
    else:
        model = C.build()
    shard_model(C.SPEC, model, mesh_for(mesh_shape))
    return model


class _FloatAllocations(C.AllocationRecorder):
    """``AllocationRecorder`` for the model's tensors only (floating point): the byte tensors
    of object collectives (the ranks' agreement, a checkpoint's manifest) are not counted."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = len(self.sizes)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        floating = [
            t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        ]
        if not any(t.is_floating_point() for t in floating):
            del self.sizes[before:]
        return out


def _meta_ranks(which: str) -> set[int]:
    return set(range(dist.get_world_size())) if which == "all" else {1, 2}


def _allocation_bound(model: nn.Module) -> int:
    """The largest single allocation a load may make: one full parameter, or one unit's
    (padded) shards, the flat buffer a meta unit gets."""
    full = max(p.full_shape.numel() * p.element_size() for p in model.parameters())
    units = [
        sum(
            (p := model.get_parameter(n))._fshard_slot.layout.slot_numel * p.element_size()
            for n in unit.param_names
        )
        for unit in fshard.units(model)
    ]
    return max(full, *units)


def _load(model: nn.Module, source: str, mesh_shape: tuple[int, ...], path: str) -> None:
    """Load seed 5's weights into ``model`` the ``source`` way."""
    want = C.build(seed=5).state_dict()
    rank0 = dist.get_rank() == 0
    if source == "full":
        fshard.load_state_dict(model, want)
    elif source == "sharded":
        fshard.load_state_dict(model, fshard.state_dict(C.build_sharded(mesh_shape, seed=5)))
    elif source == "rank0":
        fshard.load_state_dict(model, want if rank0 else None, broadcast_from_rank0=True)
    elif source == "checkpoint":
        fshard.checkpoint.load(path, model)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, want if rank0 else {}, options=options)


def _meta_load_task(mesh_shape: tuple[int, ...], which: str, path: str) -> dict[str, int]:
    """Each load path into a model that is on meta on ``which`` ranks: the result equals an
    eager model loaded the same way, the model trains, and no rank allocated more than one full
    parameter (or one unit's shards) at once."""
    rank = dist.get_rank()
    meta = rank in _meta_ranks(which)
    fshard.checkpoint.save(path, C.build_sharded(mesh_shape, seed=5))
    eager = _build(mesh_shape, meta=False)
    fshard.load_state_dict(eager, C.build(seed=5).state_dict())
    want = C.full_params(eager)
    largest: dict[str, int] = {}
    for source in SOURCES:
        model = _build(mesh_shape, meta, scratch_on_meta=meta and rank != 0 and source == "rank0")
        recorder = _FloatAllocations()
        with recorder:
            _load(model, source, mesh_shape, path)
        assert not any(t.is_meta for t in model.state_dict().values() if isinstance(t, torch.Tensor)), source
        assert all(not p.is_meta for p in model.parameters()), source
        assert torch.equal(model.scratch, torch.zeros(2)), (source, model.scratch)
        C.assert_same_tensors(C.full_params(model), want, what=f"{source}, meta on {which} ranks")
        C.loss_of(model, C.rank_batch(0, rank, dist.get_world_size())).backward()  # and it trains
        if meta:
            largest[source] = recorder.largest
    bound = _allocation_bound(eager)
    assert all(v <= bound for v in largest.values()), (largest, bound)
    return largest


@pytest.mark.parametrize("which", ["some", "all"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_every_load_path_fills_a_meta_built_model(mesh_shape, which, tmp_path):
    """Full, sharded and rank-0 dicts, a checkpoint and torch's set_model_state_dict, into a
    model on the meta device on ranks 1 and 2 or on all: parameters and buffers equal an eager
    load's, with no ``reset_parameters()`` (``materialize``) call."""
    path = os.fspath(tmp_path / "ckpt")
    get_pool(4).run(_meta_load_task, mesh_shape, which, path)


def _partial_task(source: str) -> None:
    """A meta model and a state dict lacking one weight (``strict=False``): that weight would
    keep no values, so every rank refuses the load, naming it, and none allocated anything."""
    model = _build((2,), meta=dist.get_rank() == 1)
    sd = C.build(seed=5).state_dict()
    del sd["blocks.0.fc.weight"]
    given = sd if source != "rank0" or dist.get_rank() == 0 else None
    try:
        fshard.load_state_dict(model, given, strict=False, broadcast_from_rank0=source == "rank0")
    finally:
        if dist.get_rank() == 1:
            assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("source", ["full", "rank0"])
def test_a_meta_weight_the_load_does_not_fill_is_an_error_on_every_rank(source):
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_partial_task, source, timeout=60)
    errors = info.value.errors
    assert sorted(errors) == [0, 1], info.value
    messages = {str(exc) for exc in errors.values()}
    assert len(messages) == 1, messages
    [message] = messages
    assert "1 parameter(s) are on the meta device and the state dict does not hold them ('blocks.0.fc.weight')" in message, message


def _non_persistent_task() -> None:
    """A full dict cannot fill a non-persistent buffer left on meta: an error on every rank."""
    model = _build((2,), meta=dist.get_rank() == 1, scratch_on_meta=True)
    fshard.load_state_dict(model, C.build(seed=5).state_dict())


def test_a_meta_non_persistent_buffer_outside_a_rank0_load_is_an_error_on_every_rank():
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_non_persistent_task, timeout=60)
    errors = info.value.errors
    assert sorted(errors) == [0, 1], info.value
    message = str(errors[0])
    assert str(errors[1]) == message
    assert "1 non-persistent buffer(s) are on the meta device ('scratch')" in message, message
    assert "broadcast_from_rank0=True" in message, message

