"""Error types and message builders.

User errors are ``ValueError``/``TypeError`` that name the argument, module or parameter and say
what to do. Where several things can be wrong at once, they are collected and raised together.
Internal invariants fail with the rank in the message.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

__all__ = [
    "RankMismatchError",
    "CollectiveError",
    "collective_error",
    "ProblemList",
    "internal_error",
    "first_few",
    "rank_prefix",
    "warn_user",
]


class RankMismatchError(ValueError):
    """Ranks built different models or units; raised on every rank before any collective can hang.

    The message names the first differing parameter (or unit) and both ranks.

    Example:
        >>> model(x)  # first forward, rank 1 built Linear(5, 8) where rank 0 built Linear(5, 7)
        ... # doctest: +SKIP
        RankMismatchError: ranks built different sharded models: rank 0 has parameter '0.weight'
        (unit '0', shape [7, 5], ...) where rank 1 has parameter '0.weight' (unit '0', shape [8, 5], ...)
    """


class CollectiveError(RuntimeError):
    """A collective that fshard issued failed (timed out, or a peer rank went away).

    The message names the operation and the unit (or API) that issued it, and the usual causes:
    a peer rank that stopped, crashed or timed out, or ranks that ran different units (or the same
    units in a different order) in this step. The backend's own error is the ``__cause__``.

    Example:
        >>> loss.backward()  # rank 1 skipped unit 'layers.1' in its forward  # doctest: +SKIP
        CollectiveError: [rank 0] fshard: the all_gather of 'layers.1' failed: ... Timed out ...
    """


# The same error, also an instance of the torch error it wraps, so that handlers written for
# torch's distributed errors (``except dist.DistBackendError``) keep working. Module-level (not
# made on the fly) so that they pickle.
class _CollectiveBackendError(CollectiveError, dist.DistBackendError):
    pass


class _CollectiveNetworkError(CollectiveError, dist.DistNetworkError):
    pass


class _CollectiveStoreError(CollectiveError, dist.DistStoreError):
    pass


class CollectiveMismatchError(CollectiveError, RankMismatchError):
    """Ranks were about to issue different collectives (found before issuing them, or by the
    hang check): both a ``CollectiveError`` and a ``RankMismatchError``, so either ``except``
    catches it.

    Example:
        >>> fshard.full_state_dict(model)  # on rank 0 only  # doctest: +SKIP
        CollectiveMismatchError: [rank 0] fshard: hang check after 30 s in the gather of
        'full_state_dict(0.weight)' ...: rank 1 is in the all_gather of unit '<root>' ...
    """


def collective_error(message: str, cause: BaseException) -> CollectiveError:
    """A ``CollectiveError`` that is also an instance of ``cause``'s torch error class."""
    for torch_type, ours in (
        (dist.DistBackendError, _CollectiveBackendError),
        (dist.DistNetworkError, _CollectiveNetworkError),
        (dist.DistStoreError, _CollectiveStoreError),
    ):
        if isinstance(cause, torch_type):
            return ours(message)
    return CollectiveError(message)


def rank_prefix() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"[rank {dist.get_rank()}] "
    return ""


def internal_error(message: str) -> RuntimeError:
    """An fshard invariant broke: this is a bug in fshard, not in the caller's code."""
    return RuntimeError(
        f"{rank_prefix()}fshard internal error: {message}. "
        "Please report it with the traceback at the fshard issue tracker."
    )


class ProblemList:
    """Collect every problem first, then raise once with all of them listed.

    Example:
        >>> problems = ProblemList("fully_shard(model.block)")
        >>> problems.add("parameter 'w' is on cuda:1, expected cpu")
        >>> problems.raise_if_any(ValueError)
        Traceback (most recent call last):
        ...
        ValueError: fully_shard(model.block): parameter 'w' is on cuda:1, expected cpu
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def extend(self, messages: Iterable[str]) -> None:
        self.items.extend(messages)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, error_type: type[Exception] = ValueError, hint: str = "") -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            body = self.items[0]
        else:
            body = f"{len(self.items)} problems:\n" + "\n".join(f"  - {m}" for m in self.items)
        message = f"{self.where}: {body}"
        if hint:
            message += f"\n{hint}"
        raise error_type(message)


def first_few(names: list[str]) -> str:
    """The first three of ``names`` for an error message, then "..." if there are more.

    Example:
        >>> first_few(["'a'", "'b'", "'c'", "'d'"])
        "'a', 'b', 'c' ..."
    """
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


# Frames in these directories are not the user's: fshard's own, and torch's (module hooks, the
# optimizer's step, autograd's engine call fshard's code).
_NOT_USER_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _user_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_NOT_USER_DIRS) or filename.startswith("<frozen")):
            return frame
        frame = frame.f_back
    return None


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with the location of the user's code: the innermost caller outside fshard and torch.

    A ``stacklevel`` cannot know how many torch frames (hooks, ``optimizer.step``, autograd)
    lie between fshard and the user; this walks the stack instead. The usual filters apply (a
    location warns once by default). With no such frame (a warning raised from a thread that
    runs only fshard code), the warning points at fshard's caller.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_user("fshard: something to know")
        >>> caught[0].filename.startswith(_NOT_USER_DIRS)
        False
    """
    frame = _user_frame(sys._getframe(1))
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )
