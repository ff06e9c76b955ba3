"""What an accelerate-style FSDP config says, validated: the option enums, ``LaunchConfig``
(the launch layout) and ``FSDPConfig`` (the FSDP options), with the fshard objects they stand
for. Pure: no process group.

[Note: mixed precision like accelerate]
Accelerate's FSDP plugin maps ``mixed_precision: bf16`` (``fp16``) to FSDP's ``MixedPrecision(
param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)``: compute *and* gradient reduction in
the low dtype, fp32 master weights in the shards. fshard does the same with
``MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)``, and like accelerate (whose
``prepare_model`` wraps the forward in ``convert_outputs_to_fp32``) the model returns fp32:
the root unit's policy adds ``output_dtype=torch.float32``, so a ported script computes its loss
from fp32 logits as before. Two differences: fshard never shards or casts buffers (they stay in
their own dtype), and accelerate additionally runs the forward under ``torch.autocast`` (which
also computes some ops, softmax and norms, in fp32); fshard's gathered parameters are already in
the low dtype. fp16 training needs ``fshard.ShardedGradScaler``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from fshard._options import BackwardPrefetch, CPUOffload, MixedPrecision
from fshard._strategy import ShardingStrategy, parse_strategy
from fshard._wrap import Policy, by_class, by_size

__all__ = ["CONFIG_ENV", "AutoWrapPolicy", "FSDPConfig", "LaunchConfig", "MixedPrecisionName", "StateDictType"]

#: The environment variable ``fshard launch`` sets to the config file it was given; read by
#: ``load_config()`` and ``from_config(model)`` when no config is passed.
CONFIG_ENV = "FSHARD_CONFIG_FILE"


class AutoWrapPolicy(str, Enum):
    """``fsdp_auto_wrap_policy``: which submodules become units (compares equal to its name)."""

    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class StateDictType(str, Enum):
    """``fsdp_state_dict_type``: how checkpoints should be saved (compares equal to its name)."""

    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"


class MixedPrecisionName(str, Enum):
    """``mixed_precision``: ``no``, ``fp16`` or ``bf16`` (compares equal to its value)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"


RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def _coerce_enum(owner: str, name: str, enum: type[Enum], value: object) -> Enum:
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(str(m.value) for m in enum)
        raise ValueError(f"{owner}.{name} must be one of {valid}, got {value!r}") from None


