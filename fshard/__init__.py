"""fshard: functional, composable Fully Sharded Data Parallel (ZeRO-3) for PyTorch.

Example:
    >>> import fshard
    >>> for block in model.blocks:                 # doctest: +SKIP
    ...     fshard.fully_shard(block, mesh=mesh)
    >>> fshard.fully_shard(model, mesh=mesh)       # doctest: +SKIP
"""

from fshard import checkpoint, transforms  # public submodules
from fshard._amp import ShardedGradScaler
from fshard._api import fully_shard
from fshard._clip import clip_grad_norm_, patch_torch_total_norm
from fshard._config import FSDPConfig, config_of, from_config, load_config
from fshard._controls import (
    UnshardHandle,
    no_sync,
    register_forward_method,
    reshard,
    set_coalescing,
    set_gradient_divide_factor,
    set_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from fshard._errors import CollectiveError, CollectiveMismatchError, RankMismatchError
from fshard._estimate import Estimate, UnitEstimate, estimate
from fshard._introspect import MemoryStats, UnitInfo, memory_stats, reset_peak_memory_stats, units
from fshard._materialize import materialize
from fshard._options import BackwardPrefetch, CPUOffload, MixedPrecision
from fshard._param import ShardedParameter, is_sharded
from fshard._state_dict import (
    LoadResult,
    full_state_dict,
    layout_of,
    load_optim_state_dict,
    load_state_dict,
    optim_state_dict,
    state_dict,
)
from fshard._strategy import ShardingStrategy, strategy_kwargs
from fshard._wrap import auto_shard, by_class, by_size, select_modules

__version__ = "0.1.0"

patch_torch_total_norm()  # see [Note: torch's clip_grad_norm_ on sharded parameters]

__all__ = [
    # sharding
    "fully_shard",
    "is_sharded",
    "ShardedParameter",
    "ShardingStrategy",
    "strategy_kwargs",
    "units",
    "UnitInfo",
    # control
    "no_sync",
    "set_requires_gradient_sync",
    "set_coalescing",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "register_forward_method",
    "set_gradient_divide_factor",
    "unshard",
    "reshard",
    "UnshardHandle",
    "set_prefetch",
    "BackwardPrefetch",
    "clip_grad_norm_",
    # precision, offload, initialisation, memory
    "MixedPrecision",
    "ShardedGradScaler",
    "CPUOffload",
    "materialize",
    "memory_stats",
    "reset_peak_memory_stats",
    "MemoryStats",
    # state dicts and checkpoints
    "state_dict",
    "full_state_dict",
    "load_state_dict",
    "LoadResult",
    "optim_state_dict",
    "load_optim_state_dict",
    "layout_of",
    "transforms",
    "checkpoint",
    # policies and accelerate-style config
    "auto_shard",
    "by_class",
    "by_size",
    "select_modules",
    "from_config",
    "load_config",
    "config_of",
    "FSDPConfig",
    # planning
    "estimate",
    "Estimate",
    "UnitEstimate",
    # errors
    "RankMismatchError",
    "CollectiveError",
    "CollectiveMismatchError",
]
