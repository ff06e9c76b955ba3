"""Public option types: frozen dataclasses validated on construction, no logic."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["MixedPrecision", "CPUOffload", "BackwardPrefetch", "DEFAULT_COALESCE_BYTES"]

# Adjacent small units share collectives up to this many bytes by default (fshard.set_coalescing;
# see [Note: coalesced all-gathers] in fshard._unit._group).
DEFAULT_COALESCE_BYTES = 1 << 20

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(name: str, value: object) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        raise TypeError(
            f"MixedPrecision.{name} must be None or one of "
            f"{', '.join(str(d) for d in _FLOAT_DTYPES)}, got {value!r}"
        )


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision policy for one unit.

    Shards keep their own dtype (fp32 master weights). Before compute the gathered copy is cast
    to ``param_dtype`` (so the all-gather moves half the bytes with bf16/fp16), gradients are
    reduced in ``reduce_dtype`` (default: ``param_dtype``) and land on the shard in the shard's
    dtype. Forward outputs are cast to ``output_dtype`` when set, and floating-point forward
    inputs are cast to ``param_dtype`` when ``cast_forward_inputs`` is true.

    Each unit may have its own policy, for example a norm layer kept in fp32 inside a bf16 model.

    Example:
        >>> import torch, fshard
        >>> mp = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> mp.reduce_dtype
        torch.float32
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecision.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}"
            )


@dataclass(frozen=True)
class CPUOffload:
    """Keep shards and their gradients in CPU memory; only gathered copies go to the device.

    The optimizer then steps on CPU tensors. ``pin_memory`` pins the CPU shards so host-device
    copies are asynchronous (only meaningful when an accelerator is present; ignored on a
    CPU-only machine).

    Example:
        >>> import fshard
        >>> fshard.CPUOffload(pin_memory=False).pin_memory
        False
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffload.pin_memory must be a bool, got {self.pin_memory!r}")


class BackwardPrefetch(Enum):
    """When a unit's all-gather for backward is issued (the accelerate / FSDP1 names).

    ``BACKWARD_PRE`` (default): when the next-later unit's backward starts, so the gather
    overlaps that unit's gradient computation. ``BACKWARD_POST``: once that unit's gradients are
    out (less memory held, less overlap). ``NO_PREFETCH``: only when the unit itself is reached.

    Example:
        >>> import fshard
        >>> fshard.BackwardPrefetch("BACKWARD_POST")
        <BackwardPrefetch.BACKWARD_POST: 'BACKWARD_POST'>
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"
    NO_PREFETCH = "NO_PREFETCH"


def debug_checks() -> bool:
    """Whether ``FSHARD_DEBUG`` is set (to anything but ``0``): every step's collectives are
    compared across ranks and prefetch is off (see RootState)."""
    return os.environ.get("FSHARD_DEBUG", "").strip() not in ("", "0")
