"""One unit made of several modules: ``fully_shard([model.norm, model.output])``.

The torchtitan layout: the final norm and the output head share one all-gather and one
reduce-scatter instead of riding in the root (gathered for the whole forward) or making two
tiny units. Checked against DDP, for its collectives, its errors and its state dict.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fshard
from fshard.testing import (
    RanksFailed,
    assert_equivalent_to_ddp,
    get_pool,
    mesh_for,
    trace_collectives,
)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class _LM(nn.Module):
    """Embedding, blocks, final norm and output head; ``skip_head`` returns the normed hidden
    state (the head does not run); ``recompute`` runs norm and head under a checkpoint."""

    def __init__(self, vocab: int = 11, dim: int = 8, layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.embed.weight
        self.skip_head = False
        self.recompute = False

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return h if self.skip_head else self.output(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        if self.recompute:
            return checkpoint(self._tail, h, use_reentrant=False)
        return self._tail(h)


def _lm(tied: bool = False, recompute: bool = False) -> _LM:
    torch.manual_seed(0)
    model = _LM(tied=tied)
    model.recompute = recompute
    return model


def _shard_titan(model: _LM, mesh, reshard_after_forward: bool = True) -> None:
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    returned = fshard.fully_shard(
        [model.norm, model.output], mesh=mesh, reshard_after_forward=reshard_after_forward
    )
    assert returned == [model.norm, model.output]
    fshard.fully_shard(model, mesh=mesh)


def _tokens(step: int, rank: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(0, 11, (2, 5), generator=g),)


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    logits = model(*batch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[0].reshape(-1))


@pytest.mark.parametrize(
    "mesh_shape,reshard_after_forward,tied,recompute,grad_accum",
    [
        ((2,), True, False, False, 1),
        ((4,), True, True, False, 2),
        ((2, 2), False, False, False, 1),
        ((3,), True, False, True, 1),
        ((2,), False, True, True, 2),
    ],
    ids=str,
)
def test_a_unit_of_several_modules_trains_like_ddp(mesh_shape, reshard_after_forward, tied, recompute, grad_accum):
    """Untied, and tied (the head's weight is the embedding's: it moves to the root, leaving
    the unit the norm alone); ZeRO-3 and ZeRO-2; 1D and 2D; the tail recomputed in backward."""
    world = 1
    for size in mesh_shape:
        world *= size
    report = assert_equivalent_to_ddp(
        functools.partial(_lm, tied, recompute),
        batch_fn=_tokens,
        loss_fn=_lm_loss,
        shard_fn=functools.partial(_shard_titan, reshard_after_forward=reshard_after_forward),
        optim_fn=functools.partial(torch.optim.AdamW, lr=1e-2),
        world_size=world,
        mesh_shape=mesh_shape,
        steps=3,
        grad_accum=grad_accum,
        clip_grad_norm=1.0,
    )
    assert report.params_sharded


def _collectives_worker():
    model = _lm()
    _shard_titan(model, mesh_for((2,)))
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(2):
        with trace_collectives() as records:
            _lm_loss(model, _tokens(step, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
        steps.append([(r.op, r.label) for r in records if r.op in ("all_gather", "reduce_scatter")])
    states = {}

    def seen(name):  # what the head sees between the norm and itself: the gathered weight
        def hook(module, args):
            states[name] = tuple(module.weight.shape)

        return hook

    model.output.register_forward_pre_hook(seen("output"))
    model.norm.register_forward_pre_hook(seen("norm"))
    with torch.no_grad():
        with trace_collectives() as records:
            model(*_tokens(5, dist.get_rank()))
    inference = [(r.op, r.label) for r in records if r.op == "all_gather"]
    return steps, inference, states, tuple(model.output.weight.shape), dist.get_rank()


def test_a_unit_of_several_modules_gathers_and_reduces_once_per_pass():
    """One all-gather in forward (not one per module), one in backward, one reduce-scatter;
    after the forward the modules hold their shards again."""
    for steps, inference, states, after, rank in get_pool(2).run(_collectives_worker):
        for records in steps:
            unit = [r for r in records if r[1] == "norm+output"]
            assert unit == [("all_gather", "norm+output")] * 2 + [("reduce_scatter", "norm+output")], records
        assert inference.count(("all_gather", "norm+output")) == 1, inference
        assert states == {"norm": (8,), "output": (11, 8)}
        assert after == [(6, 8), (5, 8)][rank]  # this rank's rows of the (11, 8) head


def _skip_head_worker():
    """A forward in which the head does not run (the same on every rank): the unit is freed at
    the end of the model's forward, gathered again for the norm's backward, and the next
    forward (with the head) gathers once again."""
    model = _lm()
    _shard_titan(model, mesh_for((2,)))
    reference = _lm()
    ddp = torch.nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ddp)]
    for step in range(3):
        skip = step == 1
        for m in (model, reference):
            m.skip_head = skip
        batch = _tokens(step, dist.get_rank())
        losses = []
        for m, opt in zip((model, ddp), opts, strict=True):
            out = m(*batch)
            loss = out.pow(2).mean() if skip else _lm_loss(m, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, (step, losses)
    full = fshard.full_state_dict(model, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
    return True


def test_a_module_of_the_unit_that_does_not_run_in_a_forward():
    assert get_pool(2).run(_skip_head_worker) == [True, True]


def _state_dict_worker():
    model = _lm()
    plain = _lm()
    _shard_titan(model, mesh_for((2,)))
    full = fshard.full_state_dict(model, rank0_only=False)
    assert list(full) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(full[name], value, msg=name)
    sharded = fshard.state_dict(model)
    fresh = _lm()
    torch.manual_seed(7)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    _shard_titan(fresh, mesh_for((2,)))
    fshard.load_state_dict(fresh, sharded)
    again = fshard.full_state_dict(fresh, rank0_only=False)
    return all(torch.equal(again[k], full[k]) for k in full)


def test_a_unit_of_several_modules_keeps_the_state_dict_of_the_unsharded_model():
    assert get_pool(2).run(_state_dict_worker) == [True, True]


def _root_of_several_worker():
    model = _lm()
    fshard.fully_shard([model.norm, model.output], mesh=mesh_for((2,)))  # and no root unit
    model(*_tokens(0, dist.get_rank()))


def _every_rank_raises(worker, *needles: str) -> None:
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(worker)
    assert sorted(info.value.errors) == [0, 1]
    for exc in info.value.errors.values():
        assert isinstance(exc, ValueError)
        assert all(needle in str(exc) for needle in needles), str(exc)


def test_a_unit_of_several_modules_without_a_root_is_named():
    _every_rank_raises(
        _root_of_several_worker,
        "the unit of modules [LayerNorm, Linear] ran (or was used: ",
        "before the model's first forward",
        "call fully_shard on the model too, after its blocks, if you have not",
    )


def _outside_the_root_worker():
    model, other = _lm(), _lm()
    mesh = mesh_for((2,))
    fshard.fully_shard([model.norm, other.output], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    model(*_tokens(0, dist.get_rank()))


def test_a_unit_with_a_module_outside_the_model_is_named():
    _every_rank_raises(_outside_the_root_worker, "has ['Linear'] outside the root model")


def test_bad_lists_are_named_before_anything_is_sharded():
    model = _lm()
    with pytest.raises(ValueError, match=r"fully_shard\(\[\]\): the list of modules is empty"):
        fshard.fully_shard([])
    with pytest.raises(TypeError, match=r"item \[1\] is a Tensor, not an nn.Module"):
        fshard.fully_shard([model.norm, torch.zeros(2)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"module \[1\] is module \[0\] again"):
        fshard.fully_shard([model.norm, model.norm])
    with pytest.raises(ValueError, match=r"module \[1\] \(Linear\) is inside module \[0\] \(_Block\)"):
        fshard.fully_shard([model.blocks[0], model.blocks[0].fc])
    with pytest.raises(ValueError, match=r"a ModuleList has no forward, .* pass them as a list"):
        fshard.fully_shard([model.blocks, model.norm])
    with pytest.raises(TypeError, match=r"expects an nn.Module \(or a list of them, to make one unit\), got dict"):
        fshard.fully_shard({"norm": model.norm})  # type: ignore[arg-type]
    assert not any(fshard.is_sharded(p) for p in model.parameters())


def _already_a_unit_worker():
    model = _lm()
    mesh = mesh_for((2,))
    fshard.fully_shard(model.output, mesh=mesh)
    with pytest.raises(ValueError, match=r"module \[1\] \(Linear\) is already sharded"):
        fshard.fully_shard([model.norm, model.output], mesh=mesh)
    fshard.fully_shard([model.norm, model.blocks[1]], mesh=mesh)
    with pytest.raises(ValueError, match=r"parameter '\[0\]\.weight' is already sharded by a unit above"):
        fshard.fully_shard([model.blocks[1].norm, model.embed], mesh=mesh)
    return True


def test_a_list_with_a_unit_or_a_module_inside_one_is_refused():
    assert get_pool(2).run(_already_a_unit_worker) == [True, True]


def _meta_worker():
    with torch.device("meta"):
        model = _LM()
    _shard_titan(model, mesh_for((2,)))
    torch.manual_seed(0)
    fshard.materialize(model)
    full = fshard.full_state_dict(model, rank0_only=False)
    plain = _lm()  # seeds 0 and builds on the CPU: the same draws, in module order
    return {k: bool(torch.equal(full[k], v)) for k, v in plain.state_dict().items()}


def test_a_unit_of_several_modules_built_on_meta_materializes_like_the_plain_model():
    for result in get_pool(2).run(_meta_worker):
        assert all(result.values()), result


class _Tail(nn.Module):
    """Calls the head it is given (not a submodule: as transformers passes a shared embedding)
    and then reads its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return self.proj(torch.tanh(head(self.ln(h))))


