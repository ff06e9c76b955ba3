"""The only module that calls ``torch.distributed`` collectives.

Every call goes through here so that tests and benchmarks can observe all traffic (see
``fshard.testing.trace_collectives``) and so that a profiler trace shows one ``fshard::<op>``
label per collective.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo

from fshard import _hang
from fshard._errors import CollectiveError, collective_error, rank_prefix
from fshard._options import debug_checks
from fshard._profiling import phase

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo

__all__ = [
    "CollectiveRecord",
    "add_tracer",
    "remove_tracer",
    "all_gather_into",
    "reduce_scatter_into",
    "all_reduce_",
    "all_gather_objects",
    "all_gather_objects_by_rank",
    "broadcast_",
    "gather_into",
    "scatter_into",
    "broadcast_objects",
    "wait",
    "SequenceRecord",
    "start_recording",
    "take_recording",
    "stop_recording",
]

logger = logging.getLogger("fshard")

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Dtypes every backend moves; the others (int16, uint16/32/64, float8, ...) gloo refuses, so the
# collectives that only move data send their bytes instead.
_WIRE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a byte view of it when backends may not move its dtype (data movement only)."""
    if t.dtype in _WIRE_DTYPES or t.is_complex() or not t.is_contiguous():
        return t
    return t.reshape(-1).view(torch.uint8)  # a view: what lands in it lands in ``t``


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank.

    ``input_bytes`` is what this rank contributes, ``output_bytes`` what it receives into its
    output buffer. ``label`` names the unit (module FQN) or the API that issued it.

    Example:
        >>> with fshard.testing.trace_collectives() as records:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> [(r.op, r.label, r.output_bytes) for r in records][:1]  # doctest: +SKIP
        [('all_gather', 'blocks.0', 2048)]
    """

    op: str
    group_ranks: tuple[int, ...]
    input_bytes: int
    output_bytes: int
    dtype: torch.dtype | None
    label: str
    async_op: bool

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


_TRACERS: list[Callable[[CollectiveRecord], None]] = []


def add_tracer(tracer: Callable[[CollectiveRecord], None]) -> None:
    _TRACERS.append(tracer)


def remove_tracer(tracer: Callable[[CollectiveRecord], None]) -> None:
    _TRACERS.remove(tracer)


def _trace(
    op: str,
    group: dist.ProcessGroup | None,
    input_bytes: int,
    output_bytes: int,
    dtype: torch.dtype | None,
    label: str,
    async_op: bool,
) -> None:
    if not _TRACERS:
        return
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    record = CollectiveRecord(op, ranks, input_bytes, output_bytes, dtype, label, async_op)
    for tracer in list(_TRACERS):
        tracer(record)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------ failures and order checks

# [Note: Ranks must issue the same collectives]
# A collective pairs with whatever the peer ranks issue next on the same group. Ranks that ran
# different units this step (a unit called on only some ranks, data-dependent control flow) issue
# different sequences: a different count hangs until the process group's timeout, and an equal
# count of equally sized buffers pairs the wrong units' data without any error. So (1) every
# failure of a collective names the unit and the usual causes, and (2) the root compares the
# sequence each rank issued on each of its groups after the first backward (and after every
# backward with FSHARD_DEBUG=1), turning a silent mis-pairing into an error before the optimizer
# steps on the wrong gradients.

_HINT = (
    "Usual causes: a peer rank stopped, crashed or timed out; or the ranks ran different units "
    "(or the same units in a different order) in this step, e.g. a unit called on only some ranks "
    "by data-dependent control flow, or a unit whose output reached the loss on only some ranks "
    "(so only they ran its backward); or an fshard call made on some ranks only (unshard, "
    "clip_grad_norm_, full_state_dict and checkpoint.save communicate; no_sync and "
    "set_requires_gradient_sync change what the backward does). Every rank must run each "
    "unit's forward and backward the "
    "same way: where a unit's output is unused on a rank, add 0 * output.sum() to that rank's "
    "loss. FSHARD_DEBUG=1 makes the ranks agree on every collective before issuing it and "
    "names the first difference; a rank that waits FSHARD_HANG_CHECK_S seconds (default 30) in "
    "one collective looks where its peers are and names where each one is.")


# Labels of fshard's own cross-rank checks (not a unit's collectives, not a user's call).
_CHECK_LABELS = frozenset(
    {"check_collective_order", "check_unit_order", "root_init", "set_prefetch", "set_coalescing"}
)

# Labels of the collectives that fshard's functions (not a unit's forward or backward) issue.
_API_LABELS = (
    "full_state_dict",
    "full_tensor",
    "load_state_dict",
    "optim_state_dict",
    "checkpoint.",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "fshard.",
    "from_config",
)


def _hint(label: str) -> str:
    """What usually causes a failed collective of ``label``.

    Example:
        >>> print(_hint("full_state_dict(0.weight)").split(":")[0])
        full_state_dict is collective
    """
    if not label.startswith(_API_LABELS):
        return _HINT
    api = label.split("(")[0].split(":")[0]
    return (
        f"{api} is collective: every rank of the mesh must call it, at the same point and with "
        "the same arguments (not under `if rank == 0:`, nor with rank0_only=(rank == 0); for a "
        "file on rank 0 only, call it everywhere and save on rank 0). Usual causes otherwise: a peer rank stopped, crashed or timed out, or the ranks are "
        "at different steps (one skipped a batch after an exception and went on)."
    )


@contextmanager
def _failure_context(op: str, label: str) -> Iterator[None]:
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo/NCCL timeouts are RuntimeErrors
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = f"{rank_prefix()}fshard: the {op} of {label!r} failed: {first_line}\n{_hint(label)}"
        raise collective_error(message, exc) from exc


def wait(work: dist.Work | None, *, op: str, label: str) -> None:
    """Wait for an asynchronous collective; a failure is a ``CollectiveError`` naming ``label``,
    and a wait that lasts is looked into (see [Note: the hang check] in _hang)."""
    if work is None:
        return
    issued = _ISSUED.pop(id(work), None)
    with _failure_context(op, label):
        if issued is None:
            work.wait()
        else:
            _hang.checked_wait(work, issued[0], issued[1])


# [Note: the hang check] (in _hang): what each async collective was, for its wait. Keyed by the
# Work's id; the Work is held with it so that the id stays its own until the wait.
_ISSUED: dict[int, tuple[_hang.Where, dist.ProcessGroup | None, dist.Work]] = {}
_GROUP_KEYS: dict[dist.ProcessGroup | None, str] = {}
# The groups whose next collective must first be agreed with the peers (a departure from the
# recorded order of units: see agree_before_next), and which API the last collective on a group
# was for.
_AGREE_NEXT: dict[str, str] = {}
_LAST_API: dict[str, str | None] = {}
# API calls issued every step, which the rendezvous would slow: they come after the backward's
# collectives that already paired (a rank that skipped them waits in its next one instead).
_NO_RENDEZVOUS = ("clip_grad_norm_", "ShardedGradScaler")


def reset_hang_state() -> None:
    """Start the hang check's numbering afresh (every rank at once: the testing pool does so
    between tasks, whose collectives a failed task may have left unequal)."""
    _hang.reset()
    _LAST_API.clear()
    _AGREE_NEXT.clear()
    _ISSUED.clear()  # (works a failed task issued and never waited for)


def agree_before_next(reason: str, groups: list[dist.ProcessGroup]) -> None:
    """Make this rank agree with its peers, through the store, before its next collective on
    each of ``groups`` (``reason`` says why: its units departed from the order of the first
    step). Each group agrees on its own next collective: the ranks of a 2D mesh reach their
    groups in different orders."""
    for group in groups:
        _AGREE_NEXT[_group_key(group)] = reason


def _group_key(group: dist.ProcessGroup | None) -> str:
    key = _GROUP_KEYS.get(group)
    if key is None:
        key = _GROUP_KEYS[group] = _hang.group_key(group)
    return key


def _issue(op: str, group: dist.ProcessGroup | None, label: str) -> _hang.Where:
    """Name this collective for the hang check, and agree on it with the peers first where
    fshard can see a mismatch coming (see [Note: the hang check])."""
    key = _group_key(group)
    api = label.split("(")[0].split(":")[0] if label.startswith(_API_LABELS) else None
    unit = api is None and label not in _CHECK_LABELS
    where = _hang.Where(op, label, key, _hang.next_seq(key), _hang.phase(unit), unit=unit)
    entering = api is not None and _LAST_API.get(key) != api and not api.startswith(_NO_RENDEZVOUS)
    _LAST_API[key] = api
    departure = _AGREE_NEXT.pop(key, None) if _AGREE_NEXT else None
    reason = "units departed from the first step's order" if departure is not None else None
    if reason is None and entering:
        reason = f"{api} is collective"
    elif reason is None and _DEBUG[0]:
        reason = "FSHARD_DEBUG=1"
    if reason is not None and "," in key:
        with _failure_context(op, label):
            _hang.rendezvous(where, group, reason, topic=departure)
    return where


def _finish(work: dist.Work | None, where: _hang.Where, group: dist.ProcessGroup | None, async_op: bool) -> dist.Work | None:
    """An issued collective: returned for a later ``wait`` (async), or waited for now."""
    if work is None:
        return None
    if not _waits_on_host(group):
        # NCCL: wait() only orders the CUDA stream; a wait in slices would block the host on
        # every collective. Its hangs are NCCL's watchdog's (see [Note: the hang check]).
        if not async_op:
            work.wait()
        return work if async_op else None
    if async_op:
        _ISSUED[id(work)] = (where, group, work)
        return work
    _hang.checked_wait(work, where, group)
    return None


_HOST_WAITS: dict[dist.ProcessGroup | None, bool] = {}


def _waits_on_host(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s collectives are waited for on the host (gloo), where the hang check
    can wait in slices."""
    known = _HOST_WAITS.get(group)
    if known is None:
        known = _HOST_WAITS[group] = dist.get_backend(group) == "gloo"
    return known


