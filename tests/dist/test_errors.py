"""Bad input fails fast with a clear error, on every rank, and nothing hangs."""

from __future__ import annotations

import copy
import os
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fshard
from fshard._api import device_problem
from fshard.testing import RankPool, RanksFailed, get_pool, mesh_for
from tests.dist.probes import rank_mismatch_messages


def _all_ranks_raise(world, fn, *args, match, error=ValueError):
    pool = get_pool(world)  # started (and its ranks joined) before the clock starts
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        pool.run(fn, *args)
    elapsed = time.monotonic() - start
    assert sorted(info.value.errors) == list(range(world)), "every rank must raise"
    for rank, exc in info.value.errors.items():
        assert isinstance(exc, error), (rank, exc)
        assert match(str(exc)), (rank, str(exc))
    assert elapsed < 30
    return info.value.errors


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _three_d_mesh():
    mesh = init_device_mesh("cpu", (1, 2, 2))
    fshard.fully_shard(_mlp(), mesh=mesh)


def test_mesh_must_be_1d_or_2d():
    _all_ranks_raise(4, _three_d_mesh, match=lambda m: "1D (shard) or 2D (replicate, shard)" in m and "3D" in m)


def _swapped_dim_names():
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("shard", "replicate"))
    fshard.fully_shard(_mlp(), mesh=mesh)


def test_a_mesh_named_shard_then_replicate_is_an_error():
    # Read by position it would shard over 4 and replicate over 1: the opposite of the names.
    _all_ranks_raise(
        4,
        _swapped_dim_names,
        match=lambda m: "named ('shard', 'replicate')" in m
        and "mesh_dim_names=('replicate', 'shard')" in m
        and "(4, 1)" in m,
    )


def test_wrong_argument_types_are_named():
    with pytest.raises(TypeError, match="DeviceMesh"):
        fshard.fully_shard(_mlp(), mesh="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
        fshard.fully_shard(_mlp(), reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mp_policy must be fshard.MixedPrecision"):
        fshard.fully_shard(_mlp(), mp_policy=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects an nn.Module"):
        fshard.fully_shard(torch.zeros(2))  # type: ignore[arg-type]


def _bad_arguments_worker() -> bool:
    with pytest.raises(TypeError, match="ignored_params takes an iterable of parameters, got one tensor"):
        model = _mlp()
        fshard.fully_shard(model, mesh=mesh_for((2,)), ignored_params=model[2].weight)
    with pytest.raises(ValueError, match=r"replicate_size must be a positive divisor .* got True"):
        fshard.strategy_kwargs("HYBRID_SHARD", replicate_size=True)
    with pytest.raises(ValueError, match=r"device_type must name a torch device type .* got 'gpu'"):
        fshard.strategy_kwargs("FULL_SHARD", device_type="gpu")
    with pytest.raises(ValueError, match=r"device type without an index .* got 'cpu:0'"):
        fshard.strategy_kwargs("FULL_SHARD", device_type="cpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_type 'cuda' is not available on this machine"):
            fshard.strategy_kwargs("FULL_SHARD", device_type="cuda")
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.ones(2, 5)).sum().backward()
    for norm_type in (0.0, -1.0, float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="norm_type must be a number > 0 or inf"):
            fshard.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    return True


def test_bad_strategy_clip_and_ignored_arguments_are_named():
    """Checked before anything is built: a mesh on a device type this machine lacks would
    fail later, inside torch, with no word of which argument was wrong."""
    assert all(get_pool(2).run(_bad_arguments_worker))


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.table, sparse=True)


def _unsupported_gradients_worker() -> list[str]:
    messages = []
    mesh = mesh_for((2,))
    model = nn.Sequential(nn.Embedding(7, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"module '0' \(Embedding\) makes sparse gradients \(sparse=True\)"):
        fshard.fully_shard(model, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh, ignored_params=[model[0].weight])  # left alone: fine
    lookup = _SparseLookup()
    fshard.fully_shard(lookup, mesh=mesh)
    with pytest.raises(TypeError, match=r"the gradient of 'table' in unit <root> is torch.sparse_coo"):
        lookup(torch.tensor([1, 2])).sum().backward()
    model = nn.Linear(4, 3)
    fshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.Adafactor(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(TypeError, match=r"torch.optim.Adafactor cannot step fshard's sharded parameters"):
        opt.step()
    if hasattr(torch.optim, "Muon"):  # orthogonalises whole matrices
        with pytest.raises(TypeError, match=r"torch.optim.Muon cannot step .* orthogonalises each whole"):
            torch.optim.Muon([model.weight]).step()
        whole = fshard.fully_shard(nn.Linear(4, 3), mesh=mesh_for((2, 1)))  # replicas only: fine
        whole(torch.ones(2, 4)).sum().backward()
        torch.optim.Muon([whole.weight]).step()
    with pytest.raises(RuntimeError, match=r"inside a torch.func transform that differentiates") as info:
        torch.func.grad(lambda x: model(x).sum())(torch.ones(2, 4))
    messages.append(str(info.value))
    fresh = nn.Linear(4, 3)  # before the first forward too (no root set-up inside the transform)
    fshard.fully_shard(fresh, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"inside a torch.func transform that differentiates"):
        torch.func.jacrev(fresh)(torch.ones(4))
    torch.testing.assert_close(  # what the message recommends
        torch.autograd.functional.jacobian(fresh, torch.ones(4)), fresh.weight.full_tensor()
    )
    return messages


def test_sparse_gradients_adafactor_and_torch_func_differentiation_are_named():
    """Each fails on every rank with what to do instead of deep inside a reduce (sparse
    gradients cannot be reshaped), a step that diverges from DDP (Adafactor's factored
    statistics) or an unrelated collective error (torch.func)."""
    for messages in get_pool(2).run(_unsupported_gradients_worker):
        assert "torch.autograd.grad" in messages[0]


def _twice():
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))


def test_fully_shard_twice():
    _all_ranks_raise(2, _twice, match=lambda m: "already sharded" in m and "Sequential" in m)


def _top_down():
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))


