"""The step ``fshard.estimate`` replays: fshard's unit events over a ledger of bytes, fed by a
synthetic unit order or by a forward and backward under ``FakeTensorMode``.

See [Note: what the estimate models] in ``fshard._estimate`` for what each event holds; this
module knows nothing of meshes or layouts: it gets each unit's byte counts (``UnitBytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fshard._memtrack import LiveBytes
from fshard._options import DEFAULT_COALESCE_BYTES, MixedPrecision

__all__ = ["UnitBytes", "Replay", "synthetic_step", "fake_step", "default_loss"]


class UnitBytes(NamedTuple):
    """One unit's byte counts on one rank (see [Note: what the estimate models])."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    numel: int
    shard_bytes: dict[torch.dtype, int]  # flat shards, by storage dtype
    unsharded: int  # unsharded buffers (0: aliased to the shard)
    ag_out: int  # all-gather output
    ag_in: int  # a cast or host-to-device copy of the flat shard sent to the all-gather
    grads: int  # unsharded grads (compute dtype, full shapes)
    reduce_in: int
    reduce_out: int  # separate from reduce_in (shard group > 1)
    sharded_grads: dict[torch.dtype, int]  # what the .grads view, persistent
    sharded_grads_separate: bool  # a cast copy of the reduce output (else its storage)
    optim_by_rank: list[dict[torch.dtype, int]]
    optim_largest_param: list[int]  # per rank: bytes of the largest local shard with grad


# ----------------------------------------------------------------------------- the replay