_DEBUG = [debug_checks()]


def refresh_debug() -> None:
    """Read ``FSHARD_DEBUG`` again (tests set it per run)."""
    _DEBUG[0] = debug_checks()


@dataclass
class SequenceRecord:
    """The collectives this rank issued on one group since the last check, as a digest.

    Only the first ``keep`` entries are kept in full (to name the first difference); the count
    and the digest cover all of them, so memory stays bounded whatever runs between checks.
    """

    keep: int = 512
    count: int = 0
    head: list[tuple[str, str, int]] = field(default_factory=list)
    _digest: Any = field(default_factory=hashlib.blake2b)

    def add(self, op: str, label: str, numel: int) -> None:
        self.count += 1
        self._digest.update(f"{op}|{label}|{numel};".encode())
        if len(self.head) < self.keep:
            self.head.append((op, label, numel))

    @property
    def digest(self) -> str:
        return str(self._digest.hexdigest())


# Keyed by the group object: ranks must agree on the sequence issued on each group they share.
_RECORDS: dict[dist.ProcessGroup, SequenceRecord] = {}
# Drop the group references before interpreter finalization (see _mesh: gloo groups must not be
# torn down during it).
atexit.register(_RECORDS.clear)
atexit.register(_HOST_WAITS.clear)
atexit.register(_GROUP_KEYS.clear)


