"""CPU offload equals the plain run exactly; meta-device init equals eager init exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fshard
from fshard.testing import get_pool, mesh_for
from fshard.testing.models import (
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)
from tests.dist.probes import PinProbe

SPEC = TransformerSpec(vocab=31, dim=12, heads=3, layers=2, seq=6, batch_size=3)


def _train(mesh_shape, offload, mp):
    rank = dist.get_rank()
    model = build_model(SPEC)
    kwargs = {"offload_policy": fshard.CPUOffload(pin_memory=True) if offload else None}
    if mp:
        kwargs["mp_policy"] = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = mesh_for(mesh_shape)
    with PinProbe() as pins:  # what offload does that a CPU run can see: it asks for pinned shards
        shard_model(SPEC, model, mesh, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = compute_loss(SPEC, model, make_batch(SPEC, step, rank))
        loss.backward()
        devices = {str(p.device) for p in model.parameters()} | {str(p.grad.device) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {n: p.to_local().clone() for n, p in model.named_parameters()}
    # After training (the optimizer updated the shards in place): which shards live in pinned
    # memory, and how many pinned buffers (one flat shard per unit and dtype) fshard asked for.
    pinned = sorted(n for n, p in model.named_parameters() if p.numel() and pins.holds(p.to_local()))
    nonempty = sorted(n for n, p in model.named_parameters() if p.numel())
    units = len(fshard.units(model))
    return losses, state, devices, (len(pins.ranges), units, pinned, nonempty)


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (4, 1)], ids=str)
def test_cpu_offload_equals_plain_run_exactly(mesh_shape, mp):
    """The same numbers; and what offload must do that a CPU run can see: every shard lives in a
    pinned host buffer, one per unit (fshard asks for none without offload). On CPU the shards'
    device and the copies to the compute device are the same with and without offload, so a
    shard placed on the mesh's device despite offload is found on a GPU run only."""
    plain = get_pool(4).run(_train, mesh_shape, False, mp)
    offloaded = get_pool(4).run(_train, mesh_shape, True, mp)
    for (losses, state, _, plain_pins), (off_losses, off_state, devices, off_pins) in zip(plain, offloaded, strict=True):
        assert off_losses == losses
        assert devices == {"cpu"}  # shards and their gradients live on the host
        for name, value in state.items():
            assert torch.equal(off_state[name], value), name
        assert plain_pins[0] == 0 and plain_pins[2] == []  # no pinned memory without offload
        requests, units, pinned, nonempty = off_pins
        assert requests == units and pinned == nonempty, off_pins  # one float32 bucket per unit


# --------------------------------------------------------------------------- meta-device init


class TiedLM(nn.Module):
    """Standard layers only, so every module has reset_parameters; the head is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 10), nn.Linear(10, 6)) for _ in range(2))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.empty(6))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # this module's own tensors only: the buffer
        nn.init.ones_(self.scale)

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class Recorder(TorchDispatchMode):
    """Largest tensor (in elements) any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def _shard_tied(model, mesh):
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)