def test_top_down_order_is_an_error():
    _all_ranks_raise(2, _top_down, match=lambda m: "bottom-up" in m and "'weight'" in m)


def _other_parallelism(kind):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_for((2,))
    model = _mlp()
    if kind == "ddp":
        model = nn.Sequential(DDP(model))
    elif kind == "fsdp2":
        fsdp2_fully_shard(model[0], mesh=mesh)
    elif kind == "dtensor":
        from torch.distributed.tensor import Shard, distribute_tensor

        model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Shard(0)]))
    fshard.fully_shard(model, mesh=mesh)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("ddp", "module '0' is a DistributedDataParallel wrapper; fshard replaces DDP"),
        ("fsdp2", "module '0' is already sharded by torch's FSDP"),
        ("dtensor", "parameter '2.weight' is already a DTensor"),
    ],
)
def test_modules_under_other_parallelism_are_named(kind, expected):
    _all_ranks_raise(2, _other_parallelism, kind, match=lambda m: expected in m)


def _container_unit():
    model = nn.Sequential(nn.Linear(4, 4))
    model.extra = nn.ModuleList([nn.Linear(4, 4)])
    fshard.fully_shard(model.extra, mesh=mesh_for((2,)))


def test_a_container_without_forward_is_not_a_unit():
    _all_ranks_raise(
        2,
        _container_unit,
        match=lambda m: "a ModuleList has no forward" in m and "call fully_shard on each module inside it" in m,
    )


def test_parameter_on_another_device_is_named():
    assert device_problem("w", torch.device("cpu"), torch.device("cpu")) is None
    assert device_problem("w", torch.device("meta"), torch.device("cuda", 0)) is None
    # CPU params are copied row by row to the mesh's device (as FSDP2 moves them).
    assert device_problem("w", torch.device("cpu"), torch.device("cuda", 0)) is None
    message = device_problem("layers.0.weight", torch.device("cuda", 1), torch.device("cuda", 0))
    assert message is not None
    assert "'layers.0.weight' is on cuda:1" in message and "cuda:0" in message and "module.to" in message


def _mixed_meshes():
    model = _mlp()
    sub = mesh_for((2, 2))["shard"]  # a 1D mesh over 2 of the 4 ranks
    fshard.fully_shard(model[0], mesh=sub)
    fshard.fully_shard(model, mesh=mesh_for((4,)))
    model(torch.randn(2, 5))


def test_units_over_different_ranks_cannot_mix():
    _all_ranks_raise(4, _mixed_meshes, match=lambda m: "unit '0' uses a mesh over ranks" in m and "same mesh" in m)


def _mixed_1d_2d_ok():
    model = _mlp()
    fshard.fully_shard(model[0], mesh=mesh_for((2, 2)))
    fshard.fully_shard(model, mesh=mesh_for((4,)))
    model(torch.randn(2, 5)).sum().backward()
    return True


def test_1d_and_2d_meshes_over_the_same_ranks_mix():
    assert get_pool(4).run(_mixed_1d_2d_ok) == [True] * 4


def _shared_without_common_unit():
    model = _mlp()
    model[2] = nn.Linear(7, 7)
    model.append(nn.Linear(7, 7))
    model[3].weight = model[2].weight
    mesh = mesh_for((2,))
    fshard.fully_shard(model[2], mesh=mesh)
    fshard.fully_shard(model[3], mesh=mesh)  # the root is never sharded
    model[2](torch.randn(2, 7))
    model[3](torch.randn(2, 7))