def start_recording(group: dist.ProcessGroup) -> None:
    """Record the engine's collectives on ``group`` from now on, dropping any earlier record.

    Called when a root initialises, on every rank at the same point, so that whatever an earlier
    model left on a shared group (a failed step, a model never trained) cannot show up as a
    difference in this one's check.
    """
    _RECORDS[group] = SequenceRecord()


def take_recording(group: dist.ProcessGroup) -> SequenceRecord | None:
    """Return the record of ``group`` and start a fresh one (``None`` if not recording)."""
    record = _RECORDS.get(group)
    if record is not None:
        _RECORDS[group] = SequenceRecord()
    return record


def stop_recording(group: dist.ProcessGroup) -> None:
    _RECORDS.pop(group, None)


def _record(op: str, group: dist.ProcessGroup | None, label: str, numel: int) -> None:
    if _RECORDS and group is not None:
        record = _RECORDS.get(group)
        if record is not None:
            record.add(op, label, numel)


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    label: str,
    async_op: bool = False,
) -> dist.Work | None:
    """Gather ``input`` from every rank of ``group`` into ``output`` (rank-major, 1D)."""
    _trace("all_gather", group, _nbytes(input), _nbytes(output), input.dtype, label, async_op)
    _record("all_gather", group, label, input.numel())
    with phase(f"fshard::all_gather({label})"), _failure_context("all_gather", label):
        where = _issue("all_gather", group, label)
        work = _all_gather_single(_as_wire(output), _as_wire(input), group=group, async_op=True)
        return _finish(work, where, group, async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    label: str,
    async_op: bool = False,
) -> dist.Work | None:
    """Sum ``input`` (rank-major chunks) over ``group``; this rank's chunk lands in ``output``."""
    _trace("reduce_scatter", group, _nbytes(input), _nbytes(output), input.dtype, label, async_op)
    _record("reduce_scatter", group, label, output.numel())
    with phase(f"fshard::reduce_scatter({label})"), _failure_context("reduce_scatter", label):
        where = _issue("reduce_scatter", group, label)
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _finish(work, where, group, async_op)


