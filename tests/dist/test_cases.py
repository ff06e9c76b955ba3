"""Named behaviours of fully_shard, each checked against DDP (or a DDP-equivalent reference)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import assert_equivalent_to_ddp, get_pool, mesh_for
from fshard.testing.models import (
    MLPSpec,
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    model_inputs,
    shard_model,
)
from tests.dist.probes import GatherProbe


def check(spec, *, world_size=4, mesh_shape=None, ddp_kwargs=None, rtol=1e-5, atol=1e-6, shard_fn=None, **kwargs):
    shard_kwargs = {k: kwargs.pop(k) for k in ("reshard_after_forward",) if k in kwargs}
    return assert_equivalent_to_ddp(
        functools.partial(build_model, spec),
        batch_fn=functools.partial(make_batch, spec),
        loss_fn=functools.partial(compute_loss, spec),
        shard_fn=shard_fn or functools.partial(shard_model, spec, **shard_kwargs),
        world_size=world_size,
        mesh_shape=mesh_shape,
        ddp_kwargs=ddp_kwargs,
        rtol=rtol,
        atol=atol,
        **kwargs,
    )


GPT = TransformerSpec(vocab=37, dim=12, heads=3, layers=3, seq=7, mlp_ratio=2, batch_size=3)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (1, 4), (4, 1)], ids=str)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fp32_adamw_gpt_equals_ddp(mesh_shape, reshard_after_forward):
    report = check(GPT, mesh_shape=mesh_shape, steps=3, reshard_after_forward=reshard_after_forward)
    assert report.params_compared == 37  # 2 + 3 blocks x 11 + 2; the tied head counts once


@pytest.mark.parametrize(
    "spec",
    [
        MLPSpec(frozen=(0,), widths=(7, 7, 3)),
        MLPSpec(skip_layer=1, widths=(7, 7, 3)),
        MLPSpec(repeat_layer=0),
        MLPSpec(scalar_param=True, widths=(2, 1)),  # 0-d param; params smaller than the world
        MLPSpec(checkpoint="around", widths=(6, 5)),
        TransformerSpec(checkpoint="inside", dim=6),
        TransformerSpec(checkpoint="around", dim=6),
        TransformerSpec(tie_embeddings=False, dim=8),
    ],
    ids=["frozen", "skipped", "called-twice", "scalar-and-tiny", "ckpt-around-mlp", "ckpt-inside", "ckpt-around", "untied"],
)
def test_corner_cases_equal_ddp(spec):
    unused = isinstance(spec, MLPSpec) and spec.skip_layer is not None
    check(spec, world_size=3, steps=2, ddp_kwargs={"find_unused_parameters": True} if unused else None)


@pytest.mark.parametrize("where", ["inside", "around"])
@pytest.mark.parametrize(
    "mesh_shape, reshard_after_forward", [((3,), True), ((3,), False), ((2, 2), True)], ids=str
)
def test_reentrant_checkpointing_equals_ddp(where, mesh_shape, reshard_after_forward):
    # The recomputation runs inside backward, in a nested backward of its own: units gather again
    # there and their gradients arrive from the nested pass.
    spec = TransformerSpec(checkpoint=where, reentrant=True, dim=6, layers=2)
    world_size = math.prod(mesh_shape)
    check(spec, world_size=world_size, mesh_shape=mesh_shape, steps=2, reshard_after_forward=reshard_after_forward)


@pytest.mark.parametrize("strategy", list(fshard.ShardingStrategy), ids=lambda s: s.name)
def test_strategies_equal_ddp(strategy):
    check(GPT, shard_fn=functools.partial(_shard_with_strategy, strategy), steps=2, grad_accum=2)


def _shard_with_strategy(strategy, model, mesh):
    kwargs = fshard.strategy_kwargs(strategy, replicate_size=2 if strategy.name.startswith("HYBRID") else None)
    for block in model.blocks:
        fshard.fully_shard(block, **kwargs)
    fshard.fully_shard(model, **kwargs)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_reduce_scatter_accumulation_equals_ddp(mesh_shape):
    check(GPT, mesh_shape=mesh_shape, steps=2, grad_accum=3, reduce_scatter_accumulation=True)


def _shard_and_compile(spec, what, model, mesh, **kwargs):
    shard_model(spec, model, mesh, **kwargs)
    # aot_eager traces forward and backward through AOTAutograd like inductor does, without a
    # C++ compile; the units' hooks run eagerly between the compiled pieces.
    for module in (model.blocks if what == "blocks" else [model]):
        module.compile(backend="aot_eager")


@pytest.mark.parametrize("what", ["blocks", "whole"])
@pytest.mark.parametrize("mesh_shape, reshard_after_forward", [((2,), True), ((2, 2), False)], ids=str)
def test_torch_compile_equals_ddp(what, mesh_shape, reshard_after_forward):
    spec = TransformerSpec(dim=6, layers=2)
    world_size = math.prod(mesh_shape)
    assert_equivalent_to_ddp(
        functools.partial(build_model, spec),
        batch_fn=functools.partial(make_batch, spec),
        loss_fn=functools.partial(compute_loss, spec),
        shard_fn=functools.partial(
            _shard_and_compile, spec, what, reshard_after_forward=reshard_after_forward
        ),
        world_size=world_size,
        mesh_shape=mesh_shape,
        steps=2,
    )


def test_optimizer_built_before_sharding():
    check(GPT, world_size=2, steps=2, optimizer_before_shard=True)


def _optimizer_stepped_before_sharding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()  # state at full size
    opt.zero_grad()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(3, 6)).sum().backward()
    opt.step()


def test_optimizer_stepped_before_sharding_is_a_clear_error():
    with pytest.raises(fshard.testing.RanksFailed) as info:
        get_pool(2).run(_optimizer_stepped_before_sharding)
    for exc in info.value.errors.values():
        assert isinstance(exc, ValueError)
        assert "optimizer state of sharded parameter(s) '0.weight' (exp_avg [5, 6])" in str(exc)
        assert "stepped before fully_shard" in str(exc)


# --------------------------------------------------------------------------- custom flows


def _synced_reference_step(model: nn.Module, loss: torch.Tensor) -> None:
    """DDP's gradient semantics by hand: backward, then average gradients over ranks."""
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _several_forwards_worker(spec, mesh_shape, reshard_after_forward):
    rank = dist.get_rank()
    ref, model = build_model(spec), build_model(spec)
    shard_model(spec, model, mesh_for(mesh_shape), reshard_after_forward=reshard_after_forward)
    batches = [make_batch(spec, step, rank) for step in range(3)]
    # Two forwards, an eval forward in between under no_grad, then one backward of the sum.
    losses = [compute_loss(spec, ref, b) for b in batches[:2]]
    _synced_reference_step(ref, losses[0] + losses[1])
    out = [compute_loss(spec, model, batches[0])]
    with torch.no_grad():
        compute_loss(spec, model, batches[2])
    out.append(compute_loss(spec, model, batches[1]))
    (out[0] + out[1]).backward()
    result = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        full_grad = torch.zeros_like(q) if p.grad is None else _full(p.grad, p)
        result.append((name, full_grad, q.grad))
    return result


