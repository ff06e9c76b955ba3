"""Ways of using a model that reach past the common path: parameters used on some ranks only,
tensors reaching a unit other than as arguments, dataclass outputs, and the uses fshard cannot
support, which must be clear errors rather than wrong numbers or a crash in autograd."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fshard
from fshard.testing import get_pool, mesh_for


def _assert_params_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _batch(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _sgd(*models: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]


def _square_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _beside_ddp(
    build: Callable[[], nn.Module],
    units: Callable[[nn.Module], Iterable[nn.Module]],
    *,
    mesh_shape: tuple[int, ...] | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
    **unit_kwargs: Any,
) -> tuple[DDP, nn.Module, nn.Module]:
    """``(ddp, model, reference)``: the model built with seed 0 under DDP, and a copy sharded
    with ``units(model)`` first (bottom-up, each with ``unit_kwargs``), then the root."""
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape or (dist.get_world_size(),))
    for unit in units(model):
        fshard.fully_shard(unit, mesh=mesh, **unit_kwargs)
    fshard.fully_shard(model, mesh=mesh)
    return DDP(reference, **(ddp_kwargs or {})), model, reference


def _train_side_by_side(
    pair: tuple[nn.Module, nn.Module],
    optims: list[torch.optim.Optimizer],
    shape: tuple[int, ...],
    *,
    steps: int = 2,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _square_loss,
    after_backward: Callable[[], None] | None = None,
) -> None:
    """Train the reference (DDP) and the sharded model of ``pair`` on the same batches."""
    for step in range(steps):
        x = _batch(step, shape)
        for m in pair:
            loss(m, x).backward()
        if after_backward is not None:
            after_backward()
        for opt in optims:
            opt.step()
            opt.zero_grad()


# ------------------------------------------------------------- parameters used on some ranks only


class _Routed(nn.Module):
    """Routes each rank's batch to one expert (an MoE in miniature); ``spare`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))
        self.spare = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[dist.get_rank() % 2](x)


class _RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 5)
        self.moe = _Routed()
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def _routed_worker(mesh_shape):
    ddp, model, reference = _beside_ddp(
        _RoutedNet, lambda m: [m.moe], mesh_shape=mesh_shape, ddp_kwargs={"find_unused_parameters": True}
    )
    # AdamW with weight decay tells a zero gradient from none: a param with a gradient moves.
    optims = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in (ddp, model)]

    def same_grads_present() -> None:
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name

    _train_side_by_side((ddp, model), optims, (4, 5), steps=3, after_backward=same_grads_present)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_params_used_on_some_ranks_only_equal_ddp(mesh_shape):
    """Every rank's shard gets the averaged gradient of an expert some rank used (as DDP with
    find_unused_parameters=True does); a param no rank used keeps no gradient."""
    assert all(get_pool(math.prod(mesh_shape)).run(_routed_worker, mesh_shape))


# ------------------------------------------------------------- tensors that are not arguments


class _SideInput(nn.Module):
    """A frozen weight applied to a tensor the parent sets as an attribute, not an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(4))
        self.side: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.side @ self.weight + self.bias


class _SideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.block = _SideInput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.block.side = self.enc(x)
        return self.block(x)


def _side_input_worker():
    ddp, model, reference = _beside_ddp(_SideNet, lambda m: [m.enc, m.block])
    # The batch needs no grad: only the side tensor needs the frozen weight.
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4))
    _assert_params_equal(model, reference)
    return True


def test_frozen_param_needed_by_a_tensor_that_is_not_an_argument():
    """The unit keeps its frozen weight until backward ends, not just until its own gradients
    arrive: a tensor that reached its forward as an attribute still needs it."""
    assert all(get_pool(2).run(_side_input_worker))


class _Box:
    """A plain object fshard cannot look into (not a pytree, not a dataclass)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _HiddenOutput(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> _Box | None:
        if self.how == "attribute":
            self.out = self.lin(x)  # the result kept on the module, nothing returned
            return None
        return _Box(self.lin(x))


class _HiddenOutputNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = _HiddenOutput(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box = self.block(self.inp(x))
        return box.value if box is not None else self.block.out


def _hidden_output_worker(how: str):
    ddp, model, reference = _beside_ddp(lambda: _HiddenOutputNet(how), lambda m: [m.block])
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4), steps=3)
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("how", ["attribute", "object"])
def test_unit_output_fshard_cannot_see_keeps_its_params_for_backward(how):
    """A unit whose result leaves through an attribute or an opaque object gives fshard no
    tensor to re-gather on in backward: it keeps the gathered params instead of freeing them
    (which made the backward read freed storage)."""
    assert all(get_pool(2).run(_hidden_output_worker, how))


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    aux: torch.Tensor
    note: str = "extra"


class _DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Output:
        h = self.lin(x)
        return _Output(hidden=h, aux=h.pow(2).mean())


class _DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = _DataclassBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(self.inp(x))
        assert isinstance(out, _Output) and out.note == "extra"
        return out.hidden.sum() + out.aux


