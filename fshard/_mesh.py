"""Mesh words: a 1D or 2D ``DeviceMesh`` turned into shard and replicate groups.

A 1D mesh shards over all its ranks. A 2D mesh is ``(replicate, shard)`` in that order (hybrid
shard, HSDP): parameters are sharded inside each shard group and replicated across the replicate
dimension.
"""

from __future__ import annotations

import atexit
import gc
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = [
    "MeshInfo",
    "PostForwardGroup",
    "mesh_info",
    "post_forward_group",
    "default_device_type",
    "default_mesh",
    "group_ranks",
    "in_src_row",
    "mesh_device",
    "register_mesh_cache",
    "replicate_src",
    "row_of",
    "src_rank",
]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    current = getattr(module, "current_device", None)
    if current is None:
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, current())


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """This rank's view of a 1D or 2D mesh."""

    mesh: DeviceMesh
    device: torch.device
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None  # None on a 1D mesh
    replicate_size: int
    replicate_rank: int

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks: gradients are averaged over this many."""
        return self.shard_size * self.replicate_size

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks covered by the mesh, sorted."""
        return tuple(sorted(int(r) for r in self.mesh.mesh.flatten().tolist()))

    def placements(self, replicated: bool) -> tuple[Placement, ...]:
        shard: Placement = Replicate() if replicated else Shard(0)
        if self.mesh.ndim == 1:
            return (shard,)
        return (Replicate(), shard)


def mesh_info(mesh: object, where: str) -> MeshInfo:
    """Validate ``mesh`` and return its groups; ``where`` names the caller in errors."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh "
            f"(from init_device_mesh), got {type(mesh).__name__}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{where}: mesh must be 1D (shard) or 2D (replicate, shard), got a {mesh.ndim}D mesh "
            f"of shape {tuple(mesh.shape)}; flatten the data-parallel dimensions into one or two"
        )
    dim_names = tuple(mesh.mesh_dim_names or ())
    names = tuple(n.lower() for n in dim_names)
    if len(names) == 2 and "shard" in names[0] and "replicate" in names[1]:
        raise ValueError(
            f"{where}: the mesh's dimensions are named {dim_names}, but a 2D mesh is read as "
            "(replicate, shard) by position; build it as init_device_mesh(device, "
            f"({mesh.size(1)}, {mesh.size(0)}), mesh_dim_names=({dim_names[1]!r}, "
            f"{dim_names[0]!r}))"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"{where}: this rank ({dist.get_rank()}) is not part of mesh {mesh}")
    shard_dim = mesh.ndim - 1
    shard_group = mesh.get_group(shard_dim)
    if mesh.ndim == 2:
        replicate_group: dist.ProcessGroup | None = mesh.get_group(0)
        replicate_size = mesh.size(0)
        replicate_rank = mesh.get_local_rank(0)
    else:
        replicate_group, replicate_size, replicate_rank = None, 1, 0
    return MeshInfo(
        mesh=mesh,
        device=mesh_device(mesh),
        shard_group=shard_group,
        shard_size=mesh.size(shard_dim),
        shard_rank=mesh.get_local_rank(shard_dim),
        replicate_group=replicate_group,
        replicate_size=replicate_size,
        replicate_rank=replicate_rank,
    )


_DEFAULT_MESHES: dict[tuple[str, int], DeviceMesh] = {}  # keyed by id of the default group
_MESH_CACHES: list[dict[Any, DeviceMesh]] = [_DEFAULT_MESHES]


def register_mesh_cache(cache: dict[Any, DeviceMesh]) -> dict[Any, DeviceMesh]:
    """Have ``cache`` emptied at interpreter exit (see [Note: process groups at exit])."""
    _MESH_CACHES.append(cache)
    return cache


@atexit.register
def _release_at_exit() -> None:
    """[Note: process groups at exit]
    A ``DeviceMesh`` holds its process groups, and a sharded model holds its mesh (in reference
    cycles, which only the garbage collector frees). Left alone, both are destroyed during
    interpreter finalization, where tearing down a gloo group can abort the process ("terminate
    called without an active exception") after the script already finished. Dropping fshard's
    mesh caches and collecting garbage while the interpreter is still whole destroys them at a
    safe point instead.
    """
    for cache in _MESH_CACHES:
        cache.clear()
    gc.collect()


def default_device_type(group: dist.ProcessGroup | None = None) -> str:
    """``"cuda"`` if CUDA is available and ``group`` (default: the default process group) can
    run collectives on it, else ``"cpu"``: a gloo group on a GPU machine computes on the CPU.

    Example:
        >>> default_device_type() in ("cpu", "cuda")
        True
    """
    if not torch.cuda.is_available():
        return "cpu"
    if not (dist.is_available() and dist.is_initialized()):
        return "cuda"
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        devices = {part.split(":", 1)[0].strip() for part in backend.split(",")}
        return "cuda" if "cuda" in devices else "cpu"
    return "cpu" if backend == "gloo" else "cuda"


def default_mesh(where: str) -> DeviceMesh:
    """A 1D mesh over the default process group on the default device type (cached)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where}: mesh=None needs an initialised default process group; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment), "
            "or pass mesh=init_device_mesh(...)"
        )
    device_type = default_device_type()
    key = (device_type, id(dist.group.WORLD))
    mesh = _DEFAULT_MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        _DEFAULT_MESHES[key] = mesh
    return mesh