def test_shared_parameter_without_a_common_unit():
    _all_ranks_raise(
        2,
        _shared_without_common_unit,
        match=lambda m: "'weight' belongs to a unit outside this model's tree" in m
        and "contains every user" in m
        and "This tree's root is the Linear whose forward ran first" in m,
    )


def _meta_left():
    with torch.device("meta"):
        model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(2, 5))


def test_parameters_left_on_meta_device():
    _all_ranks_raise(2, _meta_left, match=lambda m: "meta device" in m and "'0.weight'" in m and "materialize" in m)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(x, x, x)[0])


def _unit_inside_attention():
    model = _Attention()
    fshard.fully_shard(model.attn.out_proj, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(3, 2, 8))


def test_a_unit_inside_multihead_attention_is_refused():
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``: a unit
    there would never be gathered, and the attention computed with this rank's shard (a wrong
    output shape, silently, or a shape error later)."""
    _all_ranks_raise(
        2,
        _unit_inside_attention,
        match=lambda m: "unit 'attn.out_proj' is inside MultiheadAttention 'attn'" in m
        and "call fully_shard on 'attn'" in m,
    )


def _prefetch_differs(how: str):
    model = _routed_model()
    if dist.get_rank() == 1:
        if how == "set_prefetch":
            fshard.set_prefetch(model, backward="NO_PREFETCH")
        with mock.patch.dict(os.environ, {"FSHARD_DEBUG": "1" if how == "debug" else "0"}):
            model(torch.randn(3, 6), "both").sum().backward()
    else:
        with mock.patch.dict(os.environ, {"FSHARD_DEBUG": "0"}):
            model(torch.randn(3, 6), "both").sum().backward()


@pytest.mark.parametrize(
    ("how", "named"),
    [("set_prefetch", "backward=default (default: NO_PREFETCH)"), ("debug", "FSHARD_DEBUG set")],
)
def test_prefetch_settings_or_fshard_debug_on_one_rank_are_named(how, named):
    """They decide which gathers each rank issues and when: set on one rank only (a per-rank
    config file, FSHARD_DEBUG exported on one node), the first backward hung to the timeout
    with a message blaming the units run."""
    _all_ranks_raise(
        2, _prefetch_differs, how, error=fshard.RankMismatchError, match=lambda m: named in m
    )


def _prefetch_set_later(alike: bool):
    model = _routed_model()
    for step in range(3):
        if step == 1:  # after the first step: the ranks compare their settings at once
            other = [model.layers[2]] if alike or dist.get_rank() == 0 else [model.layers[1]]
            fshard.set_prefetch(model.layers[0], forward=other)
        model(torch.randn(3, 6), "both").sum().backward()
    return True


def test_prefetch_set_differently_after_the_first_step_is_named_at_once():
    """The first forward compares the prefetch settings; a later set_prefetch with other units
    on some rank made the ranks issue equal-sized gathers in other orders: rows exchanged
    between units, no error."""
    _all_ranks_raise(
        2, _prefetch_set_later, False, error=fshard.RankMismatchError,
        match=lambda m: "fshard.set_prefetch: the ranks' prefetch settings differ: unit 'layers.0' has "
        "forward=['layers.2']" in m and "forward=['layers.1']" in m and "on rank 1" in m,
    )  # fmt: skip
    assert get_pool(2).run(_prefetch_set_later, True) == [True, True]


def _param_replaced_after_a_step(when: str):
    model = _routed_model()
    model.layers[3].weight = model.layers[3].weight  # the same object again (tie_weights()): fine
    if when == "after-a-step":
        model(torch.randn(3, 6)).sum().backward()
    model.layers[1].weight = nn.Parameter(torch.full((6, 6), 0.5))
    model(torch.randn(3, 6)).sum().backward()


@pytest.mark.parametrize("when", ["after-a-step", "before-the-first-forward"])
def test_a_parameter_replaced_after_fully_shard_is_an_error(when):
    """Assigning a new Parameter to a unit's module after fully_shard: fshard put its own shard
    back at the next gather, so the new values were silently ignored (and full_state_dict
    showed the old ones); before the first forward, the new one stayed unsharded, its
    gradient never averaged."""
    _all_ranks_raise(
        2, _param_replaced_after_a_step, when,
        match=lambda m: "parameter 'layers.1.weight' of unit 'layers.1' was replaced after fully_shard" in m
        and "p.to_local().copy_(...)" in m,
    )  # fmt: skip


def _to_empty_after_fully_shard():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model.to_empty(device="cpu")  # torchtitan's meta init: to_empty, then init_weights
    model(torch.ones(3, 6)).sum().backward()


def test_to_empty_after_fully_shard_points_to_materialize():
    _all_ranks_raise(
        2, _to_empty_after_fully_shard,
        match=lambda m: "module.to_empty(device=...) after fully_shard does this" in m
        and "call fshard.materialize(model) instead of to_empty" in m,
    )  # fmt: skip


class _Doubled(nn.Module):  # elementwise: registering it on a shard succeeds
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _parametrized(when: str) -> bool:
    from torch.nn.utils import parametrize

    model = _mlp()
    square = nn.Linear(7, 7)
    model.insert(2, square)
    reference = copy.deepcopy(model)
    parametrize.register_parametrization(reference[2], "weight", _Doubled())
    if when == "before-sharding":
        parametrize.register_parametrization(square, "weight", _Doubled())
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    if when == "after-a-step":
        model(torch.randn(4, 5)).sum().backward()
    if when != "before-sharding":
        parametrize.register_parametrization(square, "weight", _Doubled())
    x = torch.randn(4, 5)
    return torch.allclose(model(x), reference(x))


def test_a_parametrization_registered_after_the_model_ran_is_an_error():
    """register_parametrization moves the parameter out of the module (into
    parametrizations.weight.original), where fshard no longer gathered it once the model had
    run: the forward computed with the shard (torch's shape error, naming neither fshard nor
    the parameter). Registered before sharding, or before the first forward (root init finds
    the parameter where it moved), it computes as the plain model does."""
    _all_ranks_raise(
        2, _parametrized, "after-a-step",
        match=lambda m: "parameter '2.weight' of unit <root> was removed from its module after the model ran" in m
        and "Apply them before the first forward" in m,
    )  # fmt: skip
    for when in ("before-sharding", "before-the-first-forward"):
        assert get_pool(2).run(_parametrized, when) == [True, True], when


def _functional_call(first: bool):
    from torch.func import functional_call

    model = _mlp()
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    x = torch.randn(4, 5)
    with torch.no_grad():
        before = None if first else model(x)
        substitute = {name: torch.randn(p.full_shape) for name, p in model.named_parameters()}
        try:
            functional_call(model, substitute, (x,))
        except ValueError as exc:
            message = str(exc)
        else:
            message = "no error"
        after = model(x)  # the model is left as it was
        reference = _mlp()(x)
    return message, before is None or torch.equal(before, after), torch.allclose(after, reference)


@pytest.mark.parametrize("first", [True, False], ids=["first-call", "after-a-forward"])
def test_functional_call_with_substituted_parameters_is_an_error(first):
    """torch.func.functional_call puts plain tensors in the modules for one call: fshard
    overwrote them with its gathered parameters (the model's own output, silently), and as the
    first call root init indexed the substitutes, so the next forward used raw shards."""
    for message, unchanged, right in get_pool(2).run(_functional_call, first):
        assert "holds another tensor" in message and "functional_call" in message, message
        assert "fshard.load_state_dict" in message
        assert unchanged and right


def _ignoring_a_number():
    fshard.fully_shard(_mlp(), mesh=mesh_for((2,)), ignored_params=[_mlp()[0].weight, 3])


def test_ignored_params_that_are_not_tensors_are_named():
    _all_ranks_raise(
        2, _ignoring_a_number, error=TypeError,
        match=lambda m: "ignored_params[1] is a int, not a parameter" in m,
    )  # fmt: skip


@pytest.mark.parametrize("norm_type", ["fro", None])
def test_clip_grad_norm_names_a_norm_type_that_is_not_a_number(norm_type):
    with pytest.raises(TypeError, match=r"clip_grad_norm_: norm_type must be a number > 0 or inf .* got "):
        fshard.clip_grad_norm_([torch.zeros(2, requires_grad=True)], 1.0, norm_type=norm_type)


def _clip_with_other_params_on_rank_one(norm_type, which):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    for block in (model[0], model[2], model[4]):
        fshard.fully_shard(block, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.ones(4, 5)).sum().backward()
    params = list(model.parameters())
    if dist.get_rank() == 1:
        if which == "fewer":  # the usual slip: a filter that differs by rank
            params = params[:-1]
        elif which == "others":  # as many, of other ones: model[2].weight for model[0].weight
            params = [model[2].weight, *params[1:]]
    fshard.clip_grad_norm_(reversed(params) if dist.get_rank() == 0 else params, 1.0, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("which", ["fewer", "others"])
def test_clip_grad_norm_refuses_different_parameters_per_rank(norm_type, which):
    """A rank passing other parameters would silently clip every rank by a wrong norm; the
    all-reduce that sums the norm tells, and every rank raises. (Order does not matter: rank 0
    passes its list reversed in the good case below.)"""
    _all_ranks_raise(
        2,
        _clip_with_other_params_on_rank_one,
        norm_type,
        which,
        match=lambda m: "clip_grad_norm_: the ranks of a shard group passed different sharded parameters" in m
        and "Pass the same parameters on every rank" in m,
        error=fshard.RankMismatchError,
    )


def _clip_same_params_in_another_order(norm_type):
    _clip_with_other_params_on_rank_one(norm_type, "same")
    return True


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_takes_the_same_parameters_in_any_order(norm_type):
    assert get_pool(2).run(_clip_same_params_in_another_order, norm_type) == [True, True]


def _block_called_first_on_rank_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    if dist.get_rank() == 1:  # a probe of the first block, on one rank
        model[0](torch.ones(2, 8))
    model(torch.ones(2, 8)).sum().backward()


def test_a_block_run_before_the_model_on_one_rank_is_named_as_such():
    """The models are the same: the ranks' roots are not (the first unit to run is the root of
    the units inside it). Said so, not "ranks built different sharded models"."""
    _all_ranks_raise(
        2,
        _block_called_first_on_rank_one,
        match=lambda m: "the ranks' first forwards started at different units: rank 0 at a "
        "Sequential, rank 1 at a Linear" in m
        and "Run the model's own forward first, on every rank" in m,
        error=fshard.RankMismatchError,
    )


def _other_mesh_shape_on_one_rank():
    meshes = {shape: mesh_for(shape) for shape in ((4,), (2, 2))}  # made on every rank, alike
    model = fshard.fully_shard(_mlp(), mesh=meshes[(2, 2) if dist.get_rank() == 3 else (4,)])
    model(torch.randn(2, 5)).sum().backward()


def test_a_mesh_of_another_shape_on_one_rank_is_named_at_once():
    """Rank 3's (2, 2) mesh has other shard and replicate groups than the others' (4,): the
    first forward's comparison ran over each rank's own groups, so the ranks met in different
    collectives and waited for the timeout, then blamed skipped units."""
    _all_ranks_raise(
        4, _other_mesh_shape_on_one_rank, error=fshard.RankMismatchError,
        match=lambda m: "rank 0 has unit <root> (mesh (4,)" in m and "where rank 3 has unit <root> (mesh (2, 2)" in m,
    )  # fmt: skip


def _divergent_shape():
    torch.manual_seed(0)
    width = 8 if dist.get_rank() == 1 else 7
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))
    fshard.fully_shard(model[0], mesh=mesh_for((3,)))
    fshard.fully_shard(model, mesh=mesh_for((3,)))
    model(torch.randn(2, 5))


def test_rank_with_a_different_parameter_shape():
    errors = _all_ranks_raise(
        3,
        _divergent_shape,
        error=fshard.RankMismatchError,
        match=lambda m: "rank 1 has parameter '0.weight' (unit '0', shape [8, 5]" in m
        and "rank 0 has parameter '0.weight' (unit '0', shape [7, 5]" in m,
    )
    assert len({str(e) for e in errors.values()}) == 1  # the same message on every rank


def _divergent_units():
    model = _mlp()
    mesh = mesh_for((2, 2))
    if dist.get_rank() != 3:
        fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    model(torch.randn(2, 5))


def test_rank_with_a_missing_unit():
    _all_ranks_raise(
        4,
        _divergent_units,
        error=fshard.RankMismatchError,
        match=lambda m: "rank 3 has parameter '0.weight' (unit <root>" in m and "(unit '0'" in m,
    )


def _ignored_params():
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)), ignored_params=[model[2].bias])
    return fshard.is_sharded(model[2].bias), tuple(model[2].bias.shape), fshard.is_sharded(model[2].weight)


def test_ignored_params_are_left_alone():
    assert get_pool(2).run(_ignored_params) == [(False, (3,), True)] * 2


# --------------------------------------------------------------------- dead and stuck ranks


def _run_children(case: str, tmp_path, check_s: float = 1.0, world: int = 2) -> dict[int, dict]:
    """Run ``tests/dist/_hang_child.py CASE`` as ``world`` processes (not the rank pool: a rank
    must really exit); return each surviving rank's JSON line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, FSHARD_HANG_CHECK_S=str(check_s), PYTHONPATH=str(root))
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dist._hang_child", case, store, str(rank), str(world)],
            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]  # fmt: skip
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                results[row["rank"]] = row
        assert proc.returncode in (0, 7), err[-2000:]
    return results


