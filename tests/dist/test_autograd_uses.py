"""Autograd patterns at a unit's edges that plain PyTorch and DDP accept: tensor hooks on
parameters, a unit returning a view of its own parameter, an auxiliary loss left in a module
attribute, a unit changing its input in place. Each trains like DDP under fshard."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives
from tests.dist.test_memory import _MayFail
from tests.dist.test_usage_cases import _assert_params_equal, _beside_ddp, _sgd, _train_side_by_side

# --------------------------------------------------------------------- tensor hooks on parameters


def _mask(grad: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros_like(grad)
    keep[::2] = 1  # every other row of the full gradient
    return grad * keep


def _triple(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


def _never(grad: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a removed hook ran")


def _add_hooks(model: nn.Module, calls: list[tuple[int, ...]]) -> None:
    model[0].weight.register_hook(_mask)
    model[2].bias.register_hook(_triple)
    model[2].weight.register_hook(lambda g: calls.append(tuple(g.shape)))  # observes only
    model[0].bias.register_hook(_never).remove()


def _tensor_hooks_worker(mesh_shape: tuple[int, ...], when: str) -> bool:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    model = copy.deepcopy(reference)
    reference_calls: list[tuple[int, ...]] = []
    calls: list[tuple[int, ...]] = []
    _add_hooks(reference, reference_calls)
    if when == "before":
        _add_hooks(model, calls)
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    if when == "after":
        _add_hooks(model, calls)
    ddp = DDP(reference)
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4), steps=2)
    _assert_params_equal(model, reference)
    # The hook saw the full gradient, as under DDP, once per backward.
    assert calls == reference_calls == [(4, 6)] * 2, (calls, reference_calls)
    return True


@pytest.mark.parametrize("when", ["before", "after"], ids=lambda w: f"{w}-fully_shard")
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_tensor_hooks_on_parameters_equal_ddp(mesh_shape, when):
    """``p.register_hook`` on a parameter (a gradient mask, a scale) changes the gradient
    before it is reduced, as under DDP; autograd computes only the gathered copy's gradient,
    so fshard runs the parameter's hooks there. A removed hook stays removed."""
    assert all(get_pool(math.prod(mesh_shape)).run(_tensor_hooks_worker, mesh_shape, when))


# ------------------------------------------------------------------ views of a unit's parameter


class _Exposing(nn.Module):
    """Returns, beside its output, views of its own weight: a row, the transpose, the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = self.lin.weight
        return self.lin(x), w[0], w.t(), w


class _ExposingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Exposing()
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, row, wt, w = self.block(x)
        return self.head(h @ wt).pow(2).mean() + row.pow(2).sum() + 0.1 * w.sum()


def _param_views_worker(reshard_after_forward: bool) -> bool:
    ddp, model, reference = _beside_ddp(
        _ExposingNet, lambda m: [m.block], reshard_after_forward=reshard_after_forward
    )
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 5), steps=2, loss=lambda m, x: m(x))
    _assert_params_equal(model, reference)
    # Held past the backward and read after the unit was freed: still the values returned.
    x = torch.ones(2, 5)
    held = model.block(x)
    model(x).backward()
    expected = reference.block.lin.weight.detach()
    torch.testing.assert_close(held[1], expected[0])
    torch.testing.assert_close(held[2], expected.t())
    with torch.no_grad():  # and without grad
        _, row, _, whole = model.block(x)
    torch.testing.assert_close(row.clone(), expected[0])
    torch.testing.assert_close(whole.clone(), expected)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_unit_returning_views_of_its_parameters_equals_ddp(reshard_after_forward):
    """A unit may return a row, the transpose or the whole of its own gathered weight: the
    caller gets a copy that outlives the unit's freed memory (a view of it would read freed
    storage, or crash), and gradients through it are DDP's."""
    assert all(get_pool(2).run(_param_views_worker, reshard_after_forward))


# ---------------------------------------------------------- auxiliary losses left in attributes


