"""The hang check: a rank stuck in an fshard collective finds out where its peers are.

[Note: the hang check]
A collective pairs with whatever its peers issue next. A rank that skipped one (a
``full_state_dict`` under ``if rank == 0:``, a unit run on some ranks only, a rank that stopped)
leaves the others waiting until the process group's timeout (30 minutes with gloo), with no
hint of why. So fshard waits for its collectives in slices of ``FSHARD_HANG_CHECK_S`` seconds
(environment, default 30). After each slice the waiting rank publishes where it is in the
c10d store every process group has, and reads where its peers are:

- a peer waiting in the same collective (same group and sequence number): keep waiting;
- a peer outside any fshard collective (busy in its own code, writing a checkpoint): it is only
  slow, never an error; log once through the ``fshard`` logger whom we wait for and where that
  rank was last seen, and keep waiting;
- a peer in a *different* fshard collective, one that gave up, or one whose heartbeat stopped
  (it exited or hangs): raise ``fshard.CollectiveError`` naming, per rank, the collective it is
  in (op, unit or API call, sequence number, forward/backward) and the likely mistake. The
  peers come to the same verdict when their own slice runs out, since a rank that gives up
  says so in the store.

Each rank's heartbeat thread writes its state to the store every third of the interval, so a
peer in user code still answers. Nothing of this runs per collective on the hot path: a
collective costs one dictionary update here; the store is only touched by the heartbeat
thread and by a rank that has already waited a whole slice.

A mismatch that gloo would see first (two all-gathers of different sizes paired, which aborts
the process) is caught before it is issued where fshard can see it coming: a rank whose units
depart from the order of the first step, and every fshard API call that communicates, first
agree with their peers through the store (``rendezvous``), and ``FSHARD_DEBUG=1`` does this
before every collective.

On NCCL, ``Work.wait`` returns once the collective is enqueued on the stream, so the check
covers the waits that happen on the host (object collectives, CPU tensors); a hang inside a
CUDA stream is NCCL's watchdog's to report.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from fshard._errors import CollectiveError, CollectiveMismatchError, rank_prefix

__all__ = [
    "HANG_CHECK_ENV",
    "Where",
    "check_interval",
    "checked_wait",
    "next_seq",
    "phase",
    "group_key",
    "rendezvous",
]

logger = logging.getLogger("fshard")

HANG_CHECK_ENV = "FSHARD_HANG_CHECK_S"
_KEY = "fshard/hang/"


def check_interval() -> float:
    """Seconds a rank waits in one collective before it looks where its peers are
    (``FSHARD_HANG_CHECK_S``, default 30)."""
    raw = os.environ.get(HANG_CHECK_ENV, "").strip()
    if not raw:
        return 30.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{HANG_CHECK_ENV}={raw!r}: expected a number of seconds, e.g. 30") from None
    if not value > 0:
        raise ValueError(f"{HANG_CHECK_ENV}={raw!r}: expected a positive number of seconds")
    return value


@dataclass(frozen=True)
class Where:
    """One fshard collective of this rank, as the hang check names it."""

    op: str
    label: str  # the unit's FQN or the API call (full_state_dict, checkpoint.save, ...)
    group: str  # the process group's ranks, e.g. "0,1"
    seq: int  # this rank's fshard collectives on that group so far
    phase: str  # forward / backward / outside forward and backward
    agreeing: bool = False  # agreeing on it with the peers before issuing it (rendezvous)
    unit: bool = True  # issued by a unit's forward or backward (else by an fshard call)

    def describe(self) -> str:
        of = f"unit {self.label!r}" if self.unit else repr(self.label)
        what = f"the {self.op} of {of} (#{self.seq} on ranks [{self.group}], {self.phase})"
        return f"the agreement before {what}" if self.agreeing else what

    def same_as(self, other: Where) -> bool:
        """The same collective (issued, or being agreed on)."""
        return (self.group, self.seq, self.op, self.label) == (other.group, other.seq, other.op, other.label)


# This rank's state, read by the heartbeat thread: the collective it waits in, the last one
# it finished, and whether it gave up (a verdict peers adopt).
_NOW: list[Where | None] = [None]
_LAST: list[tuple[Where, float] | None] = [None]
_GAVE_UP: list[str | None] = [None]
# How this rank's units departed from the first step's order in this step (None: they did not),
# and what it is agreeing on with its peers now (see rendezvous).
_DEPARTURE: list[str | None] = [None]
_AGREEING_ON: list[str | None] = [None]


def set_departure(why: str | None) -> None:
    """Record (or clear, at a new step) how this rank's units departed from the first step's."""
    _DEPARTURE[0] = why
    if why is None:
        _GAVE_UP[0] = None  # a new step: whatever this rank gave up on is behind it
_SEQ: dict[str, int] = {}


_EPOCH = [0]  # bumped by reset(): keys of an earlier epoch are never read again


def reset() -> None:
    """Forget the sequence numbers and agreements so far (every rank at the same point: the
    testing pool between tasks)."""
    _SEQ.clear()
    _MY_KEYS.clear()
    _GAVE_UP[0] = _DEPARTURE[0] = _AGREEING_ON[0] = None
    _EPOCH[0] += 1


def next_seq(group_key: str) -> int:
    """The sequence number of this rank's next fshard collective on ``group_key``."""
    seq = _SEQ.get(group_key, 0) + 1
    _SEQ[group_key] = seq
    return seq


