"""The ZeRO figures ``fshard bench`` prints beside what it measured: pure functions of the
parameter shapes, the mesh and the settings (no process group).

[Note: ZeRO theory per rank and step]
With P parameters of b bytes over a mesh R x S (replicate x shard) and AdamW:

- persistent: each rank keeps a padded shard of every parameter (dim 0 padded to a multiple of
  S, ``torch.chunk`` style), its gradient and AdamW's two moments: ``(b + b + 2b) P / S`` bytes
  plus one 4-byte step count per parameter, that is 16 P / S for fp32. DDP keeps all of it.
- collectives (payload: the all-gather output, the reduce-scatter input, the all-reduce tensor):
  a unit's parameters are all-gathered for forward and again for backward when it reshards
  after forward, once otherwise; the root unit never reshards after forward (backward starts
  with it), so it is gathered once. Gradients are reduce-scattered once per step, and on a 2D
  mesh the sharded gradients are also all-reduced over R. DDP all-reduces every gradient once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["UnitShapes", "collective_theory", "persistent_theory", "unit_shapes"]


@dataclass(frozen=True)
class UnitShapes:
    """The shapes of the parameters one unit owns (the root unit's fqn is ``""``)."""

    fqn: str
    shapes: tuple[tuple[int, ...], ...]

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def padded_numel(self, shard: int) -> int:
        """Numel with dim 0 padded to a multiple of ``shard`` (what an all-gather moves).

        Example:
            >>> from fshard._bench._theory import UnitShapes
            >>> UnitShapes("", ((5, 3), (4,), ())).padded_numel(2)
            24
        """
        total = 0
        for shape in self.shapes:
            rows = shape[0] if shape else 1
            row = math.prod(shape[1:]) if shape else 1
            total += -(-rows // shard) * shard * row
        return total

    def padding_row_numel(self) -> int:
        """One row of every parameter: the most a rank's shard differs from padded / S."""
        return sum(math.prod(s[1:]) if s else 1 for s in self.shapes)


def unit_shapes(model: nn.Module, fqns: Sequence[str]) -> list[UnitShapes]:
    """The parameters each unit owns, the units in ``fqns`` order and the root (``""``) last;
    a parameter shared by several modules (tied weights) belongs to the first unit holding it.

    Example:
        >>> import torch
        >>> from fshard._bench._theory import unit_shapes
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        >>> [(u.fqn, u.shapes) for u in unit_shapes(model, ["0"])]
        [('0', ((3, 2), (3,))), ('', ((1, 3), (1,)))]
    """
    owned: set[int] = set()
    units = []
    for fqn in [*fqns, ""]:
        module = model.get_submodule(fqn)
        shapes = []
        for p in module.parameters():
            if id(p) not in owned:
                owned.add(id(p))
                shapes.append(tuple(p.shape))
        units.append(UnitShapes(fqn, tuple(shapes)))
    return units


def persistent_theory(
    units: Sequence[UnitShapes], *, shard: int, param_bytes: int
) -> dict[str, int]:
    """Bytes of params, grads and AdamW state one rank keeps, and the ``padding`` a measured
    figure may differ by (one row per parameter and kind). ``shard=1`` is DDP.

    Example:
        >>> from fshard._bench._theory import UnitShapes, persistent_theory
        >>> persistent_theory([UnitShapes("", ((8, 2),))], shard=2, param_bytes=4)
        {'params': 32, 'grads': 32, 'optim': 68, 'padding': 8}
    """
    padded = sum(u.padded_numel(shard) for u in units) // shard * param_bytes
    count = sum(len(u.shapes) for u in units)
    rows = sum(u.padding_row_numel() for u in units) * param_bytes if shard > 1 else 0
    return {"params": padded, "grads": padded, "optim": 2 * padded + 4 * count, "padding": rows}


def collective_theory(
    units: Sequence[UnitShapes],
    *,
    impl: str,
    mesh: Sequence[int],
    reshard_after_forward: bool,
    param_bytes: int,
    gather_bytes: int,
    reduce_bytes: int,
) -> dict[str, int]:
    """Payload bytes per collective type in one step on one rank (see the module note).

    ``gather_bytes`` / ``reduce_bytes``: bytes per element of the all-gather (the compute
    dtype) and of the gradient reduction.

    Example:
        >>> from fshard._bench._theory import UnitShapes, collective_theory
        >>> units = [UnitShapes("blocks.0", ((4, 4),)), UnitShapes("", ((4,),))]
        >>> collective_theory(units, impl="fshard", mesh=(2,), reshard_after_forward=True,
        ...                   param_bytes=4, gather_bytes=4, reduce_bytes=4)
        {'all_gather': 144, 'reduce_scatter': 80}
        >>> collective_theory(units, impl="ddp", mesh=(2,), reshard_after_forward=True,
        ...                   param_bytes=4, gather_bytes=4, reduce_bytes=4)
        {'all_reduce': 80}
    """
    if impl == "ddp":
        return {"all_reduce": sum(u.numel() for u in units) * param_bytes}
    shard = mesh[-1]
    replicate = mesh[0] if len(mesh) == 2 else 1
    out: dict[str, int] = {}
    if shard > 1:
        gathers = [
            u.padded_numel(shard) * (2 if reshard_after_forward and u.fqn else 1) for u in units
        ]
        out["all_gather"] = sum(gathers) * gather_bytes
        out["reduce_scatter"] = sum(u.padded_numel(shard) for u in units) * reduce_bytes
    if replicate > 1:
        out["all_reduce"] = sum(u.padded_numel(shard) for u in units) // shard * reduce_bytes
    return out