def _dataclass_worker(mp: bool):
    # output_dtype=float64 exercises the cast through the dataclass (then compared in fp32).
    policy = fshard.MixedPrecision(output_dtype=torch.float64) if mp else None
    ddp, model, reference = _beside_ddp(_DataclassNet, lambda m: [m.block], mp_policy=policy)
    seen = []
    model.block.register_forward_hook(lambda m, a, out: seen.append((out.hidden.dtype, out.aux.dtype)))
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4), loss=lambda m, x: m(x).float())
    _assert_params_equal(model, reference)
    assert set(seen) == {(torch.float64, torch.float64) if mp else (torch.float32, torch.float32)}
    return True


@pytest.mark.parametrize("mp", [False, True], ids=["plain", "output_dtype"])
def test_dataclass_outputs_equal_ddp(mp):
    """Tensors inside a dataclass output get the unit's pre-backward gather (and casts)."""
    assert all(get_pool(2).run(_dataclass_worker, mp))


@dataclasses.dataclass
class _State:
    hidden: torch.Tensor
    aux: torch.Tensor


class _WritesIntoState(nn.Module):
    """Updates the caller's dataclass in place and returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, state: _State) -> None:
        state.hidden = torch.tanh(self.lin(state.hidden))
        state.aux = state.aux + state.hidden.pow(2).mean()


class _StateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_WritesIntoState() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = _State(hidden=self.inp(x), aux=torch.zeros(()))
        for block in self.blocks:
            block(state)
        return state.hidden.sum() + state.aux


def _state_worker():
    ddp, model, reference = _beside_ddp(_StateNet, lambda m: m.blocks)
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4), loss=lambda m, x: m(x), steps=3)
    _assert_params_equal(model, reference)
    return True


class _AppendsToList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, collected: list[torch.Tensor], pair: tuple) -> torch.Tensor:
        out = torch.tanh(self.lin(x)) * pair[0] + pair[1][0]
        collected.append(out)  # into the caller's list
        return out


class _ListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_AppendsToList() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        collected: list[torch.Tensor] = []
        for block in self.blocks:
            # A tuple (rebuilt with the wrapped tensors) holding a tensor that requires grad.
            h = block(h, collected, pair=(h.mean(), (h.std(),)))
        assert len(collected) == 2
        return sum(c.sum() for c in collected)


def _list_worker():
    ddp, model, reference = _beside_ddp(_ListNet, lambda m: m.blocks)
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4), loss=lambda m, x: m(x), steps=2)
    _assert_params_equal(model, reference)
    return True


def test_units_appending_to_the_callers_list_equal_ddp():
    """A unit gets the caller's own list (not a rebuilt copy): what it appends is seen."""
    assert all(get_pool(2).run(_list_worker))


def test_units_writing_into_the_callers_dataclass_equal_ddp():
    """A unit gets the caller's own dataclass (not a copy), so what it writes into it is seen;
    returning nothing, it keeps its params for backward."""
    assert all(get_pool(2).run(_state_worker))


# ------------------------------------------------------- between a forward and its backward


