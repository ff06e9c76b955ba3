"""Sharded and full state dicts, loading from any mesh, optimizer state, loading from rank 0."""

from __future__ import annotations

import itertools
import math
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fshard
from fshard import transforms
from fshard.testing import RanksFailed, get_pool, mesh_for, trace_collectives
from tests.dist import _sd_common as C

# ------------------------------------------------------------------------------------- tasks


def _state_dict_task(mesh_shape):
    unsharded = C.build()
    want = {k: v.clone() for k, v in unsharded.state_dict().items()}
    model = C.build_sharded(mesh_shape)
    sd = fshard.state_dict(model)
    assert list(sd) == list(want), (list(sd), list(want))
    params = dict(model.named_parameters(remove_duplicate=False))
    for key, value in sd.items():
        if key in params:
            p = params[key]
            assert isinstance(value, DTensor), key
            assert tuple(value.placements) == tuple(p.placements), key
            assert value.shape == p.full_shape, key
            assert value.to_local().data_ptr() == p.to_local().data_ptr(), f"{key} is a copy"
            assert torch.equal(value.full_tensor(), want[key]), key
        else:
            assert type(value) is torch.Tensor and torch.equal(value, want[key]), key
    assert sd["embed.weight"] is sd["head.weight"]  # tied: one DTensor under both keys
    return True


def _full_state_dict_task(mesh_shape):
    want = C.build().state_dict()
    model = C.build_sharded(mesh_shape)
    rank = dist.get_rank()
    full = fshard.full_state_dict(model)
    if rank == 0:
        C.assert_same_tensors(full, want, what="rank0_only")
        assert list(full) == list(want)
        assert full["embed.weight"] is full["head.weight"]
    else:
        assert full == {}
    everywhere = fshard.full_state_dict(model, rank0_only=False, cpu_offload=False)
    C.assert_same_tensors(everywhere, want, what="rank0_only=False")
    return True


def _big_mlp(mesh_shape):
    from fshard.testing.models import MLPSpec, build_model, shard_model

    spec = MLPSpec(in_dim=128, widths=(128,) * 8, scalar_param=True, seed=1)
    model = build_model(spec)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shard_model(spec, model, mesh_for(mesh_shape))
    return model, want


def _full_state_dict_memory_task(mesh_shape):
    model, want = _big_mlp(mesh_shape)
    full, peak = C.peak_cpu_bytes(lambda: fshard.full_state_dict(model))
    result_bytes = sum(v.numel() * v.element_size() for v in full.values())
    largest_param = max(v.numel() * v.element_size() for v in want.values())
    shard_bytes = max(p._fshard_slot.layout.slot_numel * p.element_size() for p in model.parameters())
    if dist.get_rank() == 0:
        C.assert_same_tensors(full, want)
    return {"peak": peak, "result": result_bytes, "largest_param": largest_param, "shard": shard_bytes}


def _load_across_meshes_task(src_mesh, dst_mesh):
    rank, world = dist.get_rank(), dist.get_world_size()
    source = C.build_sharded(src_mesh)
    C.train(source, C.make_optim(source), range(1))
    want = C.full_params(source)
    sharded = fshard.state_dict(source)

    target = C.build_sharded(dst_mesh, seed=11)
    result = fshard.load_state_dict(target, sharded)
    assert result == fshard.LoadResult([], [])
    C.assert_same_tensors(C.full_params(target), want, what="from DTensors")

    target = C.build_sharded(dst_mesh, seed=12)
    fshard.load_state_dict(target, want)
    C.assert_same_tensors(C.full_params(target), want, what="from a full state dict")
    # The loaded model trains on: one more step equals the source's (same mesh -> exact).
    C.train(target, C.make_optim(target), range(1, 2))
    return rank, world


def _load_while_unsharded_task():
    model = C.build_sharded((dist.get_world_size(),))
    want = dict(C.build(seed=8).state_dict())
    fshard.unshard(model)  # the module holds gathered params now
    fshard.load_state_dict(model, want)
    # The module's registered tensors are the gathered params now (model.state_dict() would
    # give the sharded DTensors, gathered or not).
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    gathered = {k: v.detach() for k, v in tensors if k in want}
    C.assert_same_tensors(gathered, want, what="gathered params after the load")
    fshard.reshard(model)
    C.assert_same_tensors(C.full_params(model), want, what="shards after the load")
    return True


