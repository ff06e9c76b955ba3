"""State-dict edge cases: snapshots that stay snapshots, wrong shapes and optimizers named at
load time, tied keys, and ``model.state_dict()`` while a unit is gathered."""

from __future__ import annotations

import copy
import math
import time
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fshard
from fshard.testing import RanksFailed, get_pool, mesh_for
from tests.dist import _sd_common as C


def _linear_pair(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()


def _snapshot_task():
    model = _linear_pair()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    osd = fshard.optim_state_dict(model, opt, full=True)
    full = fshard.full_state_dict(model, rank0_only=False)
    local = fshard.full_state_dict(model, rank0_only=False, cpu_offload=False)
    before = copy.deepcopy((osd["state"], full, local))
    _train(model, opt, steps=2)
    for now, then in zip((osd["state"], full, local), before, strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0)
    return True


def test_full_state_dicts_are_snapshots():
    """Buffers and scalar optimizer state (Adam's ``step``) are copies too, not live tensors."""
    assert all(get_pool(2).run(_snapshot_task))


def _module_state_dict_while_gathered_task():
    mp = fshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = _linear_pair(mp_policy=mp)
    fshard.unshard(model)
    sd = model.state_dict()
    want = fshard.state_dict(model)
    fshard.reshard(model)
    for key in ("0.weight", "0.bias"):
        assert isinstance(sd[key], DTensor) and sd[key].dtype == torch.float32, key
        torch.testing.assert_close(sd[key].full_tensor(), want[key].full_tensor())
    return True


def test_module_state_dict_while_gathered_is_the_fp32_shards():
    assert all(get_pool(2).run(_module_state_dict_while_gathered_task))


def _optim_errors_task(case):
    model = _linear_pair()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    osd = copy.deepcopy(fshard.optim_state_dict(model, opt, full=True))
    if case == "wrong_shape":
        osd["state"]["0.weight"]["exp_avg"] = torch.zeros(7, 6)
        osd["state"]["0.bias"]["exp_avg"] = torch.zeros(1)
        target = opt
    elif case == "other_optimizer":  # the recorded class differs
        target = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif case == "other_optimizer_unrecorded":  # no class recorded: the hyperparameters differ
        del osd["optimizer_class"]
        target = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:  # no class recorded, hyperparameters that fit: Adamax makes other state keys
        del osd["optimizer_class"]
        target = torch.optim.Adamax(model.parameters(), lr=0.1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError) as info:
        fshard.load_optim_state_dict(model, target, osd)
    torch.testing.assert_close(target.state_dict()["state"], before["state"])  # nothing loaded
    return str(info.value)


@pytest.mark.parametrize(
    "case, patterns",
    [
        ("wrong_shape", ["state['0.weight']['exp_avg']: shape mismatch", "state['0.bias']['exp_avg']"]),
        ("other_optimizer", ["saved from a torch.optim.adam.Adam (its 'optimizer_class')", "this optimizer is a torch.optim.sgd.SGD", "Build the optimizer with the class"]),
        ("other_optimizer_unrecorded", ["param_groups[0] has hyperparameters", "another kind of optimizer", "momentum"]),
        ("state_keys_unrecorded", ["has keys ['exp_avg', 'exp_avg_sq', 'step'], but torch.optim.adamax.Adamax", "makes ['exp_avg', 'exp_inf', 'step']", "another kind of optimizer"]),
    ],
)
def test_load_optim_state_dict_errors_name_the_key(case, patterns):
    for message in get_pool(2).run(_optim_errors_task, case):
        for pattern in patterns:
            assert pattern in message, message


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _tied_last_key_task(broadcast):
    sd = {"emb.weight": torch.zeros(8, 4), "head.weight": torch.ones(8, 4)}
    plain = _Tied()
    plain.load_state_dict(sd)
    model = _Tied()
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    given = sd if not broadcast or dist.get_rank() == 0 else {}
    fshard.load_state_dict(model, given, broadcast_from_rank0=broadcast)
    torch.testing.assert_close(model.emb.weight.full_tensor(), plain.emb.weight.detach())
    return True


@pytest.mark.parametrize("broadcast", [False, True], ids=["everywhere", "from_rank0"])
def test_tied_param_takes_its_last_keys_value_like_nn_module(broadcast):
    assert all(get_pool(2).run(_tied_last_key_task, broadcast))


def _module_load_wrong_shape_task():
    model = _linear_pair()
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({**model.state_dict(), "0.weight": torch.zeros(7, 6)})
    return str(info.value)


def test_module_load_state_dict_size_mismatch_names_the_full_shape():
    for message in get_pool(2).run(_module_load_wrong_shape_task):
        assert "size mismatch for 0.weight" in message
        assert "torch.Size([6, 6])" in message and "this rank holds (3, 6)" in message


def _module_load_shard_shaped_task(rows: int, given: int):
    model = nn.Sequential(nn.Embedding(rows, 3))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    before = model[0].weight.to_local().clone()
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({"0.weight": torch.randn(given, 3)})
    assert torch.equal(model[0].weight.to_local(), before)  # nothing loaded
    return str(info.value)


@pytest.mark.parametrize(("rows", "given"), [(8, 4), (5, 3), (5, 2)])
def test_module_load_state_dict_refuses_a_plain_tensor_shaped_like_a_shard(rows, given):
    """A plain tensor is the full parameter: one shaped like this rank's shard (a checkpoint
    from before a vocabulary resize) is a size mismatch on every rank, not loaded into each
    rank's rows (with uneven shards, on some ranks only, the others raising)."""
    for message in get_pool(2).run(_module_load_shard_shaped_task, rows, given):
        assert f"size mismatch for 0.weight: copying a param with shape torch.Size([{given}, 3])" in message
        assert f"the shape in current model is torch.Size([{rows}, 3])" in message


# ------------------------------------------------- optimizer state of an unsharded run (positions)


def _decay_groups(model: nn.Module, lr: float) -> list[dict]:
    """Two param groups, as training scripts build them (weight decay on matrices only)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1, "lr": lr},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": lr / 2},
    ]


def _plain_optim_task(mesh_shape):
    """Every rank trains the same unsharded model a step, then a sharded copy takes over its
    ``opt.state_dict()`` (keyed by position); both go on and must stay equal."""
    plain = C.build()
    plain_opt = torch.optim.AdamW(_decay_groups(plain, 0.05))
    for step in range(2):
        C.loss_of(plain, C.global_batch(step)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    model = C.build_sharded(mesh_shape, seed=11)
    opt = torch.optim.AdamW(_decay_groups(model, 1.0))
    fshard.load_state_dict(model, plain.state_dict())
    result = fshard.load_optim_state_dict(model, opt, plain_opt.state_dict())
    assert result == fshard.LoadResult([], [])
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.025]
    steps = range(2, 4)
    for step in steps:
        C.loss_of(plain, C.global_batch(step)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    C.train(model, opt, steps)
    C.assert_same_tensors(C.full_params(model), plain.state_dict(), exact=False, what="continued")
    return True


@pytest.mark.parametrize(("world", "mesh_shape"), [(2, (2,)), (4, (2, 2))])
def test_load_optim_state_dict_takes_an_unsharded_runs_plain_state_dict(world, mesh_shape):
    assert all(get_pool(world).run(_plain_optim_task, mesh_shape))


def _reordered_groups_task():
    """Groups built in another order (no decay first) load by their parameter names, strict."""
    model = C.build_sharded((2,))
    opt = torch.optim.AdamW(_decay_groups(model, 0.05))
    C.train(model, opt, range(2))
    osd = fshard.optim_state_dict(model, opt)
    fresh = torch.optim.AdamW(_decay_groups(model, 1.0)[::-1])
    result = fshard.load_optim_state_dict(model, fresh, osd)
    assert result == fshard.LoadResult([], [])
    assert [(g["lr"], g["weight_decay"]) for g in fresh.param_groups] == [(0.025, 0.0), (0.05, 0.1)]
    for p in model.parameters():
        for key, value in opt.state[p].items():
            torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)
    # Empty groups hold the same (no) names: they match in their order.
    params = list(model.parameters())
    saving = torch.optim.SGD([{"params": [], "lr": 1.0}, {"params": params}, {"params": [], "lr": 3.0}], lr=0.1)
    loading = torch.optim.SGD([{"params": params}, {"params": [], "lr": 7.0}, {"params": [], "lr": 7.0}], lr=0.5)
    fshard.load_optim_state_dict(model, loading, fshard.optim_state_dict(model, saving))
    assert [g["lr"] for g in loading.param_groups] == [0.1, 1.0, 3.0]
    return True


def test_load_optim_state_dict_matches_reordered_groups_by_their_parameters():
    assert all(get_pool(2).run(_reordered_groups_task))


def _plain_optim_errors_task(case):
    plain = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)  # one group of 4 params
    _train(plain, plain_opt)
    osd = plain_opt.state_dict()
    model = _linear_pair()
    if case == "groups":
        opt = torch.optim.Adam(_decay_groups(model, 0.1))
    else:
        opt = torch.optim.Adam(list(model.parameters())[:3], lr=0.1)
    with pytest.raises(ValueError) as info:
        fshard.load_optim_state_dict(model, opt, osd)
    assert not opt.state
    return str(info.value)


@pytest.mark.parametrize(
    ("case", "patterns"),
    [
        ("groups", ["numbers parameters by position (a plain opt.state_dict()) and has 1 param group(s), but the optimizer has 2"]),
        ("sizes", ["param_groups[0] of the state dict holds 4 parameter position(s), but the optimizer's group holds 3"]),
    ],
)
def test_a_plain_state_dict_must_fit_the_param_groups(case, patterns):
    for message in get_pool(2).run(_plain_optim_errors_task, case):
        for pattern in [*patterns, "build the optimizer with the same param groups"]:
            assert pattern in message, message


# ------------------------------------------------------------- optimizer state, strict=False


def _non_strict_optim_task():
    torch.manual_seed(0)
    mesh = mesh_for((dist.get_world_size(),))
    source = fshard.fully_shard(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)), mesh=mesh)
    source_opt = torch.optim.AdamW(source.parameters(), lr=0.05)
    _train(source, source_opt)
    osd = fshard.optim_state_dict(source, source_opt, full=True)
    # The target lost the last layer and gained a head of its own.
    target = fshard.fully_shard(
        nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Identity(), nn.Linear(6, 3)), mesh=mesh
    )
    target_opt = torch.optim.AdamW(target.parameters(), lr=1.0)
    with pytest.raises(ValueError) as info:
        fshard.load_optim_state_dict(target, target_opt, osd)
    _train(target, target_opt)
    head = copy.deepcopy(target_opt.state[target[3].weight])
    result = fshard.load_optim_state_dict(target, target_opt, osd, strict=False)
    got = fshard.optim_state_dict(target, target_opt, full=True)
    for name in ("0.weight", "0.bias", "1.weight", "1.bias"):
        torch.testing.assert_close(got["state"][name], osd["state"][name], rtol=0, atol=0)
    # Not in the state dict: the head keeps its own state.
    torch.testing.assert_close(target_opt.state[target[3].weight], head, rtol=0, atol=0)
    assert target_opt.param_groups[0]["lr"] == 0.05
    return str(info.value), result


def test_load_optim_state_dict_non_strict_loads_the_parameters_both_sides_hold():
    for message, result in get_pool(2).run(_non_strict_optim_task):
        assert "pass strict=False" in message, message
        assert result == fshard.LoadResult(["3.weight", "3.bias"], ["2.bias", "2.weight"])


def _submodule_state_dict_task():
    """``state_dict()`` / ``load_state_dict()`` of modules that are not units: a layer inside a
    unit, and an output head outside the unit of the embedding it is tied to (before the first
    forward places it)."""
    torch.manual_seed(0)
    mesh = mesh_for((dist.get_world_size(),))
    model = nn.Sequential(
        OrderedDict(embed=nn.Embedding(10, 4), body=nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 4)), head=nn.Linear(4, 10, bias=False))
    )
    model.head.weight = model.embed.weight
    want = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: torch.randn_like(v) for k, v in want.items()}
    fshard.fully_shard(model.embed, mesh=mesh)
    fshard.fully_shard(model.body, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)  # no forward yet: the head's weight is not placed
    got = {}
    for name in ("embed", "body.0", "body.1", "head"):
        sub = model.get_submodule(name)
        sd = sub.state_dict()
        assert sd and all(isinstance(v, DTensor) for v in sd.values()), (name, sd)
        got.update({f"{name}.{k}": v.full_tensor() for k, v in sd.items()})
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0)
    for name in ("embed", "body.0", "body.1", "head"):
        sub = model.get_submodule(name)  # a full tensor loads into it alone (each rank its rows)
        sub.load_state_dict({k: new[f"{name}.{k}"] for k in sub.state_dict()})
    full = fshard.full_state_dict(model, rank0_only=False)
    torch.testing.assert_close(full["body.0.weight"], new["body.0.weight"], rtol=0, atol=0)
    torch.testing.assert_close(full["embed.weight"], new["head.weight"], rtol=0, atol=0)  # loaded last
    return True


class _TiedLater(nn.Module):
    """An output head tied to the embedding only after fully_shard (transformers' tie_weights()
    after wrapping), and another head attached after it, reusing the embedding too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(self.emb(tokens)))
        return out + self.extra(self.emb(tokens)) if hasattr(self, "extra") else out