def _full(local: torch.Tensor, param) -> torch.Tensor:
    """Gather a sharded gradient the way its parameter is sharded (torch.chunk rows)."""
    mesh = param.device_mesh
    size = mesh.size(mesh.ndim - 1)
    if local.dim() == 0 or size == 1:
        return local.clone().reshape(param.full_shape)
    rows = param.full_shape[0]
    slot_rows = -(-rows // size)
    padded = local.new_zeros((slot_rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=mesh.get_group(mesh.ndim - 1))
    return torch.cat(gathered)[:rows]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("mesh_shape", [(3,), (1, 3)], ids=str)
def test_several_forwards_and_an_eval_forward_before_backward(mesh_shape, reshard_after_forward):
    spec = TransformerSpec(dim=6, layers=2)
    results = get_pool(3).run(_several_forwards_worker, spec, mesh_shape, reshard_after_forward)
    for rank_result in results:
        for name, got, want in rank_result:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _no_grad_frees_worker(reshard_after_forward):
    spec = TransformerSpec(dim=6, layers=2)
    model = build_model(spec)
    shard_model(spec, model, mesh_for((2,)), reshard_after_forward=reshard_after_forward)
    probe = GatherProbe(model)
    model.eval()
    with torch.no_grad():
        model(*model_inputs(spec, make_batch(spec, 0, dist.get_rank())))
    # Every registered parameter is the local shard again, and no gathered storage is alive.
    return [fshard.is_sharded(p) for p in model.parameters()], len(probe.params), probe.alive()


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_no_grad_forward_frees_what_it_gathered(reshard_after_forward):
    for sharded, seen, alive in get_pool(2).run(_no_grad_frees_worker, reshard_after_forward):
        assert all(sharded) and seen == 26  # every gathered parameter was observed
        assert alive == []


def _clip_worker(norm_type, mesh_shape):
    spec = TransformerSpec(dim=6, layers=2)
    rank = dist.get_rank()
    ref, model = build_model(spec), build_model(spec)
    shard_model(spec, model, mesh_for(mesh_shape))
    batch = make_batch(spec, 0, rank)
    _synced_reference_step(ref, compute_loss(spec, ref, batch))
    compute_loss(spec, model, batch).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type, foreach=True)
    got = fshard.clip_grad_norm_(model.parameters(), 0.05, norm_type, foreach=True)
    grads = {name: _full(p.grad, p) for name, p in model.named_parameters()}
    return float(got), float(want), grads, {n: q.grad for n, q in ref.named_parameters()}


class _NextToDDP:
    """A small model sharded by fshard (units at ``unit_indices``, then the root) beside a DDP
    replica of the same weights, each with SGD+momentum; ``step`` trains both on one batch."""

    def __init__(self, reference, mesh_shape, unit_indices, **shard_kwargs):
        import copy

        from torch.nn.parallel import DistributedDataParallel as DDP

        self.reference = reference
        self.model = copy.deepcopy(reference)
        self.ddp = DDP(reference)
        mesh = mesh_for(mesh_shape)
        for index in unit_indices:
            fshard.fully_shard(self.model[index], mesh=mesh, **shard_kwargs)
        fshard.fully_shard(self.model, mesh=mesh, **shard_kwargs)
        self.optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (self.ddp, self.model)]
        torch.manual_seed(1 + dist.get_rank())  # each rank its own batches

    def step(self, x):
        for m, opt in zip((self.ddp, self.model), self.optims, strict=True):
            m(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    def assert_equal_params(self):
        for p, q in zip(self.model.parameters(), self.reference.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-7)


def _inference_mode_between_steps(mesh_shape, kwargs):
    torch.manual_seed(0)
    pair = _NextToDDP(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6)), mesh_shape, (0, 2), **kwargs)
    for _ in range(3):
        x = torch.randn(4, 6)
        # Evaluation first: the very first gather happens under inference mode.
        with torch.inference_mode():
            torch.testing.assert_close(pair.model(x), pair.ddp.module(x), rtol=1e-5, atol=1e-6)
        pair.step(x)
    pair.assert_equal_params()
    return True


