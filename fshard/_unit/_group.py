"""One unit (one ``fully_shard`` call): its buckets, its states and the named transitions.

Control flows state -> group -> bucket/slot; the hooks in ``_hooks`` decide *when* each named
transition runs, this module decides *what* it does. The tensors each transition moves are named
in [Note: fshard tensors] (``fshard._param``); when a unit's backward is done is decided by its
base ``UnitBackward`` (``_backward``), and its gradients are reduced by ``_reduce``.
"""

from __future__ import annotations

import logging
import weakref
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, SupportsIndex

import torch
import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._bucket import GATHERED, FlatBucket
from fshard._errors import first_few, internal_error, warn_user
from fshard._mesh import PostForwardGroup, post_forward_group
from fshard._options import DEFAULT_COALESCE_BYTES, BackwardPrefetch
from fshard._param import ParamSlot, local_rows
from fshard._profiling import phase
from fshard._unit._backward import UnitBackward
from fshard._unit._context import RootContext
from fshard._unit._grad_hooks import ensure_grad_hooks, forward_tensor_hooks
from fshard._unit._reduce import UnitGrads, reduce_scatter_alone, reduce_scatter_input, summed_grad

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo
    from fshard._options import CPUOffload, MixedPrecision

__all__ = [
    "KEPT_GATHERED",
    "ParamGroup",
    "ShardedState",
    "TrainingState",
    "group_of",
    "unshard_together",
]

logger = logging.getLogger("fshard")


class ShardedState(Enum):
    """Where a unit's parameters are. Two sub-states are flags, not members (the hooks and the
    user API compare these members), and ``describe_state`` names them: UNSHARDED but *hidden*
    (``is_hidden``: the modules hold the shards again, the unsharded storage is kept for a
    backward) and SHARDED with *kept rows* (``holds_kept_rows``: ``reshard_after_forward=<int>``,
    see [Note: resharding to a smaller group after forward])."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


class TrainingState(Enum):
    """What the unit is doing. In a backward a unit may be *parked* (``parked``: one
    forward's part of the backward done, another's to come)."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"



# [Note: resharding to a smaller group after forward]
# With ``reshard_after_forward=N`` (an int dividing the shard dimension's size S), a forward with
# grad ends by keeping 1/N of the unsharded parameters rather than none (True) or all (False):
# the N consecutive ranks of the shard group around this rank share them, each keeping the
# rows of S/N of the S shards, and the backward all-gathers them over those N ranks only (one
# host's, on a multi-host job) instead of over S. Rank p of the N keeps block p: rows
# [p * S/N, (p + 1) * S/N) of every parameter's rank-major unsharded buffer, slot after slot, so
# that the N blocks gathered rank-major are that buffer again, cut in N. The rows are the
# values the forward gathered (the backward must see those), valid while the shards' version
# counters are unchanged; any other freeing of the unit drops them, and so does the next
# model forward (an optimizer step may have changed the shards meanwhile).
class _KeptRows(NamedTuple):
    target: PostForwardGroup
    rows: list[torch.Tensor | None]  # per bucket (None: aliased, nothing gathered)
    versions: tuple[int, ...]  # the shards' version counters when the forward gathered


# Units that were holding unsharded parameters aside (hidden: kept from a forward for its
# backward, or from a backward without gradient sync) or rows kept by reshard_after_forward=<int>:
# an optimizer step over their parameters frees them first (see _hooks._free_kept_before_step).
# Pruned there, lazily.
KEPT_GATHERED: weakref.WeakSet[ParamGroup] = weakref.WeakSet()



