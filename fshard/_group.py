"""One unit (one ``fully_shard`` call): its buckets, states and collectives.

Control flows state -> group -> bucket/slot; the hooks in ``_hooks`` decide *when* each named
transition runs, this module decides *what* it does.

[Note: when a unit's backward is done]
A unit's backward is done when the gradients of its forward inputs are ready: an identity
autograd Function on the inputs says so, at the same point of the backward on every rank
(every node of the unit that reads its params leads to the inputs, detached uses of a weight
included). Then the unit is freed and its gradients reduced, in that order, so the reduce's
full-size input never coexists with the gathered params. Counting arrived gradients would not
do: a param used on some ranks only (an expert the router skipped here) leaves the count short
on those ranks, which would reduce later than the others and pair the wrong collectives.

A forward run without grad inside an autograd Function's forward, within a forward with grad
or on inputs requiring grad (a reentrant checkpoint's segment), arms that identity when its
recompute runs in backward; until then the unit is not done, and stays gathered once gathered
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

import logging
import warnings
import weakref
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, SupportsIndex

import torch
import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._errors import first_few, internal_error
from fshard._mesh import PostForwardGroup, post_forward_group
from fshard._options import BackwardPrefetch
from fshard._param import GATHERED, FlatBucket, ParamSlot, chunk_cat
from fshard._placement import divide_factors
from fshard._profiling import phase

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo
    from fshard._options import CPUOffload, MixedPrecision

__all__ = ["ShardedState", "TrainingState", "ParamGroup", "PendingReduce", "PendingAllReduce"]

logger = logging.getLogger("fshard")


class ShardedState(Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


class TrainingState(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class PendingReduce:
    """A bucket's gradient reduce-scatter in flight; ``finish`` lands the sharded grads."""

    def __init__(
        self,
        group: ParamGroup,
        bucket_index: int,
        slots: list[ParamSlot],
        offsets: list[int],
        present: list[bool],
        output: torch.Tensor,
        work: dist.Work | None,
        post_divide: float,
    ) -> None:
        self.group = group
        self.bucket_index = bucket_index
        self.slots = slots
        self.offsets = offsets
        self.present = present  # which slots had a gradient on this rank (see _Reduced)
        self.output = output  # 1D, this rank's reduced chunk, reduce dtype
        self.work = work
        self.post_divide = post_divide
        # It carries sums of earlier no_sync micro-batches: a backward that raises with it in
        # flight lands it rather than drop them (see RootState._recover_from_aborted_backward).
        self.carries_sums = False

    def discard(self) -> None:
        """Wait for the reduce-scatter (peers issued it too) and drop its result."""
        _collectives.wait(self.work, op="reduce_scatter", label=self.group.trace_name)
        self.work = None

    def finish(self) -> PendingAllReduce | None:
        """Wait for the reduce-scatter; return the cross-replica all-reduce it issued, if any."""
        with phase(f"fshard::finish_reduce({self.group.trace_name})"):
            _collectives.wait(self.work, op="reduce_scatter", label=self.group.trace_name)
            self.work = None
            output = self.output
            if self.post_divide != 1.0:
                output[: self.offsets[-1]].div_(self.post_divide)  # (not the flags)
            follow_up = self.group.land_reduced(
                self.bucket_index, _Reduced(self.slots, self.offsets, self.present, output)
            )
            if follow_up is not None:
                follow_up.carries_sums = follow_up.carries_sums or self.carries_sums
            return follow_up


class PendingAllReduce:
    """A bucket's cross-replica all-reduce (2D meshes) in flight; ``finish`` sets the grads."""

    def __init__(self, reduced: _Reduced, work: dist.Work | None, label: str, carries_sums: bool) -> None:
        self.reduced = reduced
        self.work = work
        self.label = label
        self.carries_sums = carries_sums  # see PendingReduce

    def discard(self) -> None:
        _collectives.wait(self.work, op="all_reduce", label=self.label)
        self.work = None

    def finish(self) -> None:
        _collectives.wait(self.work, op="all_reduce", label=self.label)
        self.work = None
        self.reduced.assign()


