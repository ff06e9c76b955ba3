"""Accelerate-style FSDP configs: parse them (pure) and apply them to a model (``from_config``).

Users arrive from HuggingFace Accelerate with a YAML file written by ``accelerate config``. Two
shapes are accepted: the whole file (top-level keys such as ``distributed_type: FSDP`` and
``num_processes``, with the FSDP options under ``fsdp_config``), or just the ``fsdp_config``
block. ``load_config`` turns either into a frozen ``FSDPConfig`` without touching any process
group; ``from_config`` applies one to a model.

[Note: accelerate key spellings]
Accelerate has renamed several keys over time, and Transformers' ``TrainingArguments`` strips the
``fsdp_`` prefix from the same options. Every spelling maps to one canonical option: the ``fsdp_``
prefix is optional, ``fsdp_wrap_policy`` = ``fsdp_auto_wrap_policy``, ``fsdp_backward_prefetch`` =
``fsdp_backward_prefetch_policy``, ``min_num_param`` = ``min_num_params``, and the value
``SIZED_BASED_WRAP`` = ``SIZE_BASED_WRAP`` (the spellings of the HF FSDP guide). Two spellings of
one option with different values are an error. Any other key is an error that names it and lists
the valid ones.

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

import dataclasses
import difflib
import functools
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fshard import _collectives
from fshard._api import fully_shard, set_prefetch
from fshard._errors import ProblemList
from fshard._materialize import materialize
from fshard._options import BackwardPrefetch, CPUOffload, MixedPrecision
from fshard._state_dict import load_state_dict
from fshard._strategy import ShardingStrategy, parse_strategy, strategy_kwargs
from fshard._unit._registry import unit_of
from fshard._wrap import Policy, by_class, by_size, checkpoint_forward, select_modules

__all__ = [
    "CONFIG_ENV",
    "AutoWrapPolicy",
    "FSDPConfig",
    "LaunchConfig",
    "MixedPrecisionName",
    "StateDictType",
    "config_of",
    "from_config",
    "load_config",
]

logger = logging.getLogger("fshard")

M = TypeVar("M", bound=nn.Module)

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


_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


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
        if self.rdzv_backend is not None and self.rdzv_backend not in _RDZV_BACKENDS:
            raise ValueError(
                f"{owner}.rdzv_backend must be one of {', '.join(_RDZV_BACKENDS)}, got "
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
        if self.replicate_size is not None and self.sharding_strategy not in _HYBRID:
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


# -------------------------------------------------------------------------------- parsing


# Canonical option -> the accelerate spelling shown in messages.
_BLOCK_KEYS: dict[str, str] = {
    "sharding_strategy": "fsdp_sharding_strategy",
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "offload_params": "fsdp_offload_params",
    "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
    "backward_prefetch": "fsdp_backward_prefetch_policy",
    "forward_prefetch": "fsdp_forward_prefetch",
    "state_dict_type": "fsdp_state_dict_type",
    "sync_module_states": "fsdp_sync_module_states",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "use_orig_params": "fsdp_use_orig_params",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "version": "fsdp_version",
    "mixed_precision": "mixed_precision",
}
_BLOCK_ALIASES = {
    "wrap_policy": "auto_wrap_policy",
    "backward_prefetch_policy": "backward_prefetch",
    "min_num_param": "min_num_params",
    "cpu_offload": "offload_params",  # Transformers' fsdp_config
}
# Keys only a Transformers TrainingArguments fsdp_config has (the Trainer adds the xla ones to
# every config it normalises): a bare block with one of them, or a bare block in a .json file,
# is read with the Trainer's defaults (see _build).
_TRAINER_ONLY_KEYS = ("cpu_offload", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")

# The top-level keys of an accelerate config file (ClusterConfig, plus legacy spellings).
_LAUNCH_KEYS = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "gpu_ids",
    "use_cpu",
)
_IGNORED_TOP_KEYS = (
    "debug",
    "downcast_bf16",
    "main_training_function",
    "same_network",
    "enable_cpu_affinity",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_name",
    "tpu_zone",
    "tpu_vm",
    "command_file",
    "commands",
)
# Sections for other backends: accepted when empty, ignored with a warning otherwise.
_OTHER_SECTIONS = (
    "deepspeed_config",
    "megatron_lm_config",
    "ipex_config",
    "mpirun_config",
    "tp_config",
    "fp8_config",
    "dynamo_config",
)
_TOP_KEYS = (
    "compute_environment",
    "distributed_type",
    "fsdp_config",
    "parallelism_config",
    "mixed_precision",
    "fp16",
    "dynamo_backend",
    *_LAUNCH_KEYS,
    *_IGNORED_TOP_KEYS,
    *_OTHER_SECTIONS,
)

# FSDP1 / Transformers TrainingArguments options that fshard knows and has no equivalent for:
# accepted and ignored, with a warning when they are switched on (like the sections of other
# backends above), so that a Trainer fsdp_config file loads unchanged.
_XLA = "fshard does not run on PyTorch/XLA (TPU); it shards with torch.distributed on CPU or GPU"
_NO_EQUIVALENT = {
    "limit_all_gathers": "FSDP1's rate limit on all-gathers in flight has no fshard equivalent "
    "(fshard prefetches one unit ahead by default; see fshard.set_prefetch)",
    "xla": _XLA,
    "xla_fsdp_settings": _XLA,
    "xla_fsdp_grad_ckpt": _XLA,
    "xla_fsdp_v2": _XLA,
}

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class _Parser:
    """Collects every problem of one config, then raises once (see fshard._errors.ProblemList)."""

    def __init__(self, where: str) -> None:
        self.problems = ProblemList(where)

    def fail(self, key: str, value: object, expected: str) -> None:
        self.problems.add(f"{key}: {value!r} is not valid; expected {expected}")

    def boolean(self, key: str, value: object) -> bool | None:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):  # accelerate's str_to_bool takes 1 / 0 too
            return value == 1
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        self.fail(key, value, "true or false")
        return None

    def integer(self, key: str, value: object, minimum: int, maximum: int | None = None) -> int | None:
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str):
            try:
                as_float = float(value.replace("_", ""))
                number = int(as_float) if as_float.is_integer() else None
            except ValueError:
                number = None
        if number is None or number < minimum or (maximum is not None and number > maximum):
            bound = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            self.fail(key, value, bound)
            return None
        return number

    def choice(self, key: str, value: object, valid: tuple[str, ...], aliases: Mapping[str, str] = {}) -> str | None:
        if isinstance(value, str):
            name = value.strip().upper().replace("-", "_").replace(" ", "_")
            name = aliases.get(name, name)
            if name in valid:
                return name
        self.fail(key, value, f"one of {', '.join(valid)}")
        return None


def _is_off(value: object) -> bool:
    """False, 0, None, an empty section or a false-like word: a no-equivalent key left off."""
    if isinstance(value, str):
        return value.strip().lower() in (*_FALSE, "", "none")
    return not value


def _canonical_block_key(key: str) -> str | None:
    name = key[len("fsdp_"):] if key.startswith("fsdp_") else key
    name = _BLOCK_ALIASES.get(name, name)
    return name if name in _BLOCK_KEYS else None


def _unknown_key(parser: _Parser, key: object, valid: list[str], section: str, hint: str = "") -> None:
    # Compared as accelerate writes keys: lower case, with underscores.
    spelled = str(key).strip().lower().replace("-", "_").replace(" ", "_")
    close = difflib.get_close_matches(spelled, valid, n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    parser.problems.add(
        f"unknown key {key!r} in {section}{suggestion}{hint}; valid keys: {', '.join(valid)}"
    )


def _parse_mixed_precision(parser: _Parser, key: str, value: object) -> MixedPrecisionName | None:
    if value is None or value is False:  # YAML reads a bare `no` as False
        return MixedPrecisionName.NO
    if isinstance(value, str) and value.strip().lower() in ("no", "fp16", "bf16"):
        return MixedPrecisionName(value.strip().lower())
    if isinstance(value, str) and value.strip().lower() == "fp8":
        parser.problems.add(f"{key}: 'fp8' is not supported by fshard; expected one of no, fp16, bf16")
        return None
    parser.fail(key, value, "one of no, fp16, bf16")
    return None


def _parse_block(parser: _Parser, block: Mapping[Any, Any], section: str) -> dict[str, tuple[str, Any]]:
    """Canonical option -> (the key as written, parsed value); problems go to ``parser``."""
    parsed: dict[str, tuple[str, Any]] = {}
    valid = sorted(set(_BLOCK_KEYS.values()) | {"fsdp_wrap_policy", "fsdp_backward_prefetch", "min_num_params"})
    for key, value in block.items():
        canon = _canonical_block_key(key) if isinstance(key, str) else None
        if canon is None and isinstance(key, str) and key.removeprefix("fsdp_") in _NO_EQUIVALENT:
            if not _is_off(value):
                logger.warning("%s is ignored: %s", key, _NO_EQUIVALENT[key.removeprefix("fsdp_")])
            continue
        if canon is None:
            hint = ""
            if key in _TOP_KEYS:
                hint = (
                    f" ({key!r} is a top-level key of an accelerate file: pass the whole file, "
                    "with distributed_type: FSDP and the FSDP options under fsdp_config)"
                )
            _unknown_key(parser, key, valid, section, hint)
            continue
        result = _parse_value(parser, canon, key, value)
        if result is _INVALID:
            continue
        if canon in parsed and parsed[canon][1] != result:
            first = parsed[canon][0]
            parser.problems.add(
                f"{first} ({_show(parsed[canon][1])}) and {key} ({_show(result)}) set the same "
                "option to different values; keep one"
            )
            continue
        parsed[canon] = (key, result)
    return parsed


_INVALID = object()


def _show(value: object) -> str:
    """How messages print a parsed value: enums by their accelerate name."""
    if isinstance(value, ShardingStrategy):
        return value.name
    if isinstance(value, Enum):
        return str(value.value)
    return repr(value)


def _parse_value(parser: _Parser, canon: str, key: str, value: object) -> Any:
    before = len(parser.problems.items)
    result: Any
    if canon == "sharding_strategy":
        try:
            result = parse_strategy(value, key)  # type: ignore[arg-type]  # validated inside
        except (TypeError, ValueError) as exc:
            parser.problems.add(str(exc))
            result = None
    elif canon == "reshard_after_forward":
        # FSDP2-style accelerate files: a bool; FSDP1-style: a strategy name or number.
        word = value.strip().lower() if isinstance(value, str) else None
        if isinstance(value, bool):
            result = value
        elif word is not None and word in _TRUE + _FALSE and not word.isdigit():
            result = word in _TRUE  # "true" / "false" as strings; "1"-"5" are strategies
        else:
            try:
                result = parse_strategy(value, key)  # type: ignore[arg-type]  # validated inside
            except (TypeError, ValueError):
                names = ", ".join(s.name for s in ShardingStrategy)
                hint = ""
                if str(value).strip() == "0":  # not a strategy; FSDP2 files mean false
                    hint = (
                        " (a number here is an FSDP1 sharding strategy, so 0 is none; to keep "
                        "the parameters gathered after forward, write false)"
                    )
                parser.fail(key, value, f"true, false or a sharding strategy ({names} or 1-5){hint}")
                result = None
    elif canon in ("offload_params", "forward_prefetch", "sync_module_states", "cpu_ram_efficient_loading", "use_orig_params"):
        result = parser.boolean(key, value)
    elif canon == "activation_checkpointing":
        result = parser.boolean(key, value)
    elif canon == "version":
        result = parser.integer(key, value, 1, 2)
    elif canon == "auto_wrap_policy":
        choice = parser.choice(
            key, value, tuple(p.value for p in AutoWrapPolicy), {"SIZED_BASED_WRAP": "SIZE_BASED_WRAP"}
        )
        result = None if choice is None else AutoWrapPolicy(choice)
    elif canon == "transformer_layer_cls_to_wrap":
        if value is None:
            result = ()
        elif isinstance(value, str):
            result = tuple(n.strip() for n in value.split(",") if n.strip())
        elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
            result = tuple(n.strip() for n in value if n.strip())
        else:
            parser.fail(key, value, "a class name, comma-separated class names, or a list of them")
            result = None
    elif canon == "min_num_params":
        result = parser.integer(key, value, 0)
    elif canon == "backward_prefetch":
        if value is None:  # FSDP1's and accelerate's spelling of "no prefetch"
            result = BackwardPrefetch.NO_PREFETCH
        else:
            choice = parser.choice(key, value, tuple(b.value for b in BackwardPrefetch))
            result = None if choice is None else BackwardPrefetch(choice)
    elif canon == "state_dict_type":
        choice = parser.choice(key, value, ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"))
        if choice == "LOCAL_STATE_DICT":
            logger.info(
                "%s: LOCAL_STATE_DICT is FSDP1's flat-parameter shard format; fshard has no flat "
                "parameters, so it uses SHARDED_STATE_DICT (per-parameter shards, DCP-compatible)",
                key,
            )
            choice = "SHARDED_STATE_DICT"
        result = None if choice is None else StateDictType(choice)
    elif canon == "mixed_precision":
        result = _parse_mixed_precision(parser, key, value)
    else:  # pragma: no cover - _BLOCK_KEYS and this function list the same options
        raise RuntimeError(f"fshard internal error: no parser for option {canon!r}")
    return _INVALID if len(parser.problems.items) > before else result


class _Top(NamedTuple):
    """What the top level of a whole accelerate file holds besides ``fsdp_config``."""

    launch: dict[str, Any]  # LaunchConfig fields
    mixed_precision: Any  # a MixedPrecisionName, or _INVALID when not given
    parallelism: dict[str, int] | None  # _PARALLELISM_SIZES -> size; None when not given


def _parse_top(parser: _Parser, data: Mapping[Any, Any]) -> _Top:
    """Validate the top level of a whole accelerate file."""
    launch: dict[str, Any] = {}
    mixed: Any = _INVALID
    parallelism: dict[str, int] | None = None
    valid = sorted(_TOP_KEYS)
    for key, value in data.items():
        if key not in _TOP_KEYS:
            hint = ""
            if isinstance(key, str) and _canonical_block_key(key) is not None:
                hint = f" ({key!r} belongs under fsdp_config)"
            _unknown_key(parser, key, valid, "the accelerate config", hint)
            continue
        if key == "distributed_type":
            if value != "FSDP":
                parser.problems.add(
                    f"distributed_type: {value!r} is not supported; fshard runs FSDP configs "
                    "(distributed_type: FSDP)"
                )
        elif key == "compute_environment":
            if value != "LOCAL_MACHINE":
                parser.fail(key, value, "LOCAL_MACHINE (fshard does not launch on SageMaker)")
        elif key == "fsdp_config":
            if value is not None and not isinstance(value, Mapping):
                parser.fail(key, value, "a mapping of fsdp_* options")
        elif key == "mixed_precision":
            mixed = _parse_mixed_precision(parser, key, value)
        elif key == "fp16":  # accelerate's legacy spelling of mixed_precision: fp16
            if parser.boolean(key, value) and mixed is _INVALID:
                mixed = MixedPrecisionName.FP16
        elif key == "num_processes":
            unset = value is None or (type(value) is int and value <= 0)  # accelerate writes -1
            if not unset:
                launch[key] = parser.integer(key, value, 1)
        elif key == "num_machines":
            launch[key] = parser.integer(key, value, 1)
        elif key == "machine_rank":
            launch[key] = parser.integer(key, value, 0)
        elif key == "main_process_port":
            if value is not None:
                launch[key] = parser.integer(key, value, 1, 65535)
        elif key == "main_process_ip":
            if value is not None:
                if isinstance(value, str) and value.strip():
                    launch[key] = value.strip()
                else:
                    parser.fail(key, value, "a host name or IP address")
        elif key == "rdzv_backend":
            if value is not None:
                if isinstance(value, str) and value in _RDZV_BACKENDS:
                    launch[key] = value
                else:
                    parser.fail(key, value, f"one of {', '.join(_RDZV_BACKENDS)}")
        elif key == "gpu_ids":
            if value is not None:
                if isinstance(value, (list, tuple)):
                    launch[key] = ",".join(str(v) for v in value)
                elif isinstance(value, (str, int)) and not isinstance(value, bool):
                    launch[key] = str(value)
                else:
                    parser.fail(key, value, "'all' or comma-separated device indices")
        elif key == "use_cpu":
            launch[key] = parser.boolean(key, value)
        elif key == "parallelism_config":
            parallelism = _parse_parallelism(parser, value)
        elif key in _OTHER_SECTIONS:
            if value and not (key == "dynamo_config" and _dynamo_is_off(value)):
                logger.warning("%s is ignored: fshard applies only the FSDP options", key)
        elif key == "dynamo_backend":
            if isinstance(value, str) and value.upper() not in ("NO", "NONE"):
                logger.warning("dynamo_backend %r is ignored: fshard does not compile the model", value)
        # _IGNORED_TOP_KEYS: accelerate-only settings (TPU, notebooks, affinity): nothing to do.
    launch = {k: v for k, v in launch.items() if v is not None}
    return _Top(launch, mixed, parallelism)


# [Note: accelerate's parallelism_config]
# accelerate (FSDP2) lays out the ranks with a ParallelismConfig: dp_replicate_size x
# dp_shard_size x tp_size x cp_size (x sp_size) must equal num_processes. fshard does data
# parallelism only: dp_replicate_size > 1 is HSDP, fshard's hybrid layout (a (dp_replicate_size,
# dp_shard_size) mesh; HYBRID_SHARD, or HYBRID_SHARD_ZERO2 with fsdp_reshard_after_forward:
# false); dp_replicate_size 1 is plain sharding over dp_shard_size ranks. Tensor, context and
# sequence parallelism (a size > 1) are errors; their other options only matter then.
_PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
_PARALLELISM_OTHER = (
    "cp_comm_strategy",
    "cp_backend",
    "sp_backend",
    "sp_seq_length",
    "sp_seq_length_is_variable",
    "sp_attn_implementation",
)
_NOT_DATA_PARALLEL = {
    "tp_size": "tensor parallelism",
    "cp_size": "context parallelism",
    "sp_size": "sequence parallelism",
}
_PARALLELISM_PREFIX = "parallelism_config_"


def _parse_parallelism(parser: _Parser, section: object) -> dict[str, int]:
    """The sizes of accelerate's ``parallelism_config`` section (1 where not given); see
    [Note: accelerate's parallelism_config]."""
    sizes = dict.fromkeys(_PARALLELISM_SIZES, 1)
    if section is None:
        return sizes
    if not isinstance(section, Mapping):
        parser.fail("parallelism_config", section, "a mapping of parallelism_config_* sizes")
        return sizes
    valid = sorted(_PARALLELISM_PREFIX + name for name in (*_PARALLELISM_SIZES, *_PARALLELISM_OTHER))
    for key, value in section.items():
        prefixed = isinstance(key, str) and key.startswith(_PARALLELISM_PREFIX)
        name = key.removeprefix(_PARALLELISM_PREFIX) if prefixed else None
        if name in _PARALLELISM_SIZES:
            size = parser.integer(key, value, 1)
            if size is not None:
                sizes[name] = size
        elif name not in _PARALLELISM_OTHER:
            _unknown_key(parser, key, valid, "parallelism_config")
    for name, what in _NOT_DATA_PARALLEL.items():
        if sizes[name] > 1:
            parser.problems.add(
                f"{_PARALLELISM_PREFIX}{name}: {sizes[name]} asks for {what}, which fshard does "
                f"not do (it shards data parallel only); set {_PARALLELISM_PREFIX}{name}: 1 and "
                f"give those ranks to {_PARALLELISM_PREFIX}dp_shard_size (or "
                f"{_PARALLELISM_PREFIX}dp_replicate_size)"
            )
    return sizes


def _apply_parallelism(
    parser: _Parser,
    values: dict[str, Any],
    explicit_strategy: str | None,
    sizes: dict[str, int],
    num_processes: int | None,
) -> None:
    """Turn the data-parallel sizes of ``parallelism_config`` into the sharding strategy and the
    mesh (``replicate_size``, ``shard_size``); ``explicit_strategy`` is the key that named a
    strategy, if one did (see [Note: accelerate's parallelism_config])."""
    replicas, shards = sizes["dp_replicate_size"], sizes["dp_shard_size"]
    if replicas == shards == 1:
        return  # nothing asked for: the layout of the other keys
    rep_key, shard_key = f"{_PARALLELISM_PREFIX}dp_replicate_size", f"{_PARALLELISM_PREFIX}dp_shard_size"
    total = replicas * shards * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    if num_processes is not None and total != num_processes:
        parser.problems.add(
            f"parallelism_config: {rep_key} {replicas} x {shard_key} {shards} is {total} "
            f"processes, but num_processes is {num_processes}; make the product equal "
            "num_processes (accelerate requires it too)"
        )
    strategy = values.get("sharding_strategy")
    if replicas > 1:
        if explicit_strategy is None or strategy in _HYBRID:
            # Unset, or fsdp_reshard_after_forward true / false: FSDP2's HSDP.
            zero2 = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
            values["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD_ZERO2 if zero2 else ShardingStrategy.HYBRID_SHARD
            values["replicate_size"] = replicas
        else:
            parser.problems.add(
                f"{explicit_strategy} is {_show(strategy)}, but {rep_key}: {replicas} asks for "
                f"{replicas} replicas of {shards}-way sharding (hybrid sharding); set "
                f"{explicit_strategy} to HYBRID_SHARD or HYBRID_SHARD_ZERO2 (or leave it out), or "
                f"{rep_key}: 1"
            )
    elif explicit_strategy is not None and strategy not in (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
    ):
        parser.problems.add(
            f"{explicit_strategy} is {_show(strategy)}, but {rep_key}: 1 with {shard_key}: "
            f"{shards} asks for plain sharding over {shards} ranks; set {explicit_strategy} to "
            f"FULL_SHARD or SHARD_GRAD_OP (or leave it out), or set {rep_key} above 1"
        )
    values["shard_size"] = shards


# [Note: the Trainer's fsdp_config defaults]
# TrainingArguments (transformers 5.x, _process_fsdp_args) turns its fsdp_config into accelerate
# plugin arguments with defaults of its own where they differ from accelerate's: "version"
# defaults to 2; state_dict_type is always passed, FULL_STATE_DICT unless given (so FSDP2's
# SHARDED default never applies); and for version 1 only, the FSDP1 options below are passed
# with these defaults (sync_module_states "true": rank 0's weights are broadcast). For
# version 2 the Trainer passes none of them (FSDP2 has no sync_module_states: only
# cpu_ram_efficient_loading broadcasts).
_TRAINER_FSDP1_DEFAULTS: dict[str, Any] = {
    "sync_module_states": True,
    "forward_prefetch": False,
    "backward_prefetch": BackwardPrefetch.NO_PREFETCH,
    "use_orig_params": True,
}


def _apply_trainer_defaults(values: dict[str, Any], version: int | None) -> None:
    """Fill in what a Transformers Trainer fsdp_config leaves out as the Trainer does (see
    [Note: the Trainer's fsdp_config defaults])."""
    values.setdefault("state_dict_type", StateDictType.FULL_STATE_DICT)
    if (version or 2) == 1:
        for option, default in _TRAINER_FSDP1_DEFAULTS.items():
            values.setdefault(option, default)


def _dynamo_is_off(value: object) -> bool:
    return isinstance(value, Mapping) and str(value.get("dynamo_backend", "NO")).upper() == "NO"


def _build(parser: _Parser, data: Mapping[Any, Any], source: str | None) -> FSDPConfig:
    whole = "fsdp_config" in data or "distributed_type" in data
    launch: dict[str, Any] = {}
    top_mixed: Any = _INVALID
    parallelism: dict[str, int] | None = None
    if whole:
        launch, top_mixed, parallelism = _parse_top(parser, data)
        block = data.get("fsdp_config") or {}
        if not isinstance(block, Mapping):
            block = {}
        options = _parse_block(parser, block, "fsdp_config")
    else:
        options = _parse_block(parser, data, "the fsdp_config block")
    values = {canon: value for canon, (_, value) in options.items()}
    keys = {canon: key for canon, (key, _) in options.items()}
    # A Transformers fsdp_config (TrainingArguments(fsdp_config="fsdp_config.json")): the
    # Trainer wraps by class (the model's _no_split_modules) unless told otherwise, and its
    # min_num_params defaults to 0, meaning "not set".
    trainer = not whole and (
        (source is not None and source.lower().endswith(".json"))
        or any(isinstance(k, str) and k.removeprefix("fsdp_") in _TRAINER_ONLY_KEYS for k in data)
    )
    if values.get("min_num_params") == 0 and (
        trainer or values.get("auto_wrap_policy") is not AutoWrapPolicy.SIZE_BASED_WRAP
    ):
        del values["min_num_params"]  # (no size policy wraps every module: 0 is "not set")

    if top_mixed is not _INVALID:
        if "mixed_precision" in values and values["mixed_precision"] != top_mixed:
            parser.problems.add(
                f"mixed_precision is {top_mixed.value!r} at the top level but "
                f"{values['mixed_precision'].value!r} in fsdp_config; keep one"
            )
        values["mixed_precision"] = top_mixed

    strategy = values.get("sharding_strategy")
    raf = values.pop("reshard_after_forward", None)
    if raf is not None:
        implied = raf
        if isinstance(raf, bool):
            implied = ShardingStrategy.FULL_SHARD if raf else ShardingStrategy.SHARD_GRAD_OP
            if strategy is not None:
                reshards = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
                implied = strategy if reshards == raf else None
        elif strategy is not None and strategy != raf:
            implied = None
        if implied is None:
            parser.problems.add(
                f"{keys['reshard_after_forward']} ({_show(raf)}) contradicts "
                f"{keys['sharding_strategy']} ({_show(strategy)}); keep one"
            )
        else:
            values["sharding_strategy"] = implied
    if parallelism is not None:
        explicit = keys.get("sharding_strategy")
        if raf is not None and not isinstance(raf, bool):  # an FSDP1 strategy name or number
            explicit = keys["reshard_after_forward"]
        _apply_parallelism(parser, values, explicit, parallelism, launch.get("num_processes"))
    version = values.pop("version", None)
    if trainer:
        _apply_trainer_defaults(values, version)
    elif version == 2 and "state_dict_type" not in values:
        # accelerate's FSDP2 plugin saves sharded checkpoints unless told otherwise (the
        # Trainer passes FULL_STATE_DICT explicitly, so its configs keep that default).
        values["state_dict_type"] = StateDictType.SHARDED_STATE_DICT

    policy = values.get("auto_wrap_policy")
    if policy is None:
        has_classes = bool(values.get("transformer_layer_cls_to_wrap"))
        has_size = "min_num_params" in values
        if has_classes and has_size:
            parser.problems.add(
                f"{keys['transformer_layer_cls_to_wrap']} and {keys['min_num_params']} are both "
                "set but fsdp_auto_wrap_policy is not; set it to TRANSFORMER_BASED_WRAP or "
                "SIZE_BASED_WRAP"
            )
        elif has_classes:
            values["auto_wrap_policy"] = AutoWrapPolicy.TRANSFORMER_BASED_WRAP
        elif has_size:
            values["auto_wrap_policy"] = AutoWrapPolicy.SIZE_BASED_WRAP
        elif trainer:
            values["auto_wrap_policy"] = AutoWrapPolicy.TRANSFORMER_BASED_WRAP
            logger.info(
                "a Transformers fsdp_config without a wrap policy: TRANSFORMER_BASED_WRAP (the "
                "model's _no_split_modules), as the Trainer does"
            )
    elif policy is not AutoWrapPolicy.TRANSFORMER_BASED_WRAP and values.get("transformer_layer_cls_to_wrap"):
        logger.warning(
            "%s is ignored: fsdp_auto_wrap_policy is %s",
            keys["transformer_layer_cls_to_wrap"],
            policy.value,
        )
    elif policy is not AutoWrapPolicy.SIZE_BASED_WRAP and "min_num_params" in values:
        logger.warning("%s is ignored: fsdp_auto_wrap_policy is %s", keys["min_num_params"], policy.value)

    no_wrap = values.get("auto_wrap_policy", AutoWrapPolicy.NO_WRAP) is AutoWrapPolicy.NO_WRAP
    if values.get("activation_checkpointing") and no_wrap:
        parser.problems.add(
            f"{keys['activation_checkpointing']}: true checkpoints the blocks the wrap policy "
            "selects, but fsdp_auto_wrap_policy is NO_WRAP; set TRANSFORMER_BASED_WRAP (with "
            "fsdp_transformer_layer_cls_to_wrap) or SIZE_BASED_WRAP"
        )
    if values.get("use_orig_params") is False:
        logger.info(
            "%s: false has no effect: fshard always keeps the original parameters (same "
            "objects, same names; there are no flat parameters)",
            keys["use_orig_params"],
        )
    if values.get("cpu_ram_efficient_loading") and values.get("sync_module_states") is False:
        logger.info(
            "%s: true implies fsdp_sync_module_states: true (rank 0's weights are broadcast)",
            keys["cpu_ram_efficient_loading"],
        )

    launch_config: LaunchConfig | None = None
    try:
        launch_config = LaunchConfig(**launch)
    except (TypeError, ValueError) as exc:
        parser.problems.add(str(exc).replace("LaunchConfig.", ""))
    parser.problems.raise_if_any(ValueError)
    return FSDPConfig(**values, launch=launch_config or LaunchConfig(), source=source)


def _describe(source: object) -> str:
    if isinstance(source, Mapping):
        return "dict"
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__


def load_config(source: Mapping[str, Any] | str | os.PathLike[str] | FSDPConfig | None = None) -> FSDPConfig:
    """Read and validate an accelerate-style FSDP config; no process group needed.

    ``source`` is a dict or the path of a YAML file, holding either a whole ``accelerate config``
    file (``distributed_type: FSDP`` with an ``fsdp_config`` block) or just the block's keys.
    ``None`` reads the file named by ``$FSHARD_CONFIG_FILE`` (set by ``fshard launch
    --config_file``). Every unknown key or bad value is reported in one ``ValueError`` that names
    them and lists the valid ones. Every spelling accelerate and Transformers use is accepted:
    the ``fsdp_`` prefix is optional, ``fsdp_wrap_policy`` = ``fsdp_auto_wrap_policy``,
    ``fsdp_backward_prefetch`` = ``fsdp_backward_prefetch_policy``, ``min_num_param`` =
    ``min_num_params``, ``cpu_offload`` = ``fsdp_offload_params``, and ``SIZED_BASED_WRAP`` =
    ``SIZE_BASED_WRAP``. With ``fsdp_version: 2``, ``fsdp_state_dict_type`` defaults to
    ``SHARDED_STATE_DICT``, as in accelerate's FSDP2 plugin. A bare block read from a ``.json``
    file, or holding a key only Transformers writes (``cpu_offload``, ``xla``...), is a
    ``TrainingArguments`` fsdp_config and gets the Trainer's defaults: TRANSFORMER_BASED_WRAP
    when no policy is given (accelerate's default is NO_WRAP), ``FULL_STATE_DICT`` whatever the
    version, and with ``version: 1`` (the Trainer's default is 2) ``sync_module_states: true``,
    ``forward_prefetch: false``, ``backward_prefetch: NO_PREFETCH`` and ``use_orig_params:
    true``. ``min_num_params: 0`` means "not set", as in the Trainer.

    Example:
        >>> import fshard
        >>> cfg = fshard.load_config({"fsdp_config": {"fsdp_offload_params": True,
        ...                           "fsdp_sharding_strategy": "FULL_SHARD"},
        ...                           "distributed_type": "FSDP", "num_processes": 2})
        >>> cfg.offload_params, cfg.sharding_strategy.name, cfg.launch.num_processes
        (True, 'FULL_SHARD', 2)
    """
    if isinstance(source, FSDPConfig):
        return source
    path: str | None = None
    if source is None:
        path = os.environ.get(CONFIG_ENV) or None
        if path is None:
            raise ValueError(
                "no FSDP config given: pass a dict or the path of an accelerate YAML file "
                f"(fshard.from_config(model, 'fsdp.yaml')), or start the script with "
                f"`fshard launch --config_file fsdp.yaml script.py`, which sets ${CONFIG_ENV}"
            )
        source = path
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        data = _read_yaml(path)
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(
            f"load_config expects a dict, a YAML path or an FSDPConfig, got {type(source).__name__}"
        )
    parser = _Parser(f"FSDP config {_describe(source)}")
    return _build(parser, data, path)


class _BadConfigText(ValueError):
    """A config file that does not parse; the message follows "FSDP config '<path>' "."""


def _read_yaml(path: str) -> Mapping[Any, Any]:
    """The mapping in the config file ``path``: YAML, or JSON for a ``.json`` file.

    A key given twice in one mapping is an error (plain YAML and JSON readers keep the last one
    silently, so half of what the user wrote would not apply). JSON is read by the json module:
    JSON is YAML 1.2, but PyYAML reads YAML 1.1, which forbids the tab indentation JSON allows.
    """
    file = Path(path)
    if file.is_dir():
        raise IsADirectoryError(
            f"FSDP config file {path!r} is a directory, not a file; pass the path of the YAML "
            "file (an accelerate config or its fsdp_config block)"
        )
    if not file.is_file():
        raise FileNotFoundError(f"FSDP config file {path!r} does not exist")
    text = file.read_text(encoding="utf-8")
    try:
        data = _parse_json(text) if file.suffix.lower() == ".json" else _parse_yaml(text)
    except _BadConfigText as exc:
        raise ValueError(f"FSDP config {path!r} {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"FSDP config {path!r} must hold a mapping (an accelerate config or its fsdp_config "
            f"block), got a {type(data).__name__}"
        )
    return data


def _parse_json(text: str) -> Any:
    import json

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise _BadConfigText(f"gives key {key!r} twice in one object; keep one")
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise _BadConfigText(f"is not valid JSON: {exc}") from None


def _parse_yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader subclass: safe
    except yaml.YAMLError as exc:
        raise _BadConfigText(f"is not valid YAML: {exc}") from None


@functools.cache
def _unique_key_loader() -> type[Any]:
    """A ``yaml.SafeLoader`` that rejects a key given twice in one mapping (built on first use,
    so that importing fshard does not import yaml)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            # Checked before SafeLoader flattens merge keys (<<), whose keys an explicit key
            # may override.
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.setdefault(key, line)
                except TypeError:  # an unhashable key: SafeLoader reports it below
                    continue
                if first != line:
                    raise _BadConfigText(
                        f"gives key {key!r} twice in one mapping (lines {first} and {line}); "
                        "keep one"
                    )
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


# -------------------------------------------------------------------------------- applying

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
            sizes = f"{_PARALLELISM_PREFIX}dp_shard_size {cfg.shard_size}"
            if cfg.replicate_size is not None:
                sizes = f"{_PARALLELISM_PREFIX}dp_replicate_size {replicas} x {sizes}"
            raise ValueError(
                f"{_describe_source(cfg)}: parallelism_config lays out {replicas * cfg.shard_size} "
                f"processes ({sizes}), but this job runs {world}; make the sizes multiply to the "
                "number of processes (num_processes), or launch as many"
            )
    if cfg.sharding_strategy not in _HYBRID:
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
    fshard/_state_dict/_common.py).
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