class _TailAroundABlock(nn.Module):
    """Runs another unit (``block``) between its own layers and the head it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, block: nn.Module, head: nn.Module) -> torch.Tensor:
        return self.b(torch.tanh(head(block(self.a(h)))))


class _CallsInside(nn.Module):
    def __init__(self, around_block: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.tail = _TailAroundABlock() if around_block else _Tail()
        self.block = _Block(8)
        self.head = nn.Linear(8, 8)
        self.around_block = around_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.around_block:
            return self.tail(h, self.block, self.head)
        return self.tail(self.block(h), self.head)


def _nested_worker(reshard_after_forward, around_block):
    model, reference = _CallsInside(around_block), _CallsInside(around_block)
    mesh = mesh_for((2,))
    fshard.fully_shard(model.block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard([model.tail, model.head], mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ddp)]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for m, opt in zip((model, ddp), opts, strict=True):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    full = fshard.full_state_dict(model, rank0_only=False)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("around_block", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_module_of_the_unit_called_inside_another_of_its_modules(reshard_after_forward, around_block):
    """The inner call's end is not the unit's: the outer module goes on with the gathered
    parameters (freeing them there made it compute with this rank's shard: a shape error),
    and its backward too (the inner call's own inputs told the unit its backward was done, and
    the block's backward, run in between, freed it: "out of bounds for storage of size 0")."""
    for diff in get_pool(2).run(_nested_worker, reshard_after_forward, around_block):
        assert diff < 1e-6


class _Apart(nn.Module):
    """``order`` names the modules the forward calls, in turn (``extra`` twice, say)."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(_Block(8) for _ in range(3))
        self.extra = nn.LayerNorm(8)
        self.output = nn.Linear(8, 11)
        self.order = order

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for name in self.order:
            h = self.blocks[int(name)](h) if name.isdigit() else getattr(self, name)(h)
        return self.output(h)


def _gathers_worker(listed, order):
    model = _Apart(order)
    mesh = mesh_for((2,))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard([getattr(model, name) for name in listed], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(3):
        with trace_collectives() as forward:
            loss = _lm_loss(model, _tokens(step, dist.get_rank()))
        after_forward = fshard.memory_stats().gathered_bytes
        with trace_collectives() as backward:
            loss.backward()
        opt.step()
        opt.zero_grad()
        steps.append(
            (
                [r.label for r in forward if r.op == "all_gather"],
                [r.label for r in backward if r.op == "all_gather"],
                after_forward,
            )
        )
    return steps


@pytest.mark.parametrize(
    "listed,order,unit",
    [
        (("embed", "output"), ("0", "1", "2"), "embed+output"),  # far apart
        (("extra", "output"), ("0", "extra", "1", "2", "extra"), "extra+output"),  # one runs twice
    ],
    ids=["far-apart", "called-twice"],
)
def test_a_unit_of_several_modules_gathers_the_same_every_step(listed, order, unit):
    """Prefetch is once per model forward, at a unit's first call (the later modules of a unit
    prefetched the unit after its first one, run and freed already, and held it through the
    backward); a unit whose module runs again after its last one is freed at the end of the
    model's forward, so its backward gathers it again, as in the step that recorded the order."""
    for steps in get_pool(2).run(_gathers_worker, listed, order):
        first_forward, first_backward, first_after = steps[0]
        for forward, backward, after in steps[1:]:
            assert sorted(forward) == sorted(first_forward), (forward, first_forward)
            assert sorted(backward) == sorted(first_backward), (backward, first_backward)
            assert after == first_after
        assert first_forward.count(unit) == 1, first_forward
        assert unit in first_backward, first_backward  # freed after forward: gathered again