def _tied_after_sharding_task():
    torch.manual_seed(0)
    model = _TiedLater()
    fshard.fully_shard(model.emb, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model.head.weight = model.emb.weight
    model.extra = nn.Linear(4, 6, bias=False)
    model.extra.weight = model.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
        opt.zero_grad()
    trained = fshard.state_dict(model)["emb.weight"].full_tensor()
    sd = model.state_dict()
    for key in ("emb.weight", "head.weight", "extra.weight"):
        assert isinstance(sd[key], DTensor), key
        torch.testing.assert_close(sd[key].full_tensor(), trained, rtol=0, atol=0, msg=key)
    new = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    model.load_state_dict({"extra.weight": new}, strict=False)  # a full tensor, into the tie
    torch.testing.assert_close(model.emb.weight.full_tensor(), new, rtol=0, atol=0)
    return True


def test_state_dict_of_weights_tied_after_fully_shard_is_the_live_weight():
    assert all(get_pool(2).run(_tied_after_sharding_task))


def test_state_dict_of_a_module_that_is_not_a_unit_is_dtensors_and_loads_full_tensors():
    assert all(get_pool(2).run(_submodule_state_dict_task))


def _plain_optim_state_dict_task():
    """``opt.state_dict()`` / ``opt.load_state_dict()`` (torch's own) on sharded parameters."""
    torch.manual_seed(0)
    model = fshard.fully_shard(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4)), mesh=mesh_for((2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, opt, steps=2)
    own = opt.state_dict()
    assert own["param_groups"][0]["fshard_shards"] == [[dist.get_rank(), 2]]
    from_rank0 = [own]
    dist.broadcast_object_list(from_rank0, src=0)  # DDP's habit: rank 0 saves, every rank loads
    snapshots = {
        "rank 0's": from_rank0[0],
        "sharded": fshard.optim_state_dict(model, opt),
        "full": fshard.optim_state_dict(model, opt, full=True, rank0_only=False),
    }
    errors = {}
    for what, snapshot in snapshots.items():
        opt.load_state_dict(copy.deepcopy(snapshot))
        try:
            _train(model, opt)
        except ValueError as exc:
            errors[what] = str(exc)
        opt.load_state_dict(own)  # each rank its own: fine
        _train(model, opt)
        assert all("fshard_shards" not in group for group in opt.param_groups)
    return errors


def test_torch_optimizer_load_state_dict_of_other_shards_or_layouts_is_an_error():
    """Each rank must load its own plain state dict; fshard.optim_state_dict's (DTensors, or full
    tensors) go through fshard.load_optim_state_dict. Not silently wrong moments, nor an error
    deep inside the update."""
    rank0, rank1 = get_pool(2).run(_plain_optim_state_dict_task)
    assert set(rank0) == set(rank1) == {"rank 0's", "sharded", "full"}
    assert "was saved holding shard 0 of 2, but holds shard 1 of 2 here" in rank1["rank 0's"]
    assert "each rank must load its own" in rank1["rank 0's"]
    # Rank 0, whose own rows these are, refuses too: alone, it would step into a hang.
    assert "another rank of the mesh was given the optimizer state of other shards" in rank0["rank 0's"]
    for errors in (rank0, rank1):
        assert "holds DTensors" in errors["sharded"] and "fshard.load_optim_state_dict" in errors["sharded"]
        assert "has the full parameter's shape" in errors["full"]


def _optim_from_rank0_task(mesh_shape, source):
    """Only rank 0 holds the full optimizer state (rank0_only, or an unsharded run's)."""
    model = C.build_sharded(mesh_shape)
    opt = torch.optim.AdamW(_decay_groups(model, 0.05))
    C.train(model, opt, range(2))
    rank0 = dist.get_rank() == 0
    if source == "rank0_only":
        osd = fshard.optim_state_dict(model, opt, full=True, rank0_only=True)
        assert bool(osd) == rank0
    else:  # an unsharded run's plain opt.state_dict(), by position, read on rank 0 only
        plain = C.build()
        plain_opt = torch.optim.AdamW(_decay_groups(plain, 0.05))
        # torch maps the names in the params lists by position: the same state, unsharded.
        plain_opt.load_state_dict(fshard.optim_state_dict(model, opt, full=True))
        osd = plain_opt.state_dict() if rank0 else None
    fresh = torch.optim.AdamW(_decay_groups(model, 1.0))
    result = fshard.load_optim_state_dict(model, fresh, osd, broadcast_from_rank0=True)
    assert result == fshard.LoadResult([], [])
    assert [g["lr"] for g in fresh.param_groups] == [0.05, 0.025]
    for p in model.parameters():
        assert set(fresh.state[p]) == set(opt.state[p])
        for key, value in opt.state[p].items():
            assert type(fresh.state[p][key]) is torch.Tensor, key
            torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)
    # A DTensor on rank 0 (a sharded state dict) is an error on every rank, before any transfer.
    sharded = fshard.optim_state_dict(model, opt)
    with pytest.raises(ValueError, match="is a DTensor; broadcast_from_rank0 loads a full state dict"):
        fshard.load_optim_state_dict(model, fresh, sharded if rank0 else {}, broadcast_from_rank0=True)
    return True