class Replay:
    """fshard's step, event by event, over a ledger of the bytes fshard holds besides the
    persistent ones and what the fake-tensor run holds (see [Note: what the estimate models])."""

    def __init__(
        self,
        units: list[UnitBytes],
        base: int,
        *,
        offload: bool,
        reshard: bool,
        virtual_grads: bool,
        holds_reduce_input: bool,
        coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
    ) -> None:
        self.units = units
        # Adjacent small units share an all-gather and a reduce-scatter (see [Note: coalesced
        # all-gathers] in fshard._unit._group): the runs gathered together, by member name, with
        # the bytes of their shared buffers and the members not yet copied out; the reduce-scatter
        # inputs held for the next coalesced reduce-scatter.
        self.coalesce_bytes = coalesce_bytes
        self.run_of: dict[str, int] = {}
        self.runs: dict[int, tuple[int, set[str]]] = {}
        self.held: list[UnitBytes] = []
        # [Note: how long a reduce-scatter input lives] NCCL keeps the input of an async
        # collective until it is waited for (fshard waits when the next unit's reduce-scatter
        # is issued); gloo on CPU runs it at once and lets it go as the call returns (measured:
        # tests/dist/test_estimate.py's "wide" model).
        self.holds_reduce_input = holds_reduce_input
        # The prefetch plans: forward in fully_shard order after the root; backward in the
        # reverse of the order the forwards finish (the root last).
        self.forward_order_hint = units
        self.finish_order_hint = [*units[1:], units[0]]
        self.root = units[0]
        self.base = base
        self.offload = offload
        self.reshard = reshard
        self.virtual_grads = virtual_grads  # no fake run: the unsharded grads are ours to count
        self.ledger = 0
        self.peak = 0
        self.phase = "forward"
        self.peak_phase = "forward"
        self.gathered: set[str] = set()
        self.in_flight: dict[str, int] = {}  # all-gathers issued, not waited for
        self.pending: list[UnitBytes] = []  # reduce-scatters issued, not finished
        self.done: set[str] = set()
        self.forward_order: list[UnitBytes] = []
        self.finish_order: list[UnitBytes] = []
        self.activation_peak = 0

    def point(self, activations: int) -> None:
        self.activation_peak = max(self.activation_peak, activations)
        now = self.base + self.ledger + activations
        if now > self.peak:
            self.peak, self.peak_phase = now, self.phase

    def _issue_gather(self, unit: UnitBytes) -> None:
        if unit.name in self.gathered or unit.name in self.in_flight:
            return
        self.in_flight[unit.name] = unit.ag_out + unit.ag_in
        self.ledger += unit.ag_out + unit.ag_in

    def _coalescable(self, unit: UnitBytes) -> bool:
        return (
            unit.ag_out > 0
            and len(unit.shard_bytes) == 1
            and unit.name not in self.gathered
            and unit.name not in self.in_flight
            and unit.name not in self.done
        )

    def _issue_ahead(self, unit: UnitBytes, order: list[UnitBytes]) -> None:
        """A prefetch: ``unit``'s all-gather, with the units ``order`` runs after it while they
        fit in ``coalesce_bytes`` (one output; one input, their shards concatenated)."""
        run = [unit]
        if self._coalescable(unit) and unit.ag_out <= self.coalesce_bytes:
            used = unit.ag_out
            following = self._next(order, unit)
            while following is not None and self._coalescable(following):
                if any(following is u for u in run) or used + following.ag_out > self.coalesce_bytes:
                    break
                run.append(following)
                used += following.ag_out
                following = self._next(order, following)
        if len(run) == 1:
            self._issue_gather(unit)
            return
        # Each member's output block, and its flat shard (or its cast copy) in the input.
        nbytes = sum(u.ag_out + (u.ag_in or sum(u.shard_bytes.values())) for u in run)
        key = len(self.runs)
        self.runs[key] = (nbytes, {u.name for u in run})
        for u in run:
            self.run_of[u.name] = key
            self.in_flight[u.name] = 0
        self.ledger += nbytes

    def _wait_gather(self, unit: UnitBytes, activations: int) -> None:
        if unit.name in self.gathered:
            return
        self._issue_gather(unit)
        self.ledger += unit.unsharded
        self.point(activations)  # the output is copied out into the unsharded buffer
        self.ledger -= self.in_flight.pop(unit.name)
        key = self.run_of.pop(unit.name, None)
        if key is not None:  # the shared buffers go with the run's last member
            nbytes, left = self.runs[key]
            left.discard(unit.name)
            if not left:
                self.ledger -= nbytes
        self.gathered.add(unit.name)

    def _free(self, unit: UnitBytes) -> None:
        if unit.name in self.gathered:
            self.gathered.discard(unit.name)
            self.ledger -= unit.unsharded

    # events: each gets the fake run's peak since the previous event and its bytes now
    def pre_forward(self, unit: UnitBytes, span: int, activations: int) -> None:
        self.point(span)
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        self._wait_gather(unit, activations)
        following = self._next(self.forward_order_hint, unit)
        if following is not None:
            self._issue_ahead(following, self.forward_order_hint)
        self.point(activations)

    def post_forward(self, unit: UnitBytes, span: int, activations: int) -> None:
        self.point(span)
        if unit not in self.finish_order:
            self.finish_order.append(unit)
        if unit is not self.root and self.reshard:
            self._free(unit)
        self.point(activations)

    def pre_backward(self, unit: UnitBytes, span: int, activations: int) -> None:
        self.phase = "backward"
        self.point(span)
        if unit.name in self.done:
            return
        self._wait_gather(unit, activations)
        if self.virtual_grads:
            self.ledger += unit.grads
        backward = list(reversed(self.finish_order_hint))
        following = self._next(backward, unit)
        if following is not None:
            self._issue_ahead(following, backward)
        self.point(activations)

    def post_backward(self, unit: UnitBytes, span: int, activations: int, drop_grads: Callable[[], int]) -> None:
        """The unit's backward is done: free, reduce (``drop_grads`` frees the fake run's
        unsharded grads and returns the bytes it now holds)."""
        self.phase = "backward"
        self.point(span)
        if unit.name in self.done:
            return
        self.done.add(unit.name)
        self._free(unit)
        if unit.reduce_out and len(unit.shard_bytes) == 1 and self.coalesce_bytes:
            # Held for a coalesced reduce-scatter ([Note: coalesced reduce-scatters]).
            self.ledger += unit.reduce_in
            self.point(activations)
            if self.virtual_grads:
                self.ledger -= unit.grads
            activations = drop_grads()
            if self.held and self._held_bytes() + unit.reduce_in > self.coalesce_bytes:
                self._issue_held(activations)
            self.held.append(unit)
            if self._held_bytes() >= self.coalesce_bytes:
                self._issue_held(activations)
            self.point(activations)
            return
        self._issue_held(activations)
        # The reduce-scatter's input and output are made before the unsharded grads go.
        self.ledger += unit.reduce_in + unit.reduce_out
        self.point(activations)
        if self.virtual_grads:
            self.ledger -= unit.grads
        activations = drop_grads()
        if unit.reduce_out and not self.holds_reduce_input:
            self.ledger -= unit.reduce_in
        self._finish_pending()
        self.pending.append(unit)
        self.point(activations)

    def _held_bytes(self) -> int:
        return sum(u.reduce_in for u in self.held)

    def _issue_held(self, activations: int) -> None:
        """Issue the held reduce-scatter inputs as one: their concatenation (when several) and
        one output; each member's own input goes once it is copied in."""
        held, self.held = self.held, []
        if not held:
            return
        inputs = sum(u.reduce_in for u in held)
        if len(held) > 1:
            self.ledger += inputs  # the concatenated input
        self.ledger += sum(u.reduce_out for u in held)
        self.point(activations)
        if len(held) > 1:
            self.ledger -= inputs  # the members' own inputs
        if not self.holds_reduce_input:
            self.ledger -= inputs
        self._finish_pending()
        self.pending.extend(held)

    def _finish_pending(self) -> None:
        for unit in self.pending:
            if unit.reduce_out and self.holds_reduce_input:
                self.ledger -= unit.reduce_in
            kept = unit.reduce_out or unit.reduce_in  # the storage the .grads would view
            if unit.sharded_grads_separate:
                self.ledger -= kept
                if not self.offload:
                    self.ledger += sum(unit.sharded_grads.values())
        self.pending = []

    def end_backward(
        self, span: int, activations: int, drop_for: Callable[[UnitBytes], Callable[[], int]]
    ) -> None:
        """The root's end-of-backward callback: the root, and any unit the backward did not
        reach, are freed and reduced."""
        for unit in reversed(self.finish_order_hint):
            if unit.name not in self.done:
                drop = drop_for(unit)
                self.post_backward(unit, span, activations, drop)
                span = activations = drop()
        self._issue_held(activations)
        self._finish_pending()
        self.point(span)

    @staticmethod
    def _next(order: list[UnitBytes], unit: UnitBytes) -> UnitBytes | None:
        for i, u in enumerate(order[:-1]):
            if u is unit:
                return order[i + 1]
        return None


