"""When a unit's backward is done: the bookkeeping ``ParamGroup`` inherits from ``UnitBackward``.

[Note: when a unit's backward is done]
A unit's backward is done when the gradients of its forward inputs are ready: an identity
autograd Function on the inputs says so, at the same point of the backward on every rank
(every node of the unit that reads its params leads to the inputs, detached uses of a weight
included). Then the unit is freed and its gradients reduced, in that order, so the reduce's
full-size input never coexists with the unsharded params. Counting arrived gradients would not
do: a param used on some ranks only (an expert the router skipped here) leaves the count short
on those ranks, which would reduce later than the others and pair the wrong collectives.

A forward run without grad inside an autograd Function's forward, within a forward with grad
or on inputs requiring grad (a reentrant checkpoint's segment), arms that identity when its
recompute runs in backward; until then the unit is not done, and stays unsharded once gathered
for it. Without grad outside such a Function (a target computed under a plain no_grad), no
backward will come for that call: it counts for nothing, as an inference forward.

A unit with no input requiring grad (the first one), called once without one, or whose inputs
sit in a list or dict (which the identity cannot replace), has no such moment: it is reduced
when the backward ends if it ran with grad or as a reentrant checkpoint's segment (not if
gradients arrived here: the same decision on every rank; one run only under
``torch.no_grad()`` gets no gradient anywhere and is not reduced), with the others left then,
in one order on every rank. Its params are freed earlier, once every param that requires
grad has its gradient (a post-accumulate-grad hook counts them), unless it has frozen params
(nothing says when they are no longer needed: a tensor may reach the forward other than as an
argument) or its reentrant checkpoint ran a nested backward (another recompute may still need
its params).

A unit whose forward ran but whose backward never finished (a parameter left unused this step,
an output that reached no loss) is finished by the root's end-of-backward callback instead,
with zeros standing in for missing gradients so that every rank packs the same reduce-scatter;
so are gradients that arrive after a unit was reduced. The identity's outputs are views that
autograd forbids changing in place: a unit must not change its input in place.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fshard._param import ParamSlot
from fshard._unit._context import RootContext

__all__ = ["InputWaiter", "UnitBackward"]


class InputWaiter:
    """One forward's claim on a unit: its inputs' gradients are not all computed yet."""

    __slots__ = ("__weakref__", "ready")

    def __init__(self) -> None:
        self.ready = False


class _SegmentClaim:
    """A unit's claim that a reentrant checkpoint's recompute may still come (see
    ``UnitBackward.claim_segment``); only weak references are kept but the Function's own."""

    __slots__ = ("__weakref__",)