class _HeadOutside(nn.Module):
    """Returns hidden states; the caller applies the head (a unit of its own) to them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(torch.tanh(self.body(x))))


def _between_forward_and_backward_worker(reshard_after_forward: bool, case: str):
    ddp, model, reference = _beside_ddp(
        _HeadOutside, lambda m: [m.body, m.head], reshard_after_forward=reshard_after_forward
    )
    if case == "optimizer-on-gathered":
        fshard.unshard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            opt.step()
        except ValueError as exc:
            return str(exc)
        return "no error"
    if case == "optimizer-after-forward":
        for m in (ddp, model):
            m(_batch(99, (3, 4))).sum()  # a forward with grad and no backward, then build
    optims = [torch.optim.SGD(m.mid.parameters(), lr=0.1) for m in (reference, model)]
    heads = [reference.head, model.head]
    for step in range(3):
        x = _batch(step, (3, 4))
        for m, opt, head in zip((ddp, model), optims, heads, strict=True):
            loss = head(m(x)).pow(2).mean()  # the head called after the model's forward
            if case == "zero_grad":
                m.zero_grad()  # after the forward, before the backward (last step's grads)
                head.zero_grad()
            if case == "submodule-zero_grad":
                (m.module if m is ddp else m).mid.zero_grad()  # a part of the root unit
            if case == "add_param_group" and step == 0:
                opt.add_param_group({"params": list(m.module.body.parameters() if m is ddp else m.body.parameters())})
                opt.add_param_group({"params": list(head.parameters())})
            loss.backward()
            if case == "eval-with-grad":
                m(_batch(50 + step, (2, 4))).sum()  # evaluation outside torch.no_grad()
            if case == "edit-after-eval":
                m(_batch(50 + step, (2, 4))).sum()
                with torch.no_grad():
                    for p in m.parameters():
                        p.mul_(0.5)
            opt.step()
            if case not in ("zero_grad", "submodule-zero_grad"):
                opt.zero_grad()
            if case == "submodule-zero_grad":
                opt.zero_grad()
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize(
    "case",
    ["zero_grad", "submodule-zero_grad", "add_param_group", "eval-with-grad", "edit-after-eval",
     "optimizer-after-forward"],
)  # fmt: skip
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_between_a_forward_and_its_backward_equals_ddp(reshard_after_forward, case):
    """Once the model's forward returns, its modules show the shards again, though the root
    (and ZeRO-2 units) keep their gathered copies aside for backward: model.zero_grad() (of
    any submodule) clears the shards' grads, an optimizer built or extended then holds the
    shards, in-place edits reach them; and the next forward gathers afresh what a forward
    without backward kept, so it uses the stepped or edited weights. A head applied outside
    the forward is called as a unit of its own."""
    assert all(get_pool(2).run(_between_forward_and_backward_worker, reshard_after_forward, case))


def test_an_optimizer_built_on_gathered_params_is_an_error():
    for message in get_pool(2).run(_between_forward_and_backward_worker, True, "optimizer-on-gathered"):
        assert "the optimizer holds the gathered (full) copies of 'body.weight', 'body.bias'" in message
        assert "call fshard.reshard(model) first" in message


# ------------------------------------------------------------------ optimizer in backward


def _modified_before_backward_worker(reshard_after_forward: bool, case: str):
    ddp, model, reference = _beside_ddp(
        _HeadOutside, lambda m: [m.body, m.mid], reshard_after_forward=reshard_after_forward
    )
    sd = {k: v + 1.0 for k, v in reference.state_dict().items()}
    optims = _sgd(reference, model)
    outcomes = []
    for m, opt in zip((ddp, model), optims, strict=True):
        loss = m.module(_batch(0, (3, 4))).pow(2).mean() if m is ddp else _square_loss(m, _batch(0, (3, 4)))
        try:
            if case == "load_state_dict":
                (m.module if m is ddp else m).load_state_dict(sd)
            elif case == "step-between-two-backwards":
                loss.backward(retain_graph=True)
                opt.step()
            elif case == "edit-one-unit":  # a unit whose params backward reads (mid's input needs grad)
                with torch.no_grad():
                    (m.module.mid.weight if m is ddp else m.mid.weight.to_local()).add_(1.0)
            elif case == "edit-between-two-forwards":  # the second gather refills the first's storage
                with torch.no_grad():
                    (m.module.mid.weight if m is ddp else m.mid.weight.to_local()).mul_(0.5)
                x = _batch(2, (3, 4))
                loss = loss + (m.module(x).pow(2).mean() if m is ddp else _square_loss(m, x))
            loss.backward()
            outcomes.append("no error")
        except RuntimeError as exc:
            outcomes.append(str(exc))
    # Training goes on: a fresh forward and backward see the new values.
    opt = optims[1]
    opt.zero_grad()
    _square_loss(model, _batch(1, (3, 4))).backward()
    opt.step()
    return outcomes


@pytest.mark.parametrize(
    "case", ["load_state_dict", "step-between-two-backwards", "edit-one-unit", "edit-between-two-forwards"]
)
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_params_modified_between_a_forward_and_its_backward_are_an_error(reshard_after_forward, case):
    """Where autograd on the unsharded model raises (a tensor it saved for backward was modified
    in place), fshard raises too, naming the unit and the parameters, rather than computing the
    gradients from a mix of the gathered old values and re-gathered new ones. Each forward's
    backward checks against the values that forward read: after an edit and a second forward,
    the first forward's backward raises."""
    for ddp_outcome, outcome in get_pool(2).run(_modified_before_backward_worker, reshard_after_forward, case):
        assert "modified by an inplace operation" in ddp_outcome
        assert "were modified in place" in outcome and "after the forward" in outcome
        # The first changed unit the backward reaches: the root holds the head (unused, so
        # unchanged by a step), mid is reached before body.
        first = "'head.weight', 'head.bias' of unit <root>" if case == "load_state_dict" else "'mid.weight"
        assert first in outcome


def _optimizer_in_backward_worker(mesh_shape):
    ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)),
        lambda m: [m[0]],
        mesh_shape=mesh_shape,
    )
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    # One optimizer per (sharded) parameter, stepped as soon as its reduced gradient lands.
    per_param = {p: torch.optim.AdamW([p], lr=0.01) for p in model.parameters()}
    stepped = []

    def step_now(p: torch.Tensor) -> None:
        assert fshard.is_sharded(p) and p.grad is not None and p.grad.shape == p.shape
        per_param[p].step()
        per_param[p].zero_grad()
        stepped.append(p)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    for step in range(3):
        x = _batch(step, (3, 4))
        ddp(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        stepped.clear()
        model(x).pow(2).mean().backward()
        assert len(stepped) == 4 and all(p.grad is None for p in model.parameters())
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_optimizer_in_backward_equals_ddp(mesh_shape):
    """Post-accumulate-grad hooks registered on the sharded params run once the reduced
    gradient lands in ``.grad``: a per-parameter optimizer step there trains like DDP."""
    assert all(get_pool(math.prod(mesh_shape)).run(_optimizer_in_backward_worker, mesh_shape))


def _gan(mesh_shape: tuple[int, ...], reshard_after_forward: bool) -> bool:
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()

    def mlp(width_in: int, width_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(width_in, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, width_out))

    gen, disc = mlp(3, 5), mlp(5, 1)
    plain = (copy.deepcopy(gen), copy.deepcopy(disc))
    mesh = mesh_for(mesh_shape)
    for model in (gen, disc):  # two separate roots
        for layer in model[::2]:
            fshard.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fshard.fully_shard(model, mesh=mesh)

    def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))

    runs = [((gen, disc), slice(rank * 4, rank * 4 + 4)), (plain, slice(None))]  # plain: all data
    optims = [[torch.optim.Adam(m.parameters(), lr=0.01) for m in pair] for pair, _ in runs]
    for step in range(3):
        rows = torch.Generator().manual_seed(step)
        real, noise = torch.randn(4 * world, 5, generator=rows), torch.randn(4 * world, 3, generator=rows)
        for ((g, d), mine), (opt_g, opt_d) in zip(runs, optims, strict=True):
            opt_d.zero_grad()
            fake = g(noise[mine])
            # The discriminator runs twice before its backward; the generator's output is cut off.
            (bce(d(real[mine]), 1.0) + bce(d(fake.detach()), 0.0)).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(d(fake), 1.0).backward()  # through both roots, into the generator's first forward
            opt_g.step()
    _assert_params_equal(gen, plain[0])
    _assert_params_equal(disc, plain[1])
    return True