class _Chain(nn.Module):
    """``inp``, then ``count`` blocks made by ``block`` (each a unit in these tests), then a head."""

    def __init__(self, block: Callable[[], nn.Module], count: int = 3, *, dim: int = 6, residual: bool = False) -> None:
        super().__init__()
        self.residual = residual
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block() for _ in range(count))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) + h if self.residual else block(h)
        return self.head(h)


class _Expert(nn.Module):
    """An MoE-style block: returns its hidden state and leaves its auxiliary losses, computed
    from its own parameters *after* the output, in attributes for the model to collect. With
    ``aux_start`` the z-loss is that number on the first step (switched on later), and there
    is no penalty (whose hook would gather the unit for the z-loss too)."""

    def __init__(self, aux_start: float | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.router = nn.Linear(6, 3)
        self.aux_start = aux_start
        self.penalty = aux_start is None
        self.aux: torch.Tensor | float | None = None
        self.extra_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.tanh(self.lin(x))
        if self.aux_start is not None:
            self.aux, self.aux_start = self.aux_start, None
        else:
            self.aux = self.router(out).logsumexp(-1).pow(2).mean()  # a z-loss on router logits
        if self.penalty:
            self.extra_losses = [self.router.weight.pow(2).sum()]  # a penalty, in a list
        return out


class _ExpertNet(_Chain):
    def __init__(self, aux_start: float | None = None) -> None:
        super().__init__(functools.partial(_Expert, aux_start))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        aux = sum(block.aux + 0.1 * sum(block.extra_losses) for block in self.blocks)
        return out.pow(2).mean() + 0.01 * aux


def _aux_worker(mesh_shape: tuple[int, ...], aux_start: float | None) -> bool:
    build = functools.partial(_ExpertNet, aux_start)
    ddp_kwargs = {"find_unused_parameters": aux_start is not None}  # no router on step 1
    ddp, model, reference = _beside_ddp(build, lambda m: m.blocks, mesh_shape=mesh_shape, ddp_kwargs=ddp_kwargs)
    _train_side_by_side((ddp, model), _sgd(ddp, model), (4, 6), steps=3, loss=lambda m, x: m(x))
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("aux_start", [None, 0.0])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_auxiliary_losses_left_in_module_attributes_equal_ddp(mesh_shape, aux_start):
    """Autograd may run the backward of a tensor the unit's forward left in an attribute
    before the unit's outputs get their gradient: fshard gathers the unit for it too, also
    where the attribute held a number before (its module's attribute count is unchanged)."""
    assert all(get_pool(math.prod(mesh_shape)).run(_aux_worker, mesh_shape, aux_start))


# ------------------------------------------------------------- a unit changing its input in place


class _InPlaceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.act(x))


def _in_place_input_worker(mesh_shape: tuple[int, ...]) -> str:
    ddp, model, _ = _beside_ddp(
        functools.partial(_Chain, _InPlaceFirst, 2, residual=True), lambda m: m.blocks, mesh_shape=mesh_shape
    )
    try:
        _train_side_by_side((ddp, model), _sgd(ddp, model), (4, 6), steps=1)
    except RuntimeError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("mesh_shape", [(2,)], ids=str)
def test_unit_changing_its_input_in_place_is_torchs_error(mesh_shape):
    """A unit's inputs pass through an identity autograd Function that tells when their
    gradients are ready (the moment its backward is done on every rank); changing one in place
    is torch's error naming that Function, as under FSDP2 (documented), not a wrong number."""
    for message in get_pool(math.prod(mesh_shape)).run(_in_place_input_worker, mesh_shape):
        assert "_InputsGradReady" in message and "inplace" in message, message


# ------------------------------------------------------------- rank-dependent and detached uses