class UnitBackward:
    """The part of a unit that tracks its backward ([Note: when a unit's backward is done]).

    A base of ``ParamGroup``, which provides the members declared first below; the state here
    is reset by ``reset_backward`` at the end of each backward and at a fresh forward.
    """

    # ----------------------------------------------------------- provided by ParamGroup

    # Any: the root's methods take the ParamGroup, which this module cannot name (it is its base).
    root: RootContext[Any] | None
    slots: list[ParamSlot]
    _num_grad_params: int

    def post_backward(self) -> None:
        raise NotImplementedError  # ParamGroup: free the unit and reduce its gradients

    def free_after_backward(self) -> None:
        raise NotImplementedError  # ParamGroup: free (or hide) the unsharded params

    @property
    def num_grad_params(self) -> int:
        """Params of this unit that require grad (cached at each unshard; flags may change)."""
        return self._num_grad_params

    # --------------------------------------------------------------------------- state

    def reset_backward(self) -> None:
        """Forget this backward pass's bookkeeping (end of backward, or a fresh forward)."""
        self._grads_accumulated = 0
        # One token per forward whose inputs' gradients this unit waits for, held by that
        # forward's graph: a forward whose backward never comes (an evaluation with grad, a
        # skipped step) drops its token with its graph instead of holding the unit gathered.
        self._waiters: weakref.WeakSet[InputWaiter] = weakref.WeakSet()
        # A forward with grad ran without an input requiring grad: that call's backward has no
        # moment of its own to say it is done, so the unit is reduced when the backward ends.
        self.unwaited_forward = False
        # Forwards that ran without grad on inputs requiring it (inside a reentrant
        # checkpoint): each recompute in backward arms the waiter they could not. One claim
        # each, held by the checkpoint Function's node: a graph no backward comes for drops its
        # claims with it (a count would hold the unit gathered through the next step's
        # backward).
        self._segments: weakref.WeakSet[_SegmentClaim] = weakref.WeakSet()
        self.grads_reduced = False
        self.freed_in_backward = False
        self.backward_task: int | None = None  # autograd graph task of its first pre-backward
        self._nested_grads = False  # some gradient arrived in another (nested) graph task
        self.ran_since_backward = False  # its forward ran since the last backward (prefetch frees)
        self.grad_forward_ran = False  # one of those forwards ran with grad
        # ...or ran as a reentrant checkpoint's segment: gradients may come in this backward.
        # A unit that ran only under torch.no_grad() (a target network inside the training
        # forward) gets none on any rank, so the end of the backward does not reduce it.
        self.backward_may_come = False
        self.inputs_grad_awaited = False  # one of them, with grad, had inputs requiring grad
        # This backward reached the graph of a forward from before the last backward: the
        # unit stays unsharded, and is reduced, to the end (see _pre_backward_of_earlier_graph).
        self.earlier_graph = False
        # One forward's part of this backward is done, another forward's is still to come
        # (two forwards before one backward): see park / release_parked.
        self.parked = False

    @property
    def checkpointed_calls(self) -> int:
        """Reentrant checkpoint segments of this unit whose recompute may still come."""
        return len(self._segments)

    def claim_segment(self, ctx: object) -> None:
        claim = _SegmentClaim()
        claims = getattr(ctx, "_fshard_segment_claims", None)
        if claims is None:
            claims = []
            ctx._fshard_segment_claims = claims  # type: ignore[attr-defined]  # held by the autograd Function ctx
        claims.append(claim)
        self._segments.add(claim)

    def consume_segment(self) -> None:
        if self._segments:
            self._segments.pop()

    def may_need_params_in_backward(self) -> bool:
        """Whether this step's backward may read the unsharded params (they need grad, or a
        forward input did)."""
        return self._num_grad_params > 0 or len(self._waiters) > 0

    def add_input_waiter(self) -> InputWaiter:
        waiter = InputWaiter()
        self._waiters.add(waiter)
        self.inputs_grad_awaited = True
        return waiter

    def on_inputs_grad_ready(self, waiter: InputWaiter) -> None:
        waiter.ready = True
        if self.earlier_graph or waiter not in self._waiters:
            # A graph from before the last backward is (or this one is) being traversed: the
            # end of the backward reduces the unit.
            self.backward_may_come = True
            return
        if self.unwaited_forward:
            if self._grads_accumulated == self.num_grad_params:
                self._free_without_reduce()
            return
        if self.checkpointed_calls > 0:
            return
        if all(w.ready for w in self._waiters):
            self.post_backward()
            self._maybe_finish_backward()  # reduced already (end of a retained backward): free
        elif not self.parked and not self.grads_reduced:
            self.parked = True
            root = self.root
            if root is not None:
                root.park(self)

    def skipped_by_backward(self) -> bool:
        """Whether this step's backward has nothing to do with this unit, so a backward
        prefetch should pass it over: its forward did not run since the last backward (a
        skipped block), or ran only without grad outside a reentrant checkpoint (a target
        computed under ``torch.no_grad()`` inside the training forward), or no parameter of it
        requires grad and no forward of it had inputs requiring grad (a frozen embedding, a
        frozen teacher). Should its backward come all the same (a reentrant checkpoint's
        recompute, a tensor that reached the forward another way), that gathers the unit
        itself. Decided by the forwards that ran, which every rank runs alike."""
        if self.grads_reduced:
            return False
        return (
            not self.ran_since_backward
            or (not self.grad_forward_ran and self.checkpointed_calls == 0)
            or (self.num_grad_params == 0 and not self.inputs_grad_awaited)
        )

    def on_grad_accumulated(self, _param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: one of this unit's unsharded grads arrived."""
        self._grads_accumulated += 1
        if self.backward_task is not None and not self._nested_grads:
            self._nested_grads = torch._C._current_graph_task_id() != self.backward_task
        root = self.root
        if root is not None:
            root.ensure_final_callback()
        if self._grads_accumulated == self.num_grad_params and (
            self.unwaited_forward or not self._waiters
        ):
            # Every gradient is here, so nothing in this backward reads the params any more:
            # free them. The reduce waits for the end of the backward, where every rank issues
            # it in the same order: a param used on some ranks only leaves the count short
            # there, and reducing here on the others would pair the wrong collectives.
            self._free_without_reduce()

    def _free_without_reduce(self) -> None:
        """A unit without inputs requiring grad got all its gradients: free its params (when
        nothing else may read them) but leave the reduce, and any prefetch a free would start,
        to the end of the backward, a moment every rank reaches at the same point."""
        if self.earlier_graph or self._frozen_or_nested_keep() or not all(w.ready for w in self._waiters):
            return  # (the backward of a call with such inputs may still read the params)
        self.free_after_backward()
        self.freed_in_backward = True

    def _frozen_or_nested_keep(self) -> bool:
        """For a unit without inputs requiring grad: whether its params must stay unsharded
        until the backward ends, though all its gradients arrived."""
        if self.num_grad_params < len(self.slots):
            # Frozen params, and no forward input requiring grad to tell when they are no
            # longer needed (a tensor that reached the forward another way, an attribute set by
            # the parent, may still need them): the end-of-backward callback frees the unit.
            return True
        # Gradients from a nested backward (a reentrant checkpoint within the unit's forward)
        # and no input to tell when the outer backward is done with the params: another
        # recompute may still need them, so they stay until the backward ends. So do they
        # while a reentrant checkpoint around the unit has a recompute to come (freeing them
        # on the ranks whose count is complete would make only those gather again for it).
        return self._nested_grads or self.checkpointed_calls > 0

    def _maybe_finish_backward(self) -> None:
        grads_done = self.grads_reduced or self.num_grad_params == 0
        waiting = len(self._waiters) > 0
        if not grads_done or (waiting and not all(w.ready for w in self._waiters)):
            return
        if self.checkpointed_calls > 0 or (not waiting and self._frozen_or_nested_keep()):
            return  # (a recompute to come, frozen params or a nested backward may read them)
        self.free_after_backward()
        if not self.freed_in_backward:
            self.freed_in_backward = True
            root = self.root
            if root is not None:  # BACKWARD_POST prefetch: once this unit is freed
                root.on_unit_backward_done(self)