def test_a_dead_rank_is_a_collective_error_on_the_survivor_not_a_hang(tmp_path):
    """Rank 1 exits mid-training (os._exit): rank 0, in its next all-gather, gets fshard's
    CollectiveError within seconds (its peer stopped answering: gloo's own error, or the hang
    check that finds no heartbeat), never the process group's 30-minute timeout."""
    results = _run_children("dead", tmp_path)
    survivor = results[0]
    assert survivor["is_collective_error"], survivor
    assert "fshard:" in survivor["message"] and "the all_gather of " in survivor["message"], survivor["message"]
    assert survivor["seconds"] < 20, survivor


def test_a_rank_that_stops_early_is_a_collective_error_naming_it(tmp_path):
    """Rank 1 stops after one step (returns and exits); rank 0's next all-gather waits, then
    the hang check finds rank 1 gone and raises, naming the collective it waited in."""
    results = _run_children("stopped", tmp_path)
    survivor = results[0]
    assert survivor["is_collective_error"], survivor
    message = survivor["message"]
    assert "hang check" in message or "failed" in message, message
    assert "the all_gather of " in message and "'<root>'" in message, message
    assert survivor["seconds"] < 20, survivor


def _skip_a_collective():
    os.environ["FSHARD_HANG_CHECK_S"] = "1"
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(2, 5)).sum().backward()
    if dist.get_rank() == 0:
        model(torch.randn(2, 5)).sum().backward()  # rank 1 skips this step
    else:
        fshard.full_state_dict(model)  # and meets rank 0 in another collective


