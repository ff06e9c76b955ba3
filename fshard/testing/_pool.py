"""A persistent pool of ranks that runs a picklable function on every rank.

[Note: persistent rank pool]
Starting a process group costs seconds (process spawn, ``import torch``, rendezvous); a
hypothesis example should cost milliseconds. A ``RankPool`` starts ``world_size`` processes once,
joins them into one process group (gloo on 127.0.0.1 by default, rendezvous through a
``FileStore`` in a temporary directory), and then runs tasks: ``pool.run(fn, *args)`` calls
``fn(*args)`` on every rank and returns the per-rank results in rank order.

Nothing can hang the caller: every task runs under a timeout, and a rank that dies or does not
answer in time fails the call with ``RankDied`` / ``RankTimeout``; the pool is then torn down and
restarted on its next use. Exceptions raised on ranks come back as ``RanksFailed`` carrying every
failing rank's exception and traceback, after all ranks have answered, so no stale result can
leak into the next task. See [Note: resetting the pool after a failed task] for when a
``RanksFailed`` also restarts the pool.

[Note: resetting the pool after a failed task]
A task that fails on every rank before any collective (the usual test of a user error: every
rank raises the same ``ValueError``) leaves the process group as it was, and the next task runs
on the same ranks at no cost. Two kinds of failure do not:

- a *communication error* on some rank (a collective timed out, a peer closed the connection:
  torch's ``DistError`` family, ``fshard.CollectiveError``, or gloo/NCCL's own ``RuntimeError``,
  recognised by its text). Gloo closes every connection of a pair that timed out, so each later
  collective fails at once with "Connection closed by peer", in unrelated tasks;
- an *asymmetric* failure: some ranks raised and others returned. The ranks that returned may
  have issued collectives that the failing ranks never matched (or the reverse), so the next
  task's collectives could pair with stale ones, or wait out the process group's timeout;
- ranks that all raised after issuing different numbers of collectives on some process group
  (torch's per-group sequence numbers, which each failing rank reports): one was left
  unmatched, with the same consequence.

After either kind the driver stops the ranks at once (``RanksFailed.pool_reset`` is True, and the
message says so); the pool restarts, with a fresh process group, on its next use. A restart costs
seconds, which is why a symmetric user error does not trigger one.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankPool", "RanksFailed", "RankDied", "RankTimeout", "get_pool", "shutdown_pools"]

logger = logging.getLogger("fshard")


class RanksFailed(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> exception, ``tracebacks`` rank -> text.

    ``pool_reset`` is True when the failure could have left the process group unusable (a rank
    hit a communication error, or only some ranks raised): the pool's ranks were then stopped,
    and it restarts with a fresh process group on its next use. See
    [Note: resetting the pool after a failed task].

    Example:
        >>> import pytest
        >>> from fshard.testing import RanksFailed, get_pool
        >>> with pytest.raises(RanksFailed) as info:        # doctest: +SKIP
        ...     get_pool(2).run(function_that_raises)
        >>> isinstance(info.value.errors[0], ValueError)    # doctest: +SKIP
        True
    """

    def __init__(
        self,
        errors: dict[int, BaseException],
        tracebacks: dict[int, str],
        *,
        reset_reason: str | None = None,
    ) -> None:
        self.errors = errors
        self.tracebacks = tracebacks
        self._reset_reason = reset_reason
        self.pool_reset = reset_reason is not None
        first = min(errors)
        header = f"{len(errors)} rank(s) failed: {sorted(errors)}"
        if reset_reason is not None:
            header += (
                f"; {reset_reason}, so the pool's process group was reset (its ranks were "
                "stopped and restart on next use)"
            )
        parts = [header]
        for rank in sorted(tracebacks):
            parts.append(f"--- rank {rank} ---\n{tracebacks[rank].rstrip()}")
        super().__init__("\n".join(parts))
        self.first = errors[first]

    def __reduce__(self) -> tuple[Any, ...]:
        # An exception pickles as ``cls(*args)``, here the message alone: rebuild from the parts
        # (a test runner that ships failures between processes pickles them).
        return (_ranks_failed, (self.errors, self.tracebacks, self._reset_reason))


def _ranks_failed(
    errors: dict[int, BaseException], tracebacks: dict[int, str], reset_reason: str | None
) -> RanksFailed:
    return RanksFailed(errors, tracebacks, reset_reason=reset_reason)