@dataclass(frozen=True)
class PostForwardGroup:
    """The ranks a unit with ``reshard_after_forward=<int>`` reshards to after forward."""

    group: dist.ProcessGroup
    size: int  # the int: how many ranks share the unit's parameters until its backward
    rank: int  # this rank's place among them: the block of rows it keeps


# Keyed by the default group (a new one after destroy/init) and the member ranks: one process
# group per set of ranks, however many units and meshes use it.
_POST_FORWARD_GROUPS: dict[tuple[int, tuple[int, ...]], tuple[object, dist.ProcessGroup]] = {}
_MESH_CACHES.append(_POST_FORWARD_GROUPS)  # type: ignore[arg-type]  # emptied at exit too


def post_forward_group(info: MeshInfo, size: int) -> PostForwardGroup:
    """The ``size`` consecutive ranks of ``info``'s shard group that include this rank
    (consecutive ranks: one host's, where the backward's all-gather is cheapest), created on
    first use by those ranks alone."""
    group = info.shard_group
    ranks = sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))
    start = info.shard_rank // size * size
    members = tuple(ranks[start : start + size])
    world = dist.group.WORLD
    key = (id(world), members)
    cached = _POST_FORWARD_GROUPS.get(key)
    if cached is None or cached[0] is not world:
        subgroup = dist.new_group(
            list(members), use_local_synchronization=True, group_desc=f"fshard_post_forward_{size}"
        )
        if subgroup is None or subgroup == dist.GroupMember.NON_GROUP_MEMBER:
            raise RuntimeError(f"fshard: could not create the post-forward group of ranks {list(members)}")
        cached = (world, subgroup)
        _POST_FORWARD_GROUPS[key] = cached
    subgroup = cached[1]
    return PostForwardGroup(group=subgroup, size=size, rank=dist.get_rank(subgroup))


# ------------------------------------------------------------------------ mesh coordinates

# [Note: rank 0]
# "Rank 0" of a mesh is its first rank (``mesh.mesh.flatten()[0]``), which is global rank 0 for
# a mesh over all ranks: the rank that gathers a full state dict, and that broadcasts one.


def src_rank(info: MeshInfo) -> int:
    """The global rank of the mesh's rank 0 (see [Note: rank 0])."""
    return int(info.mesh.mesh.flatten()[0].item())


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``."""
    return list(dist.get_process_group_ranks(group))


def in_src_row(info: MeshInfo, src: int) -> bool:
    """True on the ranks of ``src``'s shard group (the only ones that talk to ``src`` first)."""
    return src in group_ranks(info.shard_group)


def replicate_src(info: MeshInfo, src: int) -> int | None:
    """The member of this rank's replicate group that sits in ``src``'s shard group."""
    if info.replicate_group is None or info.replicate_size == 1:
        return None
    row = set(group_ranks(info.shard_group))
    src_row = row_of(info, src)
    for rank in group_ranks(info.replicate_group):
        if row_of(info, rank) == src_row:
            return rank
    raise RuntimeError(f"no rank of replicate group {group_ranks(info.replicate_group)} in {row}")


def row_of(info: MeshInfo, rank: int) -> int:
    """The replicate coordinate (the row of the mesh) of global ``rank``."""
    coords = (info.mesh.mesh == rank).nonzero()
    return int(coords[0, 0].item())
