"""One parameter's tensors and the flat buffer a unit's shards live in.

[Note: fshard tensors]
Per parameter, the words are fixed:

- *sharded param*: the user-visible ``ShardedParameter`` (ND, unpadded local shard); its data is a
  view into the bucket's *flat shard* (1D, every slot padded to ``slot_numel``), so the flat shard
  *is* the all-gather input: no copy-in unless a dtype cast or a host-to-device copy is needed.
- *all-gather output*: ``shard_size * total`` elements, rank-major, alive only during unshard.
- *unsharded buffer*: 1D, ``shard_size * slot_numel`` elements (padded); its storage is freed
  (resized to 0 bytes) when the unit is sharded and reallocated on unshard.
- *unsharded param*: an ``nn.Parameter`` viewing the first ``full_numel`` elements of the unsharded
  buffer, created once and swapped into the module while the unit is unsharded. Autograd saves
  it in forward; because its storage is refilled before backward (see [Note: storage reuse]),
  backward sees the gathered values again.
- *unsharded grad*: ``unsharded_param.grad`` (full shape), reduce-scattered after backward.
- *sharded grad*: ``sharded_param.grad`` (local shape), in the shard's dtype and device.

[Note: storage reuse]
The unsharded param is built from ``buffer[:n].view(shape).data`` so it has its own version
counter: refilling the buffer in place does not bump the counter autograd checks, and the saved
tensor stays valid across a free/refill cycle.

[Note: aliased buckets]
With ``shard_size == 1`` and no cast or offload, a unit's full parameters *are* its shards (NO_SHARD
and HSDP with one rank per shard group). The unsharded params then view the flat shard directly:
unshard and reshard move no memory, and only the gradient all-reduce remains.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fshard import _collectives
from fshard._errors import internal_error
from fshard._placement import ShardLayout
from fshard._sharded import ShardedParameter

if TYPE_CHECKING:
    from fshard._group import ParamGroup
    from fshard._mesh import MeshInfo

__all__ = ["ParamSlot", "FlatBucket", "chunk_cat", "GATHERED"]


class GatheredMemory:
    """Bytes of gathered (full) parameters this process holds now, and the peak since reset."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes


GATHERED = GatheredMemory()  # per process, like torch.cuda's allocator statistics


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
        self.group_ref: Callable[[], ParamGroup | None] = lambda: None  # owning unit
        self.pending_grad: torch.Tensor | None = None  # a pre-existing grad, sharded at init
        self.clip_mark: int | None = None  # see fshard._clip._clip_mark

    def drop_unsharded_grad(self) -> None:
        """Forget the full gradient (this backward's and any no_sync sum)."""
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
        for module, name in self.registrations:
            module._parameters[name] = self.sharded_param

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather this parameter's shards into a new full tensor (``full_tensor``)."""
        layout = self.layout
        if layout.replicated or self.mesh_info.shard_size == 1:
            return local.clone().view(layout.full_shape)
        size = self.mesh_info.shard_size
        # On the mesh's device: a CPU-offloaded shard cannot take part in an NCCL collective.
        device = self.mesh_info.device
        padded = torch.zeros(layout.slot_numel, dtype=local.dtype, device=device)
        padded[: layout.local_numel].copy_(local.reshape(-1))
        output = torch.empty(size * layout.slot_numel, dtype=local.dtype, device=device)
        _collectives.all_gather_into(
            output, padded, self.mesh_info.shard_group, label=f"full_tensor({self.fqn})"
        )
        return output[: layout.full_numel].view(layout.full_shape).to(local.device)