class _Experts(nn.Module):
    """Every expert runs on rank 1; expert 1 never on rank 0 (a router's choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.detached = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        used = self.experts if dist.get_rank() == 1 else self.experts[:1]
        h = sum(torch.tanh(e(x)) for e in used)
        # A detached use of its own weight: its backward (for x) still reads the weight after
        # every gradient of the unit has arrived.
        g = torch.tanh(F.linear(h, self.detached.weight.detach()))
        return x + self.detached(g)


def _rank_dependent_worker() -> bool:
    ddp, model, reference = _beside_ddp(
        functools.partial(_Chain, _Experts), lambda m: m.blocks, ddp_kwargs={"find_unused_parameters": True}
    )
    _train_side_by_side((ddp, model), _sgd(ddp, model), (4, 6), steps=2)
    _assert_params_equal(model, reference)
    return True


def test_params_used_on_one_rank_and_detached_uses_equal_ddp():
    """A unit's backward ends when its inputs' gradients are ready, the same moment on every
    rank: counting arrived gradients would have ranks whose expert went unused reduce later
    than the others (a hang), and would free a unit whose detached weight is still needed."""
    assert all(get_pool(2).run(_rank_dependent_worker))


def _behind_frozen_input() -> nn.Module:
    """The first unit's input needs no grad (a frozen embedding, as in LoRA fine-tuning) and
    its experts are routed to per rank; the root has a param no rank uses."""
    chain = _Chain(_Experts, count=2)
    chain.inp.requires_grad_(False)
    chain.spare = nn.Linear(6, 6)
    return chain


def _frozen_input_worker() -> bool:
    ddp, model, reference = _beside_ddp(
        _behind_frozen_input, lambda m: m.blocks, ddp_kwargs={"find_unused_parameters": True}
    )
    _train_side_by_side((ddp, model), _sgd(ddp, model), (4, 6), steps=2)
    _assert_params_equal(model, reference)
    assert fshard.memory_stats().gathered_bytes == 0
    return True


def test_params_used_on_one_rank_in_a_unit_without_grad_requiring_inputs_equal_ddp():
    """A unit whose inputs need no grad has no moment shared by every rank before the
    backward ends: it is freed once its gradients arrived and reduced with the units left at
    the end, in one order on every rank (reducing it once its count was complete paired the
    wrong collectives on ranks where an expert went unused)."""
    assert all(get_pool(2).run(_frozen_input_worker))


class _Adapter(nn.Module):
    """A frozen base and a trainable expert that rank 0 alone routes to. Takes a tensor or, in
    a dict, ``{"h": tensor}``; ``two_outputs`` also returns a skip made before the expert."""

    def __init__(self, two_outputs: bool = False) -> None:
        super().__init__()
        self.two_outputs = two_outputs
        self.base = nn.Linear(6, 6).requires_grad_(False)
        self.expert = nn.Linear(6, 6)

    def forward(self, x):
        x = x["h"] if isinstance(x, dict) else x
        skip = x * 2
        h = torch.tanh(self.base(x)) + x
        if dist.get_rank() == 0:
            h = h + self.expert(h)
        return (h, skip) if self.two_outputs else h


class _OwnCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint of its own, as DeepSpeed and Megatron write theirs: the segment
    runs without grad in ``forward`` and again with grad in ``backward``."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class _NoMoment(nn.Module):
    """Units whose backward has no moment shared by every rank before it ends (an input in a
    dict, a reentrant checkpoint's forward run without grad, a call on a frozen embedding)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Linear(6, 6)
        self.inp = nn.Linear(6, 6)
        self.block = _Adapter(two_outputs=how == "dict_two_outputs")
        self.block2 = _Adapter()
        self.head = nn.Linear(6, 2)
        if how == "mixed_calls":
            self.embed.requires_grad_(False)
        if how == "segment_twice":
            self.block2.base.requires_grad_(True)  # no frozen param to keep it gathered anyway
        if how == "reentrant_frozen":  # a unit the backward prefetch passes over, recomputed
            self.block.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        if self.how == "dict":
            h = self.block({"h": h})
        elif self.how == "dict_two_outputs":
            out, skip = self.block({"h": h})
            h = out + skip
        elif self.how in ("reentrant", "reentrant_frozen"):
            h = checkpoint(self.block, h, use_reentrant=True)
        elif self.how == "reentrant_own":
            h = _OwnCheckpoint.apply(self.block, h)
        elif self.how == "reentrant_twice":
            h = checkpoint(self.block, checkpoint(self.block, h, use_reentrant=True), use_reentrant=True)
        elif self.how == "mixed_calls":
            h = self.block(self.embed(x)) * self.block(h)
        elif self.how == "segment_twice":  # block2's input needs no grad in the first forward
            segment = lambda t: self.block2(self.block(t))  # noqa: E731
            return self.head(checkpoint(segment, checkpoint(segment, h, use_reentrant=True), use_reentrant=True))
        return self.head(self.block2(h))


def _averaged_like_ddp(model: nn.Module) -> None:
    """DDP(find_unused_parameters=True)'s averaging by hand (DDP refuses a param that a
    reentrant checkpoint uses twice)."""
    for p in model.parameters():
        if p.requires_grad:
            seen = torch.tensor([float(p.grad is not None)])
            dist.all_reduce(seen)
            if seen.item():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / dist.get_world_size()


def _assert_grads_are_my_rows(model: nn.Module, reference: nn.Module) -> None:
    """Each sharded ``.grad`` equals this rank's rows (its shard-dim coordinate's torch.chunk)
    of the reference's averaged gradient (and is None where the reference's is)."""
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is None:
            continue
        mesh = p.device_mesh
        mine = q.grad.chunk(mesh.size(-1))[mesh.get_local_rank(-1)]
        torch.testing.assert_close(p.grad, mine, rtol=1e-5, atol=1e-6)


def _rank_batch(step: int, *shape: int) -> torch.Tensor:
    """This rank's input for ``step`` (different on every rank, the same in both models)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _step_like_ddp(model: nn.Module, reference: nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    """After both models' backward: average the reference's gradients as DDP does, compare the
    sharded ones with their rows, step both, and check nothing stays gathered."""
    _averaged_like_ddp(reference)
    _assert_grads_are_my_rows(model, reference)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    assert fshard.memory_stats().gathered_bytes == 0


def _no_moment_worker(how: str) -> bool:
    torch.manual_seed(0)
    reference = _NoMoment(how)
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    for unit in (model.block, model.block2):
        fshard.fully_shard(unit, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    opts = _sgd(reference, model)
    for step in range(2):
        x = _rank_batch(step, 4, 6)
        for m in (reference, model):
            m(x).pow(2).mean().backward()
        _step_like_ddp(model, reference, opts)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize(
    "how",
    [
        "dict",
        "dict_two_outputs",
        "reentrant",
        "reentrant_frozen",
        "reentrant_own",
        "reentrant_twice",
        "segment_twice",
        "mixed_calls",
    ],
)
def test_params_used_on_one_rank_in_units_without_a_moment_of_their_own(how):
    """Every rank reduces such a unit when the backward ends if it ran (not only the ranks
    where gradients arrived), gathers it again for a reentrant recompute on every rank (not
    only where its count was complete and it was freed), and skips the hook of an output made
    before its params were read on every rank: each was a hang."""
    assert all(get_pool(2).run(_no_moment_worker, how, timeout=60))


def _reentrant_order_worker(own: bool) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = _Chain(lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()), count=4)
    mesh = mesh_for((dist.get_world_size(),))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    inner = model.forward

    def checkpointed(x: torch.Tensor) -> torch.Tensor:
        h = model.inp(x)
        for block in model.blocks:
            h = _OwnCheckpoint.apply(block, h) if own else checkpoint(block, h, use_reentrant=True)
        return model.head(h)

    model.forward = checkpointed
    loss = model(torch.randn(3, 6)).pow(2).mean()
    with trace_collectives() as records:
        loss.backward()
    model.forward = inner
    return [(r.op, r.label) for r in records]


@pytest.mark.parametrize("own", [False, True], ids=["torch", "own_function"])
def test_reentrant_checkpointed_units_are_reduced_during_the_backward(own):
    """A reentrant checkpoint's recompute arms the unit's input waiter, so each block is
    reduced once its recompute's backward is done, not all at the end (which held every
    block's full gradients at once, DDP's memory). So with a checkpoint Function of one's own
    (DeepSpeed's, Megatron's): the forward without grad inside it is told from a target
    computed under a plain torch.no_grad() by the Function's ctx."""
    for records in get_pool(2).run(_reentrant_order_worker, own):
        order = [f"{op}:{label}" for op, label in records if label.startswith("blocks")]
        for i in (3, 2, 1):
            assert order.index(f"reduce_scatter:blocks.{i}") < order.index(f"all_gather:blocks.{i - 1}"), order