def _meta_init_worker(mesh_shape, seed):
    mesh = mesh_for(mesh_shape)
    torch.manual_seed(seed)
    eager = TiedLM()
    _shard_tied(eager, mesh)
    torch.manual_seed(seed)
    with torch.device("meta"):
        lazy = TiedLM()
    _shard_tied(lazy, mesh)
    recorder = Recorder()
    with recorder:
        fshard.materialize(lazy)
    rng_after = torch.rand(3)  # the generator advanced exactly as in eager construction
    torch.manual_seed(seed)
    TiedLM()
    rng_eager = torch.rand(3)
    eager_full = {n: p.full_tensor() for n, p in eager.named_parameters()}
    lazy_full = {n: p.full_tensor() for n, p in lazy.named_parameters()}
    tokens = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(dist.get_rank()))
    lazy(tokens).sum().backward()  # and it trains
    biggest_param = max(p.full_shape.numel() for p in lazy.parameters())
    whole_model = sum(p.full_shape.numel() for p in lazy.parameters())
    return (
        eager_full,
        lazy_full,
        torch.equal(rng_after, rng_eager),
        recorder.largest,
        biggest_param,
        whole_model,
        torch.equal(lazy.scale, torch.ones(6)),
        lazy.head.weight is lazy.embed.weight,
    )


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3,)], ids=str)
def test_materialize_equals_eager_init(mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    for eager, lazy, same_rng, largest, biggest_param, whole, buffer_ok, tied in get_pool(world).run(
        _meta_init_worker, mesh_shape, 7
    ):
        assert eager.keys() == lazy.keys()
        for name in eager:
            assert torch.equal(eager[name], lazy[name]), name
        assert same_rng and buffer_ok and tied
        # One module's parameters at a time, never the whole model.
        assert largest <= biggest_param < whole


def _custom_init(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()
    elif hasattr(module, "scale"):
        module.scale.fill_(2.0)


def _init_fn_worker():
    mesh = mesh_for((2,))
    with torch.device("meta"):
        lazy = TiedLM()
    _shard_tied(lazy, mesh)
    torch.manual_seed(3)
    fshard.materialize(lazy, init_fn=_custom_init)
    # Reference: the same init_fn over the full model, in the same module order.
    with torch.device("meta"):
        ref = TiedLM()
    ref.to_empty(device="cpu")
    torch.manual_seed(3)
    seen = set()
    for module in _children_first(ref):
        own = [id(p) for p in module.parameters(recurse=False)]
        if own and all(i in seen for i in own) and not module._buffers:
            saved = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}
            _custom_init(module)  # advances the RNG like materialize's scratch run
            with torch.no_grad():
                for n, p in module.named_parameters(recurse=False):
                    p.copy_(saved[n])
        elif own or module._buffers:
            _custom_init(module)
        seen.update(own)
    return {n: p.full_tensor() for n, p in lazy.named_parameters()}, dict(ref.named_parameters()), lazy.scale.clone()


def test_materialize_with_init_fn():
    for lazy, ref, scale in get_pool(2).run(_init_fn_worker):
        for name, value in lazy.items():
            assert torch.equal(value, ref[name].detach()), name
        assert torch.equal(scale, torch.full((6,), 2.0))


def _children_first(module):
    for child in module.children():
        yield from _children_first(child)
    yield module


class Scaled(nn.Module):
    """Own parameters next to a child's, initialised at the end of ``__init__`` as torch's own
    modules do: eager construction initialises the child first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.scale = nn.Parameter(torch.empty(6))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)


class InitOrderNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaled = Scaled()
        self.layer = nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.extra = nn.Linear(6, 3)  # left unsharded through ignored_params


def _init_order_worker():
    mesh = mesh_for((dist.get_world_size(),))
    torch.manual_seed(5)
    eager = InitOrderNet()
    with torch.device("meta"):
        lazy = InitOrderNet()
    fshard.fully_shard(lazy.layer, mesh=mesh)
    fshard.fully_shard(lazy, mesh=mesh, ignored_params={lazy.extra.weight})
    torch.manual_seed(5)
    fshard.materialize(lazy)
    for name, p in lazy.named_parameters():
        value = p.full_tensor() if fshard.is_sharded(p) else p
        assert not value.is_meta and torch.equal(value, eager.get_parameter(name).detach()), name
    return True


def test_materialize_initialises_children_first_and_ignored_params():
    """A module's own params are initialised after its children's (eager order), torch modules
    with ``_reset_parameters`` (MultiheadAttention) work, and ignored meta params get storage."""
    assert all(get_pool(2).run(_init_order_worker))


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))


def _no_reset_worker():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), NoReset())
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    fshard.materialize(model)


def test_materialize_names_modules_it_cannot_initialise():
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_no_reset_worker)
    for exc in info.value.errors.values():
        assert isinstance(exc, ValueError)
        assert "module '1' (NoReset) owns meta parameters" in str(exc) and "init_fn" in str(exc)


class DrawsIntoChild(nn.Module):
    """A parent whose initialiser draws a submodule's weight too (``how``: through
    ``nn.init``, or Hugging Face style through ``.data``) and fills the submodule's bias."""

    def __init__(self, how: str = "init") -> None:
        super().__init__()
        self.how = how
        self.child = nn.Linear(6, 8)
        self.scale = nn.Parameter(torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)
        nn.init.zeros_(self.child.bias)  # a fill: the same rows sharded or not
        if self.how == "init":
            nn.init.xavier_uniform_(self.child.weight)
        elif self.how == "data":
            self.child.weight.data.normal_(std=0.02)
        elif self.how == "setitem":
            with torch.no_grad():
                self.child.weight[:] = torch.randn(self.child.weight.shape)
        elif self.how == "scale":  # elementwise (GPT-2's scaled residual projections): fine
            with torch.no_grad():
                self.child.weight.mul_(0.5).clamp_(-0.1, 0.1)