def group_key(group: dist.ProcessGroup | None) -> str:
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return ",".join(map(str, ranks))


def phase(unit: bool) -> str:
    """Where in the step a collective is issued, for the hang check's messages: a unit's
    collectives outside a backward belong to its forward (or a call run as one)."""
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if unit else "outside forward and backward"


# ------------------------------------------------------------------------------ the heartbeat


class _Heartbeat(threading.Thread):
    """Writes this rank's state to the store every ``period`` seconds (a daemon thread)."""

    def __init__(self, period: float) -> None:
        super().__init__(name="fshard-hang-check", daemon=True)
        self.period = period
        self.beats = itertools.count(1)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(max(check_interval() / 3, 0.05)):
            try:
                _publish(next(self.beats))
            except Exception:  # a store gone with its process group: nothing to answer
                if not (dist.is_available() and dist.is_initialized()):
                    continue
                logger.debug("fshard: hang-check heartbeat failed", exc_info=True)


_THREAD: list[_Heartbeat] = []
_LOCK = threading.Lock()
_BEAT = itertools.count(10**9)  # beats the main thread writes itself (after the thread's)


def _ensure_heartbeat() -> None:
    if _THREAD and _THREAD[0].is_alive():
        return
    with _LOCK:
        if not (_THREAD and _THREAD[0].is_alive()):
            _THREAD[:] = [_Heartbeat(max(check_interval() / 3, 0.05))]
            _THREAD[0].start()


def _store() -> dist.distributed_c10d.Store:
    return dist.distributed_c10d._get_default_store()


def _publish(beat: int) -> None:
    now, last, gave_up = _NOW[0], _LAST[0], _GAVE_UP[0]
    state = {
        "departure": _DEPARTURE[0],
        "topic": _AGREEING_ON[0],
        "beat": beat,
        "now": asdict(now) if now is not None else None,
        "last": asdict(last[0]) if last is not None else None,
        "last_age": round(time.monotonic() - last[1], 1) if last is not None else None,
        "gave_up": gave_up,
    }
    _store().set(f"{_KEY}{dist.get_rank()}", json.dumps(state))


def _read(rank: int) -> dict[str, Any] | None:
    store = _store()
    key = f"{_KEY}{rank}"
    if not store.check([key]):
        return None
    state: dict[str, Any] = json.loads(store.get(key))
    return state


@contextmanager
def waiting_in(where: Where) -> Iterator[None]:
    """Mark this rank as waiting in ``where`` (for peers that look)."""
    _NOW[0] = where
    try:
        yield
    finally:
        _NOW[0] = None
        _LAST[0] = (where, time.monotonic())


# ------------------------------------------------------------------------------- the check


def _peers(group: dist.ProcessGroup | None) -> list[int]:
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return [r for r in ranks if r != me]