# ------------------------------------------------------- calling a part of the model on its own


class _Stack(nn.Module):
    """An encoder or decoder: blocks (units) between layers the root unit owns."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed  # shared with the other stack, owned by the root unit
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(6)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids)
        if memory is not None:
            h = h + memory.mean(dim=1, keepdim=True)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(11, 6)
        self.encoder = _Stack(self.shared)
        self.decoder = _Stack(self.shared)
        self.head = nn.Linear(6, 11)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(tgt, self.encoder(src)))


def _outside_calls_worker() -> bool:
    torch.manual_seed(0)
    reference = _EncoderDecoder()
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    for stack in (model.encoder, model.decoder):
        for block in stack.blocks:
            fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(dist.get_rank())
    src, tgt = torch.randint(0, 11, (2, 5), generator=gen), torch.randint(0, 11, (2, 4), generator=gen)
    with torch.no_grad():  # what generate does: the encoder first, on its own
        torch.testing.assert_close(model.encoder(src), reference.encoder(src))
    opts = _sgd(reference, model)
    for _ in range(2):
        for m in (reference, model):  # a training loop calling the stacks itself
            memory = m.encoder(src)
            m.decoder(tgt, memory).pow(2).mean().backward()
        for p in reference.parameters():  # as DDP would average (the head is unused here)
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), reference(src, tgt))
        torch.testing.assert_close(model.decoder(tgt, model.encoder(src)), reference.decoder(tgt, reference.encoder(src)))
    assert fshard.memory_stats().gathered_bytes == 0
    return True


def test_calling_a_stack_of_units_on_its_own_equals_the_plain_model():
    """transformers' generate calls ``model.get_encoder()(...)`` outside the model's forward,
    and training loops call an encoder and a decoder in turn: the root unit's layers they use
    (a shared embedding, a final norm) are gathered for such a call as for the model's forward."""
    assert all(get_pool(2).run(_outside_calls_worker))


