"""Settings of units changed after fully_shard: gradient divide factor, reshard after forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fshard
from fshard.testing import get_pool, mesh_for


class _Net(nn.Module):
    """A 0-d parameter, a bias smaller than the world, and a layer rank 0 alone uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 3)
        self.lin2 = nn.Linear(3, 6)
        self.spare = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        if dist.get_rank() == 0:
            h = h + self.spare(h)
        return self.lin2(h) * self.scale


def _grads(mesh_shape: tuple[int, ...], reduce_dtype: torch.dtype | None) -> bool:
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    mp = fshard.MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
    fshard.fully_shard(model.lin2, mesh=mesh, mp_policy=mp)
    fshard.fully_shard(model, mesh=mesh, mp_policy=mp)
    ddp = DDP(reference, find_unused_parameters=True)
    world = dist.get_world_size()
    shard = dist.get_rank() % mesh_shape[-1]
    tol: dict[str, float] = {} if reduce_dtype is None else {"rtol": 2e-2, "atol": 0.0}

    def check(x: torch.Tensor, factors: dict[str, float | None]) -> None:
        ddp(x).pow(2).mean().backward()
        model(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            factor = factors.get(name.split(".")[0], factors.get("*"))
            scale = 1.0 if factor is None else world / factor
            rows = q.grad
            if q.dim():  # this rank's rows, torch.chunk's (none for some of a 3-row bias)
                size = -(-q.shape[0] // mesh_shape[-1])
                rows = q.grad[shard * size : (shard + 1) * size]
            expected = (rows.double() * scale).float()
            if tol:  # bf16 sums: relative to the gradient's size
                tol["atol"] = 2e-2 * float(expected.abs().max()) if expected.numel() else 0.0
            torch.testing.assert_close(p.grad.reshape(expected.shape), expected, **tol, msg=name)
            p.grad = None
            q.grad = None

    for step, factor in enumerate([1.0, 3.0, 1e30, None]):
        fshard.set_gradient_divide_factor(model, factor)
        check(torch.randn(4, 6, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank())), {"*": factor})
    # One unit's factor (its module's), the others averaged.
    fshard.set_gradient_divide_factor(model.lin2, 1.0)
    check(torch.randn(4, 6), {"lin2": 1.0, "*": None})
    # Sharded accumulation: each micro-batch reduce-scattered with the factor.
    fshard.set_gradient_divide_factor(model, 1.0)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    with fshard.no_sync(model, reduce_scatter=True), ddp.no_sync():
        ddp(x1).pow(2).mean().backward()
        model(x1).pow(2).mean().backward()
    check(x2, {"*": 1.0})
    return True


@pytest.mark.parametrize(
    ("mesh_shape", "reduce_dtype"),
    [((2,), None), ((2, 2), None), ((4,), torch.bfloat16)],
    ids=["2-fp32", "2x2-fp32", "4-bf16"],
)
def test_gradients_are_the_sum_divided_by_the_factor(mesh_shape, reduce_dtype):
    """Against DDP's average: ``world / factor`` times it, for a 0-d parameter, one smaller than
    the world, one that some ranks do not use (with a factor of 1e30 too), per unit,
    and with sharded accumulation; ``None`` is DDP's average again."""
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    assert get_pool(world).run(_grads, mesh_shape, reduce_dtype) == [True] * world


def _errors() -> bool:
    model = fshard.fully_shard(_Net(), mesh=mesh_for((2,)))
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=r"set_gradient_divide_factor: factor must be a positive finite number \(or None for the average over ranks\), got"):
            fshard.set_gradient_divide_factor(model, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_gradient_divide_factor: Linear has no fshard units"):
        fshard.set_gradient_divide_factor(nn.Linear(2, 2), 1.0)
    with pytest.raises(ValueError, match=r"set_gradient_divide_factor: Linear is not a unit but part of unit _Net: settings apply to whole units"):
        fshard.set_gradient_divide_factor(model.lin1, 1.0)
    # Ranks that set different factors are caught at the first forward, naming the setting.
    fshard.set_gradient_divide_factor(model, 1.0 if dist.get_rank() == 0 else None)
    with pytest.raises(fshard.RankMismatchError, match=r"gradient_divide_factor=1.0\).* where rank 1 has .*gradient_divide_factor=None\).*set_gradient_divide_factor alike"):
        model(torch.randn(2, 6))
    return True


def test_bad_factors_are_named():
    assert get_pool(2).run(_errors) == [True, True]


def _reshard_after_forward_worker(mesh_shape: tuple[int, ...]) -> list[list[str]]:
    from fshard.testing import trace_collectives

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    for index in (0, 2, 4):
        fshard.fully_shard(model[index], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    ddp = DDP(reference)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, model)]
    backward_gathers = []
    for step, flag in enumerate([False, False, True, False]):
        fshard.set_reshard_after_forward(model, flag)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
        with trace_collectives() as forward:
            loss = model(x).pow(2).mean()
        with trace_collectives() as backward:
            loss.backward()
        ddp(x).pow(2).mean().backward()
        assert [r.label for r in forward if r.op == "all_gather"] == ["0", "2", "4"]
        backward_gathers.append([r.label for r in backward if r.op == "all_gather"])
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(TypeError, match=r"set_reshard_after_forward: reshard_after_forward must be a bool, or an int .*, got 'yes'"):
        fshard.set_reshard_after_forward(model, "yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_reshard_after_forward: Linear has no fshard units"):
        fshard.set_reshard_after_forward(nn.Linear(2, 2), True)
    return backward_gathers


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_set_reshard_after_forward_changes_the_backward_gathers(mesh_shape):
    """Units kept after forward are not gathered in backward; switched back, each is, in
    backward order; the training equals DDP's throughout."""
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    for gathers in get_pool(world).run(_reshard_after_forward_worker, mesh_shape):
        assert gathers == [[], [], ["4", "2", "0"], []], gathers


