"""The testing kit holds up: a failed task cannot poison the pool, and ``assert_equivalent_to_ddp``
neither rejects equivalent models nor passes without comparing anything.

Tests that break a process group on purpose use a pool of their own with a short ``pg_timeout``
and stop it; the rest share ``get_pool(2)``.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import RankDied, RankPool, RanksFailed, _pool, assert_equivalent_to_ddp


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 10 + rank))


# ----------------------------------------------------------- the pool after a failed task


def _pid() -> int:
    return os.getpid()


def _every_rank_raises() -> None:
    raise ValueError(f"bad input on rank {dist.get_rank()}")


def _rank1_raises_before_an_all_reduce() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails before the all_reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits out pg_timeout; gloo then closes the pair


def _rank1_raises_alone() -> bool:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails, rank 0 returns")
    return True


def _all_reduce_ranks() -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def test_a_symmetric_user_error_keeps_the_ranks_and_a_broken_collective_resets_them():
    pool = RankPool(2, timeout=60, pg_timeout=3)
    try:
        pids = pool.run(_pid)
        with pytest.raises(RanksFailed) as info:
            pool.run(_every_rank_raises)
        assert not info.value.pool_reset and "reset" not in str(info.value)
        # A runner that ships failures between processes pickles them: all the parts survive.
        copy = pickle.loads(pickle.dumps(info.value))
        assert (str(copy), copy.tracebacks, copy.pool_reset) == (
            str(info.value), info.value.tracebacks, False
        )
        assert {r: repr(e) for r, e in copy.errors.items()} == {
            r: repr(e) for r, e in info.value.errors.items()
        }
        assert pool.run(_pid) == pids, "a symmetric user error must not restart the ranks"

        with pytest.raises(RanksFailed) as info:
            pool.run(_rank1_raises_before_an_all_reduce)
        message = str(info.value).splitlines()[0]
        assert info.value.pool_reset, message
        assert pickle.loads(pickle.dumps(info.value)).pool_reset
        assert "rank(s) [0] hit a communication error" in message
        assert "the pool's process group was reset" in message
        assert not pool.running
        # Without the reset every later collective fails at once: "Connection closed by peer".
        assert pool.run(_all_reduce_ranks) == [3.0, 3.0]
        assert pool.run(_pid) != pids
    finally:
        pool.close()


def test_a_rank_that_returns_while_another_raises_resets_the_pool():
    pool = RankPool(2, timeout=60, pg_timeout=3)
    try:
        with pytest.raises(RanksFailed) as info:
            pool.run(_rank1_raises_alone)
        message = str(info.value).splitlines()[0]
        assert info.value.pool_reset and sorted(info.value.errors) == [1], message
        assert "rank(s) [0] returned while the others raised" in message
        assert "communication error" not in message
        assert pool.run(_all_reduce_ranks) == [3.0, 3.0]
    finally:
        pool.close()


def _every_rank_raises_after_an_unmatched_all_reduce() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.full((1,), 100.0), async_op=True)  # no other rank joins it
    raise ValueError("the same error on every rank")


def test_every_rank_raising_after_an_unmatched_collective_resets_the_pool():
    """Every rank raised, but rank 0 had issued a collective the others never joined: the
    ranks kept running, and the next task's all_reduce paired with the stale one (a wrong
    value on one rank, a timeout on the other)."""
    pool = RankPool(2, timeout=60, pg_timeout=3)
    try:
        with pytest.raises(RanksFailed) as info:
            pool.run(_every_rank_raises_after_an_unmatched_all_reduce)
        message = str(info.value).splitlines()[0]
        assert info.value.pool_reset, message
        assert pickle.loads(pickle.dumps(info.value)).pool_reset
        assert "issuing different numbers of collectives" in message
        assert pool.run(_all_reduce_ranks) == [3.0, 3.0]
    finally:
        pool.close()


def _shard_fails_on_rank1(model: nn.Module, mesh) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("simulated failure on rank 1 only")
    fshard.fully_shard(model, mesh=mesh)


def test_equivalence_after_a_rank_asymmetric_failure_runs_on_a_fresh_process_group():
    pool = RankPool(2, timeout=60, pg_timeout=3)
    try:
        with pytest.raises(RanksFailed) as info:
            assert_equivalent_to_ddp(_mlp, batch_fn=_batch, shard_fn=_shard_fails_on_rank1, pool=pool)
        assert info.value.pool_reset
        assert "simulated failure on rank 1 only" in str(info.value.errors[1])
        report = assert_equivalent_to_ddp(_mlp, batch_fn=_batch, pool=pool)
        assert report.params_compared == 4
    finally:
        pool.close()


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


_GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:56034. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RuntimeError(_GLOO_CLOSED), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (RuntimeError("[../unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"), True),
        (dist.DistBackendError("NCCL watchdog timeout"), True),
        (dist.DistNetworkError("connection reset"), True),
        (dist.DistStoreError("timed out waiting for key"), True),
        (fshard.CollectiveError("[rank 0] fshard: the all_gather of 'layers.1' failed"), True),
        (ConnectionResetError("reset"), True),
        (_raised(ValueError("wrapped"), RuntimeError(_GLOO_CLOSED)), True),
        (ValueError("bad input on rank 0"), False),
        (fshard.RankMismatchError("ranks built different sharded models"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x5 and 6x7)"), False),
        (RuntimeError("Timed out waiting for the user's lock"), False),
        (TypeError("not a tensor"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_communication_errors_are_told_from_user_errors(exc, expected):
    assert _pool._is_communication_error(exc) is expected


# ---------------------------------------------------------------- pool arguments and start


@pytest.mark.parametrize("backend", ["mpi", "bogus", "NCCL"])
def test_an_unsupported_backend_is_rejected_before_any_process_starts(backend):
    with pytest.raises(ValueError, match=rf"RankPool: backend must be 'gloo' \(CPU\) or 'nccl' .*got '{backend}'"):
        RankPool(2, backend=backend)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="this machine can run NCCL on 2 GPUs"
)
def test_nccl_without_a_gpu_per_rank_is_rejected():
    with pytest.raises(ValueError, match=r"backend 'nccl' needs one CUDA GPU per rank \(2 rank\(s\)\), but this machine has"):
        RankPool(2, backend="nccl")


def test_every_bad_pool_argument_is_listed_at_once():
    with pytest.raises(ValueError) as info:
        RankPool(0, backend="bogus", threads=0)
    message = str(info.value)
    assert "world_size must be >= 1, got 0" in message
    assert "got 'bogus'" in message and "threads must be >= 1, got 0" in message


def test_a_rank_that_cannot_start_says_why(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")  # each rank's gloo fails to find it
    pool = RankPool(2, pg_timeout=5)
    try:
        with pytest.raises(RankDied) as info:
            pool.start()
        message = str(info.value)
        assert "failed to start" in message and "Unable to find address for: nosuchif0" in message
        assert "__main__" not in message, "the main-guard hint does not apply: the rank said why"
        assert not pool.running
    finally:
        pool.close()


# ------------------------------------------------------------------ assert_equivalent_to_ddp


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 8)
        self.drop = nn.Dropout(0.5)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(self.l1(x)))


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return _Dropout()


def test_a_model_with_dropout_is_equivalent():
    report = assert_equivalent_to_ddp(_dropout_model, batch_fn=_batch, steps=2, grad_accum=2)
    assert report.params_compared == 4 and report.params_sharded == 4
    assert report.losses == report.ddp_losses


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"steps must be >= 1 \(optimizer steps to compare\), got 0"),
        ({"steps": -3}, r"steps must be >= 1 \(optimizer steps to compare\), got -3"),
        ({"grad_accum": 0}, r"grad_accum must be >= 1 \(micro-batches per step\), got 0"),
        (
            {"steps": 0, "grad_accum": 0, "mesh_shape": (1, 1, 2)},
            r"3 problems:\n  - mesh_shape must be 1D .* got \(1, 1, 2\)\n  - steps must be >= 1 .*\n  - grad_accum must be >= 1",
        ),
        ({"world_size": 1}, r"pool has 2 ranks but world_size is 1; pass world_size=2"),
    ],
)
def test_arguments_that_would_compare_nothing_are_rejected_before_anything_runs(kwargs, match):
    pool = RankPool(2, pg_timeout=3)  # never started by a rejected call
    try:
        with pytest.raises(ValueError, match=rf"^assert_equivalent_to_ddp: .*{match}"):
            assert_equivalent_to_ddp(_mlp, batch_fn=_batch, pool=pool, **kwargs)
        assert not pool.running
    finally:
        pool.close()


def _shard_nothing(model: nn.Module, mesh) -> None:
    del model, mesh


def test_a_shard_fn_that_shards_nothing_fails():
    with pytest.raises(AssertionError, match=r"shard_fn \(_shard_nothing\) left all 4 parameters of the model unsharded"):
        assert_equivalent_to_ddp(_mlp, batch_fn=_batch, shard_fn=_shard_nothing)


def _nan_for_fshard(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss = model(batch).pow(2).mean()
    return loss if isinstance(model, nn.parallel.DistributedDataParallel) else loss * float("nan")


def test_a_nan_loss_fails_naming_the_step_and_rank():
    with pytest.raises(AssertionError, match=r"^loss is not finite at step 0 on rank 0: fshard nan, DDP 0\.\d+"):
        assert_equivalent_to_ddp(_mlp, batch_fn=_batch, loss_fn=_nan_for_fshard)


class _DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.l1(x)}


def _dict_output_model() -> nn.Module:
    torch.manual_seed(0)
    return _DictOutput()


def test_the_default_loss_on_a_non_tensor_output_asks_for_a_loss_fn():
    with pytest.raises(TypeError, match=r"the model returned a dict, not a tensor.*pass loss_fn="):
        assert_equivalent_to_ddp(_dict_output_model, batch_fn=_batch)