def test_a_rank_that_skips_a_collective_is_a_collective_error_on_every_rank():
    """Rank 1 skips a step's forward and backward and calls full_state_dict while rank 0
    trains: both wait in different collectives; the hang check names both on every rank, in
    seconds (it waited the process group's timeout before)."""
    _all_ranks_raise(
        2,
        _skip_a_collective,
        error=fshard.CollectiveError,
        match=lambda m: "full_state_dict" in m and "the all_gather of unit '<root>'" in m,
    )


def _slow_peer(logs: bool):
    """Rank 1 sleeps for 3x the hang-check interval in its own code between steps (a slow
    checkpoint write): rank 0 waits, logs once whom it waits for, and nothing raises."""
    import logging

    os.environ["FSHARD_HANG_CHECK_S"] = "1"
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fshard").addHandler(handler)
    try:
        model = _mlp()
        fshard.fully_shard(model[0], mesh=mesh_for((2,)))
        fshard.fully_shard(model, mesh=mesh_for((2,)))
        for step in range(3):
            if dist.get_rank() == 1 and step == 1:
                time.sleep(3.0)
            model(torch.randn(2, 5)).sum().backward()
    finally:
        logging.getLogger("fshard").removeHandler(handler)
    return [r for r in records if "waiting on" in r]