def all_reduce_(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    label: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``tensor`` in place over ``group`` (SUM or MAX: ops every backend supports)."""
    _trace("all_reduce", group, _nbytes(tensor), _nbytes(tensor), tensor.dtype, label, async_op)
    _record("all_reduce", group, label, tensor.numel())
    with phase(f"fshard::all_reduce({label})"), _failure_context("all_reduce", label):
        where = _issue("all_reduce", group, label)
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return _finish(work, where, group, async_op)


def broadcast_(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, *, label: str
) -> None:
    """Broadcast ``tensor`` in place from global rank ``src``."""
    _trace("broadcast", group, _nbytes(tensor), _nbytes(tensor), tensor.dtype, label, False)
    with phase(f"fshard::broadcast({label})"), _failure_context("broadcast", label):
        where = _issue("broadcast", group, label)
        _finish(dist.broadcast(_as_wire(tensor), src=src, group=group, async_op=True), where, group, False)


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None, *, label: str) -> list[Any]:
    """Gather one picklable object from every rank of ``group`` (setup-time only)."""
    _trace("all_gather_object", group, 0, 0, None, label, False)
    with (
        phase(f"fshard::all_gather_object({label})"),
        _failure_context("all_gather_object", label),
    ):
        if dist.get_backend(group) != "gloo":
            out: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, obj, group=group)
            return out
        # As torch's all_gather_object (sizes, then the padded bytes), but as waits the hang
        # check can look into (see [Note: the hang check]).
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = dist.get_world_size(group)
        sizes = torch.zeros(size, dtype=torch.int64)
        where = _issue("all_gather_object", group, label)
        work = _all_gather_single(sizes, torch.tensor([data.numel()]), group=group, async_op=True)
        _finish(work, where, group, False)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = torch.empty(size * longest, dtype=torch.uint8)
        where = _issue("all_gather_object", group, label)
        _finish(_all_gather_single(gathered, padded, group=group, async_op=True), where, group, False)
        rows = gathered.view(size, longest)
        return [pickle.loads(rows[i, : int(sizes[i])].numpy().tobytes()) for i in range(size)]


def all_gather_objects_by_rank(obj: Any, info: MeshInfo | None, *, label: str) -> list[Any]:
    """One picklable object from every rank, on every rank, in global rank order.

    Over the ranks of ``info``'s mesh (its shard group, then its replicate group: no process
    group over the whole mesh is needed), or over the default group when ``info`` is ``None``.
    """
    if info is None:
        return all_gather_objects(obj, None, label=label)
    items = [(dist.get_rank(), obj)]
    if info.shard_size > 1:
        parts = all_gather_objects(items, info.shard_group, label=label)
        items = [item for part in parts for item in part]
    if info.replicate_group is not None and info.replicate_size > 1:
        parts = all_gather_objects(items, info.replicate_group, label=label)
        items = [item for part in parts for item in part]
    return [o for _, o in sorted(items, key=lambda item: item[0])]


def gather_into(
    output: torch.Tensor | None,
    input: torch.Tensor,
    dst: int,
    group: dist.ProcessGroup,
    *,
    label: str,
) -> None:
    """Gather ``input`` from every rank of ``group`` into ``output`` on global rank ``dst`` only.

    ``output`` (1D, rank-major, ``group size * input.numel()`` elements) is required on ``dst``
    and ignored elsewhere, so no other rank ever holds the gathered tensor. Each chunk is
    received straight into its slice of ``output`` (point-to-point): gloo's ``gather`` would
    first stage the whole result in a buffer of its own, a second full copy on ``dst``.
    """
    ranks = list(dist.get_process_group_ranks(group))
    size = len(ranks)
    me = dist.get_rank()
    is_dst = me == dst
    out_bytes = _nbytes(input) * size if is_dst else 0
    _trace("gather", group, _nbytes(input), out_bytes, input.dtype, label, False)
    flat = _as_wire(input.reshape(-1))
    with phase(f"fshard::gather({label})"), _failure_context("gather", label):
        # Point-to-point: a wait in slices would close gloo's connection, so only the agreement
        # before it (an API call's first collective) guards it.
        _issue("gather", group, label)
        if not is_dst:
            dist.send(flat, dst=dst, group=group)
            return
        if output is None:
            raise ValueError(f"gather_into({label}): the destination rank {dst} needs an output")
        chunks = _as_wire(output).view(size, -1)
        works: list[dist.Work] = []
        for index, rank in enumerate(ranks):
            if rank == me:
                chunks[index].copy_(flat)
                continue
            work = dist.irecv(chunks[index], src=rank, group=group)
            if work is not None:  # None only for ranks outside the group, never here
                works.append(work)
        for work in works:
            work.wait()  # inside the failure context above


def scatter_into(
    output: torch.Tensor,
    input: torch.Tensor | None,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    label: str,
) -> None:
    """Scatter the rank-major chunks of ``input`` (1D, on global rank ``src`` only) into ``output``.

    Rank ``i`` of ``group`` receives chunk ``i`` (``output.numel()`` elements); ``input`` is
    ignored on every rank but ``src``.
    """
    size = dist.get_world_size(group)
    is_src = dist.get_rank() == src
    in_bytes = _nbytes(output) * size if is_src else 0
    _trace("scatter", group, in_bytes, _nbytes(output), output.dtype, label, False)
    scatter_list = None
    if is_src:
        if input is None:
            raise ValueError(f"scatter_into({label}): the source rank {src} needs an input")
        scatter_list = list(_as_wire(input).view(size, -1).unbind(0))
    with phase(f"fshard::scatter({label})"), _failure_context("scatter", label):
        where = _issue("scatter", group, label)
        work = dist.scatter(_as_wire(output), scatter_list, src=src, group=group, async_op=True)
        _finish(work, where, group, False)


def broadcast_objects(obj: Any, src: int, group: dist.ProcessGroup | None, *, label: str) -> Any:
    """Broadcast one picklable object from global rank ``src``; every rank returns it."""
    _trace("broadcast_object", group, 0, 0, None, label, False)
    with (
        phase(f"fshard::broadcast_object({label})"),
        _failure_context("broadcast_object", label),
    ):
        if dist.get_backend(group) != "gloo":
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]
        is_src = dist.get_rank() == src
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if is_src else None
        length = torch.tensor([data.numel() if data is not None else 0])
        where = _issue("broadcast_object", group, label)
        _finish(dist.broadcast(length, src=src, group=group, async_op=True), where, group, False)
        buffer = data if data is not None else torch.empty(int(length), dtype=torch.uint8)
        where = _issue("broadcast_object", group, label)
        _finish(dist.broadcast(buffer, src=src, group=group, async_op=True), where, group, False)
        return obj if is_src else pickle.loads(buffer.numpy().tobytes())


def on_any_rank(flag: bool, info: MeshInfo, label: str) -> bool:
    """Whether ``flag`` holds on some rank of ``info``'s mesh (a ``MeshInfo``): a MAX
    all-reduce of one value over its shard and replicate groups."""
    value = torch.tensor([1.0 if flag else 0.0], device=info.device)
    for group, size in ((info.shard_group, info.shard_size), (info.replicate_group, info.replicate_size)):
        if group is not None and size > 1:
            all_reduce_(value, group, label=label, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