@pytest.mark.parametrize(("mesh_shape", "reshard_after_forward"), [((4,), True), ((2, 2), False)], ids=str)
def test_gan_with_two_sharded_models_equals_the_plain_run(mesh_shape, reshard_after_forward):
    """A GAN's two roots: the discriminator's step on real and detached fake samples, then the
    generator's backward through the discriminator into the generator's earlier forward."""
    assert all(get_pool(4).run(_gan, mesh_shape, reshard_after_forward))


# ---------------------------------------------------------------- clear errors, not wrong numbers


class _DirectTie(nn.Module):
    """The output head is ``F.linear`` on the embedding's weight, in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.mix(self.embed(tokens)), self.embed.weight)


def _direct_tie_worker(embed_is_unit: bool):
    torch.manual_seed(0)
    model = _DirectTie()
    reference = copy.deepcopy(model)
    mesh = mesh_for((dist.get_world_size(),))
    if embed_is_unit:
        fshard.fully_shard(model.embed, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    tokens = torch.arange(6).reshape(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(tokens)
        logits.sum().backward()
    messages = [str(w.message) for w in caught if "outside its unit's forward" in str(w.message)]
    if not embed_is_unit:
        # One unit for both: the parent's forward sees the gathered weight, as the plain model does.
        torch.testing.assert_close(logits, reference(tokens))
    return messages


def test_parent_using_a_sharded_child_param_warns():
    """Autograd accumulating into a sharded param (the parent's F.linear on a child unit's
    weight) is named in a warning: it computed with this rank's shard."""
    for messages in get_pool(2).run(_direct_tie_worker, True):
        assert len(messages) == 1 and "'embed.weight'" in messages[0]
        assert "fully_shard their common parent" in messages[0]
    assert get_pool(2).run(_direct_tie_worker, False) == [[], []]


def _penalty_worker():
    """A penalty over model.parameters() in the loss uses each shard elementwise: the
    gradients are DDP's (the penalty's value is this rank's part)."""
    ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)), lambda m: [m[0]]
    )

    def penalised(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _square_loss(m, x) + 0.1 * sum(p.pow(2).sum() for p in m.parameters())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time note about uses outside the forward
        _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 5), loss=penalised)
    _assert_params_equal(model, reference)
    return True


def test_elementwise_penalty_over_parameters_equals_ddp():
    assert all(get_pool(3).run(_penalty_worker))


def _double_backward_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4, requires_grad=True)
    try:
        (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        grad.pow(2).sum().backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        return None
    # The model still trains normally afterwards.
    model(torch.randn(3, 4)).sum().backward()
    assert model[0].weight.grad is not None
    return message


def test_create_graph_backward_is_a_clear_error():
    for message in get_pool(2).run(_double_backward_worker):
        assert message is not None and "create_graph=True" in message


def _gradient_argument_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    out = model(torch.randn(3, 4))
    weights = torch.ones(3, 2, requires_grad=True)  # a gradient argument that requires grad
    out.backward(weights)  # create_graph stays False: an ordinary backward
    return model[0].weight.grad is not None


def test_backward_with_a_gradient_that_requires_grad_is_not_create_graph():
    assert all(get_pool(2).run(_gradient_argument_worker))


def _complex_worker():
    torch.manual_seed(0)
    model = nn.Module()
    model.a = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    model.b = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))  # unused: no gradient
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    full_a = model.a.full_tensor()
    fshard.unshard(model)
    loss = (model.a.abs() ** 2).sum()
    loss.backward()
    fshard.reshard(model)
    assert model.b.grad is None
    want = (2 * full_a).chunk(dist.get_world_size())[dist.get_rank()]  # d|a|^2 = 2a, averaged
    torch.testing.assert_close(model.a.grad, want)
    return True


def test_complex_params_with_and_without_gradients():
    assert all(get_pool(2).run(_complex_worker))


def _lbfgs_worker():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.LBFGS(model.parameters())

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(TypeError, match="LBFGS cannot step fshard's sharded parameters"):
        opt.step(closure)
    return True


def test_lbfgs_is_a_clear_error():
    assert all(get_pool(2).run(_lbfgs_worker))


def _tied_head_policy_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[1], mesh=mesh, mp_policy=fshard.MixedPrecision(param_dtype=torch.float64))
    fshard.fully_shard(model, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="dtype"):  # the head's inputs became fp64
            model(torch.arange(4))
    return [str(w.message) for w in caught if "follows that unit's mp_policy" in str(w.message)]


def test_policy_of_a_unit_losing_its_tied_param_warns():
    for messages in get_pool(2).run(_tied_head_policy_worker):
        assert len(messages) == 1 and "'1.weight'" in messages[0] and "<root>" in messages[0]