# [Note: resharding to a smaller group after forward]
# With ``reshard_after_forward=N`` (an int dividing the shard dimension's size S), a forward with
# grad ends by keeping 1/N of the gathered parameters rather than none (True) or all (False):
# the N consecutive ranks of the shard group around this rank share them, each keeping the
# rows of S/N of the S shards, and the backward all-gathers them over those N ranks only (one
# host's, on a multi-host job) instead of over S. Rank p of the N keeps block p: rows
# [p * S/N, (p + 1) * S/N) of every parameter's rank-major gathered buffer, slot after slot, so
# that the N blocks gathered rank-major are that buffer again, cut in N. The rows are the
# values the forward gathered (the backward must see those), valid while the shards' version
# counters are unchanged; any other freeing of the unit drops them, and so does the next
# model forward (an optimizer step may have changed the shards meanwhile).
class _KeptRows(NamedTuple):
    target: PostForwardGroup
    rows: list[torch.Tensor | None]  # per bucket (None: aliased, nothing gathered)
    versions: tuple[int, ...]  # the shards' version counters when the forward gathered


# Units that were holding gathered parameters aside (hidden: kept from a forward for its
# backward, or from a backward without gradient sync) or rows kept by reshard_after_forward=<int>:
# an optimizer step over their parameters frees them first (see _hooks._free_kept_before_step).
# Pruned there, lazily.
KEPT_GATHERED: weakref.WeakSet[ParamGroup] = weakref.WeakSet()


