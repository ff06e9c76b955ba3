"""Applying a config to a model: ``from_config`` (shard, checkpoint, prefetch, broadcast rank 0's
weights) and ``config_of``."""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._api import fully_shard
from fshard._config._load import load_config
from fshard._config._parse import PARALLELISM_PREFIX
from fshard._config._schema import HYBRID_STRATEGIES, AutoWrapPolicy, FSDPConfig
from fshard._controls import set_prefetch
from fshard._materialize import materialize
from fshard._state_dict import load_state_dict
from fshard._strategy import strategy_kwargs
from fshard._unit._registry import unit_of
from fshard._wrap import Policy, checkpoint_forward, select_modules

__all__ = ["config_of", "from_config"]

logger = logging.getLogger("fshard")

M = TypeVar("M", bound=nn.Module)

_APPLIED: weakref.WeakKeyDictionary[nn.Module, FSDPConfig] = weakref.WeakKeyDictionary()


def config_of(model: nn.Module) -> FSDPConfig | None:
    """The ``FSDPConfig`` that ``from_config`` applied to ``model`` (``None`` if it did not).

    Example:
        >>> fshard.from_config(model, "fsdp.yaml")         # doctest: +SKIP
        >>> fshard.config_of(model).state_dict_type         # doctest: +SKIP
        <StateDictType.SHARDED_STATE_DICT: 'SHARDED_STATE_DICT'>
    """
    return _APPLIED.get(model)


