"""fshard.register_forward_method: methods other than forward that read a unit's parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import get_pool, mesh_for, trace_collectives


class _LM(nn.Module):
    """A tiny language model with the methods users call besides forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 11)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(tokens))

    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            tokens = torch.cat([tokens, self(tokens)[-1:].argmax(-1)])
        return tokens

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        # Calls the model and a registered method inside one registered method.
        return self(tokens).logsumexp(-1).mean() + self.encode(tokens).pow(2).mean()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))

    def scaled(self, h: torch.Tensor, factor: float) -> torch.Tensor:
        return factor * self.lin(h)


def _sharded_lm(mesh_shape: tuple[int, ...]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = _LM()
    model = copy.deepcopy(reference)
    mesh = mesh_for(mesh_shape)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    for name in ("encode", "generate", "loss"):
        fshard.register_forward_method(model, name)
    fshard.register_forward_method(model.blocks[0], "scaled")
    return model, reference


def _tokens(step: int, n: int = 5) -> torch.Tensor:
    return torch.randint(0, 11, (n,), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def _reduce_like_ddp(reference: nn.Module) -> None:
    for p in reference.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _methods_worker(mesh_shape: tuple[int, ...]) -> list[int]:
    model, reference = _sharded_lm(mesh_shape)
    fshard.set_coalescing(model, 0)  # per-unit collectives (this test counts them): no coalescing
    optims = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, reference)]
    base = fshard.memory_stats().gathered_bytes
    for step in range(3):
        x = _tokens(step)
        # A registered method with grad, calling the model and another registered method:
        # gradients equal the unsharded model's, averaged over ranks as DDP's.
        model.loss(x).backward()
        reference.loss(x).backward()
        _reduce_like_ddp(reference)
        for opt in optims:
            opt.step()
            opt.zero_grad()
        assert fshard.memory_stats().gathered_bytes == base
        assert all(fshard.is_sharded(p) for p in model.parameters())
    with torch.no_grad():
        x = _tokens(7)
        torch.testing.assert_close(model.encode(x), reference.encode(x))
        h = torch.randn(3, 8)
        torch.testing.assert_close(model.blocks[0].scaled(h, 2.0), reference.blocks[0].scaled(h, 2.0))
        with trace_collectives() as records:
            generated = model.generate(x, 4)
        assert generated.tolist() == reference.generate(x, 4).tolist()
    # The root is gathered once for the whole generate, each block once per decoding step.
    gathers = [r.label for r in records if r.op == "all_gather"]
    assert gathers.count("<root>") == 1, gathers
    assert gathers.count("blocks.0") == 4, gathers
    assert fshard.memory_stats().gathered_bytes == base
    # The training goes on like the reference's after the calls.
    x = _tokens(9)
    model(x).sum().backward()
    reference(x).sum().backward()
    _reduce_like_ddp(reference)
    shard = dist.get_rank() % mesh_shape[-1]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        rows = q.grad.chunk(mesh_shape[-1])[shard]  # this rank's rows of the DDP gradient
        torch.testing.assert_close(p.grad, rows, rtol=1e-5, atol=1e-6, msg=name)
    return generated.tolist()


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_registered_methods_compute_with_full_parameters_and_train_like_ddp(mesh_shape):
    """encode / generate / a loss method of the root and a method of a block, called outside
    the model's forward (with and without grad), equal the unsharded model's; gradients
    through them equal DDP's; nothing stays gathered."""
    world = 1
    for size in mesh_shape:
        world *= size
    results = get_pool(world).run(_methods_worker, mesh_shape)
    assert len(results) == world


def _inside_forward_worker() -> bool:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Block() for _ in range(2))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            # A registered method of a unit called by the model instead of the unit's forward.
            return self.blocks[1](self.blocks[0].scaled(h, 0.5))

    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    fshard.register_forward_method(model.blocks[0], "scaled")
    fshard.register_forward_method(model.blocks[0], "scaled")  # again: nothing changes
    for step in range(2):
        h = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
        model(h).pow(2).mean().backward()
        reference(h).pow(2).mean().backward()
        _reduce_like_ddp(reference)
        for m in (model, reference):
            for p in m.parameters():
                p.data -= 0.1 * p.grad
                p.grad = None
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return True


def test_a_registered_method_called_in_the_models_forward_runs_as_the_units_forward():
    assert get_pool(2).run(_inside_forward_worker) == [True, True]