def _load_errors_task(case):
    model = C.build_sharded((dist.get_world_size(),))
    full = C.full_params(model)
    sd = dict(full)
    if case == "missing":
        del sd["blocks.0.fc.weight"], sd["counter"]
    elif case == "unexpected":
        sd["blocks.9.fc.weight"] = torch.zeros(2)
    elif case == "shape":
        sd["blocks.1.out.weight"] = torch.zeros(3, 3)
        sd["counter"] = torch.zeros(4)
    elif case == "local":
        sd = fshard.transforms.to_local(fshard.state_dict(model))
    elif case == "lenient":
        del sd["blocks.0.fc.weight"]
        sd["extra.key"] = torch.zeros(1)
        return fshard.load_state_dict(model, sd, strict=False)
    fshard.load_state_dict(model, sd)
    return None


def _optim_round_trip_task(src_mesh, dst_mesh, kind):
    steps_before, steps_after = 2, 2
    source = C.build_sharded(src_mesh)
    opt = C.make_optim(source, kind)
    C.train(source, opt, range(steps_before))
    osd = fshard.optim_state_dict(source, opt)
    full_osd = fshard.optim_state_dict(source, opt, full=True)
    names = {n for n, _ in source.named_parameters()}
    assert set(osd["state"]) == names, sorted(osd["state"])
    assert osd["param_groups"][0]["params"] == [n for n, _ in source.named_parameters()]
    shard_shaped = "exp_avg" if kind == "adamw" else "momentum_buffer"
    assert isinstance(osd["state"]["blocks.0.fc.weight"][shard_shaped], DTensor)
    if kind == "adamw":
        assert type(osd["state"]["blocks.0.fc.weight"]["step"]) is torch.Tensor
    sd = fshard.state_dict(source)

    target = C.build_sharded(dst_mesh, seed=21)
    # A differently ordered optimizer with other hyperparameters: names, not positions, match.
    params = list(reversed(list(target.parameters())))
    target_opt = (
        torch.optim.AdamW(params, lr=1.0, weight_decay=0.0)
        if kind == "adamw"
        else torch.optim.SGD(params, lr=1.0, momentum=0.5)
    )
    fshard.load_state_dict(target, sd)
    fshard.load_optim_state_dict(target, target_opt, osd)
    assert target_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    reloaded = fshard.optim_state_dict(target, target_opt, full=True)
    for name, state in full_osd["state"].items():
        C.assert_same_tensors(reloaded["state"][name], state, what=f"optim state {name}")

    C.train(source, opt, range(steps_before, steps_before + steps_after))
    C.train(target, target_opt, range(steps_before, steps_before + steps_after))
    C.assert_same_tensors(
        C.full_params(target), C.full_params(source), exact=src_mesh == dst_mesh, what="continued"
    )
    # A full optimizer state dict loads too.
    third = C.build_sharded(dst_mesh, seed=22)
    third_opt = C.make_optim(third, kind)
    fshard.load_state_dict(third, sd)
    fshard.load_optim_state_dict(third, third_opt, full_osd)
    reloaded = fshard.optim_state_dict(third, third_opt, full=True)
    for name, state in full_osd["state"].items():
        C.assert_same_tensors(reloaded["state"][name], state, what=f"full optim state {name}")
    return True


def _broadcast_task(mesh_shape, src_seed):
    from fshard.testing.models import MLPSpec, build_model, shard_model

    rank = dist.get_rank()
    spec = MLPSpec(in_dim=40, widths=(48, 36), scalar_param=True, seed=src_seed)
    full = build_model(spec).state_dict() if rank == 0 else ({} if rank == 1 else None)
    other = MLPSpec(in_dim=40, widths=(48, 36), scalar_param=True, seed=src_seed + 1)

    eager = build_model(other)
    shard_model(other, eager, mesh_for(mesh_shape))
    reference_sd = [build_model(spec).state_dict()]  # what every rank would need for the eager path
    fshard.load_state_dict(eager, reference_sd[0])
    want = C.full_params(eager)
    del reference_sd

    model = build_model(other)
    shard_model(other, model, mesh_for(mesh_shape))
    recorder = C.AllocationRecorder()
    with recorder:
        result = fshard.load_state_dict(model, full, broadcast_from_rank0=True)
    assert result == fshard.LoadResult([], [])
    C.assert_same_tensors(C.full_params(model), want, what="broadcast_from_rank0")
    slot_bytes = max(
        p._fshard_slot.layout.slot_numel * p.element_size() for p in model.parameters()
    )
    full_bytes = {n: p.full_shape.numel() * p.element_size() for n, p in model.named_parameters()}
    padded = _padded_bytes(model)
    return {"largest": recorder.largest, "slot": slot_bytes, "full": full_bytes, "padded": padded}


