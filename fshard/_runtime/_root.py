"""The per-tree context a root unit owns (RootState): order, prefetch, pending reductions, the
end-of-backward callback, collective-order checks."""

from __future__ import annotations

import hashlib
import logging
import weakref

import torch
import torch.distributed as dist
from torch.autograd import Variable

from fshard import _collectives, _hang
from fshard._errors import ProblemList, RankMismatchError, internal_error
from fshard._options import BackwardPrefetch, debug_checks
from fshard._profiling import phase
from fshard._runtime._checks import check_params_in_place
from fshard._runtime._optim_hooks import _UNSYNCED
from fshard._unit._group import ParamGroup, ShardedState, TrainingState, unshard_together
from fshard._unit._reduce import (
    CoalescedReduce,
    PendingAllReduce,
    PendingReduce,
    UnissuedReduce,
    reduce_scatter_alone,
    reduce_scatter_together,
)
from fshard._unit._registry import in_backward, units_made

logger = logging.getLogger("fshard")

class _FinalCallback:
    """What a backward runs when it ends: the root's ``_final_callback``. An object of its own
    so that a weak reference tells whether the engine still holds it."""

    __slots__ = ("__weakref__", "root")

    def __init__(self, root: RootState) -> None:
        self.root = root

    def __call__(self) -> None:
        self.root._final_callback()


