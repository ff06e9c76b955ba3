"""Read-only queries of what fshard built: ``units`` (and ``UnitInfo``), ``memory_stats`` and
``reset_peak_memory_stats``. Collective-free: any rank may call them at any time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fshard._bucket import GATHERED
from fshard._options import CPUOffload, MixedPrecision
from fshard._unit._registry import units_under

__all__ = ["MemoryStats", "memory_stats", "reset_peak_memory_stats", "UnitInfo", "units"]


class MemoryStats(NamedTuple):
    """Memory of this process: gathered parameters (all units, all models) and, for the model
    and optimizer given to ``memory_stats``, this rank's persistent training state.

    ``gathered_bytes``: full parameters (and all-gather buffers) allocated now;
    ``peak_gathered_bytes``: the most held at once since the last reset.
    ``param_bytes``: the model's parameters as this rank holds them (a sharded parameter counts
    its local shard); ``grad_bytes``: their ``.grad`` tensors now; ``optim_bytes``: the
    optimizer's state tensors (AdamW: two per parameter of its shape, plus a step scalar each).
    The last three are 0 when no model (optimizer) is given. ``persistent_bytes`` is their sum.

    Example:
        >>> stats = fshard.memory_stats(model, opt)       # doctest: +SKIP
        >>> stats.peak_gathered_bytes / 2**20             # MiB  # doctest: +SKIP
        >>> stats.persistent_bytes / 2**20                # params + grads + optimizer state  # doctest: +SKIP
    """

    gathered_bytes: int
    peak_gathered_bytes: int
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0

    @property
    def persistent_bytes(self) -> int:
        """``param_bytes + grad_bytes + optim_bytes``."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


def memory_stats(
    model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> MemoryStats:
    """This rank's bytes of gathered parameters now and at most (since reset), and, given a
    model (and its optimizer), of the parameters, gradients and optimizer state it keeps.

    On CPU, where torch keeps no allocator statistics, this is how to see what prefetch and
    ``reshard_after_forward`` cost, and what sharding saves: a sharded parameter counts its
    local shard (``p.to_local()``), so ``param_bytes`` is about ``1/shard_size`` of the model's.
    Each tensor is counted once however often it is listed (a tied weight); gradients are
    those that exist now (after ``backward``, before ``zero_grad``).

    Example:
        >>> fshard.reset_peak_memory_stats()             # doctest: +SKIP
        >>> loss = model(x).sum(); loss.backward(); opt.step()   # doctest: +SKIP
        >>> stats = fshard.memory_stats(model, opt)      # doctest: +SKIP
        >>> stats.peak_gathered_bytes, stats.param_bytes, stats.grad_bytes, stats.optim_bytes  # doctest: +SKIP
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"fshard.memory_stats: model must be an nn.Module or None, got {type(model).__name__}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fshard.memory_stats: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    params = list(model.parameters()) if model is not None else []  # deduplicated: tied once
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return MemoryStats(
        GATHERED.current,
        GATHERED.peak,
        param_bytes=_tensor_bytes(params),
        grad_bytes=_tensor_bytes(grads),
        optim_bytes=_tensor_bytes(states),
    )


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``' elements, each distinct tensor once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def reset_peak_memory_stats() -> None:
    """Restart the peak of ``memory_stats()`` from the current value.

    Example:
        >>> fshard.reset_peak_memory_stats()  # doctest: +SKIP
    """
    GATHERED.peak = GATHERED.current


# ------------------------------------------------------------------------------ unit query


@dataclass(frozen=True)
class UnitInfo:
    """What one ``fully_shard`` call made: a unit of a sharded model, as ``fshard.units`` sees it.

    ``fqn``: the unit's module, relative to the module asked about (``""`` for that module
    itself; a unit of several modules joins their FQNs with ``+``). ``modules``: the module
    objects. ``param_names``: the parameters the unit owns (shards), by FQN relative to the
    module asked about, in the unit's order. ``mesh``, ``reshard_after_forward``,
    ``mp_policy`` and ``offload_policy``: the settings it runs with now (``fully_shard``'s
    arguments, or what ``set_reshard_after_forward`` set since).

    Example:
        >>> [u.fqn for u in fshard.units(model)]    # doctest: +SKIP
        ['', 'blocks.0', 'blocks.1']
    """

    fqn: str
    modules: tuple[nn.Module, ...]
    param_names: tuple[str, ...]
    mesh: DeviceMesh
    reshard_after_forward: bool | int
    mp_policy: MixedPrecision | None
    offload_policy: CPUOffload | None


def units(module: nn.Module) -> list[UnitInfo]:
    """The fshard units in ``module``'s subtree (``module`` itself included), in module order.

    What ``fully_shard``, ``auto_shard`` or ``from_config`` built, read back from the model: a
    script can print it, and a test can check that a wrapping policy or config made the intended
    units. A module that no ``fully_shard`` call reached gives ``[]``. Collective-free: any rank
    may call it, at any time. A parameter shared by several units (a tied embedding and head)
    moves to the unit of the lowest module containing all its users when the root initialises,
    on the first forward: until then it shows in the first unit that took it.

    Example:
        >>> for block in model.blocks:                     # doctest: +SKIP
        ...     fshard.fully_shard(block, mesh=mesh)
        >>> fshard.fully_shard(model, mesh=mesh)           # doctest: +SKIP
        >>> [(u.fqn, len(u.param_names)) for u in fshard.units(model)]  # doctest: +SKIP
        [('', 3), ('blocks.0', 4), ('blocks.1', 4)]
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fshard.units expects an nn.Module, got {type(module).__name__}")
    # Each module's FQN and place in module order (a module registered twice: its first).
    module_names: dict[int, tuple[int, str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        module_names.setdefault(id(m), (len(module_names), name))
    param_names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), name)  # a tied weight: its first name
    found: list[tuple[int, UnitInfo]] = []
    for group in units_under(module):
        inside = [module_names[id(m)] for m in group.modules if id(m) in module_names]
        if not inside:
            continue
        info = UnitInfo(
            fqn="+".join(name for _, name in inside),
            modules=tuple(group.modules),
            param_names=tuple(param_names.get(id(s.sharded_param), s.fqn) for s in group.slots),
            mesh=group.mesh_info.mesh,
            reshard_after_forward=group.reshard_after_forward,
            mp_policy=group.mp_policy,
            offload_policy=group.offload_policy,
        )
        found.append((min(at for at, _ in inside), info))
    return [info for _, info in sorted(found, key=lambda item: item[0])]