# ---------------------------------------------------------------------------- clip and optimizers


def _clip_without_local_grads_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    if dist.get_rank() == 0:
        model[0].zero_grad(set_to_none=True)  # no gradient among these params on this rank
        reference[0].weight.grad[:2] = 0  # the rows rank 0 holds
        reference[0].bias.grad[:2] = 0
    want = torch.nn.utils.clip_grad_norm_(reference[0].parameters(), 1.0)
    got = fshard.clip_grad_norm_(model[0].parameters(), 1.0)
    return got.item(), want.item()


def test_clip_grad_norm_joins_in_without_local_gradients():
    """A rank holding no gradient among the given params still joins the norm's all-reduce."""
    results = get_pool(2).run(_clip_without_local_grads_worker, timeout=60)
    assert results[0][0] == pytest.approx(results[1][0])
    assert results[0][0] == pytest.approx(results[0][1], rel=1e-5)  # rank 0 zeroed its rows


def _adagrad_before_sharding_worker():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model = copy.deepcopy(reference)
    ddp = DDP(reference)
    optims = [torch.optim.Adagrad(m.parameters(), lr=0.1, initial_accumulator_value=0.5) for m in (ddp, model)]
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh)  # after the optimizer made its (full-size) state
    fshard.fully_shard(model, mesh=mesh)
    _train_side_by_side((ddp, model), optims, (4, 6))
    _assert_params_equal(model, reference)
    return True


def test_optimizer_with_constructor_state_built_before_sharding():
    """Adagrad fills its state in its constructor; never stepped, it still works (SPEC §1)."""
    assert all(get_pool(3).run(_adagrad_before_sharding_worker))


def _torch_grad_scaler_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    plain = copy.deepcopy(model)
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    for m, scaler_type in ((plain, torch.amp.GradScaler), (model, fshard.ShardedGradScaler)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = scaler_type("cpu", init_scale=4.0)
        scaler.scale(m(torch.randn(2, 4)).sum()).backward()
        scaler.step(opt)  # torch's scaler on a plain model, fshard's on a sharded one: fine
        scaler.update()
    # Every rank refuses, whichever ranks found an inf (a rank skipping the step must not go on
    # alone), also with a fused optimizer (which skips inside its own step).
    for inf_ranks, fused in (((), False), ((1,), False), ((0, 1), False), ((1,), True)):
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        if dist.get_rank() in inf_ranks:
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(TypeError, match=r"Use fshard\.ShardedGradScaler"):
            scaler.step(opt)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        opt.zero_grad()
    return True


def test_torch_grad_scaler_on_sharded_params_is_a_clear_error():
    """torch's scaler checks this rank's shards only: ranks would skip different steps."""
    assert all(get_pool(2).run(_torch_grad_scaler_worker))


def _fused_scaler_worker():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)  # unscales inside its step
    scaler = fshard.ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scales, weights = [], []
    for step in range(3):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        if step == 1 and dist.get_rank() == 1:
            model[0].weight.grad[0, 0] = float("inf")  # on one rank's shard only
        before = model[0].weight.detach().clone()
        scaler.step(opt)  # no unscale_ first: the step's own check must agree across ranks
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        weights.append(torch.equal(before, model[0].weight.detach()))
    return scales, weights


def test_sharded_grad_scaler_agrees_with_fused_optimizers():
    results = get_pool(2).run(_fused_scaler_worker)
    assert results[0] == results[1]
    scales, unchanged = results[0]
    assert scales == [2048.0, 1024.0, 2048.0] and unchanged == [False, True, False]


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(x).chunk(2, dim=-1)  # two outputs of one autograd node


class _FirstHalf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.halves = _Halves()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, _unused = self.halves(x)
        return self.out(first)


def _unused_output_worker():
    ddp, model, reference = _beside_ddp(_FirstHalf, lambda m: [m.halves])
    _train_side_by_side((ddp, model), _sgd(ddp, model), (3, 4))
    _assert_params_equal(model, reference)
    return True


def test_unit_output_without_gradient_equals_ddp():
    """Autograd calls a unit's output hook with None for an output that got no gradient while
    another output of the same node did (chunk, split; a compiled graph's many outputs)."""
    assert all(get_pool(2).run(_unused_output_worker))