def _raising_worker() -> bool:
    model, reference = _sharded_lm((2,))
    base = fshard.memory_stats().gathered_bytes
    for call in (
        lambda: model.encode(torch.tensor([99])),  # out of the vocabulary: raises in the method
        lambda: model.generate(torch.tensor([99]), 2),  # raises in a nested call of the model
        lambda: model.blocks[0].scaled(torch.ones(2, 3), 1.0),  # a unit's method, wrong width
    ):
        with pytest.raises((IndexError, RuntimeError)):
            call()
        # Nothing stays gathered.
        assert fshard.memory_stats().gathered_bytes == base
        assert all(fshard.is_sharded(p) for p in model.parameters())
    # The model trains as before.
    x = _tokens(3)
    model.loss(x).backward()
    reference.loss(x).backward()
    _reduce_like_ddp(reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        rows = q.grad.chunk(2)[dist.get_rank()]  # this rank's rows of the averaged gradient
        torch.testing.assert_close(p.grad, rows, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model.encode(x), reference.encode(x))
    return True


def test_a_registered_method_that_raises_leaves_nothing_gathered():
    assert get_pool(2).run(_raising_worker) == [True, True]


def _errors_worker() -> bool:
    model, _ = _sharded_lm((2,))
    with pytest.raises(ValueError, match=r"register_forward_method: Linear is not an fshard unit: call fshard.fully_shard on it first"):
        fshard.register_forward_method(model.head, "extra_repr")
    with pytest.raises(TypeError, match=r"register_forward_method expects an nn.Module, got str"):
        fshard.register_forward_method("model", "encode")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"method_name must be the method's name as a str, got <.*: pass its name, 'encode'"):
        fshard.register_forward_method(model, model.encode)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"_LM.forward already runs as the unit's forward"):
        fshard.register_forward_method(model, "forward")
    with pytest.raises(ValueError, match=r"_LM has no attribute 'decode', not a method"):
        fshard.register_forward_method(model, "decode")
    with pytest.raises(ValueError, match=r"_LM has ModuleList 'blocks', not a method"):
        fshard.register_forward_method(model, "blocks")
    with pytest.raises(ValueError, match=r"_LM has bool 'training', not a method"):
        fshard.register_forward_method(model, "training")
    return True


def test_register_forward_method_bad_arguments_are_named():
    assert get_pool(2).run(_errors_worker) == [True, True]


def _raising_container_worker() -> bool:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.stack = nn.Sequential(_Block(), _Block())  # holds units, is none

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.stack(self.embed(tokens))

    torch.manual_seed(0)
    model = Net()
    for block in model.stack:
        fshard.fully_shard(block, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    model(torch.tensor([1, 2])).sum().backward()
    base = fshard.memory_stats().gathered_bytes
    with pytest.raises(RuntimeError):
        model.stack(torch.ones(2, 3))  # called on its own (run as the root's forward), raises
    assert fshard.memory_stats().gathered_bytes == base
    assert all(fshard.is_sharded(p) for p in model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    return True


def test_a_call_into_the_model_that_raises_leaves_nothing_gathered():
    """A container of units called from outside the model's forward runs as the root's
    forward; when it raises, the root's gathered parameters are freed at once."""
    assert get_pool(2).run(_raising_container_worker) == [True, True]


class _Decoder(_LM):
    @torch.no_grad()  # as transformers' generate is
    def decode(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        return self.generate(tokens, steps)

    def stream(self, tokens: torch.Tensor, steps: int):  # a generator function
        for _ in range(steps):
            tokens = torch.cat([tokens, self.head(self.encode(tokens))[-1:].argmax(-1)])
            yield tokens


def _grad_mode_worker() -> bool:
    torch.manual_seed(0)
    reference = _Decoder()
    model = copy.deepcopy(reference)
    mesh = mesh_for((2,))
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    model(_tokens(0)).sum().backward()
    model.zero_grad(set_to_none=True)
    base = fshard.memory_stats().gathered_bytes
    fshard.register_forward_method(model, "decode")
    x = _tokens(1)
    # Called with grad: every forward inside runs without it, and nothing it returns requires
    # grad, so nothing stays gathered for a backward that cannot come.
    assert model.decode(x, 3).tolist() == reference.decode(x, 3).tolist()
    assert fshard.memory_stats().gathered_bytes == base
    # A forward with grad before it keeps its backward: the backward still equals DDP's.
    loss = model(x).pow(2).mean()
    model.decode(x, 2)
    loss.backward()
    reference(x).pow(2).mean().backward()
    _reduce_like_ddp(reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        rows = q.grad.chunk(2)[dist.get_rank()]
        torch.testing.assert_close(p.grad, rows, rtol=1e-5, atol=1e-6, msg=name)
    assert fshard.memory_stats().gathered_bytes == base
    # A method put in place of a registered one is wrapped when registered again.
    fshard.register_forward_method(model, "encode")
    model.encode = lambda tokens: reference.head(model.embed(tokens)).sum()  # type: ignore[method-assign]
    fshard.register_forward_method(model, "encode")
    with torch.no_grad():
        assert model.encode(x).item() == pytest.approx(reference.head(reference.embed(x)).sum().item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"_Decoder.stream is a generator function: its body runs after the call returns"):
        fshard.register_forward_method(model, "stream")
    return True


def test_registered_methods_and_grad_mode_replacement_and_generators():
    """A no_grad-decorated method called with grad frees what it gathered (it kept the root for
    a backward that could not come); re-registering a replaced method wraps the new one (it
    computed with the shards); generator functions are refused (their body runs later, with
    the shards)."""
    assert get_pool(2).run(_grad_mode_worker) == [True, True]