class RootState:
    """Per-tree state owned by the root unit: order, prefetch, pending reductions, callback."""

    def __init__(self, root: ParamGroup, groups: list[ParamGroup]) -> None:
        self.root = root
        self.groups = groups
        self.units_made = units_made()  # units_under(root) is ``groups`` while this holds
        self.forward_order: list[ParamGroup] = []  # first forward's units, as each started
        self._followed = 0  # this forward's units checked against forward_order (follow)
        self._departed = False  # this forward departed from it (once is enough to agree)
        # This step's units (forwards with grad since the last backward), as each first ran,
        # and the order the last checked step (or the first) ran them in: see _check_unit_order.
        self.step_order: list[ParamGroup] = []
        self.reference_order: list[ParamGroup] | None = None
        self.steps = 0  # backwards so far (units mark their first run in a step with it)
        self.forwards = 0  # the model's forwards so far (units mark their first run in one)
        self._order_checked = False  # in this backward
        self.finish_order: list[ParamGroup] = []  # and as each finished (the root last)
        self._recorded = False
        self._recording = False
        self._callback_queued = False
        # The callback queued: the engine holds it until its backward ends, and drops it
        # unrun when that backward raises (see recover_if_backward_aborted).
        self._callback_token: weakref.ref[_FinalCallback] | None = None
        self._parked: list[ParamGroup] = []  # see ParamGroup.release_parked
        self._pending_reduces: list[PendingReduce | CoalescedReduce | PendingAllReduce] = []
        # Reduce-scatter inputs built and not yet issued, and their bytes: [Note: coalesced
        # reduce-scatters] in _reduce.
        self._unissued: list[UnissuedReduce] = []
        self._unissued_bytes = 0
        self._next_forward: dict[int, list[ParamGroup]] = {}
        self._next_backward: dict[int, list[ParamGroup]] = {}
        # See [Note: Ranks must issue the same collectives] in _collectives. FSHARD_DEBUG also
        # turns prefetch off: ranks that ran different units then issue as many collectives as
        # each other where they can, so the check names the first difference instead of the
        # step hanging until the timeout on a prefetch the other ranks never issued.
        self._check_every_step = debug_checks()
        _collectives.refresh_debug()
        self._checking = True  # until the first backward's check, or always with FSHARD_DEBUG
        self.grad_forward_pending = False
        self.warned_sharded_use = False  # see _used_while_sharded in _group
        self.hidden_kept = False  # some unit is kept gathered but hidden (see on_root_pre_forward)
        self.grad_forwards = 0  # unit forwards run with grad (see register_forward_method)
        self._process_groups = _process_groups_of(groups)
        for process_group in self._process_groups:
            _collectives.start_recording(process_group)
        check_prefetch_targets(groups)

    # Order and prefetch -----------------------------------------------------------------------

    def on_root_pre_forward(self) -> None:
        if self._callback_queued and not in_backward():
            self._recover_from_aborted_backward()
        self.forwards += 1
        for group in self.groups:
            group.modules_to_run.clear()  # (a module of a unit of several did not run)
            group.forward_depth = 0  # (a forward of it raised)
            group.outer_passed.clear()
        check_params_in_place(self.groups)
        if self.root.training_state is TrainingState.FORWARD:
            self.recover_from_aborted_forward()
        self.finish_reduces()
        if self.hidden_kept:
            # Units a previous forward kept (hidden) for a backward that has not run, e.g. an
            # evaluation outside torch.no_grad(): their shards may have changed since (an
            # optimizer step, in-place edits), so this forward gathers afresh. That backward, if
            # it comes, gathers them again into the storage it saved. The same on every rank:
            # it depends on the forwards and backwards run, not on what changed.
            self.hidden_kept = False
            for group in self.groups:
                if group.training_state is TrainingState.IDLE and (
                    group.is_hidden() or group.holds_kept_rows()
                ):
                    group.reshard()  # (also the rows a reshard_after_forward=<int> unit kept)
        if torch.is_grad_enabled():
            self.grad_forward_pending = True
        if not self._recorded and torch.is_grad_enabled():
            self._recording = True
            self.forward_order = []
            self.finish_order = []
        self._followed = 0
        _hang.set_departure(None)

    def on_root_post_forward(self) -> None:
        if self._recording:
            self._recording = False
            self._recorded = True
            self._build_prefetch_plan()
        elif self._followed < len(self.forward_order) and not self._departed:
            # Units of the first step did not run in this forward: see follow.
            missing = self.forward_order[self._followed]
            self._depart(f"this forward ended before unit {missing.label} ran, which the first step ran")
        self._departed = False
        # Free what was prefetched for a unit that then did not run (a skipped block, a wrong
        # explicit list): no backward gathers it; after an inference forward, free everything.
        inference = not torch.is_grad_enabled() and not self.grad_forward_pending
        for group in self.groups:
            if group.sharded_state is not ShardedState.SHARDED and (
                inference or not group.ran_since_backward or group.deferred_reshard
            ):
                # (deferred_reshard: a unit of several modules, one of which did not run after
                # the others, or ran again: freed now, as its last module would have; its
                # backward gathers it again.)
                if group.deferred_reshard and not inference and group.post_forward_size:
                    group.reshard_post_forward()
                    self.hidden_kept = True
                else:
                    group.reshard()
            group.deferred_reshard = False
            group.modules_to_run.clear()
            if inference:
                group.ran_since_backward = False
            elif group.sharded_state is ShardedState.UNSHARDED:
                # Kept for backward; until then the modules show the shards (hide_unsharded).
                group.hide_unsharded()
                self.hidden_kept = True
        if self._check_every_step and not self.grad_forward_pending:
            self.check_collective_order("forward")  # inference: no backward will check

    def _next_step(self) -> None:
        if self.reference_order is None and self.step_order:
            self.reference_order = self.step_order
        self.step_order = []
        self.steps += 1
        self._order_checked = False

    def follow(self, group: ParamGroup) -> None:
        """``group`` starts its first call in this forward of the model: check it against the
        order of the first step's forward. A rank whose units depart from it (a unit skipped
        or run out of turn here) agrees with its peers before its next collective, so that
        ranks that ran different units fail with a clear error instead of pairing one unit's
        gathers with another's (see [Note: the hang check] in _hang). Ranks that all depart
        alike (data-dependent order they share) agree at once and go on."""
        if self._recording or not self._recorded:
            return
        at = self._followed
        self._followed += 1
        order = self.forward_order
        if self._departed or (at < len(order) and order[at] is group):
            return
        expected = order[at].label if at < len(order) else "none (the first step ran fewer units)"
        self._depart(f"unit {group.label} ran as unit #{at + 1} of this forward, where the first step ran {expected}")

    def _depart(self, why: str) -> None:
        self._departed = True
        _hang.set_departure(why)
        _collectives.agree_before_next(why, self._process_groups)

    def record(self, group: ParamGroup) -> None:
        if self._recording and group not in self.forward_order:
            self.forward_order.append(group)

    def note_run(self, group: ParamGroup) -> None:
        """``group`` ran with grad (or as a reentrant checkpoint's segment) in this step."""
        if group.order_mark != self.steps:
            group.order_mark = self.steps
            self.step_order.append(group)

    def check_step_order(self) -> None:
        """At the start of a backward (before any of its collectives): if this step's units ran
        in another order than the last checked step's (or the first step's), check that every
        rank ran the same, in the same order.

        After the first backward nothing else compares the ranks' collectives, and ranks that ran
        as many units of one size, but different ones (LayerDrop drawing per rank, an expert per
        unit routed to per rank), would pair one unit's gathers and reductions with another's:
        wrong gradients, no error. A model whose steps run the same units never pays for this
        (nor do forwards without a backward: evaluation, generation).
        """
        if self._order_checked or not in_backward():
            return
        self._order_checked = True
        if self._check_every_step or self.reference_order is None or not self.step_order:
            # (The first backward's collectives are compared: check_collective_order. No
            # forward since the last backward, a second backward of one graph: checked then.)
            return
        if self.step_order != self.reference_order:
            self._check_unit_order()
            self.reference_order = list(self.step_order)

    def _check_unit_order(self) -> None:
        labels = [g.label for g in self.step_order]
        digest = hashlib.blake2b(repr(labels).encode(), digest_size=8).hexdigest()
        with phase("fshard::check_unit_order"):
            for process_group in self._process_groups:
                everyone = _collectives.all_gather_objects(
                    (dist.get_rank(), digest), process_group, label="check_unit_order"
                )
                if len({d for _, d in everyone}) == 1:
                    continue
                runs = _collectives.all_gather_objects(
                    (dist.get_rank(), labels), process_group, label="check_unit_order"
                )
                runs.sort()
                ref_rank, ref = runs[0]
                other_rank, other = next((r, lab) for r, lab in runs if lab != ref)
                at = next(
                    (i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
                    min(len(ref), len(other)),
                )
                nth = [run[at] if at < len(run) else "none" for run in (ref, other)]
                raise RankMismatchError(
                    f"fshard: the ranks ran different units in this step's forward: unit #{at + 1} "
                    f"to run was {nth[0]} on rank {ref_rank} but {nth[1]} on rank "
                    f"{other_rank} ({len(ref)} and {len(other)} units ran). Their gathers and "
                    "gradient reductions would pair one unit's data with another's. Every rank "
                    "must run the same units in the same order in a step: draw layer-dropping "
                    "choices from a generator seeded alike on every rank, and keep experts routed "
                    "per rank inside one unit that always runs. Do not step the optimizer."
                )

    def record_finish(self, group: ParamGroup) -> None:
        if self._recording and group not in self.finish_order:
            self.finish_order.append(group)

    def _build_prefetch_plan(self) -> None:
        """Forward: the unit that started after this one. Backward: the unit that finished
        its forward before this one (the backward runs the forward in reverse): a unit that
        contains others finishes after them, so the root, which finishes last, is first and
        prefetches the last block, and no block prefetches it again after its head's
        gradients freed it (as the start order would, where the root comes first)."""
        order = self.forward_order
        self._next_forward = {id(g): [order[i + 1]] for i, g in enumerate(order[:-1])}
        finished = self.finish_order
        self._next_backward = {id(g): [finished[i - 1]] for i, g in enumerate(finished) if i > 0}

    def forward_targets(self, group: ParamGroup) -> list[ParamGroup]:
        if self._check_every_step:
            return []  # FSHARD_DEBUG: no prefetch, see __init__
        if group.explicit_forward_prefetch is not None:
            return group.explicit_forward_prefetch
        if not group.forward_prefetch_default:
            return []
        return self._next_forward.get(id(group), [])

    def prefetch_for_forward(self, group: ParamGroup) -> None:
        """Start gathering the units the forward reaches after ``group``'s."""
        explicit = group.explicit_forward_prefetch is not None
        for target in self.forward_targets(group):
            if explicit:
                target.unshard(async_op=True)
            else:
                self.unshard_ahead(target, self._next_forward)

    def unshard_ahead(self, target: ParamGroup, order: dict[int, list[ParamGroup]]) -> None:
        """Issue ``target``'s all-gather ahead of its use, together with the units that
        ``order`` (the recorded forward or backward) runs right after it while they fit in its
        ``coalesce_bytes`` (see [Note: coalesced all-gathers] in _group)."""
        cap = target.coalesce_bytes
        used = target.coalescable_bytes() if cap else 0
        run = [target]
        # Not before the first step's collectives were compared across ranks: ranks that ran
        # different units would issue gathers of different sizes, which gloo does not survive
        # to name the cause.
        if 0 < used <= cap and not self._checking:
            backward = order is self._next_backward
            dtype = target.buckets[0].compute_dtype
            process_group = target.mesh_info.shard_group
            following = order.get(id(target))
            while following:
                candidate = following[0]
                if (
                    candidate in run
                    or candidate.explicit_forward_prefetch is not None
                    or candidate.explicit_backward_prefetch is not None
                    or (backward and (candidate.grads_reduced or candidate.skipped_by_backward()))
                ):
                    break
                nbytes = candidate.coalescable_bytes() if candidate.coalesce_bytes else 0
                if (
                    not nbytes
                    or used + nbytes > cap
                    or candidate.mesh_info.shard_group is not process_group
                    or candidate.buckets[0].compute_dtype != dtype
                ):
                    break
                run.append(candidate)
                used += nbytes
                following = order.get(id(candidate))
        if len(run) == 1:
            target.unshard(async_op=True)
        else:
            unshard_together(run)

    def backward_targets(self, group: ParamGroup, moment: BackwardPrefetch) -> list[ParamGroup]:
        if self._check_every_step:
            return []
        if group.explicit_backward_prefetch is not None:
            return group.explicit_backward_prefetch if moment is BackwardPrefetch.BACKWARD_PRE else []
        if group.backward_prefetch_default is not moment:
            return []
        return self._next_backward.get(id(group), [])

    # Backward ---------------------------------------------------------------------------------

    def on_unit_backward_done(self, group: ParamGroup) -> None:
        """BACKWARD_POST prefetch: the next unit's gather starts once this one is freed."""
        self.prefetch_for_backward(group, BackwardPrefetch.BACKWARD_POST)

    def prefetch_for_backward(self, group: ParamGroup, moment: BackwardPrefetch) -> None:
        """Gather the units the backward reaches after ``group``'s, passing over those it has
        nothing to do with this step (``skipped_by_backward``) for the ones after them: a
        skipped unit gathered here would be held to the end of the backward, and the units
        after it would lose their prefetch."""
        seen = {id(group)}
        pending = list(self.backward_targets(group, moment))
        while pending:
            target = pending.pop(0)
            if id(target) in seen:
                continue
            seen.add(id(target))
            if target.skipped_by_backward():
                pending.extend(self.backward_targets(target, moment))
            elif group.explicit_backward_prefetch is not None:
                target.prefetch_for_backward()
            elif not target.grads_reduced:
                self.unshard_ahead(target, self._next_backward)

    def ensure_final_callback(self) -> None:
        if self._callback_queued:  # (the common case, once per gradient: one test and a weakref)
            self.recover_if_backward_aborted()
            if self._callback_queued:
                return
        if not in_backward():
            return
        self._callback_queued = True
        callback = _FinalCallback(self)
        self._callback_token = weakref.ref(callback)
        Variable._execution_engine.queue_callback(callback)

    def park(self, group: ParamGroup) -> None:
        self._parked.append(group)

    def release_parked(self, current: ParamGroup) -> None:
        """``current``'s backward begins: release the units parked before it (not ``current``
        itself, called again right after its last call's backward)."""
        parked, self._parked = self._parked, []
        for group in parked:
            if group is current:
                group.parked = False
            elif group.parked:  # (not reduced since: post_backward unparks)
                group.release_parked()

    def recover_if_backward_aborted(self) -> None:
        """In a backward: if the one whose end the queued callback waits for raised (the engine
        dropped the callback with it), recover from it now, before this backward needs the
        units (a retry of a backward through a retained graph after an out-of-memory error).
        A nested backward (a reentrant checkpoint's) finds the callback held still."""
        token = self._callback_token
        if self._callback_queued and token is not None and token() is None:
            self._recover_from_aborted_backward()

    def queue_reduce(self, unissued: UnissuedReduce, max_bytes: int) -> None:
        """Hold ``unissued`` to be issued with the next reduce-scatters, up to ``max_bytes`` of
        input in all; issue what was held first where it would not fit beside it."""
        if self._checking:  # (the first step: see unshard_ahead)
            self.add_pending_reduce(reduce_scatter_alone(unissued))
            return
        nbytes = unissued.input.numel() * unissued.input.element_size()
        held = self._unissued
        if held and (
            self._unissued_bytes + nbytes > max_bytes
            or held[0].input.dtype != unissued.input.dtype
            or held[0].mesh_info.shard_group is not unissued.mesh_info.shard_group
            or held[0].owner.replicate_group is not unissued.owner.replicate_group
        ):
            self.issue_queued_reduces()
        self._unissued.append(unissued)
        self._unissued_bytes += nbytes
        if self._unissued_bytes >= max_bytes:
            self.issue_queued_reduces()

    def issue_queued_reduces(self) -> None:
        """Issue the held reduce-scatter inputs as one collective."""
        held, self._unissued, self._unissued_bytes = self._unissued, [], 0
        if held:
            self._add_pending(reduce_scatter_together(held))

    def add_pending_reduce(self, pending: PendingReduce) -> None:
        self.issue_queued_reduces()  # (issued before this one: the pipeline keeps issue order)
        self._add_pending(pending)

    def _add_pending(self, pending: PendingReduce | CoalescedReduce) -> None:
        """Issue-order pipeline: at most one reduce-scatter and one all-reduce in flight.

        Landing the previous reduce-scatter issues its cross-replica all-reduce (2D meshes),
        which in turn lands when the next reduce-scatter is issued, so both overlap backward
        compute and memory for in-flight gradients stays bounded.
        """
        previous, self._pending_reduces = self._pending_reduces, []
        for item in previous:
            follow_up = item.finish()
            if follow_up is not None:
                self._pending_reduces.append(follow_up)
        self._pending_reduces.append(pending)

    def finish_reduces(self) -> None:
        self.issue_queued_reduces()
        while self._pending_reduces:
            follow_up = self._pending_reduces.pop(0).finish()
            if follow_up is not None:
                self._pending_reduces.append(follow_up)

    def _final_callback(self) -> None:
        self._callback_queued = False
        try:
            self._end_backward()
        except BaseException:
            # A check, or a hook of yours on a gradient (run as it lands in .grad), raised:
            # start the next step clean, as after a backward that raised.
            self._recover_from_aborted_backward(land=False)
            raise
        if self._checking:
            self.check_collective_order("backward")

    def _end_backward(self) -> None:
        self.check_step_order()  # (if no unit's pre-backward ran in this backward)
        with phase("fshard::final_callback"):
            for group in self.groups:
                syncing = group.requires_gradient_sync or group.reduce_scatter_while_accumulating
                # Also a unit reduced already: gradients that arrived after its reduce (reentrant
                # checkpointing runs one nested backward per forward) are reduced now and added.
                # Decided by what every rank knows alike (whether the unit ran in a way that
                # may give gradients, and was reduced), not by whether gradients arrived here:
                # a param used on some ranks only.
                if syncing and (
                    group.has_unsharded_grads()
                    or (group.backward_may_come and not group.grads_reduced)
                ):
                    group.grads_reduced = True
                    group.reduce_grads()
                elif not syncing:
                    group.accumulate_unsynced_grads()  # units whose grads did not all arrive
            self.finish_reduces()
            for group in self.groups:
                group.flush_partials()
                if group.requires_gradient_sync:
                    _UNSYNCED.discard(group)
                else:
                    group.mark_awaiting_sync()
                    if group.has_unreduced_grads():
                        _UNSYNCED.add(group)
                group.end_backward()
            self.grad_forward_pending = False
            self._parked = []
            self._next_step()
            self.hidden_kept = False  # every unit was freed

    def _recover_from_aborted_backward(self, land: bool = True) -> None:
        """The last backward raised before its final callback ran (or in it): start clean.

        The failed backward's partial gradients are dropped: its full gradients, and its
        reductions still in flight (waited for: peers that failed at the same point issued
        them too). Those that landed before the error are in the sharded grads
        (``optimizer.zero_grad()`` clears them). But the sums of earlier ``no_sync``
        micro-batches are kept, as an unsharded model's ``.grad`` keeps them (with whatever
        the failed backward added): a unit holding one keeps its full gradients, and a
        reduction in flight that carries one lands. Every unit is freed. ``land=False`` (a hook
        of the user's raised while reductions landed) drops every reduction still in flight
        instead of running the hook again.
        """
        holding = [any(slot.awaiting_sync for slot in g.slots) for g in self.groups]
        logger.warning(
            "fshard: the previous backward of %s did not finish (it raised); freeing its units "
            "and dropping its partial gradients%s",
            self.root.label,
            " (the sums of earlier no_sync micro-batches stay)" if any(holding) else "",
        )
        self._callback_queued = False
        self.grad_forward_pending = False
        self._parked = []
        self._next_step()
        pending, self._pending_reduces = self._pending_reduces, []
        # (Not issued on any rank that failed at the same point: nothing to wait for. They
        # carry no no_sync sums: such reduces are issued alone.)
        self._unissued, self._unissued_bytes = [], 0
        failure: BaseException | None = None
        while pending:
            item = pending.pop(0)
            if not (land and item.carries_sums) or failure is not None:
                item.discard()
                continue
            try:
                follow_up = item.finish()
            except BaseException as exc:  # a gradient hook of the user's: raised after cleaning
                failure, follow_up = exc, None
            if follow_up is not None:
                pending.append(follow_up)
        for group, keep in zip(self.groups, holding, strict=True):
            if keep:
                group.accumulate_unsynced_grads()
            else:
                group.drop_unsharded_grads()
            group.end_backward(aborted=True)
        self.hidden_kept = False
        if failure is not None:
            raise failure

    def recover_from_aborted_forward(self) -> None:
        """The model's last forward raised (an out-of-memory error caught to retry with a
        smaller batch): free the units it left gathered, those whose forward it was in and
        those it prefetched, so that this forward starts from the usual memory. None of them
        has a backward to come: their forwards produced no output."""
        for group in self.groups:
            group.outside_calls.clear()
            group.nested_returned = False
            group.modules_to_run.clear()
            group.deferred_reshard = False
            group.forward_depth = 0
            group.outer_passed.clear()
            aborted = group.training_state is TrainingState.FORWARD
            if group.training_state in (TrainingState.FORWARD, TrainingState.IDLE):
                # Also units kept from their forward (reshard_after_forward=False): an optimizer
                # step may follow, and their copy would be stale. A backward still to come
                # gathers them again into the storage it saved.
                group.reshard()
            if aborted:
                group.reset_backward()
                group.training_state = TrainingState.IDLE

    # Order checks -----------------------------------------------------------------------------

    def check_collective_order(self, moment: str) -> None:
        """Compare the collectives each rank issued on each group since the last check.

        Raises ``RankMismatchError`` naming the first differing collective and both ranks. After
        the first backward this stops, unless ``FSHARD_DEBUG`` is set.
        """
        with phase("fshard::check_collective_order"):
            for process_group in self._process_groups:
                record = _collectives.take_recording(process_group)
                if record is None:
                    continue
                mine = (dist.get_rank(), record.count, record.digest)
                everyone = _collectives.all_gather_objects(
                    mine, process_group, label="check_collective_order"
                )
                if len({(count, digest) for _, count, digest in everyone}) > 1:
                    heads = _collectives.all_gather_objects(
                        (dist.get_rank(), record.count, record.digest, record.head),
                        process_group,
                        label="check_collective_order",
                    )
                    raise RankMismatchError(_order_mismatch_message(heads, moment))
        if not self._check_every_step:
            self._checking = False
            for process_group in self._process_groups:
                _collectives.stop_recording(process_group)


def check_prefetch_targets(groups: list[ParamGroup]) -> None:
    """Explicit prefetch lists (``fshard.set_prefetch``) may name only units of the same model:
    another model's unit would be gathered by this one's steps and never freed by them."""
    members = {id(g) for g in groups}
    problems = ProblemList("fshard.set_prefetch")
    for group in groups:
        lists = (("forward", group.explicit_forward_prefetch), ("backward", group.explicit_backward_prefetch))
        for kind, targets in lists:
            for target in targets or ():
                if id(target) not in members:
                    problems.add(
                        f"unit {group.label} prefetches unit {target.label} in {kind}, which is "
                        "not part of the same sharded model"
                    )
    problems.raise_if_any(ValueError, hint="List units of the model the unit belongs to.")


def _process_groups_of(groups: list[ParamGroup]) -> list[dist.ProcessGroup]:
    """The process groups the units communicate on (more than one rank), in a fixed order."""
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for g in groups:
        info = g.mesh_info
        candidates = [(info.shard_group, info.shard_size)]
        if info.replicate_group is not None:
            candidates.append((info.replicate_group, info.replicate_size))
        for process_group, size in candidates:
            if size > 1:
                found.setdefault(tuple(dist.get_process_group_ranks(process_group)), process_group)
    return [found[ranks] for ranks in sorted(found)]


def _describe_collective(head: list[tuple[str, str, int]], issued: int, index: int) -> str:
    if index < len(head):
        op, label, numel = head[index]
        return f"the {op} of unit {label!r} ({numel} elements)"
    if index < issued:
        return "a collective past the first recorded ones"
    return "nothing more"


def _order_mismatch_message(
    heads: list[tuple[int, int, str, list[tuple[str, str, int]]]], moment: str
) -> str:
    """Name the first collective where some rank's sequence differs from the lowest rank's."""
    heads = sorted(heads, key=lambda item: item[0])
    ref_rank, ref_count, ref_digest, ref_head = heads[0]
    for rank, count, digest, head in heads[1:]:
        if (count, digest) == (ref_count, ref_digest):
            continue
        index = next(
            (i for i, (a, b) in enumerate(zip(ref_head, head, strict=False)) if a != b),
            min(len(ref_head), len(head)),
        )
        return (
            f"ranks issued different collectives in this step (checked after the {moment}): "
            f"rank {ref_rank} issued {ref_count} and rank {rank} issued {count}; collective "
            f"#{index + 1} was {_describe_collective(ref_head, ref_count, index)} on rank "
            f"{ref_rank} but {_describe_collective(head, count, index)} on rank {rank}. Every rank "
            "must run the same units in the same order (a unit called on only some ranks, e.g. by data-dependent control flow, "
            "pairs one rank's data with another unit's), so this step's gradients are not valid: "
            "do not step the optimizer on them."
        )
    raise internal_error("collective digests differ but no rank's sequence does")


def root_of(group: ParamGroup) -> RootState:
    """The root context of ``group``'s tree: set at root init, before any hook body that asks."""
    root = group.root
    if not isinstance(root, RootState):
        raise internal_error(f"unit {group.label} has no root context yet (root init did not run)")
    return root
