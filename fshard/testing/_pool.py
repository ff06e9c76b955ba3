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
leak into the next task.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
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

    Example:
        >>> import pytest
        >>> from fshard.testing import RanksFailed, get_pool
        >>> with pytest.raises(RanksFailed) as info:        # doctest: +SKIP
        ...     get_pool(2).run(function_that_raises)
        >>> isinstance(info.value.errors[0], ValueError)    # doctest: +SKIP
        True
    """

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        self.errors = errors
        self.tracebacks = tracebacks
        first = min(errors)
        parts = [f"{len(errors)} rank(s) failed: {sorted(errors)}"]
        for rank in sorted(tracebacks):
            parts.append(f"--- rank {rank} ---\n{tracebacks[rank].rstrip()}")
        super().__init__("\n".join(parts))
        self.first = errors[first]


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
    results.put((rank, -1, True, b""))  # ready
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            data = pickle.dumps(value)
            results.put((rank, task_id, True, data))
        except BaseException as exc:  # reported to the driver, never swallowed
            text = traceback.format_exc()
            try:
                data = pickle.dumps((exc, text))
                pickle.loads(data)
            except Exception:  # unpicklable exception: send its text
                data = pickle.dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), text))
            results.put((rank, task_id, False, data))
    try:
        dist.destroy_process_group()
    except Exception:  # best effort at shutdown
        pass


class RankPool:
    """``world_size`` long-lived ranks in one process group; run picklable functions on all.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU, default) or ``"nccl"`` (one GPU per rank).
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
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
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
        a rank process exited, ``RankTimeout`` if the task overran ``timeout`` seconds.
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
        values: list[Any] = []
        for rank in range(self.world_size):
            ok, data = answers[rank]
            if ok:
                values.append(pickle.loads(data))
            else:
                exc, text = pickle.loads(data)
                errors[rank], texts[rank] = exc, text
                values.append(None)
        if errors:
            raise RanksFailed(errors, texts)
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
                    if what == "start":
                        hint = (
                            " (their stderr says why; from a script, start the pool under "
                            "`if __name__ == '__main__':`, since each rank re-imports the main "
                            "module, and define the functions it runs in an importable module "
                            "or that script)"
                        )
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
            if tid == task_id:
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