class RankDied(RuntimeError):
    """A rank process exited while running a task (the pool restarts on next use).

    Example:
        >>> import os
        >>> import pytest
        >>> from fshard.testing import RankDied, get_pool
        >>> pool = get_pool(2)                # doctest: +SKIP
        >>> with pytest.raises(RankDied):     # doctest: +SKIP
        ...     pool.run(os._exit, 3)
    """


class RankTimeout(TimeoutError):
    """Some ranks did not finish a task within the timeout (a hang; the pool is stopped).

    Example:
        >>> import pytest
        >>> from fshard.testing import RankTimeout, get_pool
        >>> pool = get_pool(2)                               # doctest: +SKIP
        >>> with pytest.raises(RankTimeout):                 # doctest: +SKIP
        ...     pool.run(task_where_one_rank_skips_a_collective, timeout=20)
    """


# Text of the RuntimeErrors that gloo and NCCL raise (they are not always torch's DistError types):
# a timed-out collective, a peer that closed or reset its connection.
_COMMUNICATION_ERROR_TEXTS = (
    "third_party/gloo",
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",
    "ms for recv",  # gloo: "Timed out waiting 15000ms for recv operation to complete"
    "ms for send",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
    "Watchdog caught collective operation timeout",
)


def _is_communication_error(exc: BaseException) -> bool:
    """True if ``exc``, or an exception it was raised from, says a collective or connection failed.

    Looks at the ``__cause__``/``__context__`` chain: torch's ``DistError`` family (backend,
    network and store errors), ``fshard.CollectiveError``, ``ConnectionError``, and
    ``RuntimeError``s whose text is gloo's or NCCL's. See
    [Note: resetting the pool after a failed task].

    Example:
        >>> _is_communication_error(RuntimeError("[pair.cc:553] Connection closed by peer"))
        True
        >>> _is_communication_error(ValueError("bad argument"))
        False
    """
    import torch.distributed as dist

    from fshard._errors import CollectiveError

    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (dist.DistError, CollectiveError, ConnectionError)):
            return True
        if isinstance(current, RuntimeError) and any(t in str(current) for t in _COMMUNICATION_ERROR_TEXTS):
            return True
        pending += [current.__cause__, current.__context__]
    return False


def _failure_payload(exc: BaseException, counts: dict[str, int] | None = None) -> bytes:
    """``(exception, traceback text, is communication error, collective counts)``, pickled for
    the driver."""
    text = traceback.format_exc()
    broke = _is_communication_error(exc)
    try:
        data = pickle.dumps((exc, text, broke, counts))
        pickle.loads(data)
    except Exception:  # unpicklable exception: send its text
        data = pickle.dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), text, broke, counts))
    return data


def _collective_counts() -> dict[str, int] | None:
    """How many collectives this rank issued on each of its process groups (torch's per-group
    sequence numbers, private; None where unavailable). Ranks that all raised but issued
    different counts left a collective unmatched: [Note: resetting the pool after a failed
    task]. (Point-to-point sends count on their two ranks only, so a difference may also be
    harmless: then the reset only costs a restart.)"""
    import torch.distributed as dist

    try:
        groups = list(dist.distributed_c10d._world.pg_map)
        return {
            g.group_name: int(g._get_sequence_number_for_group())  # type: ignore[attr-defined]  # private, at runtime
            for g in groups
        }
    except Exception:  # private API: no counts, no comparison
        return None


def _worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    pg_timeout_s: float,
    tasks: Any,  # multiprocessing queues
    results: Any,
    threads: int,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]  # exported at runtime
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device_id = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
            device_id=device_id,
        )
    except BaseException as exc:  # the driver says why this rank could not start
        results.put((rank, -1, False, _failure_payload(exc)))
        return
    results.put((rank, -1, True, b""))  # ready
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            from fshard._collectives import reset_hang_state

            reset_hang_state()
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            data = pickle.dumps(value)
            results.put((rank, task_id, True, data))
        except BaseException as exc:  # reported to the driver, never swallowed
            results.put((rank, task_id, False, _failure_payload(exc, _collective_counts())))
    try:
        dist.destroy_process_group()
    except Exception:  # best effort at shutdown
        pass