@pytest.mark.parametrize(("mesh_shape", "source"), [((2,), "rank0_only"), ((2, 2), "rank0_only"), ((2,), "unsharded")], ids=str)
def test_load_optim_state_dict_broadcast_from_rank0(mesh_shape, source):
    assert all(get_pool(math.prod(mesh_shape)).run(_optim_from_rank0_task, mesh_shape, source))


def _load_after_a_forward_without_backward_task(how: str) -> bool:
    """A forward with grad and no backward (an evaluation outside ``torch.no_grad()``) keeps
    units gathered, hidden, for the backward; a load (restoring the best weights) frees them
    for good: the modules show the shards after it, and an optimizer built then steps them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fshard.fully_shard(model, mesh=mesh, reshard_after_forward=False)
    best = fshard.full_state_dict(model, rank0_only=False)
    model(torch.randn(3, 4)).sum()  # kept for a backward that never comes
    assert fshard.memory_stats().gathered_bytes > 0
    if how == "fshard":
        fshard.load_state_dict(model, best)
    else:
        model.load_state_dict(best)
    assert all(fshard.is_sharded(p) for p in model.parameters())
    assert fshard.memory_stats().gathered_bytes == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return True


@pytest.mark.parametrize("how", ["fshard", "module"])
def test_a_load_after_a_forward_without_backward_leaves_the_shards_in_the_modules(how):
    assert all(get_pool(2).run(_load_after_a_forward_without_backward_task, how))


def _rank0_file_everywhere_task(path: str, mesh_shape: tuple[int, ...]) -> dict[str, str | None]:
    """Rank 0 saves its sharded state dicts with ``torch.save``; every rank loads the file
    (uneven shards too: 5 rows are 3 on rank 0, 2 on rank 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4))
    fshard.fully_shard(model, mesh=mesh_for(mesh_shape))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if dist.get_rank() == 0:
        torch.save(
            {"model": model.state_dict(), "fshard": fshard.state_dict(model), "optim": fshard.optim_state_dict(model, opt)},
            path,
        )
    else:
        fshard.optim_state_dict(model, opt)  # (collective)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    errors: dict[str, str | None] = {}
    try:
        model.load_state_dict(saved["model"])
        errors["module"] = None
    except RuntimeError as exc:
        errors["module"] = str(exc)
    for name, load in (
        ("fshard", lambda: fshard.load_state_dict(model, saved["fshard"])),
        ("optim", lambda: fshard.load_optim_state_dict(model, opt, saved["optim"])),
    ):
        try:
            load()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_another_ranks_sharded_state_dict_is_refused(tmp_path, mesh_shape):
    """A DTensor keeps the mesh coordinate of the rank that made it: loading rank 0's sharded
    state dict on every rank (the DDP habit) gave each rank rank 0's rows, silently. Ranks
    whose shard differs refuse it (``fshard.load_state_dict`` / ``load_optim_state_dict`` on
    every rank, as they agree on errors, and ``model.load_state_dict`` too: a rank holding
    those very rows, rank 0 or one of another replica on a 2D mesh, would go on alone)."""
    world = math.prod(mesh_shape)
    results = get_pool(world).run(_rank0_file_everywhere_task, str(tmp_path / "rank0.pt"), mesh_shape)
    shard_size = mesh_shape[-1]
    for rank, errors in enumerate(results):
        foreign = rank % shard_size != 0
        if foreign:
            assert "holding the shard of mesh coordinate" in errors["module"], errors
        else:
            assert "another rank of the mesh was given DTensors holding the shards of other ranks" in errors["module"], errors
        for name in ("fshard", "optim"):  # agreed: refused on every rank
            assert errors[name] is not None and "holding the shard of mesh coordinate" in errors[name], (rank, errors)