def test_a_slow_peer_is_never_an_error_only_logged_once():
    waiting = get_pool(2).run(_slow_peer, True)
    assert waiting[1] == []
    assert len(waiting[0]) == 1, waiting[0]
    assert "rank 1 is outside fshard's collectives" in waiting[0][0]
    assert "its last fshard collective was the " in waiting[0][0]


def _state_dict_on_rank_0_only():
    os.environ["FSHARD_HANG_CHECK_S"] = "1"
    model = _mlp()
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(2, 5)).sum().backward()
    if dist.get_rank() == 0:
        fshard.full_state_dict(model)  # the classic `if rank == 0: save(...)`
    model(torch.randn(2, 5)).sum().backward()


def test_full_state_dict_on_rank_0_only_is_a_collective_error_on_every_rank():
    """Issue 23, case 3: both ranks waited the process group's timeout (30 minutes)."""
    errors = _all_ranks_raise(
        2,
        _state_dict_on_rank_0_only,
        error=fshard.CollectiveError,
        match=lambda m: "full_state_dict(0.weight)" in m and "the all_gather of unit '<root>'" in m,
    )
    assert "rank 0 is in the agreement before the gather of 'full_state_dict(0.weight)'" in str(errors[1])


def _full_tensor_on_one_rank():
    os.environ["FSHARD_HANG_CHECK_S"] = "1"
    model = _mlp()
    fshard.fully_shard(model[0], mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(2, 5)).sum().backward()
    if dist.get_rank() == 1:
        model[0].weight.full_tensor()  # rank 1 only
    model(torch.randn(2, 5)).sum().backward()


def test_full_tensor_on_one_rank_is_a_collective_error_on_every_rank():
    """It killed rank 0 inside gloo ("Received data size doesn't match expected size") while
    rank 1's error named an unrelated unit."""
    _all_ranks_raise(
        2,
        _full_tensor_on_one_rank,
        error=fshard.CollectiveError,
        match=lambda m: "full_tensor" in m and "hang check" in m,
    )