def _draws_into_child_worker(how: str):
    torch.manual_seed(0)
    eager = DrawsIntoChild(how)
    with torch.device("meta"):
        lazy = DrawsIntoChild(how)
    fshard.fully_shard(lazy, mesh=mesh_for((2,)))
    torch.manual_seed(0)
    fshard.materialize(lazy)
    return all(torch.equal(p.full_tensor(), eager.get_parameter(n)) for n, p in lazy.named_parameters())


@pytest.mark.parametrize("how, op", [("init", "uniform_"), ("data", "normal_"), ("setitem", "__setitem__")])
def test_materialize_refuses_an_initialiser_drawing_into_a_submodules_shard(how, op):
    """The parent's initialiser runs after its child was sharded: its draws filled the shard
    (the same numbers on every rank; xavier's fan from the shard's shape), silently unlike
    eager init."""
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_draws_into_child_worker, how)
    for exc in info.value.errors.values():
        assert isinstance(exc, ValueError), exc
        message = str(exc)
        assert "DrawsIntoChild.reset_parameters() of module '<root>'" in message, message
        assert f"'child.weight' ({op})" in message and "'child.bias'" not in message, message


@pytest.mark.parametrize("how", ["fills only", "scale"])
def test_materialize_lets_an_initialiser_change_a_submodules_shard_elementwise(how):
    """Fills and elementwise changes (a parent scaling its child's weight, GPT-2 style) give
    the same rows sharded or not: materialize equals eager init."""
    assert get_pool(2).run(_draws_into_child_worker, how) == [True, True]


class InitsChildren(nn.Module):
    """Owns no parameters; eager construction runs its initialiser over its children (as
    nn.Transformer's ``_reset_parameters`` does), which materialize cannot repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.normal_(self.a.weight, std=10.0)


def _skipped_initialiser_worker():
    import warnings

    with torch.device("meta"):
        model = nn.Sequential(InitsChildren(), nn.Linear(4, 2))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fshard.materialize(model)
    return [(str(w.message), w.filename) for w in caught if "fshard.materialize" in str(w.message)]


def test_materialize_warns_about_an_initialiser_it_does_not_run():
    for warned in get_pool(2).run(_skipped_initialiser_worker):
        assert len(warned) == 1, warned
        messages = [message for message, _ in warned]
        assert warned[0][1] == __file__  # the user's call, not fshard's or torch's file
        assert "module(s) '0' (InitsChildren)" in messages[0] and "init_fn" in messages[0]


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0])


def _rnn_meta_worker():
    mesh = mesh_for((2,))
    torch.manual_seed(0)
    eager = Recurrent()
    with torch.device("meta"):
        lazy = Recurrent()
    for model in (eager, lazy):
        fshard.fully_shard(model.gru, mesh=mesh)
        fshard.fully_shard(model, mesh=mesh)
    torch.manual_seed(0)
    fshard.materialize(lazy)
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    outputs = [model(x) for model in (eager, lazy)]
    for out in outputs:
        out.sum().backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (eager, lazy)]
    return torch.equal(*outputs) and all(torch.equal(g, grads[1][n]) for n, g in grads[0].items())


def test_materialize_gives_an_rnn_its_storage():
    """nn.GRU / nn.LSTM keep weak references to their parameters, which
    torch.utils.swap_tensors refuses: materialize raised torch's "Cannot swap t1 because it has
    weakref associated with it", leaving the model half materialized."""
    assert get_pool(2).run(_rnn_meta_worker) == [True, True]


def _partly_meta_worker(own_unit: bool):
    torch.manual_seed(0)
    pretrained = nn.Linear(4, 6)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model[0].load_state_dict(pretrained.state_dict(), assign=True)  # a loaded backbone, a new head
    mesh = mesh_for((2,))
    if own_unit:
        fshard.fully_shard(model[1], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.materialize(model)
    return torch.equal(model[0].weight.full_tensor(), pretrained.weight.detach()) and not any(
        p.is_meta for p in model.parameters()
    )


def test_a_unit_with_meta_and_loaded_parameters_is_refused():
    """Its flat shard was made on meta: the loaded values were dropped (materialize drew new
    ones), or, with the loaded parameter first, torch's "Cannot copy out of meta tensor"."""
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_partly_meta_worker, False)
    for exc in info.value.errors.values():
        assert isinstance(exc, ValueError), exc
        assert "parameters '1.weight', '1.bias' are on the meta device but '0.weight', '0.bias' hold values" in str(exc)
    # The way the message gives: the meta ones in a unit of their own.
    assert get_pool(2).run(_partly_meta_worker, True) == [True, True]
