"""Failed collectives become ``fshard.CollectiveError`` naming the unit, without processes."""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist

import fshard
from fshard import _collectives


class _FailingWork:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self) -> bool:
        raise self.error


@pytest.mark.parametrize(
    "cause, torch_type",
    [
        (dist.DistBackendError("NCCL watchdog timeout"), dist.DistBackendError),
        (dist.DistNetworkError("connection reset"), dist.DistNetworkError),
        (dist.DistStoreError("store timeout"), dist.DistStoreError),
        (RuntimeError("[gloo] Timed out waiting 5000ms for recv"), RuntimeError),
    ],
    ids=["backend", "network", "store", "plain"],
)
def test_a_failed_wait_names_the_unit_and_keeps_the_torch_type(cause, torch_type):
    with pytest.raises(fshard.CollectiveError) as info:
        _collectives.wait(_FailingWork(cause), op="reduce_scatter", label="blocks.3")  # type: ignore[arg-type]
    error = info.value
    assert isinstance(error, torch_type)  # handlers written for torch's errors still catch it
    assert error.__cause__ is cause
    message = str(error)
    assert message.startswith("fshard: the reduce_scatter of 'blocks.3' failed: ")
    assert str(cause).splitlines()[0] in message
    assert "ran different units" in message and "FSHARD_DEBUG=1" in message
    again = pickle.loads(pickle.dumps(error))  # crosses process boundaries (the rank pool)
    assert type(again) is type(error) and str(again) == message


def test_no_work_means_nothing_to_wait_for_and_other_errors_pass_through():
    _collectives.wait(None, op="all_gather", label="x")
    with pytest.raises(ValueError, match="not a collective failure"):
        with _collectives._failure_context("all_gather", "x"):
            raise ValueError("not a collective failure")


@pytest.mark.parametrize(
    "label, api",
    [
        ("full_state_dict(0.weight)", "full_state_dict"),
        ("full_tensor(blocks.0.fc.weight)", "full_tensor"),
        ("checkpoint.save", "checkpoint.save"),
        ("clip_grad_norm_", "clip_grad_norm_"),
        ("fshard.load_optim_state_dict(broadcast_from_rank0=True): w.exp_avg", "fshard.load_optim_state_dict"),
    ],
)
def test_a_failed_collective_of_a_function_says_every_rank_must_call_it(label, api):
    """The usual mistake with these is calling them under ``if rank == 0:``, not a unit."""
    with pytest.raises(fshard.CollectiveError) as info:
        _collectives.wait(_FailingWork(RuntimeError("timed out")), op="gather", label=label)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"{api} is collective: every rank of the mesh must call it" in message
    assert "if rank == 0:" in message and "ran different units" not in message
    # Called everywhere, but with rank-dependent options, it is as if some ranks had not.
    assert "with the same arguments" in message and "rank0_only=(rank == 0)" in message


def test_a_failed_unit_collective_names_fshard_calls_made_on_some_ranks():
    with pytest.raises(fshard.CollectiveError) as info:
        _collectives.wait(_FailingWork(RuntimeError("timed out")), op="all_gather", label="blocks.1")  # type: ignore[arg-type]
    message = str(info.value)
    assert "an fshard call made on some ranks only" in message
    assert "no_sync and set_requires_gradient_sync change what the backward does" in message


class _FakeWork:
    def __init__(self) -> None:
        self.timeouts: list[object] = []

    def wait(self, timeout: object = None) -> bool:
        self.timeouts.append(timeout)
        return True


@pytest.mark.parametrize(("backend", "sliced"), [("gloo", True), ("nccl", False)])
def test_only_host_waits_are_waited_in_slices(monkeypatch, backend, sliced):
    """gloo collectives are waited for in slices of FSHARD_HANG_CHECK_S (the hang check); an
    NCCL wait only orders the CUDA stream, so a timed wait would block the host: plain wait()."""
    from fshard import _collectives, _hang

    group = object()
    monkeypatch.setattr(_collectives.dist, "get_backend", lambda g: backend)
    monkeypatch.setattr(_hang, "_ensure_heartbeat", lambda: None)
    where = _hang.Where("all_gather", "blocks.0", "0,1", 1, "forward")
    work = _FakeWork()
    _collectives._finish(work, where, group, async_op=False)  # type: ignore[arg-type]
    _collectives._HOST_WAITS.pop(group, None)
    assert (work.timeouts != [None]) == sliced, work.timeouts