@pytest.mark.parametrize(
    "mesh_shape, kwargs",
    [((2,), {}), ((2, 2), {"reshard_after_forward": False}), ((2,), {"offload_policy": fshard.CPUOffload()})],
    ids=["1d", "2d-zero2", "offload"],
)
def test_inference_mode_before_and_between_steps(mesh_shape, kwargs):
    world_size = math.prod(mesh_shape)
    assert all(get_pool(world_size).run(_inference_mode_between_steps, mesh_shape, kwargs))


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time it is armed (a failing custom op)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("backward failed on purpose")
        return grad


class _FailingLayer(nn.Module):
    def forward(self, x):
        return _FailOnce.apply(x)


def _recovers_from_failed_passes(mesh_shape):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), _FailingLayer(), nn.Linear(5, 6), nn.Linear(6, 6))
    pair = _NextToDDP(reference, mesh_shape, (0, 3, 4))
    model = pair.model
    failures = []
    for step in range(3):
        x = torch.randn(4, 6)
        if step == 1:  # a forward and a backward that raise, on every rank, then go on training
            try:
                model(torch.randn(4, 7))
            except RuntimeError as exc:
                failures.append("forward" if "shapes cannot be multiplied" in str(exc) else str(exc))
            _FailOnce.armed = True
            try:
                model(x).pow(2).sum().backward()
            except RuntimeError as exc:
                failures.append("backward" if "failed on purpose" in str(exc) else str(exc))
            pair.optims[1].zero_grad()
        pair.step(x)
    pair.assert_equal_params()
    return failures, fshard.memory_stats().gathered_bytes


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_training_goes_on_after_a_forward_or_backward_raised(mesh_shape):
    world_size = math.prod(mesh_shape)
    results = get_pool(world_size).run(_recovers_from_failed_passes, mesh_shape)
    assert results == [(["forward", "backward"], 0)] * world_size


