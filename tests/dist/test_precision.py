"""Mixed precision and the sharded grad scaler, against an unsharded reference doing the same casts.

The reference keeps fp32 master weights, runs each step on a copy cast per unit to the unit's
``param_dtype`` (inputs cast at unit boundaries, outputs cast where ``output_dtype`` says),
averages gradients over ranks in ``reduce_dtype`` and steps the fp32 masters.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives
from fshard.testing.models import TransformerSpec, build_model, compute_loss, make_batch

SPEC = TransformerSpec(vocab=31, dim=12, heads=3, layers=2, seq=6, batch_size=3)


def _policies(param_dtype, reduce_dtype, norm_fp32):
    main = fshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    norm = fshard.MixedPrecision(param_dtype=torch.float32, output_dtype=param_dtype) if norm_fp32 else None
    return main, norm


def _shard(model, mesh, main, norm):
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, mp_policy=main)
    if norm is not None:
        fshard.fully_shard(model.norm, mesh=mesh, mp_policy=norm)
    fshard.fully_shard(model, mesh=mesh, mp_policy=main)


def _reference_working_copy(master, main, norm):
    """The unsharded model as fshard computes with it: per-unit dtypes and boundary casts."""
    working = copy.deepcopy(master)
    units = [*working.blocks, working]
    policy = {id(m): main for m in units}
    if norm is not None:
        units.insert(0, working.norm)
        policy[id(working.norm)] = norm
    owned = set()
    for unit in units:  # lowest units first, like fully_shard
        for p in unit.parameters():
            if id(p) not in owned:
                owned.add(id(p))
                p.data = p.data.to(policy[id(unit)].param_dtype)

    def cast_inputs(dtype):
        def hook(module, args):
            return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

        return hook

    for unit in units:
        pol = policy[id(unit)]
        unit.register_forward_pre_hook(cast_inputs(pol.param_dtype))
        if pol.output_dtype is not None:
            unit.register_forward_hook(lambda m, a, out, d=pol.output_dtype: out.to(d))
    return working


def _mp_worker(mesh_shape, param_dtype, reduce_dtype, norm_fp32, steps, scaler_inf_rank=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    main, norm = _policies(param_dtype, reduce_dtype, norm_fp32)
    master, model = build_model(SPEC), build_model(SPEC)
    _shard(model, mesh_for(mesh_shape), main, norm)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    use_scaler = param_dtype == torch.float16
    scaler = fshard.ShardedGradScaler(init_scale=2.0**10) if use_scaler else None
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None
    losses, ref_losses, traffic, skipped = [], [], [], []
    for step in range(steps):
        batch = make_batch(SPEC, step, rank)
        # Reference: cast copy, backward, average in reduce_dtype, step the fp32 masters.
        working = _reference_working_copy(master, main, norm)
        loss = compute_loss(SPEC, working, batch)
        (ref_scaler.scale(loss) if ref_scaler else loss).backward()
        for p, w in zip(master.parameters(), working.parameters(), strict=True):
            fp32_unit = w.grad.dtype == torch.float32  # the fp32 norm unit reduces in fp32
            g = w.grad.to(torch.float32 if fp32_unit else (main.reduce_dtype or main.param_dtype))
            dist.all_reduce(g)
            p.grad = (g / world).to(torch.float32)
        if ref_scaler:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        else:
            ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        # fshard.
        with trace_collectives() as records:
            out = compute_loss(SPEC, model, batch)
            (scaler.scale(out) if scaler else out).backward()
        traffic.append([(r.op, r.input_bytes, r.output_bytes, str(r.dtype)) for r in records])
        if scaler:
            if rank == scaler_inf_rank and step == 0:
                next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            skipped.append((unchanged, scale, scaler.get_scale()))
        else:
            opt.step()
        opt.zero_grad()
        losses.append(out.item())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, ref_losses, full, dict(master.named_parameters()), traffic, skipped


TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("norm_fp32", [False, True], ids=["uniform", "norm-in-fp32"])
@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype"),
    [(torch.bfloat16, torch.float32), (torch.bfloat16, None), (torch.float16, torch.float32)],
    ids=["bf16-reduce-fp32", "bf16", "fp16-reduce-fp32"],
)
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_mixed_precision_equals_reference(mesh_shape, param_dtype, reduce_dtype, norm_fp32):
    # With fp32 reduction the per-rank compute is bit-identical to the reference's, so only the
    # reduction order differs: tight tolerance. A bf16 reduction rounds to bf16: bf16 tolerance.
    tol = 1e-5 if reduce_dtype == torch.float32 else TOL[param_dtype]
    for losses, ref_losses, full, master, _, _ in get_pool(4).run(
        _mp_worker, mesh_shape, param_dtype, reduce_dtype, norm_fp32, 3
    ):
        assert losses == pytest.approx(ref_losses, rel=tol, abs=tol)
        for name, value in full.items():
            assert value.dtype == torch.float32  # master shards stay fp32
            torch.testing.assert_close(value, master[name].detach(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_low_precision_gathers_move_half_the_bytes():
    fp32 = get_pool(2).run(_mp_worker, (2,), torch.float32, torch.float32, False, 1)[0][4][0]
    bf16 = get_pool(2).run(_mp_worker, (2,), torch.bfloat16, torch.float32, False, 1)[0][4][0]
    bf16_reduce = get_pool(2).run(_mp_worker, (2,), torch.bfloat16, None, False, 1)[0][4][0]

    def total(traffic, op):
        return sum(r[2] for r in traffic if r[0] == op)

    assert total(bf16, "all_gather") * 2 == total(fp32, "all_gather")
    assert {r[3] for r in bf16 if r[0] == "all_gather"} == {"torch.bfloat16"}
    assert total(bf16, "reduce_scatter") == total(fp32, "reduce_scatter")  # reduce_dtype fp32
    assert total(bf16_reduce, "reduce_scatter") * 2 == total(fp32, "reduce_scatter")


@pytest.mark.parametrize("inf_rank", [None, 1, 3])
def test_sharded_grad_scaler(inf_rank):
    results = get_pool(4).run(_mp_worker, (4,), torch.float16, torch.float32, False, 2, inf_rank)
    for losses, ref_losses, full, master, _, skipped in results:
        first_unchanged, scale_before, scale_after = skipped[0]
        if inf_rank is None:
            assert not first_unchanged and scale_after == scale_before
            assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
            for name, value in full.items():
                torch.testing.assert_close(value, master[name].detach(), rtol=1e-5, atol=1e-5)
        else:
            # Every rank skipped the step and lowered the scale, not just the rank with the inf.
            assert first_unchanged and scale_after == scale_before / 2
            assert not skipped[1][0]  # the next step is taken


def _fp16_reduce_worker(mesh_shape, local):
    """Reduce in fp16 (no reduce_dtype) gradients whose average fits fp16 but whose sum may not."""
    lin = nn.Linear(4, 6, bias=False)
    fshard.fully_shard(lin, mesh=mesh_for(mesh_shape), mp_policy=fshard.MixedPrecision(param_dtype=torch.float16))
    (lin(torch.ones(1, 4)).sum() * local[dist.get_rank()]).backward()  # every entry: local[rank]
    return lin.weight.grad.unique().tolist()


@pytest.mark.parametrize(
    ("mesh_shape", "local"), [((2,), (60000.0, 36000.0)), ((3,), (40000.0, 40000.0, 40000.0))], ids=str
)
def test_half_precision_reduce_overflows_only_where_the_average_would(mesh_shape, local):
    """DDP's average of these fits fp16; so does fshard's (divided by 2 before the sum, where
    the sum of 2 or 3 ranks' gradients would overflow)."""
    average = sum(local) / len(local)
    for values in get_pool(len(local)).run(_fp16_reduce_worker, mesh_shape, local):
        assert values == [average]


def test_mixed_precision_options_are_validated():
    with pytest.raises(TypeError, match="param_dtype must be None or one of"):
        fshard.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        fshard.MixedPrecision(cast_forward_inputs="yes")  # type: ignore[arg-type]


class _SeesInputs(nn.Module):
    """Records the dtypes it computes with (its weight's, then its inputs'); computes in the
    weight's dtype whatever the inputs'."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.lin.weight.dtype
        self.seen.append(tuple(t.dtype for t in (self.lin.weight, x, ids, scale) if t is not None))
        out = self.lin(x.to(dtype)) + ids.to(dtype)[:, None]
        return out if scale is None else out * scale.to(dtype)


def _cast_forward_inputs_worker(cast: bool) -> tuple[list[tuple[torch.dtype, ...]], torch.dtype]:
    torch.manual_seed(0)
    model = _SeesInputs()
    policy = fshard.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
    fshard.fully_shard(model, mesh=mesh_for((2,)), mp_policy=policy)
    x = torch.randn(3, 4, requires_grad=True)
    ids = torch.arange(3)
    model(x, ids).float().sum().backward()  # tensors only, positional
    scale = torch.full((1,), 2.0, dtype=torch.float64)
    model(x, ids, scale=scale).float().sum().backward()  # and a keyword argument
    return model.seen, x.grad.dtype


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_decides_whether_floating_inputs_are_cast(cast):
    """Floating inputs, positional or keyword, reach the module in ``param_dtype`` with
    ``cast_forward_inputs=True`` and as they were passed with ``False``; integer inputs are
    never cast. The parameters are in ``param_dtype`` either way, and the input's gradient
    comes back in its own dtype."""
    bf16, fp32, fp64, i64 = torch.bfloat16, torch.float32, torch.float64, torch.int64
    if cast:
        want = [(bf16, bf16, i64), (bf16, bf16, i64, bf16)]
    else:
        want = [(bf16, fp32, i64), (bf16, fp32, i64, fp64)]
    for seen, grad_dtype in get_pool(2).run(_cast_forward_inputs_worker, cast):
        assert seen == want
        assert grad_dtype == fp32


def _bf16_accumulation_worker(mesh_shape, reduce_scatter, micro_batches=12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    mp = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fshard.fully_shard(model, mesh=mesh, mp_policy=mp)
    rank = dist.get_rank()
    for i in range(micro_batches):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + i)) + 3
        sync = i == micro_batches - 1
        with contextlib.nullcontext() if sync else fshard.no_sync(model, reduce_scatter=reduce_scatter):
            model(x).float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_unsynced_accumulation_sums_in_the_reduce_dtype(mesh_shape):
    """no_sync keeps its running sum in reduce_dtype (fp32), not in the bf16 of the gathered
    params, so it equals sharded accumulation (which sums reduced fp32 shards)."""
    pool = get_pool(math.prod(mesh_shape))
    full = pool.run(_bf16_accumulation_worker, mesh_shape, False)
    sharded = pool.run(_bf16_accumulation_worker, mesh_shape, True)
    for a, b in zip(full, sharded, strict=True):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


class _CheckpointedBlocks(nn.Module):
    """An fp32 root around bf16 blocks, each block called through activation checkpointing."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            if self.use_reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def _checkpointed_mp_worker(use_reentrant: bool) -> bool:
    torch.manual_seed(0)
    plain, model = _CheckpointedBlocks(None), _CheckpointedBlocks(use_reentrant)
    model.load_state_dict(plain.state_dict())
    mesh = mesh_for((2,))
    policy = fshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for m in (plain, model):
        for block in m.blocks:
            fshard.fully_shard(block, mesh=mesh, mp_policy=policy)
        fshard.fully_shard(m, mesh=mesh)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    for m in (plain, model):
        m(x).pow(2).mean().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_checkpointed_unit_recomputes_on_inputs_cast_as_in_its_forward(use_reentrant):
    """The recompute in backward casts the unit's fp32 inputs to its param_dtype as its forward
    did (it ran on the fp32 inputs: a dtype error against the bf16 weights)."""
    assert all(get_pool(2).run(_checkpointed_mp_worker, use_reentrant))


def _fp16_params_scaler_worker() -> bool:
    """A model in fp16 without MixedPrecision: the gradients are fp16 shards, unscaled in
    place (torch's GradScaler refuses fp16 gradients; its FSDP scaler takes them, as this one)."""
    mesh = mesh_for((dist.get_world_size(),))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank())).half()
    params = []
    for scaled in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).half()
        fshard.fully_shard(model[0], mesh=mesh)
        fshard.fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(x).float().pow(2).mean()
        if scaled:  # a power of two: unscaling is exact in fp16
            scaler = fshard.ShardedGradScaler(init_scale=2.0**10)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == 2.0**10
        else:
            loss.backward()
            opt.step()
        params.append([p.to_local().clone() for p in model.parameters()])
    for a, b in zip(*params, strict=True):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    return True


def test_sharded_grad_scaler_takes_fp16_parameters():
    assert all(get_pool(2).run(_fp16_params_scaler_worker))


# ------------------------------------------------- output_dtype in a checkpoint's recompute


def _checkpointed_unit_with_output_dtype(shape):
    """A unit whose MixedPrecision casts its output to fp32, inside a non-reentrant activation
    checkpoint, followed by an op that saves its output (exp): the recompute in backward must
    give it the dtype the forward gave, or torch's checkpoint refuses the recomputed values."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    mp = fshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    mesh = mesh_for(shape)
    fshard.fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fshard.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 6)

    def segment(inputs):
        return torch.exp(model[0](inputs))  # exp saves its (fp32) output for backward

    out = model[1](checkpoint(segment, x, use_reentrant=False))
    assert out.dtype == torch.float32
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return [g.dtype for g in grads], all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["1d", "2x2"])
def test_output_dtype_applies_in_a_checkpoint_recompute(shape):
    for dtypes, finite in get_pool(math.prod(shape)).run(_checkpointed_unit_with_output_dtype, shape):
        assert dtypes == [torch.float32] * 4
        assert finite