def _look(
    where: Where, peers: list[int], work: dist.Work | None = None, topic: str | None = None
) -> tuple[list[str], list[str]]:
    """Where the peers are: (problems that make this an error, peers that are only slow).

    ``topic``: what this rank is agreeing on (a rendezvous); a peer that issued its collective
    without agreeing must then have departed alike (for a departure) or be in ``where``."""
    _publish(next(_BEAT))  # (at once: a peer looking now sees this rank's state)
    first = {r: _read(r) for r in peers}
    time.sleep(max(check_interval() / 3, 0.05) * 2.5)  # two of their heartbeats
    if work is not None and work.is_completed():
        return [], []  # (the peer came while we looked)
    problems: list[str] = []
    slow: list[str] = []
    for rank in peers:
        state = _read(rank)
        before = first[rank]
        if state is not None and state.get("gave_up"):
            problems.append(f"rank {rank} gave up: {state['gave_up']}")
        elif state is None or (before is not None and before["beat"] == state["beat"]):
            problems.append(
                f"rank {rank} does not answer (it exited, was killed, or hangs outside Python)"
            )
        elif state["now"] is None and topic is not None and topic == _DEPARTURE[0] and (
            state.get("departure") not in (None, topic)
        ):
            problems.append(f"rank {rank}'s units departed otherwise: {state['departure']}")
        elif state["now"] is None:
            last = state["last"]
            seen = (
                f"its last fshard collective was {Where(**last).describe()}, {state['last_age']} s ago"
                if last is not None
                else "it has issued no fshard collective yet"
            )
            slow.append(f"rank {rank} is outside fshard's collectives ({seen})")
        else:
            theirs = Where(**state["now"])
            departure = state.get("departure")
            if theirs.agreeing and state.get("topic") != (topic or where.describe()):
                if state.get("topic") == departure and departure != _DEPARTURE[0]:
                    problems.append(
                        f"rank {rank}'s units departed from the first step's order ({departure}), "
                        f"this rank's {'did too: ' + _DEPARTURE[0] if _DEPARTURE[0] else 'did not'}"
                    )
                    continue
            if topic is not None and topic == _DEPARTURE[0] and not theirs.agreeing:
                if departure != topic:
                    problems.append(
                        f"this rank's units departed from the first step's order ({topic}), "
                        f"rank {rank}'s did not: it is in {theirs.describe()}"
                    )
                continue
            if theirs.same_as(where):
                continue  # waiting with us
            if theirs.group == where.group and theirs.seq > where.seq:
                # Past this collective: it completed on their side, so it does on ours.
                continue
            if theirs.group != where.group:
                # Waiting on a collective of another group (a 2D mesh's other dimension): for
                # a peer there, or mismatched there, which that group's ranks will find.
                slow.append(f"rank {rank} waits in {theirs.describe()}")
            else:
                problems.append(f"rank {rank} is in {theirs.describe()}")
    return problems, slow


_ORDER_HINT = (
    "Every rank must run the same units in the same order in a step: draw layer-dropping "
    "choices from a generator seeded alike on every rank, and keep experts routed per rank "
    "inside one unit that always runs (where a unit's output is unused on a rank, add "
    "0 * output.sum() to that rank's loss). Do not step the optimizer."
)
_CALL_HINT = (
    "The ranks must issue the same fshard collectives in the same order: an fshard call made "
    "on some ranks only (full_state_dict, state_dict, checkpoint.save, p.full_tensor(), "
    "fshard.unshard, clip_grad_norm_ communicate: call them on every rank, and save on rank 0 "
    "only), a unit run on some ranks only (data-dependent control flow; add 0 * output.sum() to "
    "the loss of a rank that skips a unit's output), or a rank that stopped early."
)


def _verdict(
    where: Where, problems: list[str], waited: float, *, headline: str | None = None, departed: bool = False
) -> CollectiveError:
    head = headline or f"hang check after {waited:.0f} s in {where.describe()}"
    hint = _ORDER_HINT if departed or _DEPARTURE[0] else _CALL_HINT
    message = (
        f"{rank_prefix()}fshard: {head}: " + "; ".join(problems) + f". {hint} "
        f"({HANG_CHECK_ENV} sets how long a rank waits in a collective before it looks where "
        "its peers are.)"
    )
    _GAVE_UP[0] = f"{where.describe()} raised CollectiveError"
    try:
        _publish(next(_BEAT))
    except Exception:  # (the store may be gone too: the error says enough)
        logger.debug("fshard: could not publish the hang-check verdict", exc_info=True)
    if all("does not answer" in p for p in problems):
        return CollectiveError(message)
    return CollectiveMismatchError(message)


def checked_wait(work: dist.Work, where: Where, group: dist.ProcessGroup | None) -> None:
    """``work.wait()`` in slices of ``FSHARD_HANG_CHECK_S``, looking at the peers after each
    (see [Note: the hang check]). Raises ``CollectiveError`` where waiting longer cannot help."""
    if _GAVE_UP[0] is not None:
        # This rank gave up (a verdict above it on the stack, or before it in this step): its
        # peers will not join what it issued before, so clean-up code (freeing the units of a
        # forward that raised) must not wait for it. The buffers stay allocated.
        raise CollectiveError(
            f"{rank_prefix()}fshard: not waiting for {where.describe()}: this rank gave up on "
            f"{_GAVE_UP[0].removesuffix(' raised CollectiveError')} in this step, so its peers "
            "will not join it"
        )
    interval = check_interval()
    timeout = datetime.timedelta(seconds=interval)
    start = time.monotonic()
    logged: set[str] = set()
    _ensure_heartbeat()
    with waiting_in(where):
        while True:
            try:
                work.wait(timeout=timeout)
                return
            except RuntimeError as exc:
                if not _timed_out(exc):
                    raise
            problems, slow = _look(where, _peers(group), work)
            waited = time.monotonic() - start
            if problems:
                raise _verdict(where, problems, waited)
            for line in slow:
                if line.split(" is ")[0] not in logged:
                    logged.add(line.split(" is ")[0])
                    logger.warning(
                        "%sfshard: waited %.0f s in %s; waiting on: %s",
                        rank_prefix(),
                        waited,
                        where.describe(),
                        line,
                    )


