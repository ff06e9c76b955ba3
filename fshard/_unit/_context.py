"""What a unit may ask of the root of its tree: the ``RootContext`` protocol.

A ``ParamGroup`` is told its root at the root's lazy init (``ParamGroup.root``); from then on it
calls up into the root only through the members below, and the root's class (``RootState`` in
the runtime layer) implements them. The protocol is generic in the unit type so that this
module need not import the group that uses it (the root's methods take the ``ParamGroup``).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from fshard._unit._reduce import PendingReduce, UnissuedReduce

__all__ = ["RootContext"]

UnitT_contra = TypeVar("UnitT_contra", contravariant=True)


class RootContext(Protocol[UnitT_contra]):
    """The per-tree context a unit's backward reports to (``RootState`` implements it)."""

    # Whether a gradient from a use of a sharded param outside its unit's forward was warned
    # about already: once per model (see ``_grad_hooks``).
    warned_sharded_use: bool

    def ensure_final_callback(self) -> None:
        """A gradient arrived in a backward: make sure the end-of-backward callback is queued."""
        ...

    def park(self, group: UnitT_contra) -> None:
        """``group``'s part of the backward for one forward is done, another forward's is to
        come: the next unit's pre-backward releases it (``ParamGroup.release_parked``)."""
        ...

    def on_unit_backward_done(self, group: UnitT_contra) -> None:
        """``group`` was freed in the backward: a ``BACKWARD_POST`` prefetch may start."""
        ...

    def add_pending_reduce(self, pending: PendingReduce) -> None:
        """Queue a reduce-scatter in flight; the root finishes it in issue order."""
        ...

    def queue_reduce(self, unissued: UnissuedReduce, max_bytes: int) -> None:
        """Queue a reduce-scatter input for the root to issue, together with the next ones
        while they fit in ``max_bytes`` (see [Note: coalesced reduce-scatters])."""
        ...