def _counts_differ(counts: dict[int, dict[str, int] | None]) -> bool:
    """Whether some process group's collective count differs between the ranks holding it."""
    by_group: dict[str, set[int]] = {}
    for per_rank in counts.values():
        if per_rank is None:
            return False  # not known on every rank
        for name, count in per_rank.items():
            by_group.setdefault(name, set()).add(count)
    return any(len(seen) > 1 for seen in by_group.values())


def _describe_counts(counts: dict[int, dict[str, int] | None]) -> str:
    """The first process group whose counts differ, per rank, for the message."""
    names = sorted({n for c in counts.values() if c for n in c})
    for name in names:
        per_rank = {r: c[name] for r, c in sorted(counts.items()) if c and name in c}
        if len(set(per_rank.values())) > 1:
            return f"process group {name!r}, count per rank {per_rank}"
    return "?"


_BACKENDS = ("gloo", "nccl")


def _check_pool_arguments(
    world_size: int, backend: str, timeout: float, pg_timeout: float, threads: int
) -> None:
    """Raise one ``ValueError`` naming every problem with ``RankPool``'s arguments."""
    import torch
    import torch.distributed as dist

    from fshard._errors import ProblemList

    problems = ProblemList("RankPool")
    if world_size < 1:
        problems.add(f"world_size must be >= 1, got {world_size}")
    if backend not in _BACKENDS:
        problems.add(
            f"backend must be 'gloo' (CPU) or 'nccl' (one CUDA GPU per rank), got {backend!r}; "
            "the pool spawns and joins its own ranks, so launcher-bound backends such as 'mpi' "
            "do not fit it"
        )
    elif not dist.is_available():
        problems.add(f"backend {backend!r} needs torch.distributed, which this torch build lacks")
    elif backend == "gloo" and not dist.is_gloo_available():
        problems.add("backend 'gloo' is not available in this torch build")
    elif backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus < world_size:
            nccl = "NCCL is available" if dist.is_nccl_available() else "NCCL is not available"
            problems.add(
                f"backend 'nccl' needs one CUDA GPU per rank ({world_size} rank(s)), but this "
                f"machine has {gpus} (torch.cuda.is_available() is {torch.cuda.is_available()}; "
                f"{nccl}); use backend='gloo', which runs on CPU"
            )
    for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout)):
        if not value > 0:
            problems.add(f"{name} must be > 0 seconds, got {value}")
    if threads < 1:
        problems.add(f"threads must be >= 1, got {threads}")
    problems.raise_if_any(ValueError)


def _main_guard_hint_applies() -> bool:
    """True if spawned ranks re-run the main script (so a missing ``__main__`` guard can kill them).

    ``spawn`` re-imports the main module in every child: by path for ``python script.py``, by
    name for ``python -m pkg.mod`` (but never a package's ``__main__``), and not at all for an
    interactive session or ``python -c``.
    """
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