class ParamGroup:
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
        # Whether the modules hold the gathered params (they hold the shards again once the
        # model's forward is over, though the gathered storage may be kept for backward).
        self.unsharded_registered = False
        self.training_state = TrainingState.IDLE
        # Gradient sync controls (no_sync / set_requires_gradient_sync).
        self.requires_gradient_sync = True
        # False (set_reshard_after_backward): the gathered params outlive the backward, hidden,
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
        # Sharded partial sums awaiting the cross-replica all-reduce (HSDP, reduce_scatter=True).
        self._partials: dict[int, _Reduced] = {}
        self._grad_hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        # All-gather outputs issued and not yet waited for: a unit collected with some (its
        # model dropped after a forward raised) takes them out of the gathered-bytes count.
        self._in_flight_bytes = [0]
        weakref.finalize(self, _forget_in_flight, self._in_flight_bytes)
        self._kept_rows: _KeptRows | None = None  # see [Note: resharding to a smaller group ...]
        self._kept_bytes = [0]
        weakref.finalize(self, _forget_in_flight, self._kept_bytes)
        self.root: object | None = None  # the RootState of the tree, set at root init
        # set_prefetch overrides; None means the recorded order decides.
        self.explicit_forward_prefetch: list[ParamGroup] | None = None
        self.explicit_backward_prefetch: list[ParamGroup] | None = None
        self.forward_prefetch_default = True
        self.backward_prefetch_default = BackwardPrefetch.BACKWARD_PRE
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

    # ---------------------------------------------------------------------------------- layout

    def set_slots(self, slots: list[ParamSlot], locals_: list[torch.Tensor]) -> None:
        """(Re)build the buckets for ``slots`` whose local shards are ``locals_``."""
        if self.sharded_state is not ShardedState.SHARDED:
            raise internal_error(f"unit {self.label} rebuilt while {self.sharded_state.value}")
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
        # Params whose gathered copy is separate storage (not the shard itself): edits made to
        # it in place are lost when the unit is freed ([Note: edits to gathered copies]).
        self._copied_slots = [slot for b in self.buckets if not b.aliased for slot in b.slots]
        self._gathered_versions: list[int] | None = None
        # The shards' version counters when the latest forward with grad read them: a backward
        # of that forward (or of an older, retained graph) checks them. Noted per slot, so a
        # forward before a rebuild has no say.
        self._forward_versions: tuple[int, ...] | None = None
        self._versions_at_gather: tuple[int, ...] | None = None  # the shards' when gather issued
        for slot in self.slots:
            self._ensure_grad_hook(slot)

    def _ensure_grad_hook(self, slot: ParamSlot) -> None:
        """Count this param's gradient arrivals ([Note: when a unit's backward is done])."""
        unsharded = slot.unsharded_param
        if unsharded is None:
            return  # built on first unshard, hooked then
        if unsharded.requires_grad and not unsharded.__dict__.get("_fshard_hooked", False):
            unsharded._fshard_hooked = True  # type: ignore[attr-defined]  # marker on our own tensor
            # Weakly bound: a hook held by a tensor on the C++ side hides its references from
            # the garbage collector, so a bound method here would keep the model alive forever.
            ref = weakref.ref(self)

            def hook(param: torch.Tensor) -> None:
                group = ref()
                if group is not None:
                    group._on_grad_accumulated(param)

            self._grad_hook_handles.append(unsharded.register_post_accumulate_grad_hook(hook))
        sharded = slot.sharded_param
        if sharded.requires_grad and not sharded.__dict__.get("_fshard_hooked", False):
            sharded._fshard_hooked = True  # type: ignore[attr-defined]  # marker, as above
            sharded.register_post_accumulate_grad_hook(
                _used_while_sharded(slot.fqn, self.label, weakref.ref(self))
            )

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

    @property
    def num_grad_params(self) -> int:
        """Params of this unit that require grad (cached at each unshard; flags may change)."""
        return self._num_grad_params

    # ------------------------------------------------------------------------- copy and pickle

    def _refuse_copy(self) -> TypeError:
        return TypeError(
            f"cannot copy or pickle the fshard unit {self.label}: a sharded module holds this "
            "rank's shards and the mesh's process groups. Deep-copy or pickle the model before "
            "fully_shard, or build a new model and load fshard.state_dict(model) (or "
            "fshard.full_state_dict) into it; torch.save(model.state_dict()) works"
        )

    def __deepcopy__(self, memo: dict[int, object]) -> ParamGroup:
        raise self._refuse_copy()

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        raise self._refuse_copy()

    # ------------------------------------------------------------------------------ unsharding

    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> UNSHARDING (-> UNSHARDED unless ``async_op``): all-gather every bucket."""
        if (self.is_hidden() or self.sharded_state is ShardedState.UNSHARDING) and (
            self._versions_at_gather != self._shard_versions()
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
            kept.versions != self._shard_versions() or not all(b.is_packed() for b in self.buckets)
        ):
            self.drop_kept_rows()  # the shards changed since: gather them
            kept = None
        self.ensure_packed()
        with phase(f"fshard::unshard({self.trace_name})"):
            pending: list[tuple[FlatBucket, dist.Work | None, torch.Tensor, int]] = []
            for index, bucket in enumerate(self.buckets):
                if bucket.aliased:
                    continue
                rows = kept.rows[index] if kept is not None else None
                if kept is not None and rows is not None:
                    output = torch.empty(kept.target.size * rows.numel(), dtype=rows.dtype, device=rows.device)
                    nbytes = output.numel() * output.element_size()
                    GATHERED.add(nbytes)
                    self._in_flight_bytes[0] += nbytes
                    work = _collectives.all_gather_into(
                        output, rows, kept.target.group, label=self.trace_name, async_op=async_op
                    )
                    pending.append((bucket, work, output, kept.target.size))
                    continue
                all_gather_input = bucket.all_gather_input()
                size = self.mesh_info.shard_size
                if size == 1:
                    pending.append((bucket, None, all_gather_input, 0))
                    continue
                all_gather_output = torch.empty(
                    size * bucket.total, dtype=all_gather_input.dtype, device=all_gather_input.device
                )
                nbytes = all_gather_output.numel() * all_gather_output.element_size()
                GATHERED.add(nbytes)
                self._in_flight_bytes[0] += nbytes
                work = _collectives.all_gather_into(
                    all_gather_output,
                    all_gather_input,
                    self.mesh_info.shard_group,
                    label=self.trace_name,
                    async_op=async_op,
                )
                pending.append((bucket, work, all_gather_output, 0))
            self._pending_gather = pending
            # What the gather reads: the shards, or rows kept from when the forward read them.
            self._versions_at_gather = kept.versions if kept is not None else self._shard_versions()
            self.sharded_state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED: wait for the all-gathers and register the full params."""
        if self.sharded_state is ShardedState.UNSHARDED:
            if not self.unsharded_registered:
                self._register_unsharded()
            return
        if self.sharded_state is not ShardedState.UNSHARDING:
            raise internal_error(f"wait_for_unshard on unit {self.label} that is sharded")
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
            self._register_unsharded()
            self._note_gathered_versions()
        self.sharded_state = ShardedState.UNSHARDED

    def _shard_versions(self) -> tuple[int, ...]:
        return tuple(s.sharded_param._version for s in self.slots)

    def _register_unsharded(self) -> None:
        """Put the gathered params in the modules (with the shards' ``requires_grad``)."""
        num_grad_params = 0
        for slot in self.slots:
            unsharded = slot.unsharded_param
            if unsharded is None:
                raise internal_error(f"parameter {slot.fqn!r} has no unsharded param")
            requires_grad = slot.requires_grad
            num_grad_params += requires_grad
            if unsharded.requires_grad != requires_grad:
                unsharded.requires_grad_(requires_grad)
            self._ensure_grad_hook(slot)
            if slot.sharded_param._backward_hooks and requires_grad:
                _forward_tensor_hooks(slot)
            slot.use_unsharded()
        self._num_grad_params = num_grad_params
        self.unsharded_registered = True

    # [Note: edits to gathered copies]
    # A unit's forward computes with gathered copies; an in-place change to one (an
    # nn.Embedding with max_norm renormalising its rows, a weight clamped inside forward, an
    # edit between fshard.unshard and fshard.reshard) changes the copy, not the shard, and is
    # dropped when the unit is freed, where DDP would keep it. The copies' version counters
    # (their own: see [Note: storage reuse]) tell, so freeing warns, naming the parameters.

    def _note_gathered_versions(self) -> None:
        self._gathered_versions = [
            s.unsharded_param._version if s.unsharded_param is not None else 0
            for s in self._copied_slots
        ]

    def _warn_on_dropped_edits(self) -> None:
        before, self._gathered_versions = self._gathered_versions, None
        if not before:
            return
        changed = [
            repr(slot.fqn)
            for slot, version in zip(self._copied_slots, before, strict=True)
            if slot.unsharded_param is not None and slot.unsharded_param._version != version
        ]
        if changed:
            warnings.warn(
                f"fshard: parameters {first_few(changed)} of unit {self.label} were modified in "
                "place while gathered (inside the unit's forward, as nn.Embedding(max_norm=...) "
                "or a clamp_ on a weight do, or between fshard.unshard and fshard.reshard); "
                "the change was made to the gathered copy and is dropped now that the unit is "
                "freed, where DDP would keep it. Modify the shards (p.to_local()) outside the "
                "forward, or free with fshard.reshard(module, writeback=True).",
                stacklevel=2,
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
            rows = full.detach().reshape(layout.full_shape)
            if not layout.replicated:
                rows = rows.narrow(0, layout.row_offset, layout.local_shape[0])
            if rows.data_ptr() != shard.data_ptr():  # NO_SHARD / one rank: already the shard
                with torch.no_grad():
                    shard.copy_(rows.reshape(layout.local_shape))
        if not check_only:
            self._note_gathered_versions()  # the edits are kept now

    def note_forward_versions(self) -> None:
        """Remember the shards' version counters as a forward with grad reads them."""
        self._forward_versions = self._shard_versions()

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
        """The storages of this unit's gathered copies that freeing it releases."""
        ptrs = {b.gathered_storage_ptr() for b in self.buckets}
        ptrs.discard(0)
        return ptrs

    def hide_unsharded(self) -> None:
        """Put the shards back in the modules but keep the gathered storage (which autograd
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
        """After a forward with grad: free the gathered params but keep this rank's block of
        their rows for the backward's all-gather over ``post_forward_size`` ranks."""
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
        versions = self._versions_at_gather or self._shard_versions()
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
        """UNSHARDED -> SHARDED: swap the shards back in and free the gathered storage (and
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
        self._reduced = False
        self._freed_in_backward = False
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
        # unit stays gathered, and is reduced, to the end (see _pre_backward_of_earlier_graph).
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
            ctx._fshard_segment_claims = claims  # type: ignore[attr-defined]
        claims.append(claim)
        self._segments.add(claim)

    def consume_segment(self) -> None:
        if self._segments:
            self._segments.pop()

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
        """The unit's backward is done with its gathered params: free them, or, with
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

    def may_need_params_in_backward(self) -> bool:
        """Whether this step's backward may read the gathered params (they need grad, or a
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
        elif not self.parked and not self._reduced:
            self.parked = True
            root = self.root
            if root is not None:
                root.park(self)  # type: ignore[attr-defined]  # RootState, see _hooks

    def release_parked(self) -> None:
        """Another unit's backward began after this one's part for one forward ended, with the
        part for another forward still to come (two forwards before one backward: the second
        forward's backward first, through every unit, then the first's). Free the params, as
        between two steps, so that the units of the first pass are not all held gathered
        until the second reaches them; that one gathers this unit again. Its gradients are
        reduced once, when its last part is done (autograd adds the parts up in any case: a
        parameter's gradient lands in ``.grad`` once its every use is done). The moments are
        the hooks every rank runs alike. A unit called twice in a row (weights shared across
        depth) is not released between its calls: nothing else begins in between."""
        self.parked = False
        self.reshard()
        self.training_state = TrainingState.POST_BACKWARD

    def prefetch_for_backward(self) -> None:
        """Start gathering this unit for its backward, unless that is over already (the order
        of this step's forward differs from the recorded one). Decided by what every rank
        knows alike: whether the unit was reduced, not whether it was freed early."""
        if not self._reduced:
            self.unshard(async_op=True)

    def skipped_by_backward(self) -> bool:
        """Whether this step's backward has nothing to do with this unit, so a backward
        prefetch should pass it over: its forward did not run since the last backward (a
        skipped block), or ran only without grad outside a reentrant checkpoint (a target
        computed under ``torch.no_grad()`` inside the training forward), or no parameter of it
        requires grad and no forward of it had inputs requiring grad (a frozen embedding, a
        frozen teacher). Should its backward come all the same (a reentrant checkpoint's
        recompute, a tensor that reached the forward another way), that gathers the unit
        itself. Decided by the forwards that ran, which every rank runs alike."""
        if self._reduced:
            return False
        return (
            not self.ran_since_backward
            or (not self.grad_forward_ran and self.checkpointed_calls == 0)
            or (self.num_grad_params == 0 and not self.inputs_grad_awaited)
        )

    def _on_grad_accumulated(self, _param: torch.Tensor) -> None:
        self._grads_accumulated += 1
        if self.backward_task is not None and not self._nested_grads:
            self._nested_grads = torch._C._current_graph_task_id() != self.backward_task
        root = self.root
        if root is not None:
            root.ensure_final_callback()  # type: ignore[attr-defined]  # RootState, see _hooks
        if self._grads_accumulated == self.num_grad_params and (
            self.unwaited_forward or not self._waiters
        ):
            # Every gradient is here, so nothing in this backward reads the params any more:
            # free them. The reduce waits for the end of the backward, where every rank issues
            # it in the same order: a param used on some ranks only leaves the count short
            # there, and reducing here on the others would pair the wrong collectives.
            self._free_without_reduce()

    def post_backward(self) -> None:
        """This unit's backward is done: free it and reduce its gradients (unless accumulating).

        Done when its forward inputs' gradients are ready, the same moment on every rank (a
        count of arrived gradients is not: an expert routed to on some ranks only); a unit
        without such inputs is reduced by the end-of-backward callback instead."""
        if self._reduced:
            return
        self._reduced = True
        self.parked = False
        # Free the gathered params first if nothing else needs them, so that the reduce's
        # full-size input does not coexist with them (the backward's peak: gathered params,
        # their gradients, the reduce input and the next unit's prefetched all-gather).
        self._maybe_finish_backward()
        with phase(f"fshard::post_backward({self.trace_name})"):
            if self.requires_gradient_sync or self.reduce_scatter_while_accumulating:
                self.reduce_grads()
            else:
                self.accumulate_unsynced_grads()
        self.training_state = TrainingState.POST_BACKWARD
        self._maybe_finish_backward()

    def _free_without_reduce(self) -> None:
        """A unit without inputs requiring grad got all its gradients: free its params (when
        nothing else may read them) but leave the reduce, and any prefetch a free would start,
        to the end of the backward, a moment every rank reaches at the same point."""
        if self.earlier_graph or self._frozen_or_nested_keep() or not all(w.ready for w in self._waiters):
            return  # (the backward of a call with such inputs may still read the params)
        self.free_after_backward()
        self._freed_in_backward = True

    def _frozen_or_nested_keep(self) -> bool:
        """For a unit without inputs requiring grad: whether its params must stay gathered
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
        grads_done = self._reduced or self.num_grad_params == 0
        waiting = len(self._waiters) > 0
        if not grads_done or (waiting and not all(w.ready for w in self._waiters)):
            return
        if self.checkpointed_calls > 0 or (not waiting and self._frozen_or_nested_keep()):
            return  # (a recompute to come, frozen params or a nested backward may read them)
        self.free_after_backward()
        if not self._freed_in_backward:
            self._freed_in_backward = True
            root = self.root
            if root is not None:  # BACKWARD_POST prefetch: once this unit is freed
                root.on_unit_backward_done(self)  # type: ignore[attr-defined]  # RootState

    def has_unreduced_grads(self) -> bool:
        """Gradients that no ``.grad`` shows yet: full ones kept under ``no_sync``, or (2D mesh,
        sharded accumulation) shard-group sums waiting for the cross-replica all-reduce."""
        return self.has_unsharded_grads() or bool(self._partials)

    def has_unsharded_grads(self) -> bool:
        return any(
            s.accumulated_grad is not None
            or (s.unsharded_param is not None and s.unsharded_param.grad is not None)
            for s in self.slots
        )

    def reduce_dtype(self, bucket: FlatBucket) -> torch.dtype:
        """The dtype gradients of ``bucket`` are reduced (and accumulated unsynced) in."""
        mp = self.mp_policy
        if mp is not None and mp.reduce_dtype is not None and bucket.compute_dtype.is_floating_point:
            return mp.reduce_dtype
        return bucket.compute_dtype

    def mark_awaiting_sync(self) -> None:
        """After an unsynchronised backward: the params requiring grad now keep their place in
        the next reduces until one synchronises, so a param frozen in between loses nothing."""
        for slot in self.slots:
            if slot.requires_grad:
                slot.awaiting_sync = True

    def accumulate_unsynced_grads(self) -> None:
        """Under ``no_sync``: move this backward's full gradients into the reduce-dtype sums
        where the reduce dtype is not the compute dtype, as DDP-equal accumulation needs."""
        for bucket in self.buckets:
            dtype = self.reduce_dtype(bucket)
            if dtype == bucket.compute_dtype:
                continue  # autograd's own accumulation into .grad is exact enough
            for slot in bucket.slots:
                unsharded = slot.unsharded_param
                if unsharded is None or unsharded.grad is None:
                    continue
                grad, unsharded.grad = unsharded.grad, None
                if slot.accumulated_grad is None:
                    slot.accumulated_grad = grad.to(dtype)
                else:
                    slot.accumulated_grad.add_(grad)

    def drop_unsharded_grads(self) -> None:
        for slot in self.slots:
            slot.drop_unsharded_grad()

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
            grads = [_summed_grad(s) for s in slots]
            pending = self._reduce_bucket(index, slots, grads)
            pending.carries_sums = carries_sums
            for slot in slots:
                slot.drop_unsharded_grad()
            if root is not None:
                root.add_pending_reduce(pending)  # type: ignore[attr-defined]  # RootState
            else:
                follow_up = pending.finish()
                if follow_up is not None:
                    follow_up.finish()

    def _reduce_bucket(
        self, index: int, slots: list[ParamSlot], grads: list[torch.Tensor | None]
    ) -> PendingReduce:
        info = self.mesh_info
        size = info.shard_size
        reduce_dtype = self.reduce_dtype(self.buckets[index])
        inputs = []
        offsets = [0]
        present = [g is not None for g in grads]
        dp_rank = info.replicate_rank * size + info.shard_rank
        for slot, grad in zip(slots, grads, strict=True):
            layout = slot.layout
            if grad is None:  # unused on this rank this step: contribute zeros
                grad = torch.zeros(layout.full_shape, dtype=reduce_dtype, device=info.device)
            elif grad.layout is not torch.strided:
                raise TypeError(
                    f"fshard: the gradient of {slot.fqn!r} in unit {self.label} is "
                    f"{grad.layout} (from an embedding with sparse=True?); fshard reduce-scatters "
                    "dense gradients: make the operation produce a dense one"
                )
            if grad.dtype != reduce_dtype:
                grad = grad.to(reduce_dtype)
            if layout.replicated:
                # [Note: replicated gradients] Every rank holds the whole value, so every
                # rank must get the same sum, to the bit: a sum the reduce-scatter computed
                # per chunk differs in its order, and so in its last bits, from rank to rank
                # (the copies, and Adam's moments, would drift apart). Each data-parallel rank
                # sends its gradient in a column of its own, zeros elsewhere: what comes back
                # is every rank's gradient exactly (x + 0 is x), and _replicated_sum adds
                # them in one fixed order on every rank.
                column = torch.zeros((1, info.dp_size), dtype=reduce_dtype, device=info.device)
                column[0, dp_rank] = grad
                inputs.append(column.expand(size, info.dp_size))
                offsets.append(offsets[-1] + info.dp_size)
            else:
                inputs.append(grad.reshape(layout.full_shape[0], -1))
                offsets.append(offsets[-1] + layout.slot_numel)
        # [Note: which params got a gradient] One flag per slot after each rank's chunk: the
        # reduce sums them, so every rank learns which params got a gradient on *any* rank.
        if all(present):
            flags = torch.ones((1, len(slots)), dtype=reduce_dtype, device=info.device)
        else:
            flags = torch.tensor([present], dtype=reduce_dtype, device=info.device)
        inputs.append(flags.expand(size, len(slots)))
        total = offsets[-1] + len(slots)
        with phase(f"fshard::reduce_scatter_input({self.trace_name})"):
            reduce_input = torch.empty((size, total), dtype=reduce_dtype, device=info.device)
            chunk_cat(inputs, size, reduce_input)
            pre, post = divide_factors(info.dp_size, reduce_dtype, self.gradient_divide_factor)
            if pre != 1.0:
                # (Not the flags, which stay counts: a large divide factor would round them to 0.)
                reduce_input[:, : offsets[-1]].div_(pre)
        if size == 1:
            return PendingReduce(
                self, index, slots, offsets, present, reduce_input.view(-1), None, post
            )
        output = torch.empty(total, dtype=reduce_dtype, device=info.device)
        work = _collectives.reduce_scatter_into(
            output, reduce_input.view(-1), info.shard_group, label=self.trace_name, async_op=True
        )
        return PendingReduce(self, index, slots, offsets, present, output, work, post)

    def land_reduced(self, index: int, reduced: _Reduced) -> PendingAllReduce | None:
        """After a bucket's reduce-scatter: set the sharded grads, or (2D mesh) issue the
        cross-replica all-reduce that will, returned as a ``PendingAllReduce``."""
        info = self.mesh_info
        if info.replicate_group is not None and info.replicate_size > 1:
            partial = self._partials.pop(index, None)
            if partial is not None:
                reduced = reduced.merged_with(partial)
            if not self.requires_gradient_sync:
                # Sharded accumulation: keep the shard-group sum, all-reduce on the sync step.
                self._partials[index] = reduced
                return None
            work = _collectives.all_reduce_(
                reduced.output, info.replicate_group, label=self.trace_name, async_op=True
            )
            return PendingAllReduce(reduced, work, self.trace_name, carries_sums=partial is not None)
        reduced.assign()
        return None

    def flush_partials(self) -> None:
        """On a synchronised backward, all-reduce partial sums this step did not touch."""
        if not self._partials or not self.requires_gradient_sync:
            return
        for index in sorted(self._partials):
            reduced = self._partials.pop(index)
            _collectives.all_reduce_(reduced.output, self.mesh_info.replicate_group, label=self.trace_name)
            reduced.assign()


def _replicated_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` (one per data-parallel rank) as a 0-d tensor, added in the same
    order on every rank: pairwise, by element-wise adds, whose results do not depend on how
    the memory happens to be aligned (a reduction kernel's may). See [Note: replicated
    gradients]."""
    while values.numel() > 1:
        half = values.numel() // 2
        folded = values[:half] + values[half : 2 * half]
        if values.numel() % 2:
            folded[-1:] += values[-1:]
        values = folded
    return values.reshape(())


def _summed_grad(slot: ParamSlot) -> torch.Tensor | None:
    """The slot's full gradient: this backward's plus any no_sync sum kept in the reduce dtype."""
    grad = slot.unsharded_param.grad if slot.unsharded_param is not None else None
    accumulated = slot.accumulated_grad
    if accumulated is None:
        return grad
    return accumulated if grad is None else accumulated.add_(grad)


class InputWaiter:
    """One forward's claim on a unit: its inputs' gradients are not all computed yet."""

    __slots__ = ("__weakref__", "ready")

    def __init__(self) -> None:
        self.ready = False


def _forget_in_flight(in_flight_bytes: list[int]) -> None:
    GATHERED.sub(in_flight_bytes[0])


def _used_while_sharded(
    fqn: str, unit: str, group_ref: weakref.ref[ParamGroup]
) -> Callable[[torch.Tensor], None]:
    """A hook for autograd accumulating into a *sharded* param: something outside the unit's
    forward used the registered parameter while it held only this rank's shard (no fshard
    computation puts a sharded param in the graph; ``to_local()`` is detached). Right for an
    elementwise use (a penalty over ``model.parameters()``: the shard's gradient is this
    rank's rows of the full one), wrong for one that mixes rows (``F.linear(h, embed.weight)``
    in the parent): a warning, once per model, since the two cannot be told apart here."""

    def hook(_param: torch.Tensor) -> None:
        group = group_ref()
        root = group.root if group is not None else None
        if root is None or root.warned_sharded_use:  # type: ignore[attr-defined]  # RootState
            return
        root.warned_sharded_use = True  # type: ignore[attr-defined]  # RootState
        warnings.warn(
            f"fshard: parameter {fqn!r} of unit {unit} got a gradient from a use outside its "
            "unit's forward, where it holds only this rank's shard. That is right for an "
            "elementwise use (a penalty such as sum(p.pow(2).sum() for p in "
            "model.parameters()); its value is this rank's part), and wrong for anything that "
            "mixes the parameter's rows, e.g. a tied head calling F.linear(h, self.embed.weight) "
            "in the parent: put the owner and the user in one unit (fully_shard their common "
            "parent only, or tie through an nn.Module sharing the weight). Warned once per model.",
            stacklevel=2,
        )

    hook._fshard_internal = True  # type: ignore[attr-defined]  # not run by _run_user_grad_hooks
    return hook


def _forward_tensor_hooks(slot: ParamSlot) -> None:
    """Make the hooks a user registered on a sharded param with ``register_hook`` run on its
    gathered copy's gradient, the one autograd computes (full shape, before the reduction, as
    DDP runs them before its all-reduce): autograd never computes a sharded param's own."""
    unsharded = slot.unsharded_param
    if unsharded is None or unsharded.__dict__.get("_fshard_forwards_hooks", False):
        return
    unsharded._fshard_forwards_hooks = True  # type: ignore[attr-defined]  # marker on our own tensor
    sharded_ref = weakref.ref(slot.sharded_param)  # weakly: see _ensure_grad_hook

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        sharded = sharded_ref()
        hooks = sharded._backward_hooks if sharded is not None else None
        if not hooks:
            return None
        dtype = grad.dtype
        for user_hook in list(hooks.values()):
            changed = user_hook(grad)
            if changed is not None:
                grad = changed
        # A hook may promote (an fp32 mask on a bf16 gradient under MixedPrecision).
        return grad if grad.dtype == dtype else grad.to(dtype)

    unsharded.register_hook(hook)


def _run_user_grad_hooks(param: torch.Tensor) -> None:
    """Run the post-accumulate-grad hooks users registered on a sharded param, once its reduced
    gradient has landed in ``.grad`` (autograd never accumulates into a sharded param itself).
    This is what optimizer-in-backward (a per-parameter ``step()`` in such a hook) needs."""
    hooks = param._post_accumulate_grad_hooks
    if not hooks:
        return
    for hook in list(hooks.values()):
        if not getattr(hook, "_fshard_internal", False):
            hook(param)


class _SegmentClaim:
    """A unit's claim that a reentrant checkpoint's recompute may still come (see
    ``ParamGroup.claim_segment``); only weak references are kept but the Function's own."""

    __slots__ = ("__weakref__",)


class _Reduced(NamedTuple):
    """A bucket's reduced gradient chunk: ``output[offsets[i]:]`` belongs to ``slots[i]``, and
    ``output[offsets[-1] + i]`` counts the ranks where ``slots[i]`` got a gradient."""

    slots: list[ParamSlot]
    offsets: list[int]
    present: list[bool]  # on this rank; the flags in ``output`` say for every rank
    output: torch.Tensor  # 1D, reduce dtype, on the compute device

    def merged_with(self, older: _Reduced) -> _Reduced:
        """Add an earlier micro-batch's partial sum into this one."""
        if [id(s) for s in older.slots] == [id(s) for s in self.slots]:
            self.output.add_(older.output)
            present = [a or b for a, b in zip(self.present, older.present, strict=True)]
            return self._replace(present=present)
        # The set of params requiring grad changed between micro-batches: merge slot by slot.
        where = {id(s): i for i, s in enumerate(self.slots)}
        present = list(self.present)
        for j, slot in enumerate(older.slots):
            i = where.get(id(slot))
            if i is None:
                continue
            n = older.offsets[j + 1] - older.offsets[j]
            new, old = self.offsets[i], older.offsets[j]
            self.output[new : new + n].add_(older.output[old : old + n])
            self.output[self.offsets[-1] + i].add_(older.output[older.offsets[-1] + j])
            present[i] = present[i] or older.present[j]
        return self._replace(present=present)

    def anywhere(self) -> list[bool]:
        """Which slots got a gradient on some rank (reads the flags only if one did not here)."""
        if all(self.present):
            return self.present
        start = self.offsets[-1]
        flags = self.output[start : start + len(self.slots)].tolist()
        # abs(): the flags share the bucket's dtype, which may be complex.
        return [here or abs(flag) > 0 for here, flag in zip(self.present, flags, strict=True)]

    def assign(self) -> None:
        """Set (or accumulate into) ``.grad`` of each sharded param that got a gradient on
        any rank (as DDP does: the others' rows are averaged in even where it was unused)."""
        if not self.slots:
            return
        output = self.output
        first = self.slots[0].sharded_param
        if output.dtype != first.dtype or output.device != first.device:
            # Blocking when it lands on the host (CPU offload): the optimizer reads it next.
            to_host = first.device.type == "cpu" and output.device.type != "cpu"
            output = output.to(first.device, first.dtype, non_blocking=not to_host)
        ends = self.offsets[1:]
        for slot, offset, end, present in zip(self.slots, self.offsets[:-1], ends, self.anywhere(), strict=True):
            if not present:
                continue
            layout = slot.layout
            if layout.replicated:
                grad = _replicated_sum(output[offset:end])
            else:
                grad = output[offset : offset + layout.local_numel].view(layout.local_shape)
            param = slot.sharded_param
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
            _run_user_grad_hooks(param)
