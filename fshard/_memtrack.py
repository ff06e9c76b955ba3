"""Live tensor bytes, counted by storage: a tracker that works on any device, fake tensors too.

``LiveBytes`` is a ``TorchDispatchMode``: every tensor an operator returns has its storage
noted (held weakly, so the tracker keeps nothing alive), and after every operator the bytes of
the storages still alive are summed. It measures what the program holds, not what the
allocator reserved: no caching allocator rounding, no fragmentation, no RSS noise, and the same
figure on CPU, CUDA and under ``FakeTensorMode`` (where nothing is allocated at all).

[Note: counting by storage]
Views share their base's storage, so a storage is counted once however many tensors view it,
and only a storage an operator *made* is noted: an output on the storage of one of its inputs (a
view, an in-place or ``out=`` operator) is not new, so touching a tensor made before the tracker
started does not start counting it.
Sizes are read at every operator rather than at allocation, because storages change size in
place: fshard frees a unit's unsharded buffer with ``storage.resize_(0)`` and regrows it before
the next all-gather, neither of which is an operator the mode sees; the next operator does.
Tensors that exist before the tracker starts (parameters, gradients, optimizer state) are not
seen unless passed to ``track``. Storages are keyed by ``id``; a dead storage whose id is
reused is replaced, never mistaken for the new one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Track the bytes of live tensor storages while the context is active.

    ``current`` is the bytes alive now, ``peak`` the most seen after any operator since the
    start (or the last ``reset_peak``). ``take_peak()`` returns the peak since the previous call
    and starts a new span, for a timeline of spans between events.

    Example:
        >>> import torch
        >>> from fshard._memtrack import LiveBytes
        >>> with LiveBytes() as live:
        ...     a = torch.empty(1000)             # 4000 bytes
        ...     b = torch.empty(250) + 1          # a temporary of 1000 bytes dies in the add
        ...     del a
        >>> live.peak, live.current
        (6000, 1000)
    """

    def __init__(self, track: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0
        self._span_peak = 0
        self.track(track)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` (made before the tracker started) while they live."""
        for tensor in tensors:
            self._note(tensor)
        self._update()

    @property
    def current(self) -> int:
        """Bytes of the noted storages alive now, at their present size."""
        total = 0
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is None:
                del self._live[key]
            else:
                total += storage.nbytes()
        return total

    def reset_peak(self) -> None:
        self.peak = self._span_peak = self.current

    def take_peak(self) -> int:
        """The peak since the previous ``take_peak`` (or the start); a new span starts now."""
        current = self.current
        span, self._span_peak = max(self._span_peak, current), current
        return span

    def _note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._live.get(key)
        if known is None or known() is not storage:
            self._live[key] = weakref.ref(storage)

    def _update(self) -> None:
        current = self.current
        self.peak = max(self.peak, current)
        self._span_peak = max(self._span_peak, current)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout is torch.strided
        }
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided:
                if id(leaf.untyped_storage()) not in inputs:  # a view or an out=: not new
                    self._note(leaf)
        self._update()
        return out