# ------------------------------------------------------------------------ after a failed forward


def _failed_micro_batch_worker(reshard_after_forward: bool) -> bool:
    ddp, model, reference = _beside_ddp(
        functools.partial(_Chain, _MayFail, dim=16), lambda m: m.blocks, reshard_after_forward=reshard_after_forward
    )
    opts = _sgd(ddp, model)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for m in (ddp, model):
            m(x).pow(2).mean().backward()
        model.blocks[2].fail = True  # the next micro-batch fails in the last block; skipped
        with contextlib.suppress(RuntimeError):
            model(x * 2)
        model.blocks[2].fail = False
        for opt in opts:  # the step changes the weights the failed forward left gathered
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_training_on_after_a_failed_micro_batch_equals_ddp(reshard_after_forward):
    """Units a failed forward left gathered (kept ones too) are freed by the next forward, so
    it computes with the weights the optimizer stepped in between, not a stale copy."""
    assert all(get_pool(2).run(_failed_micro_batch_worker, reshard_after_forward))


def _hook_under_mixed_precision_worker() -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    mesh = mesh_for((2,))
    fshard.fully_shard(model[0], mesh=mesh, mp_policy=fshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    fshard.fully_shard(model, mesh=mesh)
    mask = torch.ones(6, 4)  # fp32, on a bf16 gradient: the result is promoted to fp32
    mask[::2] = 0
    model[0].weight.register_hook(lambda g: g * mask)
    model(torch.randn(3, 4)).sum().backward()
    grad = model[0].weight.grad
    full = torch.cat([torch.zeros_like(grad), grad]) if dist.get_rank() else grad
    rows = torch.arange(grad.shape[0]) + dist.get_rank() * grad.shape[0]
    return bool((grad[rows % 2 == 0] == 0).all()) and full.dtype == torch.float32


def test_a_tensor_hook_promoting_a_low_precision_gradient():
    """Under MixedPrecision the gathered copy's gradient is bf16; a hook returning fp32 (an
    fp32 mask) is cast back, as autograd requires, instead of failing."""
    assert all(get_pool(2).run(_hook_under_mixed_precision_worker))


# ------------------------------------------------------------- graphs kept from an earlier backward


class _Twice(nn.Module):
    """A block applied twice (weights shared across depth), between two layers of the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.inp(x))))


def _retained_backwards(model: nn.Module, x: torch.Tensor, pattern: str) -> None:
    if pattern == "two-losses":  # one forward, two losses, the first backward retains
        out = model(x)
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
    elif pattern == "first-then-both":  # two forwards; the first loss's backward, then both
        first, second = model(x).pow(2).mean(), model(x + 1).pow(2).mean()
        first.backward(retain_graph=True)
        (first + second).backward()
    elif pattern == "retain-forward-both":  # a retained backward, a new forward, both
        first = model(x).pow(2).mean()
        first.backward(retain_graph=True)
        (first + model(x + 1).pow(2).mean()).backward()
    else:  # "input-grad-then-backward": autograd.grad of the input (retained), then more
        x = x.clone().requires_grad_(True)
        first = model(x).pow(2).mean()
        (grad_x,) = torch.autograd.grad(first, x, retain_graph=True)
        (first + model(x + grad_x).pow(2).mean()).backward()


def _retained_worker(pattern: str, reshard_after_forward: bool) -> bool:
    torch.manual_seed(0)
    reference = _Twice()
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model.block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh)
    opts = _sgd(reference, model)
    for step in range(3):
        x = _rank_batch(step, 6, 4)
        for m in (reference, model):
            _retained_backwards(m, x, pattern)
        _step_like_ddp(model, reference, opts)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize(
    "pattern", ["two-losses", "first-then-both", "retain-forward-both", "input-grad-then-backward"]
)
def test_backward_through_a_graph_kept_from_an_earlier_backward(pattern, reshard_after_forward):
    """A backward that reaches a graph an earlier backward kept (``retain_graph=True``) or did
    not reach gathers the unit again and reduces it when it ends, adding to the gradients this
    backward reduced already, as the plain model accumulates them (the unit had been freed by
    the earlier backward, and the second backward read freed storage)."""
    assert all(get_pool(2).run(_retained_worker, pattern, reshard_after_forward, timeout=60))


# ------------------------------------------------------------- a failed backward under no_sync


def _bad_batch(grad: torch.Tensor) -> torch.Tensor:
    raise FloatingPointError("a micro-batch with NaNs")


def _failed_accumulation_worker(reduce_scatter: bool, fail_first: bool) -> bool:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[1], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    failing = 0 if fail_first else 1
    for k in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * k + dist.get_rank()))
        for m in (reference, model):
            out = m(x)
            if k == failing:
                out.register_hook(_bad_batch)  # raises before any parameter's gradient
            sync = contextlib.nullcontext() if m is reference or k == 2 else fshard.no_sync(model, reduce_scatter=reduce_scatter)
            with sync, contextlib.suppress(FloatingPointError):
                out.pow(2).mean().backward()
    _averaged_like_ddp(reference)
    _assert_grads_are_my_rows(model, reference)
    return True


@pytest.mark.parametrize("fail_first", [False, True], ids=["middle-fails", "first-fails"])
@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["full-sums", "sharded-sums"])
def test_a_failed_micro_batch_keeps_the_others_accumulated(reduce_scatter, fail_first):
    """Three micro-batches under ``no_sync``, the last synchronised; one backward raises (a
    NaN check) and is skipped: the gradients are the other two's, as an unsharded model's
    ``.grad`` accumulates them (the full sums kept under no_sync were dropped with the failed
    backward's partial gradients, leaving the last micro-batch's alone)."""
    assert all(get_pool(2).run(_failed_accumulation_worker, reduce_scatter, fail_first))


def _zero_grad_mid_accumulation_worker(mesh_shape: tuple[int, ...], reduce_scatter: bool) -> bool:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    fshard.fully_shard(model[1], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # What the docs say each mode does with micro-batch 0 when zero_grad() follows it.
    dropped = reduce_scatter and len(mesh_shape) == 1
    for k in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * k + dist.get_rank()))
        sync = fshard.no_sync(model, reduce_scatter=reduce_scatter) if k < 2 else contextlib.nullcontext()
        with sync:
            model(x).pow(2).mean().backward()
        if k > 0 or not dropped:
            reference(x).pow(2).mean().backward()
        if k == 0:
            opt.zero_grad()
    _averaged_like_ddp(reference)
    _assert_grads_are_my_rows(model, reference)
    return True


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["full-sums", "sharded-sums"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_zero_grad_between_micro_batches_keeps_or_drops_them_as_documented(mesh_shape, reduce_scatter):
    """``optimizer.zero_grad()`` after an unsynchronised micro-batch keeps it (the sum is
    fshard's until the synchronised backward), except with ``reduce_scatter=True`` on a 1D
    mesh, where nothing waits and each micro-batch's shard is in ``.grad`` at once (dropped,
    as FSDP2 does): the no_sync docstring and the guide say so."""
    assert all(get_pool(math.prod(mesh_shape)).run(_zero_grad_mid_accumulation_worker, mesh_shape, reduce_scatter))


class _SwitchableAdapter(nn.Module):
    """Switched off on some steps: returns its input as it got it (both as it is and, in a
    tuple, next to a result of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> Any:
        if self.how == "tuple":  # (its result must not have saved x, which the caller changes)
            return x, x + self.lin.bias if self.enabled else x * 2
        return self.lin(x) if self.enabled else x


class _ChangesUnitOutputInPlace(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.adapter = _SwitchableAdapter()
        self.adapter.how = how
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.adapter(self.inp(x))
        if isinstance(h, tuple):
            h[0][:, :3].mul_(2)  # a view of the returned input, changed in place
            return self.head(h[0] + h[1])
        return self.head(self.act(h))  # the parent's in-place ReLU on the unit's output


def _unit_output_changed_in_place_worker(how: str) -> bool:
    torch.manual_seed(0)
    reference = _ChangesUnitOutputInPlace(how)
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model.adapter, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    opts = _sgd(reference, model)
    for step in range(3):
        for m in (reference, model):
            m.adapter.enabled = step == 1
        x = _rank_batch(step, 4, 5)
        for m in (reference, model):
            m(x).tanh().sum().backward()
        _step_like_ddp(model, reference, opts)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("how", ["as-is", "tuple"])
def test_a_unit_returning_its_input_lets_the_caller_change_it_in_place(how):
    """A unit that returns its input as it got it (an adapter switched off): the parent's
    nn.ReLU(inplace=True) on it, or an in-place change of a slice of it, raised torch's
    "Output 0 of _InputsGradReady is a view and is being modified inplace" (fshard's private
    Function), where the plain model trains; now the unit hands back the tensor it was given."""
    assert all(get_pool(2).run(_unit_output_changed_in_place_worker, how))


# ------------------------------------------------------------------------------ torch.func.vmap


def _vmap_worker(reshard_after_forward: bool) -> bool:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[1], mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh)
    opts = _sgd(reference, model)
    for step in range(3):
        xs = _rank_batch(step, 2, 5, 4)
        for m in (reference, model):
            torch.func.vmap(m)(xs).pow(2).mean().backward()
        _step_like_ddp(model, reference, opts)
        with torch.no_grad():  # an evaluation under vmap between steps
            torch.testing.assert_close(torch.func.vmap(model)(xs), torch.func.vmap(reference)(xs))
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_vmap_over_the_model_then_backward_equals_the_plain_model(reshard_after_forward):
    """A unit run inside ``torch.func.vmap`` returns batched wrappers, whose hooks the backward
    outside the transform never runs: the unit stays gathered for that backward, which reduces
    and frees it (it was freed after its forward and never gathered again: the backward read
    freed storage)."""
    assert all(get_pool(2).run(_vmap_worker, reshard_after_forward))


# ------------------------------------------------------- retrying a backward that raised


class _FailsOnce(nn.Module):
    """Two blocks, and a hook between them that raises in the first backward only (an
    out-of-memory error half-way through the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.low = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.high = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.failures = 0

    def _maybe_fail(self, grad: torch.Tensor) -> torch.Tensor:
        if self.failures:
            self.failures -= 1
            raise MemoryError("out of memory (simulated)")
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.low(self.inp(x))
        h.register_hook(self._maybe_fail)  # after high's and head's backward, before low's
        return self.head(self.high(h))


def _retry_worker(reshard_after_forward: bool) -> bool:
    torch.manual_seed(0)
    reference = _FailsOnce()
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    for block in (model.low, model.high):
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh)
    opts = _sgd(reference, model)
    for step in range(3):
        x = _rank_batch(step, 6, 4)
        for m, opt in zip((reference, model), opts, strict=True):
            loss = m(x).pow(2).mean()
            m.failures = 1 if step != 1 else 0
            with contextlib.suppress(MemoryError):
                loss.backward(retain_graph=True)
            if step != 1:  # the same graph again, from clean gradients
                opt.zero_grad()
                loss.backward()
        _step_like_ddp(model, reference, opts)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_retrying_a_backward_that_raised_equals_the_plain_model(reshard_after_forward):
    """A backward through a retained graph raises half-way (caught as an out-of-memory error)
    and is run again: fshard sees that the first one ended (the engine dropped its end-of-
    backward callback) and starts clean, so the retry gathers the units the first reduced and
    freed (it read their freed storage)."""
    assert all(get_pool(2).run(_retry_worker, reshard_after_forward))


class _FailBetween(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a backward fails between two units."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailBetween.armed:
            raise FloatingPointError("a micro-batch with NaNs")
        return grad


class _Four(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.head = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c(self.b(_FailBetween.apply(self.a(x)))))


def _failed_sync_worker(mesh_shape: tuple[int, ...], reduce_scatter: bool) -> bool:
    torch.manual_seed(0)
    reference = _Four()
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    for unit in (model.a, model.b, model.c, model):
        fshard.fully_shard(unit, mesh=mesh)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + k)) for k in range(4)]
    for m in (reference, model):
        sync = fshard.no_sync(m, reduce_scatter=reduce_scatter) if m is model else contextlib.nullcontext()
        with sync:
            for x in xs[:2]:
                m(x).pow(2).sum().backward()
        _FailBetween.armed = True  # the synchronised micro-batch fails after c's and b's backward
        try:
            with contextlib.suppress(FloatingPointError):
                m(xs[2]).pow(2).sum().backward()
        finally:
            _FailBetween.armed = False
        m(xs[3]).pow(2).sum().backward()  # the next one, without zero_grad
    _averaged_like_ddp(reference)
    _assert_grads_are_my_rows(model, reference)
    return True


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["full-sums", "sharded-sums"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_a_failed_synchronised_backward_keeps_the_no_sync_sums(mesh_shape, reduce_scatter):
    """Two micro-batches under ``no_sync``, then the synchronised one raises half-way, after
    some units issued their reduce-scatters: those land (they carry the earlier sums), so the
    gradients are an unsharded model's, which keeps every sum and the failed backward's partial
    gradients (dropped with the reduces in flight, the earlier micro-batches were lost)."""
    assert all(get_pool(math.prod(mesh_shape)).run(_failed_sync_worker, mesh_shape, reduce_scatter))


def _hook_raising_at_the_end_worker() -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[1], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    fail = [True]

    def step_in_backward(param: torch.Tensor) -> None:  # an optimizer-in-backward step
        if fail[0]:
            raise RuntimeError("the step in backward failed")

    model[2].weight.register_post_accumulate_grad_hook(step_in_backward)
    outcomes = []
    for _ in range(3):
        try:
            model(torch.randn(4, 8)).pow(2).sum().backward()
            outcomes.append(f"ok {fshard.memory_stats().gathered_bytes}")
        except RuntimeError as exc:
            outcomes.append(str(exc))
        fail[0] = False
    return outcomes


def test_a_gradient_hook_raising_as_gradients_land_leaves_the_next_step_clean():
    """A hook on a sharded parameter's gradient runs as the end of the backward lands it; when
    it raises, the units are freed as after any failed backward (the next backward read a unit
    left half-way and its freed storage)."""
    for outcomes in get_pool(2).run(_hook_raising_at_the_end_worker):
        assert outcomes == ["the step in backward failed", "ok 0", "ok 0"], outcomes