def synthetic_step(replay: Replay) -> None:
    """The event sequence without a batch: units run in ``fully_shard`` order inside the root,
    the backward in reverse; no activations."""
    root, others = replay.root, replay.units[1:]

    def none() -> int:
        return 0  # no fake run: nothing to free

    replay.pre_forward(root, 0, 0)
    for unit in others:
        replay.pre_forward(unit, 0, 0)
        replay.post_forward(unit, 0, 0)
    replay.post_forward(root, 0, 0)
    replay.pre_backward(root, 0, 0)
    for unit in reversed(others):
        replay.pre_backward(unit, 0, 0)
        replay.post_backward(unit, 0, 0, none)
    replay.end_backward(0, 0, lambda unit: none)


# ------------------------------------------------------------------------- the fake-tensor run


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Run ``model`` on ``batch`` (a tuple of arguments, a dict of keyword arguments, or one
    tensor) and make a scalar of the output: its ``loss`` if it has one (Transformers with
    labels), else the sum of its first tensor."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(t for t in tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple()) if isinstance(t, torch.Tensor))
    return first if first.ndim == 0 else first.sum()


@contextmanager
def _fake_parameters(
    model: nn.Module, fake_mode: Any, mp: MixedPrecision | None
) -> Iterator[dict[int, nn.Parameter]]:
    """Swap every parameter and buffer of ``model`` for a fake CPU tensor (parameters in the
    compute dtype), and put the originals back after. Yields original id -> fake parameter."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    made: dict[int, Any] = {}  # original id -> its fake (tied parameters stay tied)
    with fake_mode:
        for module in model.modules():
            tables: list[tuple[dict[str, Any], bool]] = [(module._parameters, True), (module._buffers, False)]
            for table, is_param in tables:
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    fake = made.get(id(value))
                    if fake is None:
                        dtype = value.dtype
                        if is_param and mp is not None and mp.param_dtype is not None and dtype.is_floating_point:
                            dtype = mp.param_dtype
                        empty = torch.empty(value.shape, dtype=dtype, device="cpu")
                        fake = nn.Parameter(empty, requires_grad=value.requires_grad) if is_param else empty
                        made[id(value)] = fake
                    swapped.append((table, name, value))
                    table[name] = fake
    try:
        yield made
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value


class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's input; its backward says the input's gradient is computed, the
    moment fshard frees and reduces the unit (see [Note: when a unit's backward is done])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback()
        return grad, None


def fake_step(
    model: nn.Module,
    units: list[UnitBytes],
    replay: Replay,
    batch_fn: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    mp: MixedPrecision | None,
) -> None:
    """Forward and backward of one micro-batch under ``FakeTensorMode``, unit events fed to
    ``replay`` from module and tensor hooks (the moments fshard's own hooks act)."""
    from torch._subclasses import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    live = LiveBytes()
    handles: list[Any] = []
    with _fake_parameters(model, fake_mode, mp) as fakes:

        def drop_for(unit: UnitBytes) -> Callable[[], int]:
            def drop() -> int:
                for p in unit.params:
                    fake = fakes.get(id(p))
                    if fake is not None:
                        fake.grad = None
                return live.current

            return drop

        for unit in units:
            handles.extend(_hook_unit(unit, replay, live, drop_for(unit)))
        try:
            model.train()
            with fake_mode, live:
                batch = batch_fn()
                if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
                    dtype = mp.param_dtype
                    batch = tree_map(
                        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        batch,
                    )
                live.reset_peak()
                loss = loss_fn(model, batch)
                loss.backward()
                del loss
                replay.end_backward(live.take_peak(), live.current, drop_for)
        finally:
            for handle in handles:
                handle.remove()


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def _hook_unit(unit: UnitBytes, replay: Replay, live: LiveBytes, drop: Callable[[], int]) -> list[Any]:
    """Forward pre/post hooks on the unit's module that feed ``replay`` its events."""
    waiting = [0]

    def input_grad_ready() -> None:
        waiting[0] -= 1
        if waiting[0] == 0:
            replay.post_backward(unit, live.take_peak(), live.current, drop)

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        if _in_backward():
            return None  # an activation-checkpoint recompute: the unit is gathered, nothing to arm
        replay.pre_forward(unit, live.take_peak(), live.current)
        if unit is replay.root or not torch.is_grad_enabled():
            return None
        count = [0]

        def mark(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                count[0] += 1
                return _InputsGradReady.apply(t, input_grad_ready)
            return t

        args, kwargs = tree_map(mark, (args, kwargs))
        waiting[0] = count[0]
        return args, kwargs

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if _in_backward():
            return  # a recompute: fshard frees the unit after its backward, not here
        replay.post_forward(unit, live.take_peak(), live.current)
        fired = [False]

        def once(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                replay.pre_backward(unit, live.take_peak(), live.current)

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(once)

    return [
        unit.module.register_forward_pre_hook(pre, with_kwargs=True),
        unit.module.register_forward_hook(post, with_kwargs=True),
    ]