class ParamGroup(UnitBackward, UnitGrads):
    """The state of one unit: its parameters, their flat buckets and the unit's state machine."""

    def __init__(
        self,
        module: nn.Module,
        slots: list[ParamSlot],
        mesh_info: MeshInfo,
        *,
        reshard_after_forward: bool | int,
        mp_policy: MixedPrecision | None,
        offload_policy: CPUOffload | None,
        locals_: list[torch.Tensor],
    ) -> None:
        self.module = module
        # Every module of the unit: ``module`` alone, or the modules given to
        # ``fully_shard([norm, head])`` (``module`` is the first of them).
        self.modules: list[nn.Module] = [module]
        self.fqns: list[str] = []  # every module's FQN, set at root init ("" for the root)
        # Of a unit of several modules: those that have not run yet in this forward; the unit
        # is freed after the last of them (see _hooks._post_forward), or, if one does not run,
        # at the end of the model's forward (``deferred_reshard``).
        self.modules_to_run: set[int] = set()
        self.deferred_reshard = False
        # Forwards of this unit's modules under way (one of them called inside another's) and
        # the outer ones' passed inputs, set aside meanwhile.
        self.forward_depth = 0
        self.outer_passed: list[dict[int, tuple[torch.Tensor, torch.Tensor]] | None] = []
        # Set when a nested call (one inside another) returned, for the forward hook that runs
        # even when a forward raised: that call did not (see _hooks._after_forward).
        self.nested_returned = False
        self.forward_mark = -1  # the model forward (RootState.forwards) it last started in
        self.mesh_info = mesh_info
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.slots: list[ParamSlot] = []
        self.buckets: list[FlatBucket] = []
        self.sharded_state = ShardedState.SHARDED
        # Whether the modules hold the unsharded params (they hold the shards again once the
        # model's forward is over, though the unsharded storage may be kept for backward).
        self.unsharded_registered = False
        self.training_state = TrainingState.IDLE
        # Gradient sync controls (no_sync / set_requires_gradient_sync).
        self.requires_gradient_sync = True
        # False (set_reshard_after_backward): the unsharded params outlive the backward, hidden,
        # and the next forward uses them if the shards did not change since (no all-gather).
        self.reshard_after_backward = True
        # The sum over data-parallel ranks is divided by this (None: their number, the average,
        # as DDP); set by set_gradient_divide_factor.
        self.gradient_divide_factor: float | None = None
        self.reduce_scatter_while_accumulating = False
        # (bucket, work, output, parts): parts > 0 for a gather of kept rows (see the Note).
        self._pending_gather: list[tuple[FlatBucket, dist.Work | None, torch.Tensor, int]] = []
        # The running forward's inputs as passed through _InputsGradReady: id(passed) ->
        # (passed, what the unit was given), to hand back the latter if the unit returns one.
        self.passed_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._partials = {}  # see UnitGrads
        self._grad_hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        # All-gather outputs issued and not yet waited for: a unit collected with some (its
        # model dropped after a forward raised) takes them out of the gathered-bytes count.
        self._in_flight_bytes = [0]
        weakref.finalize(self, _forget_in_flight, self._in_flight_bytes)
        self._kept_rows: _KeptRows | None = None  # see [Note: resharding to a smaller group ...]
        self._kept_bytes = [0]
        weakref.finalize(self, _forget_in_flight, self._kept_bytes)
        self.root: RootContext[ParamGroup] | None = None  # the tree's root context, set at root init
        # set_prefetch overrides; None means the recorded order decides.
        self.explicit_forward_prefetch: list[ParamGroup] | None = None
        self.explicit_backward_prefetch: list[ParamGroup] | None = None
        self.forward_prefetch_default = True
        self.backward_prefetch_default = BackwardPrefetch.BACKWARD_PRE
        # Adjacent small units share one all-gather up to this many bytes of all-gather output
        # (set_coalescing; 0: every unit its own). See [Note: coalesced all-gathers].
        self.coalesce_bytes = DEFAULT_COALESCE_BYTES
        # The modules of this unit not inside another unit (built on first use, see _hooks).
        self.own_modules: list[nn.Module] | None = None
        # Per own module: its attribute count when last looked at, and the attributes that may
        # hold a tensor made in forward (see _hooks._made_since).
        self.attr_index: list[tuple[int, tuple[str, ...]]] = []
        # Modules of this unit called from outside its forward, being run as its forward now.
        self.outside_calls: list[nn.Module] = []
        self.order_mark = -1  # the step in which it last ran with grad (RootState.steps)
        # Autograd's sequence number when the latest forward with grad began (see _hooks).
        self.forward_seq = 0
        self.reset_backward()
        self.set_slots(slots, locals_)

    @property
    def fqn(self) -> str | None:
        """The (first) module's FQN, ``None`` before root init."""
        return self.fqns[0] if self.fqns else None

    @property
    def label(self) -> str:
        """How error messages name this unit: its quoted FQN, or ``<root>`` (a unit of several
        modules: the list of them)."""
        if len(self.modules) > 1:
            names = [repr(f) for f in self.fqns] if self.fqns else [type(m).__name__ for m in self.modules]
            return "[" + ", ".join(names) + "]"
        if self.fqn is None:
            return type(self.module).__name__
        return repr(self.fqn) if self.fqn else "<root>"

    @property
    def trace_name(self) -> str:
        """How collective traces and profiler labels name this unit: its FQN, or ``<root>``
        (a unit of several modules: their FQNs joined by ``+``)."""
        if len(self.modules) > 1:
            return "+".join(self.fqns) if self.fqns else "+".join(type(m).__name__ for m in self.modules)
        if self.fqn is None:
            return type(self.module).__name__
        return self.fqn or "<root>"

    # ----------------------------------------------------------------------------------- state

    def describe_state(self) -> str:
        """The unit's state for messages, implicit sub-states included: ``hidden`` (unsharded
        but the modules hold the shards), rows kept by ``reshard_after_forward=<int>``, parked
        between two forwards' parts of one backward."""
        sharded = self.sharded_state.value
        if self.is_hidden():
            sharded += " (hidden)"
        elif self._kept_rows is not None:
            sharded += f" (rows kept for {self._kept_rows.target.size} ranks)"
        training = self.training_state.value + (" (parked)" if self.parked else "")
        return f"{sharded}, {training}"

    def _state_error(self, transition: str, expected: str) -> RuntimeError:
        """``transition`` found the unit in a state it cannot start from: an fshard bug, named
        with the unit and its state. (Callers test the precondition inline: the hot path pays
        no call for it.)"""
        return internal_error(
            f"{transition} on unit {self.label} in state {self.describe_state()}; "
            f"expected {expected}"
        )

    def pre_forward(self) -> None:
        """The unit's forward begins (not a recompute in backward): IDLE/FORWARD -> FORWARD.

        The first forward since the last backward starts the backward bookkeeping afresh; a
        call of a module of this unit inside another's forward sets the outer one's passed
        inputs aside (``forward_depth``)."""
        if self.root is None:
            raise self._state_error("pre_forward", "the root's lazy init to have run")
        if self.training_state is TrainingState.IDLE and not self.ran_since_backward:
            self.reset_backward()  # the first forward since the last backward
        self.training_state = TrainingState.FORWARD
        self.ran_since_backward = True
        if self.forward_depth > 0:
            # A module of this unit (of several) called inside the forward of another of them:
            # the outer call's passed inputs wait (see _hooks._post_forward).
            self.outer_passed.append(self.passed_inputs)
            self.passed_inputs = None
        self.forward_depth += 1
        if len(self.modules) > 1 and not self.modules_to_run:
            # A unit of several modules is gathered once for all of them (see _hooks).
            self.modules_to_run = {id(m) for m in self.modules}

    def post_forward(self, *, free: bool, grad_enabled: bool, model_forward_running: bool) -> bool:
        """The unit's outermost forward call returned: -> IDLE, freeing the unit if ``free``
        (after a forward with grad and ``reshard_after_forward=<int>``, to the rows kept for the
        backward).

        A unit of several modules some of which have not run yet in the model's forward stays
        unsharded for them; if one does not run after all, the end of the model's forward
        frees it (``deferred_reshard``). Returns whether it resharded to the post-forward group
        (rows kept for the backward, which the root's next forward drops if unused)."""
        if self.forward_depth != 0:
            raise self._state_error("post_forward", "its outermost forward call")
        kept_rows = False
        if free:
            if self.modules_to_run and model_forward_running:
                self.deferred_reshard = True
            elif grad_enabled and self.post_forward_size:
                self.reshard_post_forward()
                self.deferred_reshard = False
                kept_rows = True
            else:
                self.reshard()
                self.deferred_reshard = False
        self.training_state = TrainingState.IDLE
        return kept_rows

    def pre_backward(self) -> None:
        """The unit's backward begins (or goes on: a later output's hook): -> PRE_BACKWARD,
        unsharded. Not for a unit whose backward is over (reduced, or freed once every
        gradient arrived): gathering again on some ranks only would leave collectives
        unpaired."""
        if self.grads_reduced or self.freed_in_backward:
            raise self._state_error("pre_backward", "a unit whose backward is not over")
        if self.training_state is TrainingState.PRE_BACKWARD and (
            self.sharded_state is ShardedState.UNSHARDED
        ):
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()

    # ---------------------------------------------------------------------------------- layout

    def set_slots(self, slots: list[ParamSlot], locals_: list[torch.Tensor]) -> None:
        """(Re)build the buckets for ``slots`` whose local shards are ``locals_``."""
        if self.sharded_state is not ShardedState.SHARDED:
            raise self._state_error("set_slots", "a sharded unit")
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles = []
        self.slots = list(slots)
        self._num_grad_params = sum(1 for s in self.slots if s.requires_grad)
        for slot in self.slots:
            slot.group_ref = weakref.ref(self)
        by_dtype: dict[torch.dtype, list[tuple[ParamSlot, torch.Tensor]]] = {}
        for slot, local in zip(slots, locals_, strict=True):
            by_dtype.setdefault(local.dtype, []).append((slot, local))
        offload = self.offload_policy
        shard_device = torch.device("cpu") if offload is not None else self.mesh_info.device
        self.buckets = []
        for dtype, members in by_dtype.items():
            compute_dtype = dtype
            if self.mp_policy is not None and self.mp_policy.param_dtype is not None:
                if dtype.is_floating_point:
                    compute_dtype = self.mp_policy.param_dtype
            bucket = FlatBucket(
                [m[0] for m in members],
                self.mesh_info,
                compute_dtype=compute_dtype,
                shard_device=shard_device,
                pin_memory=offload is not None and offload.pin_memory,
            )
            bucket.pack([m[1] for m in members])
            self.buckets.append(bucket)
        # Params whose unsharded copy is separate storage (not the shard itself): edits made to
        # it in place are lost when the unit is freed ([Note: edits to unsharded copies]).
        self._copied_slots = [slot for b in self.buckets if not b.aliased for slot in b.slots]
        self._unsharded_versions: list[int] | None = None
        # The shards' version counters when the latest forward with grad read them: a backward
        # of that forward (or of an older, retained graph) checks them. Noted per slot, so a
        # forward before a rebuild has no say.
        self.forward_versions: tuple[int, ...] | None = None
        self._versions_at_gather: tuple[int, ...] | None = None  # the shards' when gather issued
        for slot in self.slots:
            ensure_grad_hooks(self, slot, self._grad_hook_handles)

    def ensure_packed(self) -> None:
        """Re-pack if a sharded param's data was replaced since packing (e.g. ``model.to``)."""
        if all(b.is_packed() for b in self.buckets):
            return
        for slot in self.slots:
            shape = slot.sharded_param.shape
            if shape != slot.layout.local_shape:
                raise ValueError(
                    f"parameter {slot.fqn!r} of fshard unit {self.label} was given data of shape "
                    f"{list(shape)} after fully_shard, but its shard of the full "
                    f"{list(slot.layout.full_shape)} parameter is {list(slot.layout.local_shape)} "
                    "on this rank: something replaced it as if it held the full parameter "
                    "(resize_token_embeddings, p.data = new_tensor). Change parameter shapes "
                    "before fully_shard."
                )
        logger.debug("fshard: re-packing unit %s after its parameters' data changed", self.label)
        self.set_slots(self.slots, [s.sharded_param.detach() for s in self.slots])

    # ------------------------------------------------------------------------- copy and pickle

    def refuse_copy(self) -> TypeError:
        return TypeError(
            f"cannot copy or pickle the fshard unit {self.label}: a sharded module holds this "
            "rank's shards and the mesh's process groups. Deep-copy or pickle the model before "
            "fully_shard, or build a new model and load fshard.state_dict(model) (or "
            "fshard.full_state_dict) into it; torch.save(model.state_dict()) works"
        )

    def __deepcopy__(self, memo: dict[int, object]) -> ParamGroup:
        raise self.refuse_copy()

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        raise self.refuse_copy()

    # ------------------------------------------------------------------------------ unsharding

    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> UNSHARDING (-> UNSHARDED unless ``async_op``): all-gather every bucket."""
        if (self.is_hidden() or self.sharded_state is ShardedState.UNSHARDING) and (
            self._versions_at_gather != self.shard_versions()
            or not all(b.is_packed() for b in self.buckets)
        ):
            # Kept from a forward whose backward has not run, or prefetched by one (a unit
            # called again late in the forward prefetches the one recorded after it), or kept
            # from a backward without gradient sync (set_reshard_after_backward), and the shards
            # changed since the gather was issued (an optimizer step, an edit; or their data
            # was replaced: p.data = ..., model.to(dtype)): gather afresh rather than show the
            # old values. (That backward, if it comes, raises: see
            # check_unchanged_since_forward.) The same on every rank: every rank steps or edits
            # alike.
            self.reshard()
        if self.sharded_state is ShardedState.UNSHARDED or (
            self.sharded_state is ShardedState.UNSHARDING and not async_op
        ):
            self.wait_for_unshard()  # prefetched: wait for it; kept but hidden: show it again
        if self.sharded_state is not ShardedState.SHARDED:
            return
        kept = self._kept_rows
        if kept is not None and (
            kept.versions != self.shard_versions() or not all(b.is_packed() for b in self.buckets)
        ):
            self.drop_kept_rows()  # the shards changed since: gather them
            kept = None
        self.ensure_packed()
        with phase(f"fshard::unshard({self.trace_name})"):
            self._pending_gather = self._issue_all_gathers(kept, async_op)
            # What the gather reads: the shards, or rows kept from when the forward read them.
            self._versions_at_gather = kept.versions if kept is not None else self.shard_versions()
            self.sharded_state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def _issue_all_gathers(
        self, kept: _KeptRows | None, async_op: bool
    ) -> list[tuple[FlatBucket, dist.Work | None, torch.Tensor, int]]:
        """All-gather every bucket that is not aliased: its all-gather input over the shard
        group, or the rows kept from the forward over their smaller group (``parts`` > 0)."""
        pending: list[tuple[FlatBucket, dist.Work | None, torch.Tensor, int]] = []
        size = self.mesh_info.shard_size
        for index, bucket in enumerate(self.buckets):
            if bucket.aliased:
                continue
            rows = kept.rows[index] if kept is not None else None
            if kept is not None and rows is not None:
                inputs, group, parts = rows, kept.target.group, kept.target.size
            else:
                inputs, group, parts = bucket.all_gather_input(), self.mesh_info.shard_group, 0
                if size == 1:
                    pending.append((bucket, None, inputs, 0))  # the all-gather output itself
                    continue
            output = torch.empty(
                (parts or size) * inputs.numel(), dtype=inputs.dtype, device=inputs.device
            )
            nbytes = output.numel() * output.element_size()
            GATHERED.add(nbytes)
            self._in_flight_bytes[0] += nbytes
            work = _collectives.all_gather_into(
                output, inputs, group, label=self.trace_name, async_op=async_op
            )
            pending.append((bucket, work, output, parts))
        return pending

    def coalescable_bytes(self) -> int:
        """The bytes of this unit's all-gather output if its gather may be issued together with
        other units' now (a plain sharded unit: one bucket gathered over the whole shard group),
        else 0. Decided by state every rank holds alike."""
        if (
            self.sharded_state is not ShardedState.SHARDED
            or self._kept_rows is not None
            or len(self.buckets) != 1
            or self.mesh_info.shard_size == 1
        ):
            return 0
        bucket = self.buckets[0]
        if bucket.aliased or not bucket.is_packed():
            return 0
        return self.mesh_info.shard_size * bucket.total * bucket.compute_dtype.itemsize

    def adopt_gather(self, work: dist.Work | None, output: torch.Tensor) -> None:
        """SHARDED -> UNSHARDING with ``output`` (a ``(shard_size, total)`` view of an
        all-gather issued for several units, see ``unshard_together``) as its all-gather output."""
        nbytes = output.numel() * output.element_size()
        GATHERED.add(nbytes)
        self._in_flight_bytes[0] += nbytes
        self._pending_gather = [(self.buckets[0], work, output, 0)]
        self._versions_at_gather = self.shard_versions()
        self.sharded_state = ShardedState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED: wait for the all-gathers and register the full params."""
        if self.sharded_state is ShardedState.UNSHARDED:
            if not self.unsharded_registered:
                self.register_unsharded()
            return
        if self.sharded_state is not ShardedState.UNSHARDING:
            raise self._state_error(
                "wait_for_unshard", "an all-gather issued (unsharding) or done (unsharded)"
            )
        with phase(f"fshard::copy_out({self.trace_name})"):
            from_kept = False
            for bucket, work, all_gather_output, parts in self._pending_gather:
                _collectives.wait(work, op="all_gather", label=self.trace_name)
                # Allocated only now: a prefetched unit holds the all-gather output alone
                # while its gather is in flight, not that and its unsharded params.
                bucket.alloc_unsharded()
                bucket.copy_out(all_gather_output, parts)
                from_kept = from_kept or parts > 0
                if self.mesh_info.shard_size > 1:  # size 1 gathers nothing: no output buffer
                    nbytes = all_gather_output.numel() * all_gather_output.element_size()
                    GATHERED.sub(nbytes)
                    self._in_flight_bytes[0] -= nbytes
            self._pending_gather = []
            if from_kept:
                self.drop_kept_rows()  # gathered again: the full params hold them now
            self.register_unsharded()
            self._note_unsharded_versions()
        self.sharded_state = ShardedState.UNSHARDED

    def shard_versions(self) -> tuple[int, ...]:
        return tuple(s.sharded_param._version for s in self.slots)

    def register_unsharded(self) -> None:
        """Put the unsharded params in the modules (with the shards' ``requires_grad``)."""
        num_grad_params = 0
        for slot in self.slots:
            unsharded = slot.unsharded_param
            if unsharded is None:
                raise internal_error(f"parameter {slot.fqn!r} has no unsharded param")
            requires_grad = slot.requires_grad
            num_grad_params += requires_grad
            if unsharded.requires_grad != requires_grad:
                unsharded.requires_grad_(requires_grad)
            ensure_grad_hooks(self, slot, self._grad_hook_handles)
            if slot.sharded_param._backward_hooks and requires_grad:
                forward_tensor_hooks(slot)
            slot.use_unsharded()
        self._num_grad_params = num_grad_params
        self.unsharded_registered = True

    # [Note: edits to unsharded copies]
    # A unit's forward computes with unsharded copies; an in-place change to one (an
    # nn.Embedding with max_norm renormalising its rows, a weight clamped inside forward, an
    # edit between fshard.unshard and fshard.reshard) changes the copy, not the shard, and is
    # dropped when the unit is freed, where DDP would keep it. The copies' version counters
    # (their own: see [Note: storage reuse]) tell, so freeing warns, naming the parameters.

    def _note_unsharded_versions(self) -> None:
        self._unsharded_versions = [
            s.unsharded_param._version if s.unsharded_param is not None else 0
            for s in self._copied_slots
        ]

    def _warn_on_dropped_edits(self) -> None:
        before, self._unsharded_versions = self._unsharded_versions, None
        if not before:
            return
        changed = [
            repr(slot.fqn)
            for slot, version in zip(self._copied_slots, before, strict=True)
            if slot.unsharded_param is not None and slot.unsharded_param._version != version
        ]
        if changed:
            warn_user(
                f"fshard: parameters {first_few(changed)} of unit {self.label} were modified in "
                "place while gathered (inside the unit's forward, as nn.Embedding(max_norm=...) "
                "or a clamp_ on a weight do, or between fshard.unshard and fshard.reshard); "
                "the change was made to the gathered copy and is dropped now that the unit is "
                "freed, where DDP would keep it. Modify the shards (p.to_local()) outside the "
                "forward, or free with fshard.reshard(module, writeback=True)."
            )

    def write_back(self, *, check_only: bool = False) -> None:
        """Copy this rank's rows of each gathered parameter into its shard (``reshard``'s
        ``writeback``): edits made to the full parameters while gathered are kept. With
        ``check_only``, only raise if it cannot."""
        if self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()
        if self.sharded_state is not ShardedState.UNSHARDED or self.is_hidden():
            return  # (hidden: kept for a backward, the modules show the shards, edits go there)
        for slot in self.slots:
            full, shard = slot.unsharded_param, slot.sharded_param
            if full is None:
                raise internal_error(f"parameter {slot.fqn!r} has no unsharded param")
            if full.dtype != shard.dtype:
                raise ValueError(
                    f"fshard.reshard(writeback=True): unit {self.label} holds {slot.fqn!r} "
                    f"gathered in {full.dtype} (its MixedPrecision param_dtype) but keeps the "
                    f"shard in {shard.dtype}; writing back would round every value of the "
                    "shard. Edit the shards (p.to_local()) or load new values with "
                    "fshard.load_state_dict instead."
                )
            if check_only:
                continue
            layout = slot.layout
            rows = local_rows(full.detach().reshape(layout.full_shape), layout)
            if rows.data_ptr() != shard.data_ptr():  # NO_SHARD / one rank: already the shard
                with torch.no_grad():
                    shard.copy_(rows.reshape(layout.local_shape))
        if not check_only:
            self._note_unsharded_versions()  # the edits are kept now

    def note_forward_versions(self) -> None:
        """Remember the shards' version counters as a forward with grad reads them."""
        self.forward_versions = self.shard_versions()

    def check_unchanged_since_forward(self, before: tuple[int, ...] | None) -> None:
        """Raise if a shard was modified in place since the forward (whose version counters
        were ``before``) that the backward now reaches: that backward would mix the values
        gathered then (kept, or saved by autograd in storage a later gather refills) with the
        new ones. Autograd raises for the same code on an unsharded model, as DDP does."""
        if before is None:
            return
        changed = [
            repr(slot.fqn)
            for slot, version in zip(self.slots, before, strict=True)
            if slot.sharded_param._version != version
        ]
        if changed:
            raise RuntimeError(
                f"fshard: parameters {first_few(changed)} of unit {self.label} were modified "
                "in place (optimizer.step(), load_state_dict, copy_, ...) after the forward "
                "whose backward is now running, so its gradients would mix the old and the new "
                "values. Modify parameters after the backward, or run the forward again. (On an "
                "unsharded model or under DDP, autograd raises 'one of the variables needed for "
                "gradient computation has been modified by an inplace operation' for this.)"
            )

    def is_hidden(self) -> bool:
        """Gathered, but the modules hold the shards (see ``hide_unsharded``)."""
        return self.sharded_state is ShardedState.UNSHARDED and not self.unsharded_registered

    def gathered_storage_ptrs(self) -> set[int]:
        """The storages of this unit's unsharded copies that freeing it releases."""
        ptrs = {b.unsharded_storage_ptr() for b in self.buckets}
        ptrs.discard(0)
        return ptrs

    def hide_unsharded(self) -> None:
        """Put the shards back in the modules but keep the unsharded storage (which autograd
        saved for backward): outside a forward or backward, ``model.parameters()``, hence
        ``model.zero_grad()``, in-place edits and optimizers built then, see the shards."""
        if self.sharded_state is ShardedState.UNSHARDED and self.unsharded_registered:
            for slot in self.slots:
                slot.use_sharded()
            self.unsharded_registered = False
            KEPT_GATHERED.add(self)

    @property
    def post_forward_size(self) -> int:
        """The ranks to reshard to after a forward with grad: ``reshard_after_forward``'s int
        (0 for a bool). See [Note: resharding to a smaller group after forward]."""
        value = self.reshard_after_forward
        return 0 if isinstance(value, bool) else value

    def holds_kept_rows(self) -> bool:
        return self._kept_rows is not None

    def reshard_post_forward(self) -> None:
        """After a forward with grad: free the unsharded params but keep this rank's block of
        their rows for the backward's all-gather over ``post_forward_size`` ranks."""
        if self.post_forward_size <= 0:
            raise self._state_error("reshard_post_forward", "reshard_after_forward=<int>")
        if self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()
        self.drop_kept_rows()
        if self.sharded_state is not ShardedState.UNSHARDED or any(b.aliased for b in self.buckets):
            self.reshard()
            return
        target = post_forward_group(self.mesh_info, self.post_forward_size)
        rows: list[torch.Tensor | None] = [
            None if b.aliased else b.post_forward_rows(target.rank, target.size) for b in self.buckets
        ]
        versions = self._versions_at_gather or self.shard_versions()
        self.reshard()
        nbytes = sum(r.numel() * r.element_size() for r in rows if r is not None)
        GATHERED.add(nbytes)
        self._kept_bytes[0] = nbytes
        self._kept_rows = _KeptRows(target, rows, versions)
        KEPT_GATHERED.add(self)

    def drop_kept_rows(self) -> None:
        if self._kept_rows is not None:
            self._kept_rows = None
            GATHERED.sub(self._kept_bytes[0])
            self._kept_bytes[0] = 0

    def reshard(self) -> None:
        """UNSHARDED -> SHARDED: swap the shards back in and free the unsharded storage (and
        any rows kept from a forward: see [Note: resharding to a smaller group after forward])."""
        if self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()
        self.drop_kept_rows()
        if self.sharded_state is ShardedState.SHARDED:
            return
        self._warn_on_dropped_edits()
        with phase(f"fshard::reshard({self.trace_name})"):
            for slot in self.slots:
                slot.use_sharded()
            for bucket in self.buckets:
                bucket.free_unsharded()
        self.unsharded_registered = False
        self.sharded_state = ShardedState.SHARDED

    # -------------------------------------------------------------------------------- backward

    def end_backward(self, *, aborted: bool = False) -> None:
        """Back to idle after a backward (or an aborted one: always freed), bookkeeping
        forgotten."""
        if aborted:
            self.reshard()
        else:
            self.free_after_backward()
        self.reset_backward()
        self.training_state = TrainingState.IDLE

    def free_after_backward(self) -> None:
        """The unit's backward is done with its unsharded params: free them, or, with
        ``reshard_after_backward`` off and in a backward without gradient sync (a gradient
        accumulation micro-batch), put the shards back in the modules and keep the gathered
        storage for the next forward (``unshard`` shows it again if the shards have not
        changed since the gather, and gathers afresh if they have).

        A synchronised backward always frees: the optimizer step that follows changes the
        shards, and not every change shows in their version counters (fused optimizers and
        ``p.data.add_`` write without bumping them), so the next forward must gather."""
        if (
            not self.reshard_after_backward
            and not self.requires_gradient_sync
            and self.sharded_state is ShardedState.UNSHARDED
        ):
            self.hide_unsharded()
        else:
            self.reshard()

    def release_parked(self) -> None:
        """Another unit's backward began after this one's part for one forward ended, with the
        part for another forward still to come (two forwards before one backward: the second
        forward's backward first, through every unit, then the first's). Free the params, as
        between two steps, so that the units of the first pass are not all held unsharded
        until the second reaches them; that one gathers this unit again. Its gradients are
        reduced once, when its last part is done (autograd adds the parts up in any case: a
        parameter's gradient lands in ``.grad`` once its every use is done). The moments are
        the hooks every rank runs alike. A unit called twice in a row (weights shared across
        depth) is not released between its calls: nothing else begins in between."""
        if not self.parked:
            raise self._state_error("release_parked", "a parked unit (see on_inputs_grad_ready)")
        self.parked = False
        self.reshard()
        self.training_state = TrainingState.POST_BACKWARD

    def prefetch_for_backward(self) -> None:
        """Start gathering this unit for its backward, unless that is over already (the order
        of this step's forward differs from the recorded one). Decided by what every rank
        knows alike: whether the unit was reduced, not whether it was freed early."""
        if not self.grads_reduced:
            self.unshard(async_op=True)

    def post_backward(self) -> None:
        """This unit's backward is done: free it and reduce its gradients (unless accumulating).

        Done when its forward inputs' gradients are ready, the same moment on every rank (a
        count of arrived gradients is not: an expert routed to on some ranks only); a unit
        without such inputs is reduced by the end-of-backward callback instead."""
        if self.grads_reduced:
            return
        self.grads_reduced = True
        self.parked = False
        # Free the unsharded params first if nothing else needs them, so that the reduce's
        # full-size input does not coexist with them (the backward's peak: unsharded params,
        # their gradients, the reduce input and the next unit's prefetched all-gather).
        self._maybe_finish_backward()
        with phase(f"fshard::post_backward({self.trace_name})"):
            if self.requires_gradient_sync or self.reduce_scatter_while_accumulating:
                self.reduce_grads()
            else:
                self.accumulate_unsynced_grads()
        self.training_state = TrainingState.POST_BACKWARD
        self._maybe_finish_backward()

    def reduce_grads(self) -> None:
        """Reduce-scatter (and on 2D meshes all-reduce) every bucket's unsharded grads."""
        root = self.root
        for index, bucket in enumerate(self.buckets):
            slots = [
                s
                for s in bucket.slots
                if (s.requires_grad or s.awaiting_sync) and s.layout.slot_numel > 0
            ]
            if not slots:
                continue
            carries_sums = any(slot.awaiting_sync for slot in slots)
            if self.requires_gradient_sync:
                for slot in slots:
                    slot.awaiting_sync = False
            # Reduced even with no gradient here: another rank may have some (and every rank
            # must issue the same collectives).
            grads = [summed_grad(s) for s in slots]
            unissued = reduce_scatter_input(
                self,
                index,
                slots,
                grads,
                mesh_info=self.mesh_info,
                reduce_dtype=self.reduce_dtype(bucket),
                divide_factor=self.gradient_divide_factor,
            )
            pending = None
            if (
                root is not None
                and self.coalesce_bytes
                and len(self.buckets) == 1
                and self.mesh_info.shard_size > 1
                and self.requires_gradient_sync
                and not carries_sums
            ):
                # Issued by the root, maybe with the next units' ([Note: coalesced
                # reduce-scatters] in _reduce).
                root.queue_reduce(unissued, self.coalesce_bytes)
            else:
                pending = reduce_scatter_alone(unissued)
                pending.carries_sums = carries_sums
            for slot in slots:
                slot.drop_unsharded_grad()
            if pending is None:
                continue
            if root is not None:
                root.add_pending_reduce(pending)
            else:
                follow_up = pending.finish()
                if follow_up is not None:
                    follow_up.finish()