class _CheckpointedBlock(nn.Module):
    """Reentrant activation checkpointing of part of the unit's forward: each forward's
    recompute (in its own nested backward) needs the unit gathered, after the rest of the
    unit's gradients arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.l1(t)), x, use_reentrant=True)
        return x + self.l2(h)


class _TwoBlockNet(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        block = _CheckpointedBlock if where == "inside" else lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.where = where
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([block(), block()])
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.where == "inside" else torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.out(h)


def _two_forwards_reentrant_worker(where: str, reshard_after_forward: bool):
    torch.manual_seed(0)
    reference = _TwoBlockNet(where)
    model = copy.deepcopy(reference)
    mesh = mesh_for((dist.get_world_size(),))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)

    def average_reference_grads() -> None:  # DDP refuses reentrant backward passes that reuse
        for p in reference.parameters():  # params: average by hand, as DDP would
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    def two_forwards(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _square_loss(m, x) + _square_loss(m, x.flip(0) * 2)  # one backward

    _train_side_by_side(
        (reference, model),
        _sgd(reference, model),
        (3, 6),
        loss=two_forwards,
        after_backward=average_reference_grads,
    )
    _assert_params_equal(model, reference)
    return True


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_two_forwards_with_reentrant_checkpointing_equal_ddp(where, reshard_after_forward):
    """Reentrant checkpointing runs one nested backward per forward: a unit called twice gets
    its gradients in two parts, and recomputes with its params in both."""
    assert all(get_pool(2).run(_two_forwards_reentrant_worker, where, reshard_after_forward))


# ------------------------------------------------------------- parameters no unit owns


class _Wrapper(nn.Module):
    """A wrapper holding the model and a head of its own (a classifier around a backbone)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def _unowned_worker(how: str, shape: tuple[int, ...] = (2,)):
    torch.manual_seed(0)
    model = _Wrapper()
    before = [p.detach().clone() for p in model.parameters()]
    if how == "root":
        fshard.fully_shard(model.inner[0], mesh=mesh_for(shape))
        fshard.fully_shard(model, mesh=mesh_for(shape))
    else:
        ignored = [model.head.weight, model.head.bias] if how == "ignored" else None
        fshard.fully_shard(model.inner, mesh=mesh_for(shape), ignored_params=ignored)  # inner only
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        unchanged = all(
            torch.equal(p.detach(), b) for p, b in zip(model.head.parameters(), before[-2:], strict=True)
        )
        return str(exc), unchanged
    return None, True


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["1d", "2x2"])
def test_an_optimizer_stepping_params_no_unit_owns_is_an_error_on_every_rank(shape):
    """A wrapper's head outside the sharded module (fully_shard(model) forgotten) would train
    on each rank's own gradients (DDP of the wrapper averages them): the first step raises on
    every rank before any update, naming the parameters and both fixes. Sharding the wrapper as
    the root owns them; ignored_params says they are synchronised elsewhere."""
    results = get_pool(math.prod(shape)).run(_unowned_worker, "inner-only", shape)
    for message, unchanged in results:
        assert message is not None, "no error"
        assert "2 trainable parameter(s) that no fshard unit owns" in message
        assert "head.weight [3, 8]" in message and "head.bias [3]" in message
        assert "fshard.fully_shard(model, mesh=mesh)" in message and "ignored_params" in message
        assert unchanged
    for how in ("root", "ignored"):
        for message, _ in get_pool(math.prod(shape)).run(_unowned_worker, how, shape):
            assert message is None, how


def _forgotten_root_worker():
    """A GPT whose blocks are sharded and whose root is not: lm_head and the final norm belong
    to no unit."""
    from fshard.testing.models import TinyTransformer, TransformerSpec

    torch.manual_seed(0)
    model = TinyTransformer(TransformerSpec(vocab=32, dim=16, heads=2, layers=2, seq=8))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh_for((2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (2, 8))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not fshard.is_sharded(p)}
    try:
        opt.step()
    except ValueError as exc:
        after = {n: p.detach() for n, p in model.named_parameters() if not fshard.is_sharded(p)}
        return str(exc), all(torch.equal(before[n], after[n]) for n in before), sorted(before)
    return None, False, sorted(before)


def test_forgetting_the_root_is_an_error_on_every_rank_before_any_update():
    """Issue 23, case 1: blocks sharded, fully_shard(model) never called."""
    for message, unchanged, unowned in get_pool(2).run(_forgotten_root_worker):
        assert message is not None, "trained silently"
        assert unchanged
        for name in unowned:
            assert name in message, (name, message)
        assert "fully_shard(model" in message


# ------------------------------------------------------------- edits to gathered copies