def from_config(
    model: M,
    config: Mapping[str, Any] | str | os.PathLike[str] | FSDPConfig | None = None,
) -> M:
    """Shard ``model`` as an accelerate-style FSDP config says; returns ``model``.

    ``config`` is anything ``fshard.load_config`` takes (a dict, a YAML path, an ``FSDPConfig``;
    ``None`` reads ``$FSHARD_CONFIG_FILE``, set by ``fshard launch``). In order:

    - the wrap policy (TRANSFORMER_BASED_WRAP: ``fshard.by_class`` of the named classes found in
      the model; SIZE_BASED_WRAP: ``fshard.by_size(min_num_params)``; NO_WRAP: root only) picks
      the units, which are sharded bottom-up, then the root (as ``fshard.auto_shard`` does),
      with the mesh and ``reshard_after_forward`` of ``fshard.strategy_kwargs(
      sharding_strategy)`` (HYBRID: ``parallelism_config_dp_replicate_size`` replicas, else one
      per machine), ``mp_policy`` from ``mixed_precision`` (the root's also with
      ``output_dtype=torch.float32``: the model returns fp32, as accelerate's does) and
      ``CPUOffload()`` if ``offload_params``;
    - with ``activation_checkpointing``, the forward of each block the wrap policy selected is
      recomputed in backward (non-reentrant ``torch.utils.checkpoint``; the module keeps its
      class and FQNs, unlike accelerate's ``checkpoint_wrapper``);
    - ``backward_prefetch`` / ``forward_prefetch``, when given, go to ``fshard.set_prefetch``;
    - with ``sync_module_states`` or ``cpu_ram_efficient_loading``, rank 0's weights (as they
      were before sharding) are broadcast to every rank with ``fshard.load_state_dict(...,
      broadcast_from_rank0=True)``, so other ranks may start from any weights: a model they
      built under ``torch.device("meta")`` is materialized (``fshard.materialize``) first.

    The applied config stays retrievable with ``fshard.config_of(model)``. Every rank must
    call it (it is collective); the default process group must be initialised.

    Example:
        >>> import fshard                                              # doctest: +SKIP
        >>> model = fshard.from_config(model, "examples/accelerate_config.yaml")  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-4)      # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_config expects an nn.Module, got {type(model).__name__}")
    cfg = load_config(config)
    if unit_of(model) is not None:
        how = "from_config was applied to it before" if model in _APPLIED else "it is a unit already"
        raise ValueError(
            f"from_config({type(model).__name__}): the model is already sharded ({how}); apply "
            "a config once, to a model not sharded yet"
        )
    policy = cfg.wrap_policy(model)
    # Chosen and checked before sharding (and before any communication): once a block is
    # sharded, its parameters count as owned, and an error after sharding would leave the
    # model half-sharded.
    recomputed = _checkpointed_blocks(model, cfg, policy)
    kwargs = strategy_kwargs(
        cfg.sharding_strategy,
        replicate_size=_replicate_size(cfg),
        device_type="cpu" if cfg.launch.use_cpu else None,
    )
    rank0_state = _rank0_state_dict(model, cfg) if cfg.syncs_module_states else None
    shard_kwargs: dict[str, Any] = {
        "mesh": kwargs["mesh"],
        "reshard_after_forward": kwargs["reshard_after_forward"],
        "mp_policy": cfg.mp_policy,
        "offload_policy": cfg.offload_policy,
    }
    if policy is not None:
        for fqn in select_modules(model, policy):
            fully_shard(model.get_submodule(fqn), **shard_kwargs)
    mp = cfg.mp_policy  # fp32 outputs, as accelerate gives: [Note: mixed precision like accelerate]
    root_mp = None if mp is None else dataclasses.replace(mp, output_dtype=torch.float32)
    fully_shard(model, **{**shard_kwargs, "mp_policy": root_mp})
    for fqn in recomputed:
        checkpoint_forward(model.get_submodule(fqn))
    if cfg.forward_prefetch is not None or cfg.backward_prefetch is not None:
        set_prefetch(model, forward=cfg.forward_prefetch, backward=cfg.backward_prefetch)
    if rank0_state is not None:
        _broadcast_from_rank0(model, rank0_state)
    _APPLIED[model] = cfg
    logger.info(
        "from_config(%s): %s, wrap %s, mixed precision %s, offload %s",
        type(model).__name__,
        cfg.sharding_strategy.name,
        cfg.auto_wrap_policy.value,
        cfg.mixed_precision.value,
        cfg.offload_params,
    )
    return model


def _checkpointed_blocks(model: nn.Module, cfg: FSDPConfig, policy: Policy | None) -> list[str]:
    """The FQNs ``fsdp_activation_checkpointing`` recomputes; raises before anything changes.

    A policy that selects nothing is an error, like NO_WRAP with checkpointing (a rejected
    config): the key would silently do nothing.
    """
    if not cfg.activation_checkpointing or policy is None:
        return []
    selected = select_modules(model, policy)
    if not selected:
        if cfg.auto_wrap_policy is AutoWrapPolicy.SIZE_BASED_WRAP:
            how = f"fsdp_min_num_params: {cfg.min_num_params}"
            fix = "lower fsdp_min_num_params"
        else:
            names = [getattr(c, "__name__", str(c)) for c in getattr(policy, "classes", ())]
            how = f"classes {', '.join(dict.fromkeys(names))}"
            fix = (
                "name block classes below the root that hold parameters in "
                "fsdp_transformer_layer_cls_to_wrap"
            )
        raise ValueError(
            f"fsdp_activation_checkpointing: true checkpoints the blocks the wrap policy selects, "
            f"but {cfg.auto_wrap_policy.value} ({how}) selects no submodule of "
            f"{type(model).__name__} (the root is never one, nor a module without parameters); "
            f"{fix}, or set fsdp_activation_checkpointing: false"
        )
    patched = [fqn for fqn in selected if "forward" in model.get_submodule(fqn).__dict__]
    if patched:
        raise ValueError(
            f"fsdp_activation_checkpointing: the forward of {', '.join(repr(f) for f in patched)} "
            "is already set on the instance (checkpointed before, or patched by other code); "
            "leave out fsdp_activation_checkpointing or the patch"
        )
    return selected


def _replicate_size(cfg: FSDPConfig) -> int | None:
    """Replicas for the hybrid strategies: ``parallelism_config_dp_replicate_size``, else one
    per machine.

    Under torchrun (``fshard launch``), ``strategy_kwargs`` derives the machine count from
    ``LOCAL_WORLD_SIZE``, which is right even when ``--nnodes`` overrode the file; otherwise the
    file's ``num_machines`` says, and must divide the world size (checked here, to blame the
    key the user wrote rather than ``strategy_kwargs``' ``replicate_size``).
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if cfg.shard_size is not None and world is not None:
        replicas = cfg.replicate_size or 1
        if replicas * cfg.shard_size != world:
            sizes = f"{PARALLELISM_PREFIX}dp_shard_size {cfg.shard_size}"
            if cfg.replicate_size is not None:
                sizes = f"{PARALLELISM_PREFIX}dp_replicate_size {replicas} x {sizes}"
            raise ValueError(
                f"{_describe_source(cfg)}: parallelism_config lays out {replicas * cfg.shard_size} "
                f"processes ({sizes}), but this job runs {world}; make the sizes multiply to the "
                "number of processes (num_processes), or launch as many"
            )
    if cfg.sharding_strategy not in HYBRID_STRATEGIES:
        return None
    if cfg.replicate_size is not None:
        return cfg.replicate_size
    if "LOCAL_WORLD_SIZE" in os.environ:
        return None
    machines = cfg.launch.num_machines
    if machines is None or world is None:
        return machines
    if world % machines:
        raise ValueError(
            f"{_describe_source(cfg)}: {cfg.sharding_strategy.name} keeps one replica per machine, "
            f"but num_machines: {machines} does not divide the {world} processes this job runs; "
            f"set num_machines to the number of machines the job runs on (a divisor of {world}), "
            "or start the script with `fshard launch`, which takes the machine count from the "
            "launch"
        )
    return machines