def _debug_names_the_mismatch_before_it_runs():
    os.environ["FSHARD_DEBUG"] = "1"
    try:
        model = _routed_model()
        model(torch.randn(3, 6)).sum().backward()
        route = "first" if dist.get_rank() == 0 else "second"
        with fshard.testing.trace_collectives() as records:
            try:
                model(torch.randn(3, 6), route).sum().backward()
            except fshard.CollectiveError as exc:
                issued = [(r.op, r.label) for r in records if r.op == "all_gather"]
                return str(exc), issued
    finally:
        del os.environ["FSHARD_DEBUG"]
    return None, []


def test_fshard_debug_names_a_mismatch_before_the_mismatched_collective_runs():
    for message, issued in get_pool(2).run(_debug_names_the_mismatch_before_it_runs):
        assert message is not None and "were about to issue different collectives" in message, message
        assert "'layers.1'" in message and "'layers.2'" in message, message
        # Neither rank issued the all-gather of the unit only it ran.
        assert ("all_gather", "layers.1") not in issued or ("all_gather", "layers.2") not in issued


# ------------------------------------------------------- ranks that run different units


class _Routed(nn.Module):
    """Four equal layers; ``route`` picks which of the middle two run (data-dependent flow)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor, route: str = "both") -> torch.Tensor:
        x = self.layers[0](x)
        if route in ("both", "first"):
            x = self.layers[1](x)
        if route in ("both", "second"):
            x = self.layers[2](x)
        return self.layers[3](x)


def _routed_model() -> nn.Module:
    model = _Routed()
    mesh = mesh_for((2,))
    for layer in model.layers:
        fshard.fully_shard(layer, mesh=mesh)
    return fshard.fully_shard(model, mesh=mesh)


def _unit_skipped_on_one_rank():
    model = _routed_model()
    model(torch.randn(3, 6), "first" if dist.get_rank() == 0 else "both").sum().backward()


def test_a_unit_skipped_on_one_rank_names_the_collective_and_the_cause():
    pool = RankPool(2, timeout=60, pg_timeout=5)
    try:
        pool.start()  # not timed, as above
        start = time.monotonic()
        with pytest.raises(RanksFailed) as info:
            pool.run(_unit_skipped_on_one_rank)
        assert time.monotonic() - start < 30
        assert sorted(info.value.errors) == [0, 1]
        for rank, exc in info.value.errors.items():
            assert isinstance(exc, fshard.CollectiveError), (rank, exc)
            message = str(exc)
            assert message.startswith(f"[rank {rank}] fshard: the ") and " failed: " in message
            assert "ran different units" in message and "FSHARD_DEBUG=1" in message
    finally:
        pool.close()


def _units_swapped_between_ranks():
    model = _routed_model()
    model(torch.randn(3, 6), "first" if dist.get_rank() == 0 else "second").sum().backward()


def test_units_swapped_between_ranks_fail_the_first_backward():
    # Same number of equally sized collectives: without the check these pair unit 1's data on
    # rank 0 with unit 2's on rank 1 and train on wrong gradients without any error.
    _all_ranks_raise(
        2,
        _units_swapped_between_ranks,
        error=fshard.RankMismatchError,
        match=lambda m: "collective #2 was the all_gather of unit 'layers.1' (21 elements) on rank 0"
        in m
        and "the all_gather of unit 'layers.2' (21 elements) on rank 1" in m
        and "do not step the optimizer" in m,
    )


def _swap_at_step(swap_step: int, debug: bool):
    with mock.patch.dict(os.environ, {"FSHARD_DEBUG": "1" if debug else "0"}):
        model = _routed_model()
        # A swap after the first step: with FSHARD_DEBUG the per-step collective check names
        # the difference; without it, the step's run order differs from the first step's, so
        # the ranks compare the units they ran at the start of the backward (equal counts of
        # equal sizes: the collectives would pair one unit's data with another's, silently).
        checks = []
        for step in range(3):
            route = "first" if dist.get_rank() == 0 and step == swap_step else "both"
            if step == swap_step and dist.get_rank() == 1:
                route = "second"
            with fshard.testing.trace_collectives() as records:
                model(torch.randn(3, 6), route).sum().backward()
            checks.append(sum(r.label == "check_collective_order" for r in records))
        return checks


def test_the_order_is_checked_on_the_first_step_and_every_step_with_fshard_debug():
    # By default only the first backward pays for the check (one object all-gather).
    assert get_pool(2).run(_swap_at_step, -1, False) == [[1, 0, 0]] * 2
    assert get_pool(2).run(_swap_at_step, -1, True) == [[1, 1, 1]] * 2
    _all_ranks_raise(
        2,
        _swap_at_step,
        2,
        True,
        error=fshard.RankMismatchError,
        match=lambda m: "unit 'layers.1'" in m and "unit 'layers.2'" in m,
    )


def test_units_swapped_between_ranks_after_the_first_step_are_an_error_before_the_backward():
    """LayerDrop drawing per rank, or an expert per unit routed to per rank, after the first
    step: as many units of one size ran on each rank, but different ones. The forward's order
    differs from the first step's, so the ranks compare what they ran: an error on every rank
    before any collective pairs one unit's data with another's (they trained on wrong
    gradients, without a word)."""
    _all_ranks_raise(
        2,
        _swap_at_step,
        1,
        False,
        error=fshard.RankMismatchError,
        # Found in the forward now, before the first collective of the units that differ (it
        # was found at the start of the backward): rank 1 ran 'layers.2' where the first step
        # ran 'layers.1'; rank 0 ran 'layers.3' where the first step ran 'layers.2'.
        match=lambda m: "the ranks were about to issue different collectives" in m
        and "unit 'layers.2' ran as unit #3 of this forward, where the first step ran 'layers.1'" in m
        and "unit 'layers.3' ran as unit #4 of this forward, where the first step ran 'layers.2'" in m
        and "seeded alike on every rank" in m,
    )


def _same_skip_on_every_rank() -> list[int]:
    model = _routed_model()
    checks = []
    for step in range(3):  # the first step runs every unit; later ones skip one, alike
        with fshard.testing.trace_collectives() as records:
            model(torch.randn(3, 6), "both" if step == 0 else "first").sum().backward()
        checks.append(sum(r.label == "check_unit_order" for r in records))
    return checks


def _steps_alike_with_extra_forwards() -> list[int]:
    model = _routed_model()
    checks = []
    for _ in range(3):
        with fshard.testing.trace_collectives() as records:
            # A full and a shallower forward in one step, then one backward; an evaluation
            # with grad and no backward, then generation-like forwards without grad.
            loss = model(torch.randn(3, 6), "both").sum() + model(torch.randn(3, 6), "first").sum()
            loss.backward()
            model(torch.randn(3, 6), "both").sum()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(3, 6), "first")
        checks.append(sum(r.label == "check_unit_order" for r in records))
    return checks


def test_steps_that_run_alike_pay_no_order_check():
    # The order compared is a step's (its forwards with grad up to its backward), so extra
    # forwards in a step, and forwards that no backward follows, cost nothing.
    assert get_pool(2).run(_steps_alike_with_extra_forwards) == [[0, 0, 0]] * 2


def test_units_skipped_alike_on_every_rank_are_checked_and_train():
    # The same skip everywhere passes the check: one object all-gather in a step whose units
    # differ from the last checked step's, none in steps that run the same units as it.
    assert get_pool(2).run(_same_skip_on_every_rank) == [[0, 1, 0]] * 2


@pytest.mark.parametrize(
    "call",
    [
        lambda m: fshard.set_requires_gradient_sync(m, False),
        lambda m: fshard.no_sync(m).__enter__(),
        lambda m: fshard.unshard(m),
        lambda m: fshard.reshard(m),
        lambda m: fshard.state_dict(m),
        lambda m: fshard.full_state_dict(m),
        lambda m: fshard.materialize(m),
    ],
    ids=["set_requires_gradient_sync", "no_sync", "unshard", "reshard", "state_dict", "full_state_dict", "materialize"],
)
def test_controls_on_a_module_without_units_say_what_to_do(call):
    with pytest.raises(ValueError, match=r"has no fshard units; call fshard.fully_shard"):
        call(_mlp())


def _data_replaced_by_a_full_tensor():
    model = _mlp()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.randn(2, 5)).sum().backward()
    with torch.no_grad():  # as resize_token_embeddings does: new full-size data for the param
        model[0].weight.data = torch.zeros(9, 5)
    model(torch.randn(2, 5))


def test_param_data_replaced_after_sharding_names_the_param():
    _all_ranks_raise(
        2,
        _data_replaced_by_a_full_tensor,
        match=lambda m: "parameter '0.weight' of fshard unit <root> was given data of shape [9, 5]" in m
        and "its shard of the full [7, 5] parameter is [" in m
        and "resize_token_embeddings" in m,
    )


def _unshard_different_units():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))  # units of one size: rows would pair
    mesh = mesh_for((2,))
    for layer in model:
        fshard.fully_shard(layer, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    model(torch.ones(2, 6)).sum().backward()  # training has started
    want = [layer.weight.full_tensor() for layer in model]
    fshard.unshard(model[dist.get_rank()])  # rank 0 the first block, rank 1 the second
    return [torch.equal(layer.weight, w) for layer, w in zip(model, want, strict=True)]


def test_unshard_of_different_units_on_different_ranks_is_named():
    """``fshard.unshard`` is collective: ranks asking for different units of the same size
    would swap rows silently; both raise instead."""
    for message in rank_mismatch_messages(_unshard_different_units):
        assert "fshard.unshard: the ranks of the shard group asked for different units" in message
        assert "not under `if rank == 0:`" in message
