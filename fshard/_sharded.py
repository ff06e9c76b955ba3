"""The sharded parameter type: a plain ``nn.Parameter`` holding this rank's shard, DTensor-like.

[Note: sharded parameter identity]
``fully_shard`` does not replace a module's parameters: it turns each ``nn.Parameter`` object into
a ``ShardedParameter`` *in place* (its data becomes this rank's shard and its class the subclass
below). The object keeps its name, ``requires_grad`` and identity, so an optimizer built before
``fully_shard`` keeps working, and optimizer math runs on a plain dense tensor: the subclass adds
methods but no ``__torch_function__``, so there is no dispatch overhead on the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, SupportsIndex, TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

if TYPE_CHECKING:
    from fshard._param import ParamSlot

__all__ = ["ShardedParameter", "is_sharded"]


class ShardedParameter(nn.Parameter):
    """A parameter whose data is this rank's dim-0 shard (``torch.chunk`` semantics).

    Created by ``fshard.fully_shard``; never construct one yourself. It behaves as a normal
    parameter of the local shard's shape for optimizers, and adds a DTensor-like view of the
    whole tensor.

    Example:
        >>> # after fshard.fully_shard(model, mesh=mesh) on 4 ranks
        >>> # p = model.weight                  # full shape (10, 3)
        >>> # p.full_shape, p.to_local().shape  # (torch.Size([10, 3]), torch.Size([3, 3]))
        >>> # p.placements                      # (Shard(dim=0),)
        >>> # full = p.full_tensor()            # collective: every rank of the mesh calls it
    """

    _fshard_slot: ParamSlot

    def _slot(self) -> ParamSlot:
        slot = self.__dict__.get("_fshard_slot")
        if slot is None:
            raise RuntimeError(
                "this ShardedParameter is detached from its fshard unit (it was copied, pickled "
                "or built by hand); use the parameter of the sharded model itself"
            )
        return slot

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Pickling a sharded model reaches its parameters first: refuse as the unit does.
        slot = self.__dict__.get("_fshard_slot")
        group = slot.group_ref() if slot is not None else None
        if group is not None:
            raise group._refuse_copy()
        return super().__reduce_ex__(protocol)

    def to_local(self) -> torch.Tensor:
        """This rank's shard as a plain tensor sharing storage with the parameter."""
        return self.detach()

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter, gathered over the shard group (collective on the mesh).

        Returns a new plain tensor of shape ``full_shape`` on the parameter's device.
        """
        return self._slot().gather_full(self.detach())

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the parameter is sharded over (the one passed to ``fully_shard``)."""
        return self._slot().mesh_info.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """``(Shard(0),)`` on a 1D mesh, ``(Replicate(), Shard(0))`` on a 2D mesh.

        0-d parameters cannot be chunked and are replicated: ``Replicate()`` on every mesh dim.
        """
        slot = self._slot()
        return slot.mesh_info.placements(slot.layout.replicated)

    @property
    def full_shape(self) -> torch.Size:
        """The shape of the whole (unsharded) parameter; ``self.shape`` is the local shard's."""
        return self._slot().layout.full_shape

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # Tensor.__repr__ has an internal keyword
        slot = self.__dict__.get("_fshard_slot")
        if slot is None:
            return f"ShardedParameter(detached, local={torch.Tensor.__repr__(self.detach())})"
        placements = ", ".join(str(p) for p in self.placements)
        return (
            f"ShardedParameter(fqn={slot.fqn!r}, full_shape={list(slot.layout.full_shape)}, "
            f"placements=({placements}), local={torch.Tensor.__repr__(self.detach())})"
        )


def is_sharded(tensor: object) -> TypeGuard[ShardedParameter]:
    """True if ``tensor`` is a parameter sharded by ``fshard.fully_shard``.

    Example:
        >>> import torch, fshard
        >>> fshard.is_sharded(torch.nn.Parameter(torch.zeros(2)))
        False
    """
    return isinstance(tensor, ShardedParameter) and "_fshard_slot" in tensor.__dict__
