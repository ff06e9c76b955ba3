"""One parameter: the sharded parameter type and the slot that holds its other tensors.

[Note: fshard tensors]
The words for a parameter's tensors are fixed; every module uses these and cites this Note.
Shapes are per rank; ``S`` is ``shard_size``, ``layout`` the parameter's ``ShardLayout``.

============================  ====  ==================================================================
role                          dims  what it is in fshard
============================  ====  ==================================================================
*sharded param*               ND    the user-visible ``ShardedParameter``, ``layout.local_shape``
                                    (unpadded, possibly 0 rows). Its data is a view into its bucket's
                                    flat shard (``FlatBucket.flat_shard``, owned by the bucket, alive
                                    as long as the unit; a re-pack makes a new one).
*padded shard*                1D    the sharded param's region of the flat shard: ``slot_numel``
                                    elements, this rank's rows then zeros. The flat shard is the
                                    padded shards of a bucket's slots, slot after slot.
*all-gather input*            1D    the flat shard itself, or a copy of it on the compute device or
                                    in the compute dtype (``FlatBucket.all_gather_input``; the copy
                                    is freed once the all-gather is done).
*all-gather output*           1D    ``S * total`` elements, rank-major, made by ``unshard`` and freed
                                    after the copy-out (counted in ``GATHERED`` meanwhile). With
                                    ``S == 1`` it is the all-gather input.
*unsharded buffer*            1D    per bucket one storage of ``S * total`` elements, slot after
                                    slot, each slot's ``S * slot_numel`` rank-major (padded). Owned
                                    by the bucket; freed (resized to 0 bytes) when the unit is
                                    sharded and reallocated on unshard.
*unsharded param*             ND    an ``nn.Parameter`` of ``layout.full_shape`` viewing the first
                                    ``full_numel`` elements of the slot's unsharded buffer, made once
                                    per packing and swapped into the modules while the unit is
                                    unsharded. Autograd saves it in forward; since its storage is
                                    refilled before backward ([Note: storage reuse]), backward sees
                                    the unsharded values again.
*unsharded grad*              ND    ``unsharded_param.grad`` (full shape, compute dtype), made by
                                    autograd; under ``no_sync`` summed into ``accumulated_grad`` (the
                                    reduce dtype) where that is wider. Dropped once reduced.
*sharded grad*                ND    ``sharded_param.grad`` (local shape, the shard's dtype and
                                    device): a view of this rank's reduce-scatter output, then the
                                    optimizer's.
============================  ====  ==================================================================

The old word for "unsharded" was "gathered"; ``GATHERED`` (the byte count) keeps it.

[Note: storage reuse]
The unsharded param is built from ``buffer[:n].view(shape).data`` so it has its own version
counter: refilling the buffer in place does not bump the counter autograd checks, and the saved
tensor stays valid across a free/refill cycle.

[Note: sharded parameter identity]
``fully_shard`` does not replace a module's parameters: it turns each ``nn.Parameter`` object into
a ``ShardedParameter`` *in place* (its data becomes this rank's shard and its class the subclass
below). The object keeps its name, ``requires_grad`` and identity, so an optimizer built before
``fully_shard`` keeps working, and optimizer math runs on a plain dense tensor: the subclass adds
methods but no ``__torch_function__``, so there is no dispatch overhead on the hot path.

[Note: swapped sharded parameters]
``Module._apply`` (``model.to(dtype)``, ``.double()``, ``.cpu()``) changes a parameter in one of
two ways: ``param.data = fn(param)`` by default, or, with
``torch.__future__.set_swap_module_params_on_conversion(True)``, ``torch.utils.swap_tensors(param,
nn.Parameter(fn(param)))``, which swaps the tensor underneath *and* the Python class and
``__dict__``. The second would leave a plain ``Parameter`` of the local shard's shape that no unit
knows. So while a ``ShardedParameter`` belongs to a unit it refuses to change its class or
``__dict__``: the swap still replaces the tensor underneath (the shard cast, the same object),
exactly what ``.data =`` does, and the unit re-packs its flat shard at the next unshard (the data
pointers moved: ``FlatBucket.is_packed``). The other side of the swap, ``fn``'s throw-away
``Parameter``, gets the class and a reference to this ``__dict__``; nothing keeps it. Autograd's
hooks are registered on the tensor underneath, so they leave with the old one (the Python dict of
post-accumulate-grad hooks stays): the grad-hook marker is dropped and a ``_fshard_swapped`` one
set here, and the unit hooks the new tensor when it next registers its unsharded params. A conversion that changes
nothing returns the parameter itself, and ``nn.Parameter`` of a subclass asks ``detach()`` to keep
the type: called from there (only), ``detach`` returns a ``ShardedParameter`` with no unit, the
swap's throw-away side, sharing the same storage.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from fshard import _collectives
from fshard._errors import internal_error
from fshard._placement import ShardLayout

if TYPE_CHECKING:
    from fshard._mesh import MeshInfo

__all__ = [
    # the parameter
    "ShardedParameter",
    "is_sharded",
    # its unit's view of it
    "ParamSlot",
    "SlotOwner",
    # this rank's rows, and back to the full tensor
    "local_rows",
    "padded_shard",
    "full_from_padded",
]


class SlotOwner(Protocol):
    """What a slot, and its sharded parameter, need of the unit that owns them."""

    @property
    def label(self) -> str:
        """How messages name the unit."""
        ...

    def refuse_copy(self) -> TypeError:
        """The error for copying or pickling the unit (its parameters refuse alike)."""
        ...


# ------------------------------------------------------------------------------ the parameter


_PARAMETER_NEW = nn.Parameter.__new__.__code__


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

    def __setattr__(self, name: str, value: Any) -> None:
        # [Note: swapped sharded parameters]
        if name in ("__class__", "__dict__") and "_fshard_slot" in self.__dict__:
            if name == "__dict__":
                # The tensor underneath is about to be replaced, and autograd's hooks with it:
                # the unit hooks the new one at its next unshard (``ensure_grad_hooks``).
                self.__dict__.pop("_fshard_hooked", None)
                self.__dict__["_fshard_swapped"] = True
            return
        super().__setattr__(name, value)

    def detach(self) -> torch.Tensor:
        detached = super().detach()
        caller = sys._getframe(0).f_back
        if caller is not None and caller.f_code is _PARAMETER_NEW:
            # nn.Parameter(this parameter): Module._apply swapping in a conversion that changed
            # nothing (a tied weight met twice, an integer parameter, .cpu() of a CPU shard).
            # nn.Parameter of a subclass wants detach() to keep the type: [Note: swapped sharded
            # parameters].
            detached.__class__ = ShardedParameter
        return detached

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Pickling a sharded model reaches its parameters first: refuse as the unit does.
        slot = self.__dict__.get("_fshard_slot")
        owner = slot.group_ref() if slot is not None else None
        if owner is not None:
            raise owner.refuse_copy()
        return super().__reduce_ex__(protocol)

    def to_local(self) -> torch.Tensor:
        """This rank's shard as a plain tensor sharing storage with the parameter."""
        return self.detach()

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter, gathered over the shard group (collective on the mesh).

        Returns a new plain tensor of shape ``full_shape`` on the parameter's device.
        """
        slot = self._slot()
        local = self.detach()
        return all_gather_full(local, slot.layout, slot.mesh_info, label=f"full_tensor({slot.fqn})")

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


# [Note: torch's foreach and fused optimizer paths]
# torch's optimizers take the multi-tensor (``foreach``) or fused kernels by default only when
# every parameter's type is exactly one of a list (``torch.optim.optimizer``'s and
# ``torch.utils._foreach_utils``'s ``_foreach_supported_types``: Tensor, Parameter, and DTensor,
# which adds itself there on import); any other type, a subclass too, silently gets the
# per-tensor loop, several times slower on GPUs. A ShardedParameter is a plain dense tensor to
# every kernel (no ``__torch_function__``, see [Note: sharded parameter identity]), so it is
# added to both lists when this module is imported, as DTensor is. The lists are private to
# torch: where a torch lacks them, nothing is registered and optimizers work as before.
_TORCH_FOREACH_TYPE_LISTS = (
    ("torch.optim.optimizer", "_foreach_supported_types"),
    ("torch.utils._foreach_utils", "_foreach_supported_types"),
)


def register_foreach_type() -> list[str]:
    """Add ``ShardedParameter`` to torch's lists of types its optimizers run with the foreach
    and fused kernels (see [Note: torch's foreach and fused optimizer paths]); idempotent.
    Returns the lists it is in, as ``module.name``."""
    registered = []
    for module_name, attr in _TORCH_FOREACH_TYPE_LISTS:
        try:
            types = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
        if not isinstance(types, list):
            continue
        if ShardedParameter not in types:
            types.append(ShardedParameter)
        registered.append(f"{module_name}.{attr}")
    return registered


register_foreach_type()


def is_sharded(tensor: object) -> TypeGuard[ShardedParameter]:
    """True if ``tensor`` is a parameter sharded by ``fshard.fully_shard``.

    Example:
        >>> import torch, fshard
        >>> fshard.is_sharded(torch.nn.Parameter(torch.zeros(2)))
        False
    """
    return isinstance(tensor, ShardedParameter) and "_fshard_slot" in tensor.__dict__


def set_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """Point ``param`` at ``data`` keeping the object (and so its identity for optimizers)."""
    if param.is_meta == data.is_meta:
        param.data = data
        return
    # meta -> real storage (materialize): ``.data =`` refuses to change the backend, so swap the
    # tensor contents into the same Python object, keeping its class and attributes.
    replacement = nn.Parameter(data, requires_grad=param.requires_grad)
    replacement.__class__ = type(param)
    replacement.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, replacement)


# ----------------------------------------------------------------- this rank's rows and back


def local_rows(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's rows of a full-shaped ``full`` (a view; all of it for a replicated 0-d
    parameter): the sharded param's values ([Note: chunk layout] in ``_placement``)."""
    if layout.replicated:
        return full
    return full.narrow(0, layout.row_offset, layout.local_shape[0])


def padded_shard(local: torch.Tensor, layout: ShardLayout, device: torch.device) -> torch.Tensor:
    """A new padded shard (1D, ``slot_numel``) of a shard-shaped ``local``, on ``device``: what
    one rank sends to gather the full tensor ([Note: fshard tensors])."""
    padded = torch.zeros(layout.slot_numel, dtype=local.dtype, device=device)
    padded[: layout.local_numel].copy_(local.detach().reshape(-1))
    return padded


def full_from_padded(gathered: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The full tensor in the rank-major padded shards ``gathered`` (1D, ``S * slot_numel``):
    the padding trimmed off, viewed in ``full_shape``."""
    if gathered.numel() != layout.full_numel:
        gathered = gathered[: layout.full_numel]
    return gathered.view(layout.full_shape)


def all_gather_full(
    local: torch.Tensor, layout: ShardLayout, mesh_info: MeshInfo, *, label: str
) -> torch.Tensor:
    """All-gather a shard-shaped ``local`` into a new full tensor on ``local``'s device (pad,
    all-gather over the shard group, trim); a collective on the shard group."""
    if layout.replicated or mesh_info.shard_size == 1:
        return local.detach().clone().view(layout.full_shape)
    # On the mesh's device: a CPU-offloaded shard cannot take part in an NCCL collective.
    device = mesh_info.device
    padded = padded_shard(local, layout, device)
    output = torch.empty(mesh_info.shard_size * layout.slot_numel, dtype=local.dtype, device=device)
    _collectives.all_gather_into(output, padded, mesh_info.shard_group, label=label)
    return full_from_padded(output, layout).to(local.device)


# --------------------------------------------------------------------------------- the slot


def _no_owner() -> SlotOwner | None:
    return None


class ParamSlot:
    """The roles of one managed parameter (see [Note: fshard tensors])."""

    def __init__(
        self, sharded_param: ShardedParameter, fqn: str, layout: ShardLayout, mesh_info: MeshInfo
    ) -> None:
        self.sharded_param = sharded_param
        self.fqn = fqn
        self.layout = layout
        self.mesh_info = mesh_info
        # (module, attribute name) pairs that register this parameter; tied weights have several.
        self.registrations: list[tuple[nn.Module, str]] = []
        self.unsharded_buffer: torch.Tensor | None = None  # 1D padded
        self.unsharded_param: nn.Parameter | None = None  # ND view of the buffer
        # Full gradient summed over no_sync micro-batches in the reduce dtype, when that is wider
        # than the compute dtype (autograd would keep summing in bf16 / fp16 otherwise).
        self.accumulated_grad: torch.Tensor | None = None
        # Required grad in an unsynchronised backward since the last synchronised reduce: it
        # takes part in that reduce even if frozen since (rank-consistent, unlike a local grad).
        self.awaiting_sync = False
        # The owning unit, held weakly (``fshard._unit._group.group_of`` gives its ParamGroup).
        self.group_ref: Callable[[], SlotOwner | None] = _no_owner
        self.pending_grad: torch.Tensor | None = None  # a pre-existing grad, sharded at init
        self.clip_mark: int | None = None  # see fshard._clip._clip_mark
        # The checksum of the full value at fully_shard and the shard's version counter then
        # (see _checksum): root init compares them across ranks while the shards are unchanged.
        self.value_checksum: tuple[int, int] | None = None

    def drop_unsharded_grad(self) -> None:
        """Forget the unsharded grad (this backward's and any no_sync sum)."""
        self.accumulated_grad = None
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    def use_unsharded(self) -> None:
        """Register the unsharded param in every module that holds this parameter."""
        unsharded = self.unsharded_param
        if unsharded is None:
            raise internal_error(f"parameter {self.fqn!r} has no unsharded param")
        for module, name in self.registrations:
            module._parameters[name] = unsharded

    def use_sharded(self) -> None:
        """Register the sharded param in every module that holds this parameter."""
        for module, name in self.registrations:
            module._parameters[name] = self.sharded_param