def _padded_bytes(model):
    """The largest parameter padded to whole shards: what rank 0 scatters at once."""
    return max(
        p._fshard_slot.mesh_info.shard_size * p._fshard_slot.layout.slot_numel * p.element_size()
        for p in model.parameters()
    )


def _broadcast_memory_task(mesh_shape):
    """What rank 0 allocates while it loads a model of 16 equal weights (and their biases)
    into the others: the largest allocation, and the bytes allocated before each scatter
    (since the one before)."""
    from fshard.testing.models import MLPSpec, build_model, shard_model

    spec = MLPSpec(in_dim=128, widths=(128,) * 16, seed=1)
    want = build_model(spec).state_dict()
    other = MLPSpec(in_dim=128, widths=(128,) * 16, seed=2)
    model = shard_model(other, build_model(other), mesh_for(mesh_shape))
    full = want if dist.get_rank() == 0 else None
    recorder = C.AllocationRecorder()
    scatters: list[int] = []  # len(recorder.sizes) as each scatter is issued

    def on_record(record):
        if record.op == "scatter":
            scatters.append(len(recorder.sizes))

    with trace_collectives(on_record=on_record), recorder:
        fshard.load_state_dict(model, full, broadcast_from_rank0=True)
    C.assert_same_tensors(C.full_params(model), want, what="broadcast_from_rank0")
    bounds = [0, *scatters]
    slot_bytes = max(p._fshard_slot.layout.slot_numel * p.element_size() for p in model.parameters())
    return {
        "largest": recorder.largest,
        "per_scatter": [sum(recorder.sizes[a:b]) for a, b in itertools.pairwise(bounds)],
        "padded": _padded_bytes(model),
        "slot": slot_bytes,
        "model": sum(v.numel() * v.element_size() for v in want.values()),
    }