class _Renormed(nn.Module):
    """An embedding with max_norm renormalises the rows it looks up, in place, in forward."""

    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, max_norm=max_norm)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _dropped_edits_worker(case: str):
    torch.manual_seed(0)
    model = _Renormed(max_norm=0.1 if case == "max_norm" else None)
    fshard.fully_shard(model.embed, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case in ("max_norm", "plain"):
            model(torch.arange(6).reshape(2, 3)).sum().backward()
        else:
            fshard.unshard(model)
            with torch.no_grad():
                model.embed.weight.mul_(2.0)  # the gathered copy
            fshard.reshard(model, writeback=case == "writeback")
    return [str(w.message) for w in caught if "modified in place while gathered" in str(w.message)]


@pytest.mark.parametrize("case", ["max_norm", "unshard-edit", "writeback", "plain"])
def test_in_place_edits_to_gathered_params_that_are_dropped_warn(case):
    """nn.Embedding(max_norm=...) renormalises rows of the gathered copy in its forward, and an
    edit between unshard and reshard changes the copy: freeing the unit drops the change (DDP
    keeps it), so fshard warns, naming the parameter. Kept by writeback, or no edit: silent."""
    for messages in get_pool(2).run(_dropped_edits_worker, case):
        if case in ("writeback", "plain"):
            assert messages == []
        else:
            assert len(messages) == 1 and "parameters 'embed.weight' of unit 'embed'" in messages[0]


def _edit_then_backward_of_the_later_forward_worker() -> bool:
    ddp, model, reference = _beside_ddp(
        _HeadOutside, lambda m: [m.body, m.mid], ddp_kwargs={"find_unused_parameters": True}
    )
    optims = _sgd(ddp, model)
    for m in (ddp, model):
        first = m.module(_batch(0, (3, 4))) if m is ddp else model(_batch(0, (3, 4)))  # noqa: F841 (kept alive)
        with torch.no_grad():
            (m.module.mid.weight if m is ddp else m.mid.weight.to_local()).mul_(0.5)
        _square_loss(m, _batch(1, (3, 4))).backward()  # (DDP's own forward: it syncs)
    for opt in optims:
        opt.step()
    _assert_params_equal(model, reference)
    return True


def test_an_edit_before_a_later_forward_is_fine_for_that_forwards_backward():
    """The backward of the forward after the edit reads the new values only: no error (the
    earlier forward's graph, alive but never differentiated, does not matter), DDP's result."""
    assert all(get_pool(2).run(_edit_then_backward_of_the_later_forward_worker))


def _stale_kept_copy_worker(case: str) -> list[float]:
    """A forward with grad whose backward never comes keeps the root (and units with
    reshard_after_forward=False) gathered, hidden; the shards then change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    mesh = mesh_for((2,))
    fshard.fully_shard(model[1], mesh=mesh, reshard_after_forward=False)
    fshard.fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4)
    model(x).sum()  # no backward
    with torch.no_grad():
        for p in (model[1].weight, model[2].weight):
            p.to_local().zero_()
    if case == "unshard":  # fshard.unshard shows the shards' values, not the kept copy's
        fshard.unshard(model)
        seen = [model[1].weight.detach().abs().sum().item(), model[2].weight.detach().abs().sum().item()]
        fshard.reshard(model)
        return seen
    if case == "writeback":  # nothing was edited while gathered: the shards keep their values
        fshard.reshard(model, writeback=True)
        return [model[1].weight.full_tensor().abs().sum().item(), model[2].weight.full_tensor().abs().sum().item()]
    # "unit_on_its_own": the kept unit computes with its new weights
    out = model[1](torch.ones(3, 4))
    return [(out - model[1].bias.full_tensor()).abs().sum().item()]


@pytest.mark.parametrize("case", ["unshard", "writeback", "unit_on_its_own"])
def test_kept_copies_are_not_reused_once_the_shards_changed(case):
    """A copy kept from a forward whose backward has not run is gathered afresh once its shards
    changed (an optimizer step, an edit), by fshard.unshard and by the unit's own forward, and
    fshard.reshard(writeback=True) does not write it back over the new shards."""
    for seen in get_pool(2).run(_stale_kept_copy_worker, case):
        assert seen == [0.0] * len(seen), seen


def _unshard_a_block_first_worker(reshard_first: bool):
    ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)),
        lambda m: (m[0], m[2], m[4]),
    )
    optims = _sgd(ddp, model)
    fshard.unshard(model[0])  # FSDP2's `model.layers[0].unshard()`, before the first forward
    assert model[0].weight.shape == (6, 6)
    if reshard_first:
        fshard.reshard(model[0])
    _train_side_by_side((ddp, model), optims, (4, 6), steps=3)
    # The modules show the shards again, each with its gradient slot, and train like DDP.
    assert all(fshard.is_sharded(p) for p in model.parameters())
    _assert_params_equal(model, reference)
    model(_batch(9, (4, 6))).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    return True


@pytest.mark.parametrize("reshard_first", [False, True])
def test_unshard_of_a_block_before_the_first_forward(reshard_first):
    """The block became a root of its own then, gathered; the model's root init, at its first
    forward, read its parameters off the modules: the gathered copies, which the modules then
    kept (freed, plain, without gradients: reading one crashed the process)."""
    assert get_pool(2).run(_unshard_a_block_first_worker, reshard_first) == [True, True]


def _keep_after_backward_worker(reshard_after_forward: bool):
    from fshard.testing import trace_collectives

    ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)),
        lambda m: (m[0], m[2], m[4]),
        reshard_after_forward=reshard_after_forward,
    )
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    optims = _sgd(ddp, model)
    with pytest.raises(TypeError, match=r"set_reshard_after_backward: reshard_after_backward must be a bool, got 0"):
        fshard.set_reshard_after_backward(model, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"set_reshard_after_backward: Linear has no fshard units"):
        fshard.set_reshard_after_backward(nn.Linear(2, 2), False)
    fshard.set_reshard_after_backward(model, False)
    gc.collect()  # units earlier tasks dropped free their bytes now, not during the count below
    base = fshard.memory_stats().gathered_bytes  # (what earlier tasks in this rank left)
    gathers, kept = [], []
    for step in range(2):
        for micro in range(3):
            x = _batch(10 * step + micro, (4, 6))
            last = micro == 2
            with contextlib.ExitStack() as stack:
                if not last:
                    stack.enter_context(fshard.no_sync(model))
                    stack.enter_context(ddp.no_sync())
                with trace_collectives() as records:
                    _square_loss(model, x).backward()
                _square_loss(ddp, x).backward()
            gathers.append(sum(r.op == "all_gather" for r in records))
            kept.append(fshard.memory_stats().gathered_bytes - base)
            # Between micro-batches the modules show the shards, as always.
            assert all(fshard.is_sharded(p) for p in model.parameters())
        for opt in optims:
            opt.step()
            opt.zero_grad()
    _assert_params_equal(model, reference)
    model(_batch(99, (4, 6))).sum().backward()  # (synced: frees)
    with fshard.no_sync(model):
        model(_batch(99, (4, 6))).sum().backward()
    before = fshard.memory_stats().gathered_bytes - base
    fshard.set_reshard_after_backward(model, True)  # keeps what was kept, for the next forward
    flipped = fshard.memory_stats().gathered_bytes - base
    fshard.reshard(model)  # frees it
    return gathers, kept, (before, flipped), fshard.memory_stats().gathered_bytes - base


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_units_kept_gathered_after_backward_for_gradient_accumulation(reshard_after_forward):
    """Each micro-batch after the first uses the gathered params its predecessor's backward
    kept; after the optimizer step the shards changed, so the next forward gathers afresh
    (and trains like DDP)."""
    for gathers, kept, before, after in get_pool(2).run(_keep_after_backward_worker, reshard_after_forward):
        units = 3  # (the root holds no parameter of its own)
        if reshard_after_forward:  # freed after forward, gathered in backward: that stays
            assert gathers == [2 * units, units, units] * 2, gathers
        else:
            assert gathers == [units, 0, 0] * 2, gathers
        # Kept after the micro-batches without sync; the synchronised last one frees.
        assert kept[0] > 0 and kept[1] > 0 and kept[2] == 0 and kept[3:] == kept[:3], kept
        assert before[0] > 0 and before[1] == before[0] and after == 0


def _shard_keeping_after_backward(spec, model, mesh):
    from fshard.testing.models import shard_model

    shard_model(spec, model, mesh, reshard_after_forward=False)
    fshard.set_reshard_after_backward(model, False)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_units_kept_after_backward_train_like_ddp(mesh_shape):
    """Every step reuses nothing stale: the optimizer step changes the shards, and the next
    forward gathers afresh (checkpointed blocks and a tied head included)."""
    import functools

    from fshard.testing import assert_equivalent_to_ddp
    from fshard.testing.models import TransformerSpec, build_model, compute_loss, make_batch

    spec = TransformerSpec(vocab=13, dim=6, layers=2, checkpoint="around", tail_unit=True)
    assert_equivalent_to_ddp(
        functools.partial(build_model, spec),
        batch_fn=functools.partial(make_batch, spec),
        loss_fn=functools.partial(compute_loss, spec),
        shard_fn=functools.partial(_shard_keeping_after_backward, spec),
        world_size=math.prod(mesh_shape),
        mesh_shape=mesh_shape,
        steps=3,
        grad_accum=2,
    )


def _keep_with_silent_updates_worker(how: str):
    ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)),
        lambda m: (m[0], m[2], m[4]),
        reshard_after_forward=False,
    )
    fshard.set_reshard_after_backward(model, False)
    if how.startswith("fused"):  # writes the params without bumping their version counters
        optims = [torch.optim.AdamW(m.parameters(), lr=0.05, fused=True) for m in (ddp, model)]
    for step in range(3):
        x = _batch(step, (4, 6))
        with contextlib.ExitStack() as stack:
            if how == "fused-reduce-scatter":
                # Each micro-batch's .grad is final on a 1D mesh: a step may follow any of them.
                stack.enter_context(fshard.no_sync(model, reduce_scatter=True))
            _square_loss(model, x).backward()
        _square_loss(ddp, x).backward()
        if how.startswith("fused"):
            for opt in optims:
                opt.step()
                opt.zero_grad()
        else:
            with torch.no_grad():
                for m in (model, ddp):
                    for p in m.parameters():
                        if how == "data-add":  # a hand-written SGD step
                            p.data.add_(p.grad, alpha=-0.1)
                        else:  # "data-assign"
                            p.data = p.data - 0.1 * p.grad
                        p.grad = None
    _assert_params_equal(model, reference)
    x = _batch(9, (4, 6))
    torch.testing.assert_close(model(x), ddp(x), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("how", ["fused", "fused-reduce-scatter", "data-add", "data-assign"])
def test_kept_params_never_outlive_an_update_fshard_cannot_see(how):
    """Fused optimizers and p.data edits change the shards without a version bump: units are
    kept only after backwards without sync, an optimizer step over a kept unit's parameters
    frees it (a step between reduce-scattering no_sync micro-batches), and a replaced p.data
    is seen; the next forward gathered the values from before the step (wrong results, or a
    crash in backward)."""
    assert get_pool(2).run(_keep_with_silent_updates_worker, how) == [True, True]


def _keep_then_replace_data_worker():
    _ddp, model, reference = _beside_ddp(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)),
        lambda m: (m[0],),
        reshard_after_forward=False,
    )
    fshard.set_reshard_after_backward(model, False)
    with fshard.no_sync(model):
        model(_batch(0, (4, 6))).sum().backward()  # model[0] kept gathered
    with torch.no_grad():
        for m in (model, reference):
            m[0].weight.data = m[0].weight.data * 2  # new data, same version counter
    x = _batch(1, (4, 6))
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    return True


def test_kept_params_are_gathered_again_after_their_data_is_replaced():
    """Between micro-batches, p.data = ... replaces a shard's storage: the kept copy is stale,
    and the next forward gathers afresh (it showed the old values, and its backward's
    re-pack freed the storage autograd had saved)."""
    assert get_pool(2).run(_keep_then_replace_data_worker) == [True, True]