def _check_optional_int(owner: str, name: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be None or an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """The top-level keys of an accelerate file that say how to start the processes.

    ``num_processes`` is the *total* over all machines, as in accelerate (``fshard launch`` runs
    ``num_processes // num_machines`` per machine). ``None`` means "not given".

    Example:
        >>> import fshard
        >>> fshard.load_config({"distributed_type": "FSDP", "num_processes": 2}).launch.num_processes
        2
    """

    num_processes: int | None = None
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = None
    gpu_ids: str | None = None
    use_cpu: bool = False

    def __post_init__(self) -> None:
        owner = "LaunchConfig"
        _check_optional_int(owner, "num_processes", self.num_processes, 1)
        _check_optional_int(owner, "num_machines", self.num_machines, 1)
        _check_optional_int(owner, "machine_rank", self.machine_rank, 0)
        _check_optional_int(owner, "main_process_port", self.main_process_port, 1)
        if self.main_process_port is not None and self.main_process_port > 65535:
            raise ValueError(f"{owner}.main_process_port must be <= 65535, got {self.main_process_port!r}")
        if self.rdzv_backend is not None and self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(
                f"{owner}.rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got "
                f"{self.rdzv_backend!r}"
            )
        for name in ("main_process_ip", "gpu_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{owner}.{name} must be None or a str, got {value!r}")
        if not isinstance(self.use_cpu, bool):
            raise TypeError(f"{owner}.use_cpu must be a bool, got {self.use_cpu!r}")
        if (
            self.machine_rank is not None
            and self.num_machines is not None
            and self.machine_rank >= self.num_machines
        ):
            raise ValueError(
                f"{owner}.machine_rank {self.machine_rank} must be < num_machines {self.num_machines}"
            )


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """An accelerate-style FSDP configuration, validated; build it with ``fshard.load_config``.

    Fields mirror the ``fsdp_config`` keys without their ``fsdp_`` prefix; ``mixed_precision``
    is the accelerate top-level key and ``launch`` holds the other top-level keys
    (``LaunchConfig``). ``backward_prefetch=None`` / ``forward_prefetch=None`` keep fshard's
    defaults (prefetch the next unit in both directions). ``replicate_size`` and ``shard_size``
    are the data-parallel layout of accelerate's ``parallelism_config`` (``dp_replicate_size``,
    ``dp_shard_size``; ``None`` when not given): the hybrid strategies replicate
    ``replicate_size`` times, otherwise once per machine. Enum fields compare equal to their
    accelerate names (``cfg.state_dict_type == "SHARDED_STATE_DICT"``), so checkpoint code can
    honour them. ``mp_policy``, ``offload_policy`` and ``wrap_policy(model)`` give the fshard
    objects that ``from_config`` uses.

    Example:
        >>> import fshard
        >>> cfg = fshard.load_config({"fsdp_sharding_strategy": 2, "mixed_precision": "bf16"})
        >>> cfg.sharding_strategy.name, cfg.mp_policy.param_dtype
        ('SHARD_GRAD_OP', torch.bfloat16)
    """

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    offload_params: bool = False
    auto_wrap_policy: AutoWrapPolicy = AutoWrapPolicy.NO_WRAP
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    backward_prefetch: BackwardPrefetch | None = None
    forward_prefetch: bool | None = None
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    sync_module_states: bool = False
    cpu_ram_efficient_loading: bool = False
    use_orig_params: bool = True
    activation_checkpointing: bool = False
    mixed_precision: MixedPrecisionName = MixedPrecisionName.NO
    replicate_size: int | None = None
    shard_size: int | None = None
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    source: str | None = None  # where it was read from (a path), for messages

    def __post_init__(self) -> None:
        owner = "FSDPConfig"
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "sharding_strategy", parse_strategy(self.sharding_strategy, f"{owner}.sharding_strategy"))
        set_(self, "auto_wrap_policy", _coerce_enum(owner, "auto_wrap_policy", AutoWrapPolicy, self.auto_wrap_policy))
        set_(self, "state_dict_type", _coerce_enum(owner, "state_dict_type", StateDictType, self.state_dict_type))
        set_(self, "mixed_precision", _coerce_enum(owner, "mixed_precision", MixedPrecisionName, self.mixed_precision))
        if self.backward_prefetch is not None:
            set_(
                self,
                "backward_prefetch",
                _coerce_enum(owner, "backward_prefetch", BackwardPrefetch, self.backward_prefetch),
            )
        for name in (
            "offload_params",
            "sync_module_states",
            "cpu_ram_efficient_loading",
            "use_orig_params",
            "activation_checkpointing",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if self.forward_prefetch is not None and not isinstance(self.forward_prefetch, bool):
            raise TypeError(f"{owner}.forward_prefetch must be None or a bool, got {self.forward_prefetch!r}")
        classes = self.transformer_layer_cls_to_wrap
        if isinstance(classes, str) or not all(isinstance(c, str) and c for c in classes):
            raise TypeError(
                f"{owner}.transformer_layer_cls_to_wrap must be a tuple of class names, got {classes!r}"
            )
        set_(self, "transformer_layer_cls_to_wrap", tuple(classes))
        n = self.min_num_params
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{owner}.min_num_params must be an int >= 0, got {n!r}")
        if not isinstance(self.launch, LaunchConfig):
            raise TypeError(f"{owner}.launch must be a LaunchConfig, got {self.launch!r}")
        _check_optional_int(owner, "replicate_size", self.replicate_size, 1)
        _check_optional_int(owner, "shard_size", self.shard_size, 1)
        if self.replicate_size is not None and self.sharding_strategy not in HYBRID_STRATEGIES:
            raise ValueError(
                f"{owner}.replicate_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, not "
                f"{self.sharding_strategy.name}; leave it None"
            )

    # ------------------------------------------------------------------ the fshard objects

    @property
    def mp_policy(self) -> MixedPrecision | None:
        """The ``MixedPrecision`` for ``mixed_precision`` (see [Note: mixed precision like accelerate])."""
        dtype = {MixedPrecisionName.BF16: torch.bfloat16, MixedPrecisionName.FP16: torch.float16}
        chosen = dtype.get(self.mixed_precision)
        return None if chosen is None else MixedPrecision(param_dtype=chosen, reduce_dtype=chosen)

    @property
    def offload_policy(self) -> CPUOffload | None:
        """``CPUOffload()`` when ``offload_params`` is true, else ``None``."""
        return CPUOffload() if self.offload_params else None

    @property
    def syncs_module_states(self) -> bool:
        """Whether rank 0's weights are broadcast after sharding (either of the two keys)."""
        return self.sync_module_states or self.cpu_ram_efficient_loading

    def wrap_policy(self, model: nn.Module) -> Policy | None:
        """The policy ``auto_wrap_policy`` names for ``model`` (``None`` for NO_WRAP).

        TRANSFORMER_BASED_WRAP without class names falls back to the model's
        ``_no_split_modules`` (as accelerate does for Transformers models). Class names are
        resolved against ``model``: a name it does not contain is a ``ValueError`` listing the
        class names it has.

        Example:
            >>> import fshard
            >>> from fshard.testing.models import TinyTransformer, TransformerSpec
            >>> cfg = fshard.load_config({"fsdp_transformer_layer_cls_to_wrap": "Block"})
            >>> fshard.select_modules(model := TinyTransformer(TransformerSpec()), cfg.wrap_policy(model))
            ['blocks.0', 'blocks.1']
        """
        if self.auto_wrap_policy is AutoWrapPolicy.NO_WRAP:
            return None
        if self.auto_wrap_policy is AutoWrapPolicy.SIZE_BASED_WRAP:
            return by_size(self.min_num_params)
        names = self.transformer_layer_cls_to_wrap
        source = "fsdp_transformer_layer_cls_to_wrap"
        if not names:
            names = tuple(getattr(model, "_no_split_modules", None) or ())
            source = (
                f"{type(model).__name__}._no_split_modules (used because "
                "fsdp_transformer_layer_cls_to_wrap is not set; set it to name the blocks)"
            )
            if not names:
                raise ValueError(
                    f"fsdp_auto_wrap_policy is TRANSFORMER_BASED_WRAP but no "
                    f"fsdp_transformer_layer_cls_to_wrap is given and {type(model).__name__} has no "
                    "_no_split_modules; name the block class(es), e.g. "
                    "fsdp_transformer_layer_cls_to_wrap: BertLayer"
                )
        try:
            return by_class(*names).resolve(model)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