# [Note: coalesced all-gathers]
# Over gloo (and NCCL, at a smaller scale) a collective costs a fixed latency on top of its
# bytes: a model of many small units pays it twice per unit in every step. So when a unit's
# gather is issued ahead of its use (the forward's or the backward's prefetch; not in the
# first step, see RootState.unshard_ahead), the units that the recorded order runs right after
# it join the same all-gather, while each is a plain sharded unit (``coalescable_bytes``), holds at most ``coalesce_bytes``
# and the gather stays within the first unit's ``coalesce_bytes``: one input (their flat shards
# concatenated), one output whose ``(shard_size, sum of totals)`` view holds each unit's
# rank-major all-gather output as a block of columns. Each unit then waits for the shared work
# and copies its block out as if it had gathered alone, at its own time: what the user wrapped
# and when each unit is freed do not change, only how many collectives carry them. The price
# is memory: the units of one gather are held from its issue, at most ``coalesce_bytes`` in
# all-gather outputs (``DEFAULT_COALESCE_BYTES``, 1 MiB).


def unshard_together(groups: list[ParamGroup]) -> None:
    """Issue one all-gather for ``groups`` (each ``coalescable_bytes() > 0``, on one shard group
    and compute dtype): each goes SHARDED -> UNSHARDING with its block of the output."""
    first = groups[0]
    inputs = [g.buckets[0].all_gather_input() for g in groups]
    size = first.mesh_info.shard_size
    total = sum(t.numel() for t in inputs)
    label = f"{first.trace_name}..{groups[-1].trace_name}"
    with phase(f"fshard::unshard({label})"):
        flat = torch.cat(inputs)
        output = torch.empty(size * total, dtype=flat.dtype, device=flat.device)
        work = _collectives.all_gather_into(
            output, flat, first.mesh_info.shard_group, label=label, async_op=True
        )
        columns = output.view(size, total)
        start = 0
        for group, part in zip(groups, inputs, strict=True):
            group.adopt_gather(work, columns[:, start : start + part.numel()])
            start += part.numel()


def _forget_in_flight(in_flight_bytes: list[int]) -> None:
    GATHERED.sub(in_flight_bytes[0])


def group_of(slot: ParamSlot) -> ParamGroup | None:
    """The unit that owns ``slot`` (``None`` once it was collected)."""
    owner = slot.group_ref()
    return owner if isinstance(owner, ParamGroup) else None
