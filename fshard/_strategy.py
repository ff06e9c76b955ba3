"""The classic sharding strategies, expressed as meshes and ``reshard_after_forward``."""

from __future__ import annotations

import os
from enum import Enum, IntEnum
from typing import TypedDict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fshard._errors import warn_user
from fshard._mesh import default_device_type, register_mesh_cache

__all__ = ["ShardingStrategy", "StrategyKwargs", "strategy_kwargs", "parse_strategy"]


class ShardingStrategy(IntEnum):
    """The FSDP1 / accelerate strategy names, numbered as in an accelerate config.

    | name | no. | what it shards |
    |---|---|---|
    | ``FULL_SHARD`` | 1 | params, grads, optimizer state (ZeRO-3) |
    | ``SHARD_GRAD_OP`` | 2 | grads and optimizer state; params stay gathered forward to backward (ZeRO-2) |
    | ``NO_SHARD`` | 3 | nothing (DDP) |
    | ``HYBRID_SHARD`` | 4 | ``FULL_SHARD`` inside a node, replicated across nodes |
    | ``HYBRID_SHARD_ZERO2`` | 5 | ``SHARD_GRAD_OP`` inside a node, replicated across nodes |

    ``fshard.strategy_kwargs(strategy)`` turns one into ``fully_shard`` arguments.

    Example:
        >>> import fshard
        >>> fshard.ShardingStrategy(4).name
        'HYBRID_SHARD'
    """

    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    HYBRID_SHARD_ZERO2 = 5


class StrategyKwargs(TypedDict):
    mesh: DeviceMesh
    reshard_after_forward: bool


def parse_strategy(strategy: ShardingStrategy | int | str, where: str) -> ShardingStrategy:
    """Accept a ``ShardingStrategy``, its number 1-5, or its name (any case); also torch's
    FSDP1 ``torch.distributed.fsdp.ShardingStrategy`` (by name: its number 5 is called
    ``_HYBRID_SHARD_ZERO2``, a leading underscore fshard ignores)."""
    valid = ", ".join(f"{s.name} ({s.value})" for s in ShardingStrategy)
    if isinstance(strategy, ShardingStrategy):
        return strategy
    if isinstance(strategy, Enum) and type(strategy).__module__.startswith("torch.distributed.fsdp"):
        strategy = strategy.name
    if isinstance(strategy, bool):
        raise TypeError(f"{where}: strategy must be a ShardingStrategy, 1-5 or a name, got {strategy!r}")
    if isinstance(strategy, int):
        try:
            return ShardingStrategy(strategy)
        except ValueError:
            raise ValueError(f"{where}: unknown sharding strategy {strategy!r}; valid: {valid}") from None
    if isinstance(strategy, str):
        key = strategy.strip().upper().replace(" ", "_").replace("-", "_").lstrip("_")
        if key.isdigit():
            return parse_strategy(int(key), where)
        if key in ShardingStrategy.__members__:
            return ShardingStrategy[key]
        raise ValueError(f"{where}: unknown sharding strategy {strategy!r}; valid: {valid}")
    raise TypeError(f"{where}: strategy must be a ShardingStrategy, 1-5 or a name, got {strategy!r}")


_MESHES: dict[tuple[str, tuple[int, ...], int], DeviceMesh] = register_mesh_cache({})


def _mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    key = (device_type, shape, id(dist.group.WORLD))
    mesh = _MESHES.get(key)
    if mesh is None:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        _MESHES[key] = mesh
    return mesh