def _timed_out(exc: RuntimeError) -> bool:
    """Whether a wait ended because its slice ran out (gloo's ``Work.wait(timeout)``, a store's
    ``wait``), not because the collective itself failed (a process-group timeout, a peer gone)."""
    text = str(exc).lower()
    return text.startswith("operation timed out") or "wait timeout" in text


def rendezvous(where: Where, group: dist.ProcessGroup | None, reason: str, topic: str | None = None) -> None:
    """Agree with the peers of ``group`` on the collective this rank issues next, through the
    store, before issuing it: ranks about to issue different collectives raise
    ``CollectiveError`` on every rank instead of pairing them (see [Note: the hang check]).
    ``reason`` says why this rank checks (an API call, FSHARD_DEBUG); ``topic``, what the ranks
    must agree on, is the collective itself unless given (a departure from the first step's
    order of units: every rank must have departed alike)."""
    topic = topic if topic is not None else where.describe()
    _ensure_heartbeat()
    store = _store()
    me = dist.get_rank()
    peers = _peers(group)
    base = f"{_KEY}rv/{_EPOCH[0]}/{where.group}/"
    prefix = f"{base}{where.seq}/"
    mine = json.dumps({"where": asdict(where), "topic": topic})
    store.set(f"{prefix}{me}", mine)
    store.set(f"{base}now/{me}", mine)  # what this rank agrees on now, at whatever sequence number
    keys = [f"{prefix}{r}" for r in peers]
    interval = check_interval()
    start = looked = time.monotonic()
    pause = 0.005
    differ: list[str] = []
    _AGREEING_ON[0] = topic
    try:
        with waiting_in(dataclasses.replace(where, agreeing=True)):
            while True:
                if store.check(keys):  # (polled: a store's timed wait logs each timeout)
                    break
                time.sleep(pause)
                pause = min(pause * 2, interval / 4, 0.5)
                # A peer agreeing on something else (another sequence number: it departed
                # elsewhere, or it entered another call) is a mismatch now, not in a slice.
                differ = _other_agreements(store, base, peers, where.seq, topic)
                if differ:
                    break
                if time.monotonic() - looked < interval:
                    continue
                problems, slow = _look(where, peers, topic=topic)
                looked = time.monotonic()
                if problems:
                    raise _verdict(where, problems, looked - start)
                if not slow:
                    break  # every peer without a key is in this very collective, issued alike
    finally:
        _AGREEING_ON[0] = None
    if not differ:
        differ = _other_agreements(store, base, peers, where.seq, topic, at_seq=True)
    if differ:
        departed = topic == _DEPARTURE[0] or any("departed" in d or "ran as unit" in d for d in differ)
        raise _verdict(
            where,
            [f"this rank (rank {me}): {topic}", *differ],
            time.monotonic() - start,
            headline=f"the ranks were about to issue different collectives ({reason})",
            departed=departed,
        )
    # Agreed. (The "now" key stays where the agreement failed: the peers read the difference.)
    store.set(f"{base}now/{me}", "{}")  # (overwritten, never deleted: a reader may be reading it)
    # Every peer has read this rank's key of the agreement before on this group: the collective
    # agreed on then needed them all.
    previous = _MY_KEYS.get(where.group)
    if previous is not None:
        store.delete_key(previous)
    _MY_KEYS[where.group] = f"{prefix}{me}"


def _other_agreements(
    store: dist.distributed_c10d.Store, base: str, peers: list[int], seq: int, topic: str, at_seq: bool = False
) -> list[str]:
    """Peers that agree on something other than ``topic`` at ``seq``: from their key at ``seq``
    (``at_seq``: once every key is there), or from what they agree on now. A peer agreeing at
    an earlier number that this rank agreed on too has not yet seen that everyone did
    (harmless); any other number is a collective one of the two issued without agreeing."""
    out = []
    for rank in peers:
        mine = f"{base}{seq}/{rank}"
        if at_seq or store.check([mine]):
            if not store.check([mine]):
                continue
            theirs = json.loads(store.get(mine))
        else:
            now = f"{base}now/{rank}"
            if not store.check([now]):
                continue
            theirs = json.loads(store.get(now))
            if not theirs:
                continue  # done agreeing
            earlier = Where(**theirs["where"]).seq
            if earlier < seq and store.check([f"{base}{earlier}/{dist.get_rank()}"]):
                continue  # still on one this rank agreed on too: it has not seen that yet
        where = Where(**theirs["where"])
        if theirs["topic"] != topic or where.seq != seq:
            out.append(f"rank {rank}: {theirs['topic']} (before {where.describe()})")
    return out


_MY_KEYS: dict[str, str] = {}
