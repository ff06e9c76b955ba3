"""What ``fshard bench`` measures inside a step, the same way for every implementation.

- ``CollectiveCounter``: calls and bytes per collective type, seen at the ``c10d`` and
  ``_c10d_functional`` dispatcher ops (``torch.ops.c10d.*``). ``ProcessGroup`` methods reach the
  collectives through these ops, so DDP's reducer (C++), FSDP2 and fshard are all counted alike.
- ``LiveTensorBytes``: the peak of the bytes of live tensor storages during a step, on any
  device. A ``TorchDispatchMode`` sees every tensor an op reads or makes; each storage is kept in
  a table through a weak reference (its entry goes when the storage is freed) and its current
  size is read again whenever the total may grow (a storage resized to 0, as sharding libraries
  do to free an unsharded parameter, counts 0). Not RSS: allocator caches and Python objects are
  not tensor bytes.
- ``storage_bytes``: the bytes of the distinct storages behind some tensors (persistent state).

[Note: what the live-bytes tracker sees]
Storages alive when the step starts are counted when they are registered (``track``:
parameters, gradients, optimizer state, buffers) or when an op first touches them (a
communication buffer kept between steps). A storage that no op touches during the step and that
was not registered is not counted. Wrapper tensor subclasses (DTensor) are looked through to the
tensors they hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = [
    "CollectiveCounter",
    "CollectiveTotals",
    "LiveTensorBytes",
    "collective_kind",
    "local_tensors",
    "storage_bytes",
]

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Ops in those namespaces that move no payload (or only wait for one already counted).
_NOT_COLLECTIVES = ("barrier", "monitored_barrier", "wait_tensor", "wait", "batch_isend_irecv")


def collective_kind(op_name: str) -> str:
    """The collective type of a c10d op name.

    Example:
        >>> from fshard._bench._measure import collective_kind
        >>> [collective_kind(n) for n in ("_allgather_base_", "reduce_scatter_tensor", "allreduce_")]
        ['all_gather', 'reduce_scatter', 'all_reduce']
    """
    name = op_name.strip("_").replace("all_", "all")
    if name.startswith("allgather"):
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if name.startswith("allreduce"):
        return "all_reduce"
    if name.startswith("broadcast"):
        return "broadcast"
    return name


def _nbytes(x: Any) -> int:
    leaves, _ = tree_flatten(x)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _group_size(args: tuple[Any, ...]) -> int:
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return int(dist.ProcessGroup.unbox(a).size())
    return 0


@dataclass
class CollectiveTotals:
    calls: int = 0
    bytes: int = 0  # payload: all-gather output, reduce-scatter input, else the tensor(s) sent


@dataclass
class CollectiveCounter(TorchDispatchMode):
    """Calls and payload bytes per collective type, for the ops dispatched on this thread.

    The payload is the size of the collective's full buffer: an all-gather's output (the
    unsharded tensor), a reduce-scatter's input (the unsharded gradient), an all-reduce's
    tensor. Coalesced ops count one call per tensor.
    """

    totals: dict[str, CollectiveTotals] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_COLLECTIVES:
            self._count(func._opname, args)
        return func(*args, **kwargs)

    def _count(self, opname: str, args: tuple[Any, ...]) -> None:
        kind = collective_kind(opname)
        functional = not opname.endswith("_")  # _c10d_functional ops return a new tensor
        if kind == "all_gather" and functional:
            payload = _nbytes(args[0]) * int(args[1])  # (input, group_size, group_name)
        elif kind in ("all_gather",):
            payload = _nbytes(args[0])  # (output(s), input(s), group, ...)
        elif kind == "reduce_scatter":
            payload = _nbytes(args[0] if functional else args[1])
        else:
            payload = _nbytes(args[0])
        leaves = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        entry = self.totals.setdefault(kind, CollectiveTotals())
        entry.calls += max(1, len(leaves))
        entry.bytes += payload

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": v.calls, "bytes": v.bytes} for k, v in sorted(self.totals.items())}


def local_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with real storage behind ``t``: itself, or what a wrapper subclass holds."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]  # DTensor also lists its device mesh
        return [x for i in inner if isinstance(i, torch.Tensor) for x in local_tensors(i)]
    return [t]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    return t.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once).

    Example:
        >>> import torch
        >>> from fshard._bench._measure import storage_bytes
        >>> x = torch.zeros(10)
        >>> storage_bytes([x, x[2:], torch.zeros(3)])
        52
    """
    seen: dict[int, int] = {}
    for t in tensors:
        for local in local_tensors(t):
            s = _storage(local)
            if s is not None:
                seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of live tensor storages while the mode is on (see the module notes).

    Example:
        >>> import torch
        >>> from fshard._bench._measure import LiveTensorBytes
        >>> with LiveTensorBytes() as live:
        ...     a = torch.ones(1000)          # 4000 bytes
        ...     b = (a * 2).sum()             # 4000 more, then 4 (a * 2 is freed)
        ...     del a
        ...     c = torch.ones(10)
        >>> live.peak_bytes, live.current_bytes()
        (8004, 44)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak_bytes = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages from now on (state alive before the step)."""
        self._touch(list(tensors))
        self._update_peak()

    def current_bytes(self) -> int:
        total = 0
        for ref in self._live.values():
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def _touch(self, tensors: list[Any]) -> None:
        """Register the storages not seen yet."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for local in local_tensors(t):
                storage = _storage(local)
                if storage is not None and storage._cdata not in self._live:
                    key = storage._cdata
                    self._live[key] = weakref.ref(storage, self._forgetter(key))

    def _forgetter(self, key: int) -> Callable[[object], None]:
        """The weakref callback that drops ``key`` when its storage is freed."""

        def forget(_: object) -> None:
            self._live.pop(key, None)

        return forget

    def _update_peak(self) -> None:
        # Summed again after every op: storages are resized in place (to 0 and back) by
        # sharding libraries without an op the mode would see, so a running total would drift.
        self.peak_bytes = max(self.peak_bytes, self.current_bytes())

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        self._touch(inputs)
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        self._touch(outputs)
        self._update_peak()
        return out