def strategy_kwargs(
    strategy: ShardingStrategy | int | str,
    *,
    replicate_size: int | None = None,
    device_type: str | None = None,
) -> StrategyKwargs:
    """The ``mesh`` and ``reshard_after_forward`` that implement a classic strategy.

    FULL_SHARD and SHARD_GRAD_OP use a 1D mesh over all ranks; NO_SHARD a ``(world, 1)`` mesh
    (every rank holds everything, gradients are all-reduced); the hybrid strategies a
    ``(replicate_size, world // replicate_size)`` mesh, where ``replicate_size`` defaults to the
    number of nodes (``world_size // LOCAL_WORLD_SIZE``, as set by torchrun). Meshes are created
    once per shape and reused. Every rank must call it (mesh creation is collective).
    ``device_type`` defaults to cuda where CUDA is available and the default process group runs
    on it (NCCL), else cpu.

    Example:
        >>> kwargs = fshard.strategy_kwargs("HYBRID_SHARD", replicate_size=2)  # doctest: +SKIP
        >>> fshard.fully_shard(model, **kwargs)                              # doctest: +SKIP
    """
    where = "strategy_kwargs"
    strategy = parse_strategy(strategy, where)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where}: needs an initialised default process group; call "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size()
    if device_type is None:
        device_type = default_device_type()
    _check_device_type(device_type, where)
    if replicate_size is not None and strategy not in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy.HYBRID_SHARD_ZERO2,
    ):
        raise ValueError(
            f"{where}: replicate_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, "
            f"not {strategy.name}"
        )
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return {
            "mesh": _mesh(device_type, (world,)),
            "reshard_after_forward": strategy is ShardingStrategy.FULL_SHARD,
        }
    if strategy is ShardingStrategy.NO_SHARD:
        return {"mesh": _mesh(device_type, (world, 1)), "reshard_after_forward": False}
    defaulted = replicate_size is None
    if replicate_size is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replicate_size = max(1, world // max(1, local))
    bad_type = not isinstance(replicate_size, int) or isinstance(replicate_size, bool)
    if bad_type or replicate_size < 1 or world % replicate_size:
        raise ValueError(
            f"{where}: replicate_size must be a positive divisor of the world size {world}, "
            f"got {replicate_size!r}"
        )
    if replicate_size == 1 and world > 1:
        _say_hybrid_is_not_hybrid(strategy, world, defaulted)
    return {
        "mesh": _mesh(device_type, (replicate_size, world // replicate_size)),
        "reshard_after_forward": strategy is ShardingStrategy.HYBRID_SHARD,
    }


_SAID_HYBRID_IS_NOT_HYBRID = False


def _say_hybrid_is_not_hybrid(strategy: ShardingStrategy, world: int, defaulted: bool) -> None:
    """Once per process, on rank 0: a hybrid strategy with one replica is its 1D twin."""
    global _SAID_HYBRID_IS_NOT_HYBRID
    if _SAID_HYBRID_IS_NOT_HYBRID or dist.get_rank() != 0:
        return
    _SAID_HYBRID_IS_NOT_HYBRID = True
    twin = "FULL_SHARD" if strategy is ShardingStrategy.HYBRID_SHARD else "SHARD_GRAD_OP"
    why = (
        f"all {world} ranks run on one machine (LOCAL_WORLD_SIZE is {world})"
        if defaulted
        else "replicate_size is 1"
    )
    warn_user(
        f"fshard: {strategy.name} here is {twin}: {why}, so there is one replica and every "
        f"parameter is sharded over all {world} ranks. To keep several replicas, pass "
        f"replicate_size=R (R a divisor of {world} above 1, e.g. 2) to strategy_kwargs, or "
        "launch on several machines (one replica per machine)."
    )


def _check_device_type(device_type: object, where: str) -> None:
    """A device type torch knows and this machine has (checked before a mesh is built on it)."""
    try:
        device = torch.device(device_type)  # type: ignore[call-overload]  # any object: torch says what it rejects
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{where}: device_type must name a torch device type ('cpu', 'cuda', ...), got "
            f"{device_type!r}"
        ) from None
    if device.index is not None:
        raise ValueError(
            f"{where}: device_type is a device type without an index ({device.type!r}), got "
            f"{device_type!r}; each rank uses its current device of that type"
        )
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if device.type != "cpu" and (is_available is None or not is_available()):
        raise ValueError(
            f"{where}: device_type {device_type!r} is not available on this machine; leave it "
            "out to use the default (cuda where available, else cpu)"
        )