def _units_worker() -> list[tuple]:
    from fshard.testing.models import TransformerSpec, build_model

    model = build_model(TransformerSpec(vocab=11, dim=6, heads=2, layers=2, tie_embeddings=True))
    assert fshard.units(model) == []  # nothing sharded yet
    mesh = mesh_for((2,))
    bf16 = fshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fshard.fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=False, mp_policy=bf16)
    fshard.fully_shard(model.blocks[0], mesh=mesh, offload_policy=fshard.CPUOffload())
    fshard.fully_shard([model.norm, model.head], mesh=mesh)  # one unit of two modules
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_reshard_after_forward(model.blocks[0], False)  # read back as set since
    found = fshard.units(model)
    ids = {id(m): name for name, m in model.named_modules()}
    names = {id(p): name for name, p in model.named_parameters()}
    assert all(fshard.is_sharded(p) for p in model.parameters())
    owned = [name for u in found for name in u.param_names]
    assert sorted(owned) == sorted(names.values())  # each parameter in exactly one unit
    assert all(u.mesh is mesh for u in found)
    rows = [
        (u.fqn, tuple(ids[id(m)] for m in u.modules), u.reshard_after_forward,
         u.mp_policy.param_dtype if u.mp_policy else None, u.offload_policy is not None)
        for u in found
    ]  # fmt: skip
    sub = [(u.fqn, u.param_names) for u in fshard.units(model.blocks[1])]
    # The tied embedding (the head's weight is the same parameter) is the head unit's until the
    # root initialises on the first forward, which moves it to the root (the lowest module
    # that contains both its users).
    before = found[3].param_names
    model(torch.zeros(1, 3, dtype=torch.long))
    after = (fshard.units(model)[0].param_names, fshard.units(model)[3].param_names)
    return [rows, sub, before, after]


def test_units_reads_back_what_fully_shard_built():
    for rows, sub, before, after in get_pool(2).run(_units_worker):
        assert rows == [
            ("", ("",), True, None, False),
            ("blocks.0", ("blocks.0",), False, None, True),
            ("blocks.1", ("blocks.1",), False, torch.bfloat16, False),
            ("norm+head", ("norm", "head"), True, None, False),
        ]
        assert [fqn for fqn, _ in sub] == [""]  # relative to the module asked about
        assert sub[0][1] and all(not name.startswith("blocks.") for name in sub[0][1])
        assert before == ("norm.weight", "norm.bias", "embed.weight")
        assert after == (("pos", "embed.weight"), ("norm.weight", "norm.bias"))


def test_units_needs_a_module():
    with pytest.raises(TypeError, match=r"fshard.units expects an nn.Module, got Tensor"):
        fshard.units(torch.zeros(2))  # type: ignore[arg-type]