def _describe_source(cfg: FSDPConfig) -> str:
    """The config in messages: its file, if it came from one."""
    return f"FSDP config {cfg.source!r}" if cfg.source is not None else "FSDP config (dict)"


def _sync_keys(cfg: FSDPConfig) -> str:
    """The key(s) that asked for rank 0's weights to be broadcast, for messages."""
    keys = [
        key
        for key, on in (
            ("fsdp_sync_module_states", cfg.sync_module_states),
            ("fsdp_cpu_ram_efficient_loading", cfg.cpu_ram_efficient_loading),
        )
        if on
    ]
    return " and ".join(keys) + (" are" if len(keys) > 1 else " is") + " true"


def _rank0_state_dict(model: nn.Module, cfg: FSDPConfig) -> dict[str, torch.Tensor]:
    """Rank 0's full state dict before sharding (other ranks: empty), for the broadcast.

    The tensors alias the module's current storage; ``fully_shard`` moves each parameter into
    its unit's flat shard and leaves the old storage untouched, so no copy is needed.

    Only rank 0 can tell whether its weights are real, so it broadcasts its verdict (an error
    message or ``None``) first, one small object over the default group, and every rank raises
    the same error: raising on rank 0 alone would leave the others waiting in the weight
    broadcast until the process-group timeout (see [Note: ranks agree on errors] in
    fshard/_state_dict.py).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    rank = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    problem: str | None = None
    if rank == 0:
        state = model.state_dict()
        on_meta = [k for k, v in state.items() if v.is_meta]
        if on_meta:
            problem = (
                f"{_sync_keys(cfg)}: rank 0's weights are broadcast to every rank, so rank 0 "
                f"must build {type(model).__name__} with real weights, but "
                f"{', '.join(on_meta[:5])}{' ...' if len(on_meta) > 5 else ''} are on the meta "
                "device on rank 0; build the model on rank 0 without torch.device('meta') (the "
                "other ranks may use it)"
            )
    problem = _collectives.broadcast_objects(problem, 0, None, label="from_config: rank 0's weights")
    if problem is not None:
        raise ValueError(f"{problem}\n(found on rank 0; every rank raises this error)")
    return state


def _broadcast_from_rank0(model: nn.Module, rank0_state: dict[str, torch.Tensor]) -> None:
    if any(p.is_meta for p in model.parameters()):
        # Other ranks built it on the meta device: allocate shards first. No initialiser: the
        # broadcast below overwrites every value (modules need no reset_parameters()).
        materialize(model, init_fn=_leave_uninitialised)
    load_state_dict(model, rank0_state, broadcast_from_rank0=True)


def _leave_uninitialised(_module: nn.Module) -> None:
    """``materialize``'s ``init_fn`` when every value is about to be loaded anyway."""