def _set_data(param: nn.Parameter, data: torch.Tensor) -> None:
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


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Write ``tensors`` chunk-major into ``out`` of shape ``(num_chunks, total)``.

    Each tensor is 2D ``(rows, row_numel)``, cut into ``num_chunks`` row chunks of
    ``ceil(rows / num_chunks)`` rows (zero padded); chunk ``r`` of every tensor goes, in order, into
    row ``r`` of ``out``. This is the reduce-scatter input layout.
    """
    if hasattr(torch, "_chunk_cat"):
        torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)
        return
    column = 0
    for t in tensors:
        rows, row_numel = t.shape
        slot_rows = -(-rows // num_chunks)
        width = slot_rows * row_numel
        padded = t.new_zeros(slot_rows * num_chunks, row_numel)
        padded[:rows].copy_(t)
        out[:, column : column + width].copy_(padded.view(num_chunks, width))
        column += width


def _forget_gathered(storage: torch.UntypedStorage) -> None:
    GATHERED.sub(storage.nbytes())


class FlatBucket:
    """The parameters of one unit that share a dtype: one flat shard, one all-gather."""

    def __init__(
        self,
        slots: list[ParamSlot],
        mesh_info: MeshInfo,
        *,
        compute_dtype: torch.dtype,
        shard_device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.slots = slots
        self.mesh_info = mesh_info
        self.shard_dtype = slots[0].sharded_param.dtype
        self.compute_dtype = compute_dtype
        self.shard_device = shard_device
        self.pin_memory = pin_memory
        self.slot_numels = [s.layout.slot_numel for s in slots]
        self.offsets = [0]
        for n in self.slot_numels:
            self.offsets.append(self.offsets[-1] + n)
        self.flat_shard: torch.Tensor = torch.empty(0)  # 1D, set by pack()
        self.aliased = False  # see [Note: aliased buckets]
        self._params: list[ShardedParameter] = []
        self._packed_ptrs: list[int] = []

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def compute_device(self) -> torch.device:
        return self.mesh_info.device

    # ----------------------------------------------------------------------------------- packing

    def pack(self, locals_: Sequence[torch.Tensor]) -> None:
        """Copy local shards into a fresh flat shard and point the sharded params at it."""
        device = locals_[0].device if locals_ else self.shard_device
        if device.type != "meta":
            device = self.shard_device
        flat = torch.zeros(self.total, dtype=self.shard_dtype, device=device)
        if self.pin_memory and device.type == "cpu" and torch.cuda.is_available():
            flat = flat.pin_memory()
        for slot, local, offset in zip(self.slots, locals_, self.offsets[:-1], strict=True):
            view = flat[offset : offset + slot.layout.local_numel].view(slot.layout.local_shape)
            if device.type != "meta":
                view.copy_(local.detach().reshape(slot.layout.local_shape))
            _set_data(slot.sharded_param, view)
        self.flat_shard = flat
        self.aliased = (
            self.mesh_info.shard_size == 1
            and self.compute_dtype == self.shard_dtype
            and device == self.compute_device
        )
        self._params = [s.sharded_param for s in self.slots]
        self._packed_ptrs = [p.data_ptr() for p in self._params]
        # A new packing gets new unsharded params (see [Note: fshard tensors]).
        self._unsharded: torch.Tensor | None = None  # 1D, every slot's unsharded buffer in a row
        self._copy_out_views: list[torch.Tensor] = []
        for slot in self.slots:
            slot.unsharded_buffer = slot.unsharded_param = None
        if self.aliased:
            for slot, offset in zip(self.slots, self.offsets[:-1], strict=True):
                self._build_unsharded(slot, self.flat_shard[offset : offset + slot.layout.slot_numel])

    def is_packed(self) -> bool:
        """False if something replaced a sharded param's data (``model.to(...)``, ``p.data = x``).

        New data means new storage, so comparing data pointers suffices; the dtype check covers
        a rank whose shards are all empty (their pointers do not move).
        """
        return (
            not self._params or self._params[0].dtype == self.shard_dtype
        ) and [p.data_ptr() for p in self._params] == self._packed_ptrs

    def _build_unsharded(self, slot: ParamSlot, buffer: torch.Tensor) -> None:
        """Create ``slot``'s unsharded param as a view of ``buffer`` (once per packing)."""
        view = buffer[: slot.layout.full_numel].view(slot.layout.full_shape)
        # `.data` gives the param its own version counter: [Note: storage reuse].
        slot.unsharded_buffer = buffer
        slot.unsharded_param = nn.Parameter(view.data, requires_grad=slot.requires_grad)
        # A marker (the optimizer check, module.state_dict()): the slot it gathers, held weakly.
        slot.unsharded_param._fshard_gathered_of = weakref.ref(slot)  # type: ignore[attr-defined]

    # ----------------------------------------------------------------------------- unsharding

    def all_gather_input(self) -> torch.Tensor:
        """The flat shard on the compute device in the compute dtype."""
        flat = self.flat_shard
        if flat.device != self.compute_device:
            flat = flat.to(self.compute_device, non_blocking=True)
        if flat.dtype != self.compute_dtype:
            flat = flat.to(self.compute_dtype)
        return flat

    def alloc_unsharded(self) -> None:
        """Give the unsharded params memory: one storage for the whole bucket.

        The first call after packing allocates it and builds the unsharded params as views;
        later calls only resize the same storage back (its tensors, saved by autograd, stay
        valid: [Note: storage reuse]).
        """
        if self.aliased:
            return
        size = self.mesh_info.shard_size
        if self._unsharded is None:
            # Never inference tensors, even when the first gather runs under
            # torch.inference_mode(): training reuses this storage and autograd saves its views.
            with torch.inference_mode(False):
                self._unsharded = torch.empty(
                    size * self.total, dtype=self.compute_dtype, device=self.compute_device
                )
                for slot, offset, numel in zip(
                    self.slots, self.offsets[:-1], self.slot_numels, strict=True
                ):
                    buffer = self._unsharded[size * offset : size * (offset + numel)]
                    self._build_unsharded(slot, buffer)
                    self._copy_out_views.append(buffer.view(size, numel))
            GATHERED.add(self._unsharded.numel() * self._unsharded.element_size())
            # A bucket collected while gathered (its model deleted mid-step) leaves the count.
            weakref.finalize(self, _forget_gathered, self._unsharded.untyped_storage())
            return
        storage = self._unsharded.untyped_storage()
        nbytes = self._unsharded.numel() * self._unsharded.element_size()
        if storage.nbytes() != nbytes:
            GATHERED.add(nbytes - storage.nbytes())
            storage.resize_(nbytes)

    def gathered_storage_ptr(self) -> int:
        """Where the unsharded buffer's memory is while gathered (0 if it is the shard's own or
        not allocated): the storage that ``free_unsharded`` takes away."""
        if self.aliased or self._unsharded is None:
            return 0
        return self._unsharded.untyped_storage().data_ptr()

    def free_unsharded(self) -> None:
        if self.aliased or self._unsharded is None:
            return
        storage = self._unsharded.untyped_storage()
        GATHERED.sub(storage.nbytes())
        storage.resize_(0)

    def copy_out(self, all_gather_output: torch.Tensor, parts: int = 0) -> None:
        """Scatter the rank-major all-gather output into the unsharded buffers; with ``parts``,
        an all-gather of ``parts`` blocks of ``post_forward_rows`` (see [Note: resharding to
        a smaller group after forward] in _group)."""
        size = self.mesh_info.shard_size
        outs = self._copy_out_views
        if parts:
            # Part i holds rows [i * size / parts, (i + 1) * size / parts) of every slot: the
            # same memory as the slots' [size, numel] views, cut in ``parts`` rows.
            rows = size // parts
            outs = [view.view(parts, -1) for view in outs]
            torch.split_with_sizes_copy(
                all_gather_output.view(parts, rows * self.total),
                [rows * n for n in self.slot_numels],
                dim=1,
                out=outs,
            )
            return
        if len(outs) == 1:
            outs[0].copy_(all_gather_output.view(size, -1))
            return
        torch.split_with_sizes_copy(
            all_gather_output.view(size, self.total), self.slot_numels, dim=1, out=outs
        )

    def post_forward_rows(self, part: int, parts: int) -> torch.Tensor:
        """Rows ``[part * size / parts, (part + 1) * size / parts)`` of every slot's gathered
        buffer, slot after slot in a new 1D tensor: what this rank keeps after a forward that
        reshards to ``parts`` ranks."""
        rows = self.mesh_info.shard_size // parts
        return torch.cat([view[part * rows : (part + 1) * rows].reshape(-1) for view in self._copy_out_views])


