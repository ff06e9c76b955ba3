"""Test-side probes that watch a sharded model through public torch hooks only, and a runner
for tasks that must fail with ``RankMismatchError`` on every rank."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from torch import nn

import fshard
from fshard.testing import RankPool, RanksFailed


def rank_mismatch_messages(fn: Callable[..., Any], *args: Any, world: int = 2) -> list[str]:
    """Run ``fn(*args)`` on a fresh pool (a mismatch may leave the ranks' collectives out of
    step, so not a shared one) and return every rank's ``RankMismatchError`` message; any other
    outcome, on any rank, fails the test."""
    pool = RankPool(world, pg_timeout=15)
    try:
        with pytest.raises(RanksFailed) as info:
            pool.run(fn, *args, timeout=60)
    finally:
        pool.close()
    assert sorted(info.value.errors) == list(range(world)), info.value
    for exc in info.value.errors.values():
        assert isinstance(exc, fshard.RankMismatchError), exc
    return [str(exc) for exc in info.value.errors.values()]


class GatherProbe:
    """Remember every full (gathered) parameter the model computes with, and its gradient.

    Forward pre-hooks registered after ``fully_shard`` run after fshard has gathered a unit, so
    the parameters a module sees then are the gathered ones (and their ``.grad`` the full
    gradient). Only weak references are kept, so the probe never keeps memory alive.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params: dict[int, tuple[str, weakref.ref]] = {}
        for module_name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(self._make_hook(module_name))

    def _make_hook(self, module_name: str):
        def hook(module: nn.Module, args: object) -> None:
            for name, p in module.named_parameters(recurse=False):
                if not fshard.is_sharded(p):  # the gathered parameter
                    fqn = f"{module_name}.{name}" if module_name else name
                    self.params[id(p)] = (fqn, weakref.ref(p))

        return hook

    def alive(self) -> list[str]:
        """Gathered parameters or full gradients whose memory is still allocated."""
        out = []
        for fqn, ref in self.params.values():
            t = ref()
            if t is None:
                continue
            if t.untyped_storage().nbytes() > 0:
                out.append(f"param {fqn}")
            if t.grad is not None and t.grad.untyped_storage().nbytes() > 0:
                out.append(f"grad {fqn}")
        return sorted(out)


class PinProbe:
    """Records the pinned-memory requests made while it is active, on a machine without CUDA.

    ``CPUOffload(pin_memory=True)`` keeps each unit's shards in pinned host memory, which only a
    CUDA machine can give: fshard asks for it only where ``torch.cuda.is_available()``. Inside
    the probe that says True, and ``Tensor.pin_memory()`` returns a copy (new memory, as the real
    one does) whose range is recorded, so a test on CPU sees what fshard asked for and whether
    the shards live in that memory. Enter it after the mesh exists (mesh creation asks CUDA too).

    Example:
        >>> with PinProbe() as pins:  # doctest: +SKIP
        ...     fshard.fully_shard(model, mesh=mesh, offload_policy=fshard.CPUOffload())
        >>> pins.holds(model.weight.to_local())  # doctest: +SKIP
        True
    """

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def __enter__(self) -> PinProbe:
        import torch

        self._patches = [
            mock.patch.object(torch.cuda, "is_available", lambda: True),
            # A function (not the bound method): it binds to the tensor as pin_memory does.
            mock.patch.object(torch.Tensor, "pin_memory", lambda tensor, *args: self._pin(tensor)),
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for patch in reversed(self._patches):
            patch.stop()

    def _pin(self, tensor: Any) -> Any:
        copy = tensor.clone()
        self.ranges.append((copy.data_ptr(), copy.untyped_storage().nbytes()))
        return copy

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor``'s memory lies in memory pinned while the probe was active."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(lo <= start and end <= lo + n for lo, n in self.ranges)