def _init_module(module):
    """reset_parameters() where there is one; the MLP's own 0-d scale gets ones."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        for p in module._parameters.values():
            if p is not None:
                torch.nn.init.ones_(p)


def _broadcast_meta_task(mesh_shape):
    """Only rank 0 builds real weights; the others build on the meta device and materialize."""
    from fshard.testing.models import (
        MLP,
        MLPSpec,
        build_model,
        compute_loss,
        make_batch,
        shard_model,
    )

    rank = dist.get_rank()
    spec = MLPSpec(in_dim=40, widths=(48, 36), scalar_param=True, seed=7)
    want = {k: v.clone() for k, v in build_model(spec).state_dict().items()}  # only to compare
    if rank == 0:
        model = build_model(spec)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = MLP(spec)
        full = None
    shard_model(spec, model, mesh_for(mesh_shape))
    if rank != 0:
        fshard.materialize(model, init_fn=_init_module)
    recorder = C.AllocationRecorder()
    with recorder:
        fshard.load_state_dict(model, full, broadcast_from_rank0=True)
    C.assert_same_tensors(C.full_params(model), want, what="meta + materialize + broadcast")
    compute_loss(spec, model, make_batch(spec, 0, rank)).backward()  # and it trains
    slot_bytes = max(p._fshard_slot.layout.slot_numel * p.element_size() for p in model.parameters())
    return recorder.largest, slot_bytes


def _broadcast_errors_task(case):
    model = C.build_sharded((dist.get_world_size(),))
    full = C.full_params(model)  # collective: every rank gathers, then only rank 0 keeps it
    if dist.get_rank() != 0:
        full = {}
    if case == "missing" and dist.get_rank() == 0:
        del full["pos"]
    if case == "none_on_rank0" and dist.get_rank() == 0:
        full = None
    fshard.load_state_dict(model, full, broadcast_from_rank0=True)


def _layout_task(mesh_shape):
    want = {k: v.clone() for k, v in C.build().state_dict().items()}
    model = C.build_sharded(mesh_shape)
    layout = fshard.layout_of(model)
    coord = tuple(mesh_for(mesh_shape).get_coordinate())
    local = transforms.to_local(fshard.state_dict(model))
    expected = transforms.shard(want, layout, coord)
    C.assert_same_tensors(local, expected, what=f"local shards at {coord}")
    return pickle.dumps(layout), coord, local


def _module_state_dict_task(mesh_shape):
    """``model.state_dict()`` and ``model.load_state_dict()`` on a sharded model."""
    import copy
    import io

    want = C.build(seed=11).state_dict()
    model = C.build_sharded(mesh_shape)
    sd = model.state_dict()
    ours = fshard.state_dict(model)
    assert list(sd) == list(ours) == list(C.build().state_dict())
    for key, value in ours.items():
        if isinstance(value, DTensor):
            got = sd[key]
            assert isinstance(got, DTensor) and got.placements == value.placements, key
            assert got.to_local().data_ptr() == value.to_local().data_ptr(), f"{key} is a copy"
        else:
            assert torch.equal(sd[key], value), key
    # Tied: both keys alias the one shard (torch's own state_dict gives two detached aliases).
    assert sd["embed.weight"].to_local().data_ptr() == sd["head.weight"].to_local().data_ptr()
    # A unit's own state_dict() has its relative keys, also as DTensors.
    block = model.blocks[0].state_dict()
    assert set(block) == set(C.build().blocks[0].state_dict()) and all(isinstance(v, DTensor) for v in block.values())
    # torch.save / torch.load(weights_only=True) round trip, then load it back into the model.
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    # A full state dict from the unsharded model loads on every rank (each keeps its rows), also
    # into a unit that is gathered right now.
    fshard.unshard(model.blocks[1])
    result = model.load_state_dict(want)
    assert not result.missing_keys and not result.unexpected_keys
    C.assert_same_tensors(fshard.full_state_dict(model, rank0_only=False), want, what="full load")
    # ... and the sharded one saved above brings the first weights back.
    model.load_state_dict(saved)
    C.assert_same_tensors(fshard.full_state_dict(model, rank0_only=False), C.build().state_dict(), what="sharded load")
    # A DTensor state dict from another mesh loads too (gathered, then this rank's rows).
    other = C.build_sharded((dist.get_world_size(),), seed=11)
    model.load_state_dict(other.state_dict())
    C.assert_same_tensors(fshard.full_state_dict(model, rank0_only=False), want, what="other mesh")
    errors = []
    try:
        model.load_state_dict(want, assign=True)
    except ValueError as exc:
        errors.append(str(exc))
    for copy_or_pickle in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        try:
            copy_or_pickle(model)
        except TypeError as exc:
            errors.append(str(exc))
    return errors


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_state_dict_is_dtensors_under_the_unsharded_keys(mesh_shape):
    assert all(get_pool(4).run(_state_dict_task, mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_module_state_dict_is_the_sharded_state_dict_and_loads_full_or_sharded(mesh_shape):
    world = math.prod(mesh_shape)
    for assign_error, *copy_errors in get_pool(world).run(_module_state_dict_task, mesh_shape):
        assert "load_state_dict(assign=True) would replace fshard's sharded parameters" in assign_error
        assert "fshard.materialize(model)" in assign_error
        assert len(copy_errors) == 3  # deepcopy, pickle.dumps, torch.save(model)
        for copy_error in copy_errors:
            assert copy_error.startswith("cannot copy or pickle the fshard unit")
            assert "before fully_shard" in copy_error


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_full_state_dict_has_the_unsharded_keys_and_values(mesh_shape):
    assert all(get_pool(4).run(_full_state_dict_task, mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_full_state_dict_peak_memory_is_one_param_plus_the_result(mesh_shape):
    results = get_pool(4).run(_full_state_dict_memory_task, mesh_shape)
    rank0 = results[0]
    model_bytes = rank0["result"]
    assert rank0["largest_param"] + rank0["shard"] < model_bytes / 2  # the test can tell
    # Rank 0 holds the result plus one (padded) shard in flight: the other ranks' shards land
    # straight in the gathered parameter, which is the result. Never a second full parameter.
    extra = rank0["peak"] - rank0["result"]
    assert 0 <= extra <= rank0["shard"] + 4096, rank0
    for rank, other in enumerate(results[1:], start=1):
        # Other ranks only send their padded shard.
        assert other["result"] == 0
        assert other["peak"] <= other["shard"] + 4096, (rank, other)


@pytest.mark.parametrize(("src_mesh", "dst_mesh"), [((2, 2), (4,)), ((4,), (2, 2)), ((4,), (4,))])
def test_load_state_dict_from_any_mesh_full_or_sharded(src_mesh, dst_mesh):
    get_pool(4).run(_load_across_meshes_task, src_mesh, dst_mesh)


def test_load_state_dict_into_an_unsharded_model_updates_the_gathered_params():
    assert all(get_pool(2).run(_load_while_unsharded_task))


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("missing", r"missing key\(s\): \['counter', 'blocks.0.fc.weight'\]|missing key\(s\): \['blocks.0.fc.weight', 'counter'\]"),
        ("unexpected", r"unexpected key\(s\): \['blocks.9.fc.weight'\]"),
        ("shape", r"2 problems:(?=.*key 'blocks.1.out.weight': shape mismatch, the model's parameter has shape \[8, 16\] but the state dict has \[3, 3\])(?=.*key 'counter': shape mismatch, the model's buffer has shape \[3\] but the state dict has \[4\])"),
        ("local", r"key 'blocks.0.fc.weight': shape mismatch.*\(it has this rank's shard shape"),
    ],
)
def test_load_state_dict_errors_name_every_key(case, pattern):
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_errors_task, case)
    assert sorted(info.value.errors) == [0, 1]  # every rank raises, none hangs
    for error in info.value.errors.values():
        assert isinstance(error, ValueError)
        assert re.search(pattern, str(error), re.S), str(error)


def test_load_state_dict_non_strict_reports_keys():
    results = get_pool(2).run(_load_errors_task, "lenient")
    for result in results:
        assert result == fshard.LoadResult(["blocks.0.fc.weight"], ["extra.key"])


@pytest.mark.parametrize(
    ("src_mesh", "dst_mesh", "kind"),
    [((2, 2), (4,), "adamw"), ((4,), (4,), "sgd"), ((4,), (2, 2), "sgd")],
)
def test_optim_state_dict_is_keyed_by_name_and_reshards(src_mesh, dst_mesh, kind):
    get_pool(4).run(_optim_round_trip_task, src_mesh, dst_mesh, kind)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_load_from_rank0_equals_eager_and_other_ranks_never_hold_a_full_param(mesh_shape):
    results = get_pool(4).run(_broadcast_task, mesh_shape, 5)
    # Rank 0's largest allocation is one padded parameter (what it scatters), not the model.
    rank0 = results[0]
    assert rank0["largest"] <= rank0["padded"] < sum(rank0["full"].values()), rank0
    for rank, r in enumerate(results[1:], start=1):
        assert r["largest"] <= r["slot"], (rank, r)
        big = {n: b for n, b in r["full"].items() if b > r["slot"]}
        assert big, "the model must have params larger than a shard for this test to mean much"
        assert r["largest"] < min(big.values()), (rank, r)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_load_from_rank0_streams_one_param_at_a_time_on_rank0(mesh_shape):
    """Rank 0 allocates one padded parameter (the chunks it scatters) and its own shard of
    it, then scatters it, parameter after parameter: no buffer the size of the model (16
    times as large), nor every parameter's chunks before the first scatter. (Counted in
    fshard's allocations between scatters, not as the allocator's peak, which varies from
    run to run with when the backend's copies of a scatter's input are freed.)"""
    rank0 = get_pool(4).run(_broadcast_memory_task, mesh_shape)[0]
    assert rank0["largest"] <= rank0["padded"], rank0
    assert len(rank0["per_scatter"]) == 32  # one scatter per parameter
    one_param = rank0["padded"] + rank0["slot"]
    assert one_param < rank0["model"] / 8, rank0  # the test can tell
    # (The first scatter also follows the ranks' agreement on the keys: a few small objects.)
    assert max(rank0["per_scatter"]) <= one_param + 16384, rank0


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_load_from_rank0_into_a_meta_model_after_materialize(mesh_shape):
    if not hasattr(fshard, "materialize"):
        pytest.skip("fshard.materialize is not available in this tree")
    results = get_pool(4).run(_broadcast_meta_task, mesh_shape)
    for rank, (largest, slot_bytes) in enumerate(results[1:], start=1):
        assert largest <= slot_bytes, (rank, largest, slot_bytes)


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("missing", r"missing key\(s\): \['pos'\]"),
        ("none_on_rank0", r"rank 0 must pass the full state dict as a mapping, got NoneType"),
    ],
)
def test_load_from_rank0_errors_reach_every_rank(case, pattern):
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_broadcast_errors_task, case)
    assert sorted(info.value.errors) == [0, 1]
    for error in info.value.errors.values():
        assert isinstance(error, ValueError)
        assert re.search(pattern, str(error)), str(error)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_layout_of_is_picklable_and_matches_the_shards(mesh_shape):
    results = get_pool(4).run(_layout_task, mesh_shape)
    layouts = {pickle.loads(r[0]) for r in results}
    assert len(layouts) == 1
    layout = layouts.pop()
    assert layout.mesh_shape == mesh_shape
    assert layout["blocks.0.fc.weight"].placements == (("S(0)",) if len(mesh_shape) == 1 else ("R", "S(0)"))
    assert layout["counter"].placements == tuple("R" for _ in mesh_shape)
    want = C.build().state_dict()
    locals_ = {coord: local for _, coord, local in results}
    C.assert_same_tensors(transforms.unshard(locals_, layout), dict(want), what="unshard of gathered shards")
