"""A gradient scaler for fp16 training of a sharded model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fshard import _collectives
from fshard._mesh import default_device_type

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients: an inf/nan on any rank skips every rank.

    Each rank only sees its own gradient shards, so after unscaling the found-inf flag is
    all-reduced (MAX) over ``process_group`` (default: the whole world) before the step decides.
    Use it exactly like ``GradScaler``. Unlike ``GradScaler`` it unscales fp16 gradients too (a
    model in fp16 without ``MixedPrecision``), as torch's FSDP ``ShardedGradScaler`` does.

    Example:
        >>> scaler = fshard.ShardedGradScaler()           # doctest: +SKIP
        >>> scaler.scale(loss).backward()                 # doctest: +SKIP
        >>> scaler.unscale_(optimizer)                    # doctest: +SKIP
        >>> fshard.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
        >>> scaler.step(optimizer)                        # doctest: +SKIP
        >>> scaler.update()                               # doctest: +SKIP
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if device is None:
            device = default_device_type(process_group)
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's shards, then agree with every rank on whether any was not finite."""
        if not self._enabled:
            return
        super().unscale_(optimizer)  # raises if this optimizer was already unscaled this step
        if dist.is_available() and dist.is_initialized():
            self._sync_found_inf(optimizer)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # fp16 gradients too: a model in fp16 without MixedPrecision has fp16 shards, which
        # torch's GradScaler refuses to unscale in place (as torch's FSDP scaler, this one does).
        unscaled: dict[torch.device, torch.Tensor] = super()._unscale_grads_(
            optimizer, inv_scale, found_inf, True
        )
        return unscaled

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The inf/nan check of ``step`` for optimizers that unscale inside their own step
        (fused Adam/AdamW/SGD: ``step`` skips ``unscale_``): agreed across ranks too."""
        super()._check_inf_per_device(optimizer)
        if dist.is_available() and dist.is_initialized():
            self._sync_found_inf(optimizer)
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _sync_found_inf(self, optimizer: torch.optim.Optimizer) -> None:
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        backend_device = default_device_type(self.process_group)
        flags = list(found.values())
        any_inf = torch.zeros(1, dtype=torch.float32, device=backend_device)
        for flag in flags:
            any_inf = torch.maximum(any_inf, flag.reshape(1).to(backend_device, torch.float32))
        if not flags:  # no gradients on this rank: it still takes part in the vote
            found[torch.device(self._device)] = torch.zeros(1, device=self._device)
            flags = list(found.values())
        _collectives.all_reduce_(
            any_inf, self.process_group, label="ShardedGradScaler", op=dist.ReduceOp.MAX
        )
        for flag in flags:
            flag.copy_(any_inf.reshape(flag.shape).to(flag.device, flag.dtype))
