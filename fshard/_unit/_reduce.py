"""A unit's gradient reduction: the reduce-scatter (and on 2D meshes the all-reduce) pipeline.

After a unit's backward (``ParamGroup.reduce_grads``) each bucket's unsharded grads are packed
into one reduce-scatter input (``reduce_scatter_input``), issued alone
(``reduce_scatter_alone``) or with the next units' (``reduce_scatter_together``); what that
returns is queued on the root, which finishes it when the next one is issued (at most one
reduce-scatter and one all-reduce in flight). Finishing lands this rank's ``Reduced`` chunk: as sharded grads
([Note: fshard tensors] in ``_param``), or, on a 2D mesh, through a cross-replica all-reduce
(``PendingAllReduce``) first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist

from fshard import _collectives
from fshard._bucket import FlatBucket, chunk_cat
from fshard._errors import internal_error
from fshard._param import ParamSlot
from fshard._placement import divide_factors
from fshard._profiling import phase
from fshard._unit._grad_hooks import run_user_grad_hooks

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo
    from fshard._options import MixedPrecision

__all__ = [
    "CoalescedReduce",
    "PendingAllReduce",
    "PendingReduce",
    "ReduceOwner",
    "Reduced",
    "UnissuedReduce",
    "UnitGrads",
    "reduce_scatter_alone",
    "reduce_scatter_input",
    "reduce_scatter_together",
    "summed_grad",
]


class ReduceOwner(Protocol):
    """What a reduce in flight needs of its unit (``ParamGroup``)."""

    @property
    def label(self) -> str: ...

    @property
    def trace_name(self) -> str: ...

    def land_reduced(self, index: int, reduced: Reduced) -> PendingAllReduce | None: ...

    def prepare_landing(self, index: int, reduced: Reduced) -> tuple[Reduced | None, bool]: ...

    @property
    def replicate_group(self) -> dist.ProcessGroup | None: ...


class PendingReduce:
    """A bucket's gradient reduce-scatter in flight; ``finish`` lands the sharded grads."""

    def __init__(
        self,
        group: ReduceOwner,
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
        self.present = present  # which slots had a gradient on this rank (see Reduced)
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

    def reduced(self) -> Reduced:
        """The landed chunk (after the wait), divided by the post-divide factor."""
        output = self.output
        if self.post_divide != 1.0:
            output[: self.offsets[-1]].div_(self.post_divide)  # (not the flags)
        return Reduced(self.slots, self.offsets, self.present, output)

    def finish(self) -> PendingAllReduce | None:
        """Wait for the reduce-scatter; return the cross-replica all-reduce it issued, if any."""
        with phase(f"fshard::finish_reduce({self.group.trace_name})"):
            _collectives.wait(self.work, op="reduce_scatter", label=self.group.trace_name)
            self.work = None
            follow_up = self.group.land_reduced(self.bucket_index, self.reduced())
            if follow_up is not None:
                follow_up.carries_sums = follow_up.carries_sums or self.carries_sums
            return follow_up


class CoalescedReduce:
    """Several units' reduce-scatter in one collective ([Note: coalesced reduce-scatters]):
    waited for once, landed unit by unit, and on a 2D mesh all-reduced across replicas in one
    collective too."""

    def __init__(self, members: list[PendingReduce], output: torch.Tensor, work: dist.Work | None, label: str) -> None:
        self.members = members  # each with its slice of ``output``, the slices in order
        self.output = output
        self.work = work
        self.label = label
        self.carries_sums = False  # (units carrying no_sync sums reduce alone)

    def discard(self) -> None:
        _collectives.wait(self.work, op="reduce_scatter", label=self.label)
        self.work = None

    def finish(self) -> PendingAllReduce | None:
        with phase(f"fshard::finish_reduce({self.label})"):
            _collectives.wait(self.work, op="reduce_scatter", label=self.label)
            self.work = None
            to_all_reduce: list[Reduced] = []
            carries_sums = False
            for member in self.members:
                member.work = None
                reduced, had_partial = member.group.prepare_landing(member.bucket_index, member.reduced())
                if reduced is not None:
                    to_all_reduce.append(reduced)
                    carries_sums = carries_sums or had_partial
            if not to_all_reduce:
                return None  # (1D: every unit's grads are set)
            # The units share one replicate group (RootState.queue_reduce) and all synchronise
            # (only then do they coalesce), so each needs the all-reduce: one, in place, over
            # the whole output.
            if len(to_all_reduce) != len(self.members):
                raise internal_error(f"some units of the coalesced reduce {self.label!r} were not synchronised")
            group = self.members[0].group.replicate_group
            work = _collectives.all_reduce_(self.output, group, label=self.label, async_op=True)
            return PendingAllReduce(to_all_reduce, work, self.label, carries_sums=carries_sums)


class PendingAllReduce:
    """A bucket's cross-replica all-reduce (2D meshes) in flight; ``finish`` sets the grads."""

    def __init__(self, reduced: list[Reduced], work: dist.Work | None, label: str, carries_sums: bool) -> None:
        self.reduced = reduced  # (several: a coalesced reduce's units, in one all-reduce)
        self.work = work
        self.label = label
        self.carries_sums = carries_sums  # see PendingReduce

    def discard(self) -> None:
        _collectives.wait(self.work, op="all_reduce", label=self.label)
        self.work = None

    def finish(self) -> None:
        _collectives.wait(self.work, op="all_reduce", label=self.label)
        self.work = None
        for reduced in self.reduced:
            reduced.assign()


def summed_grad(slot: ParamSlot) -> torch.Tensor | None:
    """The slot's unsharded grad: this backward's plus any no_sync sum kept in the reduce dtype."""
    grad = slot.unsharded_param.grad if slot.unsharded_param is not None else None
    accumulated = slot.accumulated_grad
    if accumulated is None:
        return grad
    return accumulated if grad is None else accumulated.add_(grad)


def reduce_scatter_alone(unissued: UnissuedReduce) -> PendingReduce:
    """Issue ``unissued``'s reduce-scatter on its own over the shard group (a shard group of one
    reduces nothing: the input is this rank's chunk)."""
    if unissued.mesh_info.shard_size == 1:
        return unissued.pending(unissued.input.view(-1), None)
    return cast(PendingReduce, reduce_scatter_together([unissued]))  # (one item: not coalesced)


class UnissuedReduce(NamedTuple):
    """A bucket's reduce-scatter input, built, its collective not yet issued (see [Note:
    coalesced reduce-scatters])."""

    owner: ReduceOwner
    bucket_index: int
    slots: list[ParamSlot]
    offsets: list[int]
    present: list[bool]
    input: torch.Tensor  # (shard_size, total): row r is what rank r gets the sum of
    post_divide: float
    mesh_info: MeshInfo

    def pending(self, output: torch.Tensor, work: dist.Work | None) -> PendingReduce:
        return PendingReduce(
            self.owner, self.bucket_index, self.slots, self.offsets, self.present, output, work, self.post_divide
        )


def reduce_scatter_input(
    owner: ReduceOwner,
    index: int,
    slots: list[ParamSlot],
    grads: list[torch.Tensor | None],
    *,
    mesh_info: MeshInfo,
    reduce_dtype: torch.dtype,
    divide_factor: float | None,
) -> UnissuedReduce:
    """Build bucket ``index``'s reduce-scatter input from its unsharded grads ``grads`` (one per
    slot, ``None`` where none arrived on this rank)."""
    present = [g is not None for g in grads]
    reduce_input, offsets, post = _reduce_scatter_input(
        owner, slots, grads, present, mesh_info, reduce_dtype, divide_factor
    )
    return UnissuedReduce(owner, index, slots, offsets, present, reduce_input, post, mesh_info)


# [Note: coalesced reduce-scatters]
# As with all-gathers ([Note: coalesced all-gathers] in _group), the reduce-scatters of small
# units the backward finishes one after another may share one collective: each unit builds its
# ``(shard_size, total)`` input when its backward is done (freeing its unsharded grads as
# before) and the root issues them together once the next would pass ``coalesce_bytes``, a unit
# that cannot join comes, or the backward ends. Concatenated along the columns, row r is still
# what rank r gets, so each unit's reduced chunk is a slice of the one output and lands as if
# reduced alone. The sums are the same element by element: only the buffer they travel in is
# shared. On a 2D mesh the whole output then goes through one cross-replica all-reduce
# (``CoalescedReduce``), not one per unit: several gloo all-reduces in flight at once on slices
# of one storage gave wrong sums now and then in fshard's 2x2 runs (not reproduced in a
# torch-only script), and one collective is cheaper anyway.
def reduce_scatter_together(items: list[UnissuedReduce]) -> PendingReduce | CoalescedReduce:
    """Issue one reduce-scatter over the shard group for ``items`` (same reduce dtype, shard
    group and replicate group)."""
    first = items[0]
    if len(items) == 1:
        reduce_input, label = first.input, first.owner.trace_name
    else:
        reduce_input = torch.cat([item.input for item in items], dim=1)
        label = f"{first.owner.trace_name}..{items[-1].owner.trace_name}"
    output = torch.empty(reduce_input.shape[1], dtype=reduce_input.dtype, device=reduce_input.device)
    work = _collectives.reduce_scatter_into(
        output, reduce_input.view(-1), first.mesh_info.shard_group, label=label, async_op=True
    )
    if len(items) == 1:
        return first.pending(output, work)
    members = []
    start = 0
    for item in items:
        width = item.input.shape[1]
        members.append(item.pending(output[start : start + width], work))
        start += width
    return CoalescedReduce(members, output, work, label)


def _reduce_scatter_input(
    owner: ReduceOwner,
    slots: list[ParamSlot],
    grads: list[torch.Tensor | None],
    present: list[bool],
    info: MeshInfo,
    reduce_dtype: torch.dtype,
    divide_factor: float | None,
) -> tuple[torch.Tensor, list[int], float]:
    """The reduce-scatter input ``(shard_size, total)``: chunk ``r`` of every grad in row ``r``
    (``chunk_cat``), then one flag per slot, divided by the pre-divide factor; each slot's offset
    in a row; and the post-divide factor that ``PendingReduce.finish`` applies."""
    size = info.shard_size
    inputs = []
    offsets = [0]
    dp_rank = info.replicate_rank * size + info.shard_rank
    for slot, grad in zip(slots, grads, strict=True):
        layout = slot.layout
        if grad is None:  # unused on this rank this step: contribute zeros
            grad = torch.zeros(layout.full_shape, dtype=reduce_dtype, device=info.device)
        elif grad.layout is not torch.strided:
            raise TypeError(
                f"fshard: the gradient of {slot.fqn!r} in unit {owner.label} is "
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
    with phase(f"fshard::reduce_scatter_input({owner.trace_name})"):
        reduce_input = torch.empty((size, total), dtype=reduce_dtype, device=info.device)
        chunk_cat(inputs, size, reduce_input)
        pre, post = divide_factors(info.dp_size, reduce_dtype, divide_factor)
        if pre != 1.0:
            # (Not the flags, which stay counts: a large divide factor would round them to 0.)
            reduce_input[:, : offsets[-1]].div_(pre)
    return reduce_input, offsets, post


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


class Reduced(NamedTuple):
    """A bucket's reduced gradient chunk: ``output[offsets[i]:]`` belongs to ``slots[i]``, and
    ``output[offsets[-1] + i]`` counts the ranks where ``slots[i]`` got a gradient."""

    slots: list[ParamSlot]
    offsets: list[int]
    present: list[bool]  # on this rank; the flags in ``output`` say for every rank
    output: torch.Tensor  # 1D, reduce dtype, on the compute device

    def merged_with(self, older: Reduced) -> Reduced:
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
            run_user_grad_hooks(param)


class UnitGrads:
    """The part of a unit that holds its unsharded grads until they are reduced, and lands
    the reduced ones (see [Note: fshard tensors] in ``_param``).

    A base of ``ParamGroup``, which provides the members declared first below.
    """

    # ----------------------------------------------------------- provided by ParamGroup

    slots: list[ParamSlot]
    buckets: list[FlatBucket]
    mesh_info: MeshInfo
    mp_policy: MixedPrecision | None
    requires_gradient_sync: bool
    # Sharded partial sums awaiting the cross-replica all-reduce (HSDP, reduce_scatter=True).
    _partials: dict[int, Reduced]

    @property
    def trace_name(self) -> str:
        raise NotImplementedError  # ParamGroup: how traces name the unit

    # ------------------------------------------------------------------------ grads

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

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The group gradients are all-reduced over after the reduce-scatter (2D meshes)."""
        info = self.mesh_info
        return info.replicate_group if info.replicate_size > 1 else None

    def prepare_landing(self, index: int, reduced: Reduced) -> tuple[Reduced | None, bool]:
        """After a bucket's reduce-scatter: set the sharded grads (1D; returns ``None``), keep
        the sum for a later synchronised step (2D without sync; ``None``), or return what the
        cross-replica all-reduce must sum (2D), with whether it carries an earlier partial sum."""
        if self.replicate_group is None:
            reduced.assign()
            return None, False
        partial = self._partials.pop(index, None)
        if partial is not None:
            reduced = reduced.merged_with(partial)
        if not self.requires_gradient_sync:
            # Sharded accumulation: keep the shard-group sum, all-reduce on the sync step.
            self._partials[index] = reduced
            return None, False
        return reduced, partial is not None

    def land_reduced(self, index: int, reduced: Reduced) -> PendingAllReduce | None:
        """After a bucket's reduce-scatter: set the sharded grads, or (2D mesh) issue the
        cross-replica all-reduce that will, returned as a ``PendingAllReduce``."""
        to_all_reduce, carries_sums = self.prepare_landing(index, reduced)
        if to_all_reduce is None:
            return None
        work = _collectives.all_reduce_(
            to_all_reduce.output, self.replicate_group, label=self.trace_name, async_op=True
        )
        return PendingAllReduce([to_all_reduce], work, self.trace_name, carries_sums=carries_sums)

    def flush_partials(self) -> None:
        """On a synchronised backward, all-reduce partial sums this step did not touch."""
        if not self._partials or not self.requires_gradient_sync:
            return
        for index in sorted(self._partials):
            reduced = self._partials.pop(index)
            _collectives.all_reduce_(reduced.output, self.mesh_info.replicate_group, label=self.trace_name)
            reduced.assign()