def _step_after_unsynced_backward(mesh_shape, reduce_scatter):
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6))
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    seen = []
    for last_synced in (True, False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fshard.no_sync(model, reduce_scatter=reduce_scatter):
                model(x).sum().backward()
            if last_synced:
                model(x).sum().backward()
            else:
                with fshard.no_sync(model, reduce_scatter=reduce_scatter):
                    model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        seen.append([str(w.message) for w in caught if "without sync" in str(w.message)])
    return seen


@pytest.mark.parametrize(
    "mesh_shape, reduce_scatter", [((2,), False), ((2, 2), False), ((2, 2), True)], ids=str
)
def test_stepping_on_unreduced_gradients_warns(mesh_shape, reduce_scatter):
    world_size = math.prod(mesh_shape)
    for synced, unsynced, synced_again in get_pool(world_size).run(
        _step_after_unsynced_backward, mesh_shape, reduce_scatter
    ):
        assert synced == [] and synced_again == []
        assert len(unsynced) == 1
        assert "hold gradients accumulated without sync" in unsynced[0]
        assert "Run the last micro-batch's backward with gradient sync on" in unsynced[0]


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0, 3.0])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_clip_grad_norm_matches_torch(norm_type, mesh_shape):
    for got, want, grads, ref_grads in get_pool(4).run(_clip_worker, norm_type, mesh_shape):
        assert got == pytest.approx(want, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def _clip_fp64_and_ignored_worker(norm_type, ignored):
    """float64 params (the norm must be float64, as torch's), and an unsharded (ignored) bias
    whose gradient differs per rank unless all-reduced by the user."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ddp = DDP(copy.deepcopy(model))
    kwargs = {"ignored_params": [model[2].bias]} if ignored else {}
    fshard.fully_shard(model[0], mesh=mesh_for((2,)), **kwargs)
    fshard.fully_shard(model, mesh=mesh_for((2,)), **kwargs)
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    ddp(x).square().mean().backward()
    if ignored == "reduced":  # the user averages what fshard leaves alone, as DDP does
        dist.all_reduce(model[2].bias.grad)
        model[2].bias.grad /= dist.get_world_size()
    want = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.01, norm_type)
    got = fshard.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    grads = {name: _full(p.grad, p) if fshard.is_sharded(p) else p.grad for name, p in model.named_parameters()}
    ref = {name: p.grad for name, p in ddp.module.named_parameters()}
    return got, want, grads, ref


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("ignored", [None, "reduced", "per_rank"])
def test_clip_grad_norm_in_float64_and_with_ignored_params(norm_type, ignored):
    results = get_pool(2).run(_clip_fp64_and_ignored_worker, norm_type, ignored)
    assert results[0][0] == results[1][0]  # every rank clips its shards by one factor
    for got, want, grads, ref in results:
        assert got.dtype == want.dtype == torch.float64
        if ignored == "per_rank":
            continue  # the ignored bias's part is its mean over ranks: no unsharded equivalent
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[name], rtol=1e-12, atol=1e-15)


def _clip_nan_worker(norm_type, nan_rank):
    model = nn.Linear(8, 8)
    fshard.fully_shard(model, mesh=mesh_for((4,)))
    model(torch.ones(2, 8)).sum().backward()
    if dist.get_rank() == nan_rank:
        model.weight.grad[0, 0] = float("nan")  # an overflow lands in one rank's shard
    norm = fshard.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    with pytest.raises(RuntimeError, match=r"the total norm of order .* is nan"):
        fshard.clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)
    return math.isnan(float(norm))


@pytest.mark.parametrize("norm_type", [float("inf"), 2.0])
@pytest.mark.parametrize("nan_rank", [0, 3])
def test_a_nan_in_any_ranks_shard_makes_the_norm_nan_everywhere(norm_type, nan_rank):
    """As torch's clip_grad_norm_ on the full gradient: a MAX all-reduce alone does not carry
    a NaN from every rank (gloo's keeps the other ranks' finite maximum)."""
    assert all(get_pool(4).run(_clip_nan_worker, norm_type, nan_rank))


def _unshard_worker():
    spec = MLPSpec(widths=(7, 3))
    model = build_model(spec)
    reference = build_model(spec)
    shard_model(spec, model, mesh_for((3,)))
    local_shapes = [tuple(p.shape) for p in model.parameters()]
    fshard.unshard(model)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fshard.reshard(model)
    after = [tuple(p.shape) for p in model.parameters()]
    handle = fshard.unshard(model, async_op=True)
    handle.wait()
    again = {n: p.detach().clone() for n, p in model.named_parameters()}
    fshard.reshard(model)
    return local_shapes, full, after, again, dict(reference.named_parameters())


def _writeback_worker(strategy, mp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    kwargs = fshard.strategy_kwargs(strategy, **({"replicate_size": 2} if "HYBRID" in strategy else {}))
    policy = fshard.MixedPrecision(param_dtype=torch.bfloat16) if mp else None
    fshard.fully_shard(model[0], mp_policy=policy, **kwargs)
    fshard.fully_shard(model, **kwargs)
    fshard.unshard(model)
    with torch.no_grad():
        for m in (model, reference):
            m[0].weight.mul_(-2.0)  # the same edit on every rank
            m[1].bias.fill_(0.25)
    with pytest.raises(TypeError, match=r"fshard.reshard: writeback must be a bool, got 1"):
        fshard.reshard(model, writeback=1)  # nothing freed: the edits are still there below
    try:
        fshard.reshard(model, writeback=True)
    except ValueError as exc:
        return str(exc)
    full = fshard.full_state_dict(model, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    # Without writeback the edits are dropped.
    fshard.unshard(model)
    with torch.no_grad():
        model[1].bias.fill_(9.0)
    fshard.reshard(model)
    return fshard.full_state_dict(model, rank0_only=False)["1.bias"].tolist()


@pytest.mark.parametrize(
    ("mesh_shape", "strategy"),
    [((3,), "FULL_SHARD"), ((3,), "SHARD_GRAD_OP"), ((3,), "NO_SHARD"), ((2, 2), "HYBRID_SHARD")],
    ids=str,
)
def test_reshard_with_writeback_keeps_edits_to_the_gathered_params(mesh_shape, strategy):
    for result in get_pool(math.prod(mesh_shape)).run(_writeback_worker, strategy, False):
        # Without writeback the edit is dropped, except where the gathered params are the
        # shards themselves (one rank per shard group): there it is made to the shards.
        assert result == ([9.0] * 3 if strategy == "NO_SHARD" else [0.25] * 3), result


def test_reshard_with_writeback_refuses_a_lower_precision_gather():
    for message in get_pool(2).run(_writeback_worker, "FULL_SHARD", True):
        assert "fshard.reshard(writeback=True): unit '0' holds '0.weight' gathered in torch.bfloat16" in message


def test_unshard_and_reshard_by_hand():
    for local_shapes, full, after, again, ref in get_pool(3).run(_unshard_worker):
        assert local_shapes == after
        for name, value in full.items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=0, atol=0)
            torch.testing.assert_close(again[name], value, rtol=0, atol=0)


def _dtensor_like_worker(mesh_shape):
    spec = MLPSpec(in_dim=5, widths=(10, 1), scalar_param=True)
    model = build_model(spec)
    reference = dict(build_model(spec).named_parameters())
    mesh = mesh_for(mesh_shape)
    shard_model(spec, model, mesh)
    out = {}
    for name, p in model.named_parameters():
        out[name] = {
            "sharded": fshard.is_sharded(p),
            "local": p.to_local().clone(),
            "full": p.full_tensor(),
            "full_shape": tuple(p.full_shape),
            "placements": tuple(str(x) for x in p.placements),
            "mesh_is_mesh": p.device_mesh is mesh,
            "reference": reference[name].detach(),
            "plain_local": type(p.to_local()) is torch.Tensor,
        }
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_sharded_parameters_are_dtensor_like(mesh_shape):
    size = mesh_shape[-1]
    results = get_pool(4).run(_dtensor_like_worker, mesh_shape)
    for rank, result in enumerate(results):
        shard_rank = rank % size
        for _name, info in result.items():
            assert info["sharded"] and info["mesh_is_mesh"] and info["plain_local"]
            torch.testing.assert_close(info["full"], info["reference"], rtol=0, atol=0)
            assert info["full_shape"] == tuple(info["reference"].shape)
            if info["reference"].dim() == 0:
                expected_local = info["reference"]
                shard = "R"
            else:
                chunks = info["reference"].chunk(size)
                expected_local = chunks[shard_rank] if shard_rank < len(chunks) else info["reference"][:0]
                shard = "S(0)"
            torch.testing.assert_close(info["local"], expected_local, rtol=0, atol=0)
            assert info["placements"] == ((shard,) if len(mesh_shape) == 1 else ("R", shard))


class _OddDtypes(nn.Module):
    """Frozen params of dtypes gloo cannot move (int16, uint16, float8) beside a trained layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        values = torch.arange(-7, 7).reshape(7, 2)
        self.codes = nn.Parameter(values.to(torch.int16), requires_grad=False)
        self.ids = nn.Parameter(values.abs().to(torch.uint16), requires_grad=False)
        self.scales = nn.Parameter((values / 8).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.codes.float().sum() + self.ids.float().sum() + self.scales.float().sum()
        return self.linear(x) + bias


def _odd_dtypes_worker(mesh_shape):
    torch.manual_seed(0)
    reference = _OddDtypes()
    model = copy.deepcopy(reference)
    fshard.fully_shard(model, mesh=mesh_for(mesh_shape))
    model(torch.ones(2, 3)).sum().backward()  # gathered for the forward
    fulls = {name: p.full_tensor() for name, p in model.named_parameters()}
    on_rank0 = fshard.full_state_dict(model)  # one parameter gathered at a time, to rank 0
    fresh = _OddDtypes()
    for p in fresh.parameters():
        p.data.zero_()
    fshard.fully_shard(fresh, mesh=mesh_for(mesh_shape))
    fshard.load_state_dict(fresh, reference.state_dict() if dist.get_rank() == 0 else None, broadcast_from_rank0=True)
    loaded = {name: p.full_tensor() for name, p in fresh.named_parameters()}
    for name, q in reference.named_parameters():
        for what, got in (("full_tensor", fulls[name]), ("broadcast load", loaded[name])):
            assert got.dtype == q.dtype and torch.equal(got.view(torch.uint8), q.detach().view(torch.uint8)), (what, name)
        if dist.get_rank() == 0:
            assert torch.equal(on_rank0[name].view(torch.uint8), q.detach().view(torch.uint8)), name
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_parameters_of_dtypes_gloo_cannot_move(mesh_shape):
    """int16, uint16 and float8 params are gathered, broadcast and saved as their bytes (gloo has
    no collectives for those dtypes): the values are exact."""
    assert all(get_pool(math.prod(mesh_shape)).run(_odd_dtypes_worker, mesh_shape))


def _tied_sibling_units_worker():
    # The head and the embedding are both units; their shared weight must move to the root.
    spec = TransformerSpec(dim=6, layers=1)
    model = build_model(spec)
    mesh = mesh_for((2,))
    fshard.fully_shard(model.embed, mesh=mesh)
    fshard.fully_shard(model.head, mesh=mesh)
    shard_model(spec, model, mesh)
    batch = make_batch(spec, 0, dist.get_rank())
    before = {u.fqn: u.param_names for u in fshard.units(model)}
    compute_loss(spec, model, batch).backward()
    after = {u.fqn: u.param_names for u in fshard.units(model)}
    return before, after, model.head.weight is model.embed.weight, model.embed.weight.grad is not None


def test_tied_weight_across_units_moves_to_common_unit():
    for before, after, same, has_grad in get_pool(2).run(_tied_sibling_units_worker):
        # fully_shard(model.embed) took the shared weight first; the first forward moves it to
        # the root, the lowest unit above both of its users.
        assert "embed.weight" in before["embed"] and "embed.weight" not in before[""], before
        assert "embed.weight" in after[""], after
        assert not any("embed.weight" in names or "head.weight" in names for fqn, names in after.items() if fqn), after
        assert same and has_grad


def test_tied_weight_across_units_equals_ddp():
    check(GPT, shard_fn=_shard_embed_and_head_separately, world_size=2, steps=2)


def _shard_embed_and_head_separately(model, mesh):
    fshard.fully_shard(model.embed, mesh=mesh)
    fshard.fully_shard(model.head, mesh=mesh)
    shard_model(GPT, model, mesh)


def _set_sync_worker():
    spec = TransformerSpec(dim=6, layers=2)
    rank = dist.get_rank()
    ref, model = build_model(spec), build_model(spec)
    shard_model(spec, model, mesh_for((2, 2)))
    batches = [make_batch(spec, i, rank) for i in range(3)]
    loss = sum(compute_loss(spec, ref, b) for b in batches)
    _synced_reference_step(ref, loss)
    fshard.set_requires_gradient_sync(model, False)
    compute_loss(spec, model, batches[0]).backward()
    compute_loss(spec, model, batches[1]).backward()
    no_grads_yet = all(p.grad is None for p in model.parameters())
    fshard.set_requires_gradient_sync(model, True)
    compute_loss(spec, model, batches[2]).backward()
    grads = {n: _full(p.grad, p) for n, p in model.named_parameters()}
    return no_grads_yet, grads, {n: q.grad for n, q in ref.named_parameters()}


def test_set_requires_gradient_sync_accumulates_like_ddp_no_sync():
    for no_grads_yet, grads, ref in get_pool(4).run(_set_sync_worker):
        assert no_grads_yet
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7)


def _dtype_change_worker():
    rank = dist.get_rank()
    ref, model = build_model(GPT).double(), build_model(GPT)
    shard_model(GPT, model, mesh_for((3,)))
    model.double()  # replaces every shard's data: fshard re-packs its buffers on next use
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        batch = make_batch(GPT, step, rank)
        _synced_reference_step(ref, compute_loss(GPT, ref, batch))
        ref_opt.step()
        ref_opt.zero_grad()
        loss = compute_loss(GPT, model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return full, dict(ref.named_parameters())


def test_dtype_change_after_sharding_is_picked_up():
    for full, ref in get_pool(3).run(_dtype_change_worker):
        for name, value in full.items():
            assert value.dtype == torch.float64
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-9, atol=1e-11)


def _swapped_dtype_change_worker(mesh_shape, swap, train_first):
    """``model.to(torch.float64)`` after sharding, with torch's swap-on-conversion on or off,
    before or after a training step: the same parameter objects stay sharded (identity,
    ``is_sharded``, ``to_local``, ``full_tensor``) and training matches a float64 reference."""
    rank = dist.get_rank()
    ref, model = build_model(GPT), build_model(GPT)
    shard_model(GPT, model, mesh_for(mesh_shape))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dict(model.named_parameters())
    hook_calls = []  # a user's post-accumulate-grad hook (optimizer-in-backward) outlives the swap
    before["blocks.0.qkv.weight"].register_post_accumulate_grad_hook(lambda p: hook_calls.append(p.dtype))
    steps = [0, 1, 2] if train_first else [1, 2]
    if train_first:  # one float32 step first: the grad hooks are in place when the swap comes
        batch = make_batch(GPT, 0, rank)
        _synced_reference_step(ref, compute_loss(GPT, ref, batch))
        ref_opt.step()
        ref_opt.zero_grad()
        compute_loss(GPT, model, batch).backward()
        opt.step()
        opt.zero_grad()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        ref.to(torch.float64)
        model.to(torch.float64)
        model.cpu()  # changes nothing: torch swaps each parameter for itself
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    after = dict(model.named_parameters())
    kept = {
        n: (after[n] is p, fshard.is_sharded(after[n]), tuple(after[n].to_local().shape), after[n].dtype)
        for n, p in before.items()
    }
    local_shapes = {n: tuple(p.to_local().shape) for n, p in before.items()}
    for step in steps[1:] if train_first else steps:
        batch = make_batch(GPT, step, rank)
        _synced_reference_step(ref, compute_loss(GPT, ref, batch))
        ref_opt.step()
        ref_opt.zero_grad()
        compute_loss(GPT, model, batch).backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return kept, local_shapes, full, {n: p.detach() for n, p in ref.named_parameters()}, hook_calls


@pytest.mark.parametrize("train_first", [False, True], ids=["fresh", "after_a_step"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "set_data"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_module_to_dtype_keeps_parameters_sharded_with_or_without_swapping(mesh_shape, swap, train_first):
    for kept, local_shapes, full, ref, hook_calls in get_pool(4).run(_swapped_dtype_change_worker, mesh_shape, swap, train_first):
        assert hook_calls == [torch.float32] * train_first + [torch.float64] * 2
        for name, (same, sharded, shape, dtype) in kept.items():
            assert same and sharded, (name, same, sharded)
            assert shape == local_shapes[name] and dtype == torch.float64, (name, shape, dtype)
        # A float32 step first differs from the reference by float32 rounding.
        rtol, atol = (1e-5, 1e-6) if train_first else (1e-9, 1e-11)
        for name, value in full.items():
            assert value.dtype == torch.float64
            torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol)


def _freeze_between_micro_batches(mesh_shape, reduce_scatter):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = mesh_shape[-1]
    mismatches = []
    # Step 0: weight trainable in micro-batch 0, frozen in 1 (the synced one). Step 1: the
    # other way round. Every grad must be the average over ranks of the local sums.
    for step, frozen_in in enumerate((1, 0)):
        batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + 2 * step + i)) for i in range(2)]
        for net in (reference, model):
            for i, x in enumerate(batches):
                net[0].weight.requires_grad_(i != frozen_in)
                unsynced = net is model and i == 0
                with fshard.no_sync(model, reduce_scatter=reduce_scatter) if unsynced else contextlib.nullcontext():
                    net(x).square().sum().backward()  # the reference sums locally
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            expected = torch.chunk(q.grad, shards)[rank % shards]
            if p.grad is None or not torch.allclose(p.grad, expected, atol=1e-5):
                mismatches.append((step, name))
        for net in (reference, model):
            net.zero_grad()
    return mismatches


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["no_sync", "no_sync-rs"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_freezing_a_param_between_micro_batches_loses_no_gradient(mesh_shape, reduce_scatter):
    """A param that got gradients in an unsynchronised micro-batch and is frozen before the
    synced one still gets them reduced (and not left to leak into a later step); one unfrozen
    between micro-batches gets the ones it had."""
    results = get_pool(math.prod(mesh_shape)).run(_freeze_between_micro_batches, mesh_shape, reduce_scatter)
    assert results == [[]] * math.prod(mesh_shape)


class _BufferedBlock(nn.Module):
    """A block with buffers: BatchNorm's running statistics (updated in forward) and a fixed
    scale read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5, bias=False)  # (a bias before a norm has no gradient but noise)
        self.norm = nn.BatchNorm1d(5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)) * self.scale)


class _Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_BufferedBlock() for _ in range(2))
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _buffered_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _buffers_worker(mesh_shape):
    model, reference = _Buffered(), _Buffered()
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh_for(mesh_shape))
    fshard.fully_shard(model, mesh=mesh_for(mesh_shape))
    names = [name for name, _ in reference.named_buffers()]
    assert [name for name, _ in model.named_buffers()] == names
    for _ in range(2):  # the buffers stay whole, plain tensors, and update in place like the reference's
        x = _buffered_batch(0, dist.get_rank())
        model(x).sum().backward()
        reference(x).sum().backward()
        for (name, buffer), want in zip(model.named_buffers(), reference.buffers(), strict=True):
            assert type(buffer) is torch.Tensor and not fshard.is_sharded(buffer), name
            assert buffer.shape == want.shape and torch.equal(buffer, want), name
    return dict(model.state_dict())["blocks.0.norm.running_mean"].shape == (5,)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_buffers_stay_whole_and_train_like_ddp(mesh_shape):
    """Buffers are not sharded: every rank holds each whole, updates it in its own forward (as
    FSDP2 does; DDP also broadcasts rank 0's before each forward), and the model with them
    trains like DDP."""
    assert all(get_pool(4).run(_buffers_worker, mesh_shape))
    assert_equivalent_to_ddp(_Buffered, batch_fn=_buffered_batch, world_size=4, mesh_shape=mesh_shape, steps=3)


def _shard_on_the_default_mesh(model, mesh):
    del mesh  # mesh=None: a 1D mesh over the default process group
    for block in model.blocks:
        fshard.fully_shard(block)
    fshard.fully_shard(model)
    from torch.distributed.tensor import Shard

    for name, p in model.named_parameters():
        assert p.device_mesh.mesh.tolist() == list(range(dist.get_world_size())), name
        assert p.device_mesh.device_type == "cpu" and tuple(p.placements) == (Shard(0),), name


def test_the_default_mesh_is_1d_over_every_rank():
    check(GPT, shard_fn=_shard_on_the_default_mesh, world_size=3, steps=2)