def _full_optim_state_with_rank_dependent_order_task() -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    params = list(model.parameters())
    if dist.get_rank() == 1:  # a set of parameters, or any order that depends on the rank
        params.reverse()
    opt = torch.optim.Adam(params, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    full = fshard.optim_state_dict(model, opt, full=True)["state"]
    for name, p in model.named_parameters():
        want = opt.state[p]["exp_avg"]  # this rank's rows, gathered by name below
        rows = torch.cat(_all_gather_list(want)) if want.dim() else want
        assert torch.equal(full[name]["exp_avg"], rows), name
    return True


def _all_gather_list(local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``local`` (rows may differ in number), with plain torch collectives."""
    sizes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, local.shape[0])
    padded = torch.zeros((max(sizes), *local.shape[1:]), dtype=local.dtype)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [g[:n] for g, n in zip(gathered, sizes, strict=True)]


def test_full_optim_state_dict_with_param_groups_ordered_per_rank():
    """The ranks gather one tensor at a time in the model's order, not their param groups'
    (a ``set`` of parameters orders them per process): gathered in each rank's own order, the
    rows of one parameter's state were joined with another's, under the wrong names."""
    assert all(get_pool(2).run(_full_optim_state_with_rank_dependent_order_task))


# ------------------------------------------------------------- meta tensors in a load


def _every_rank_raises_at_once(fn, *args, patterns) -> str:
    """Run ``fn`` on 2 ranks: each raises the same ``ValueError`` holding ``patterns``, within
    seconds (no rank waits in a collective for the timeout)."""
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(fn, *args, timeout=30)
    assert time.monotonic() - start < 15, "a rank waited in a collective"
    errors = info.value.errors
    assert sorted(errors) == [0, 1], f"every rank must raise, only {sorted(errors)} did: {info.value}"
    assert all(type(exc) is ValueError for exc in errors.values()), info.value
    messages = {str(exc) for exc in errors.values()}
    assert len(messages) == 1, f"the ranks raised different errors: {messages}"
    [message] = messages
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    return message


def _unchanged(tensors: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    for now, then in zip(tensors, before, strict=True):
        assert torch.equal(now, then), "a failed load changed the model or the optimizer"


def _meta_value_task(what: str, broadcast: bool) -> None:
    """A tensor of the state dict on the meta device (a weight an empty-weights load left
    unfilled): on rank 0 for ``broadcast``, else on rank 1 only (rank 0's dict is fine)."""
    model = _linear_pair()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    holder = dist.get_rank() == (0 if broadcast else 1)
    meta = torch.empty(6, device="meta")
    if what == "model":
        sd = fshard.full_state_dict(model, rank0_only=False)
        if holder:
            sd["0.bias"] = meta
        watched = [p.detach() for p in model.parameters()]
    else:
        sd = fshard.optim_state_dict(model, opt, full=True)
        if holder:
            sd["state"]["0.bias"]["exp_avg"] = meta
        watched = [t for p in model.parameters() for t in opt.state[p].values()]
    given = sd if holder or not broadcast else {}
    before = [t.clone() for t in watched]
    try:
        if what == "model":
            fshard.load_state_dict(model, given, broadcast_from_rank0=broadcast)
        else:
            fshard.load_optim_state_dict(model, opt, given, broadcast_from_rank0=broadcast)
    finally:
        _unchanged(watched, before)


@pytest.mark.parametrize("broadcast", [False, True], ids=["everywhere", "from_rank0"])
@pytest.mark.parametrize("what", ["model", "optim"])
def test_a_meta_tensor_in_the_state_dict_is_an_error_naming_its_key_on_every_rank(what, broadcast):
    """Named in the agreed checks, before anything is sent or loaded: not torch's bare "Cannot
    copy out of meta tensor" on one rank in the middle of the load (from rank 0: of its
    scatter, with the other ranks left waiting in it)."""
    key = "key '0.bias'" if what == "model" else "state['0.bias']['exp_avg']"
    _every_rank_raises_at_once(
        _meta_value_task, what, broadcast, patterns=[f"1 tensor(s) of the state dict are on the meta device ({key})", "holds no data"]
    )


def _meta_buffer_model() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``_linear_pair``'s model and a full state dict of it; on rank 1 the BatchNorm's running
    statistics are left on the meta device (weights loaded with assign=True, buffers not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    if dist.get_rank() == 1:
        for name in ("running_mean", "running_var"):
            model[1].register_buffer(name, torch.empty(6, device="meta"))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    return model, sd


def _meta_buffer_task(broadcast: bool) -> None:
    """A state dict without the meta buffers (``strict=False``): the load cannot fill them."""
    model, sd = _meta_buffer_model()
    sd = {k: v for k, v in sd.items() if not k.startswith(("1.running_mean", "1.running_var"))}
    given = sd if not broadcast or dist.get_rank() == 0 else {}
    watched = [p.detach() for p in model.parameters()]
    before = [t.clone() for t in watched]
    try:
        fshard.load_state_dict(model, given, strict=False, broadcast_from_rank0=broadcast)
    finally:
        _unchanged(watched, before)


def _meta_buffer_filled_task(broadcast: bool) -> bool:
    """A state dict that holds them: the load gives them storage and fills them."""
    model, sd = _meta_buffer_model()
    fshard.load_state_dict(model, sd if not broadcast or dist.get_rank() == 0 else {}, broadcast_from_rank0=broadcast)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(model[1], name), sd[f"1.{name}"], rtol=0, atol=0)
    model.eval()(torch.randn(3, 6))
    return True


def _meta_buffer_materialized_task(broadcast: bool) -> bool:
    """What the error says to do: materialize, then load; the model then runs."""
    model, sd = _meta_buffer_model()
    fshard.materialize(model)
    fshard.load_state_dict(model, sd if not broadcast or dist.get_rank() == 0 else {}, broadcast_from_rank0=broadcast)
    torch.testing.assert_close(model[1].running_mean, sd["1.running_mean"], rtol=0, atol=0)
    model.eval()(torch.randn(3, 6))
    return True


@pytest.mark.parametrize("broadcast", [False, True], ids=["everywhere", "from_rank0"])
def test_a_buffer_left_on_the_meta_device_is_filled_or_an_error_naming_it(broadcast):
    """A load copies into the model's buffers, and a copy into a meta buffer does nothing
    (torch only warns): the load reported success and the forward failed. Now a meta buffer
    the state dict holds gets storage and its values ([Note: loading into a meta model]), and
    one it does not hold is an error on every rank, before anything is loaded."""
    message = _every_rank_raises_at_once(
        _meta_buffer_task,
        broadcast,
        patterns=[
            "2 buffer(s) are on the meta device and the state dict does not hold them ('1.running_mean', '1.running_var')",
            "fshard.materialize(model)",
        ],
    )
    assert "num_batches_tracked" not in message and "parameter" not in message, message
    assert all(get_pool(2).run(_meta_buffer_filled_task, broadcast))
    assert all(get_pool(2).run(_meta_buffer_materialized_task, broadcast))


class _WithTable(nn.Module):
    """A non-persistent buffer (a rotary table) used by the forward, also registered by a
    child: the same tensor under two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.child = nn.Module()
        self.child.register_buffer("table", self.table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table


def _meta_table_model(meta_on: int) -> nn.Module:
    torch.manual_seed(0)
    model = _WithTable()
    with torch.no_grad():
        model.table.mul_(3.0)  # a value no constructor gives: it must come from rank 0
    if dist.get_rank() == meta_on:
        table = torch.empty(4, device="meta")
        model.register_buffer("table", table, persistent=False)
        model.child.register_buffer("table", table, persistent=False)
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    return model


def _meta_non_persistent_buffer_task() -> torch.Tensor:
    model = _meta_table_model(meta_on=1)
    sd = fshard.full_state_dict(model, rank0_only=False)
    fshard.load_state_dict(model, sd if dist.get_rank() == 0 else {}, broadcast_from_rank0=True)
    assert model.table.device == torch.device("cpu")
    torch.testing.assert_close(model.table, torch.arange(4.0) * 3, rtol=0, atol=0)
    assert model.child.table is model.table  # still one tensor
    return model(torch.ones(2, 4)).detach()


def test_non_persistent_buffers_on_the_meta_device_take_rank0s_values():
    """``broadcast_from_rank0`` copies buffers no state dict holds from rank 0's model; a copy
    into a meta buffer did nothing, so a rank that built them on meta kept them there."""
    out0, out1 = get_pool(2).run(_meta_non_persistent_buffer_task)
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)


def _meta_non_persistent_buffer_on_rank0_task() -> None:
    model = _meta_table_model(meta_on=0)
    sd = {k: v.detach().clone() for k, v in fshard.full_state_dict(model, rank0_only=False).items()}
    fshard.load_state_dict(model, sd if dist.get_rank() == 0 else {}, broadcast_from_rank0=True)


def test_a_non_persistent_buffer_on_the_meta_device_on_rank0_is_an_error_on_every_rank():
    """Rank 0 cannot send a buffer it holds no data for: refused in the agreed checks, not
    torch's error on rank 0 alone with the other ranks waiting in the broadcast."""
    _every_rank_raises_at_once(
        _meta_non_persistent_buffer_on_rank0_task,
        patterns=["non-persistent buffer(s) are on the meta device on rank 0 ('table', 'child.table')", "torch.device('meta')"],
    )