class RankPool:
    """``world_size`` long-lived ranks in one process group; run picklable functions on all.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU, default) or ``"nccl"`` (one CUDA GPU per rank, so it needs
            ``world_size`` GPUs). Checked here, before any process starts.
        timeout: default seconds a task may take before the pool declares a hang.
        pg_timeout: the process group's own collective timeout, in seconds.
        threads: torch intra-op threads per rank (1 keeps small ranks from oversubscribing).

    Example:
        >>> from fshard.testing import RankPool
        >>> def where_am_i():
        ...     import torch.distributed as dist
        ...     return dist.get_rank()
        >>> with RankPool(2) as pool:          # doctest: +SKIP
        ...     pool.run(where_am_i)
        [0, 1]
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 180.0,
        pg_timeout: float = 60.0,
        threads: int = 1,
    ) -> None:
        _check_pool_arguments(world_size, backend, timeout, pg_timeout, threads)
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.threads = threads
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._dir: str | None = None
        self._task_id = 0

    # Lifecycle ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while every rank process is alive."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self, start_timeout: float = 120.0) -> None:
        """Spawn the ranks and join them into a process group (no-op if already running)."""
        if self.running:
            return
        self.close()
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="fshard-pool-")
        store_path = os.path.join(self._dir, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for rank in range(self.world_size):
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    store_path,
                    self.backend,
                    self.pg_timeout,
                    self._tasks[rank],
                    self._results,
                    self.threads,
                ),
                daemon=True,
                name=f"fshard-rank-{rank}",
            )
            proc.start()
            self._procs.append(proc)
        self._collect(-1, start_timeout, what="start")

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the rendezvous directory."""
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # queue may be broken after a crash
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self._procs, self._tasks, self._results = [], [], None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Tasks ----------------------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises ``RanksFailed`` if any rank raised (after every rank answered), ``RankDied`` if
        a rank process exited, ``RankTimeout`` if the task overran ``timeout`` seconds. After a
        ``RankDied``, a ``RankTimeout``, or a ``RanksFailed`` whose ``pool_reset`` is True, the
        pool restarts on its next use.
        """
        payload = pickle.dumps((fn, args, kwargs))
        self.start()
        self._task_id += 1
        task_id = self._task_id
        for q in self._tasks:
            q.put((task_id, payload))
        answers = self._collect(task_id, timeout if timeout is not None else self.timeout, what=getattr(fn, "__qualname__", repr(fn)))
        errors: dict[int, BaseException] = {}
        texts: dict[int, str] = {}
        broken: list[int] = []
        counts: dict[int, dict[str, int] | None] = {}
        values: list[Any] = []
        for rank in range(self.world_size):
            ok, data = answers[rank]
            if ok:
                values.append(pickle.loads(data))
            else:
                exc, text, broke, counts[rank] = pickle.loads(data)
                errors[rank], texts[rank] = exc, text
                if broke:
                    broken.append(rank)
                values.append(None)
        if errors:
            # [Note: resetting the pool after a failed task]
            reasons = []
            if broken:
                reasons.append(f"rank(s) {broken} hit a communication error")
            if len(errors) < self.world_size:
                returned = sorted(set(range(self.world_size)) - set(errors))
                reasons.append(
                    f"rank(s) {returned} returned while the others raised, so their collectives "
                    "may be out of step"
                )
            elif not broken and _counts_differ(counts):
                reasons.append(
                    "the ranks raised after issuing different numbers of collectives (one left "
                    f"unmatched: {_describe_counts(counts)})"
                )
            reason = " and ".join(reasons) if reasons else None
            if reason is not None:
                logger.info("RankPool(%d): %s; stopping the ranks", self.world_size, reason)
                self.close()
            raise RanksFailed(errors, texts, reset_reason=reason)
        return values

    def _collect(self, task_id: int, timeout: float, what: str) -> dict[int, tuple[bool, bytes]]:
        answers: dict[int, tuple[bool, bytes]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            try:
                rank, tid, ok, data = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.close()
                    hint = ""
                    if task_id == -1 and _main_guard_hint_applies():
                        hint = (
                            " (their stderr says why; from a script, start the pool under "
                            "`if __name__ == '__main__':`, since each rank re-imports the main "
                            "module, and define the functions it runs in an importable module "
                            "or that script)"
                        )
                    elif task_id == -1:
                        hint = " (their stderr says why)"
                    raise RankDied(
                        f"rank(s) {dead} died while running {what} (exit codes {codes}); "
                        f"the pool was stopped and will restart on next use{hint}"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(answers))
                    self.close()
                    raise RankTimeout(
                        f"rank(s) {missing} did not finish {what} within {timeout:.0f}s (a hang or "
                        "a collective some ranks never joined); the pool was stopped"
                    ) from None
                continue
            if tid != task_id:
                continue
            if task_id == -1 and not ok:
                # A rank that could not join the process group leaves the others waiting in the
                # rendezvous until its timeout: stop them now and say why.
                exc, text, *_ = pickle.loads(data)
                self.close()
                raise RankDied(
                    f"rank {rank} failed to start ({type(exc).__name__}: {exc}); the pool was "
                    f"stopped and will restart on next use\n--- rank {rank} ---\n{text.rstrip()}"
                ) from None
            answers[rank] = (ok, data)
        return answers


_POOLS: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, *, backend: str = "gloo") -> RankPool:
    """The process-wide pool for ``world_size`` ranks, started on first use and then reused.

    Example:
        >>> from fshard.testing import get_pool
        >>> pool = get_pool(2)      # doctest: +SKIP
        >>> pool.run(len, [1, 2])   # doctest: +SKIP
        [2, 2]
    """
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = RankPool(world_size, backend=backend)
    pool.start()
    return pool


def shutdown_pools() -> None:
    """Stop every pool started by ``get_pool`` (also runs at interpreter exit).

    Example:
        >>> from fshard.testing import shutdown_pools
        >>> shutdown_pools()  # e.g. in a session-scoped pytest fixture's teardown
    """
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
