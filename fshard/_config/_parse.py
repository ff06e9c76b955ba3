"""Parsing an accelerate config mapping into an ``FSDPConfig``: every key spelling, value and
contradiction checked, every problem reported at once (pure: no files, no process group).

[Note: accelerate key spellings]
Accelerate has renamed several keys over time, and Transformers' ``TrainingArguments`` strips the
``fsdp_`` prefix from the same options. Every spelling maps to one canonical option: the ``fsdp_``
prefix is optional, ``fsdp_wrap_policy`` = ``fsdp_auto_wrap_policy``, ``fsdp_backward_prefetch`` =
``fsdp_backward_prefetch_policy``, ``min_num_param`` = ``min_num_params``, and the value
``SIZED_BASED_WRAP`` = ``SIZE_BASED_WRAP`` (the spellings of the HF FSDP guide). Two spellings of
one option with different values are an error. Any other key is an error that names it and lists
the valid ones.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from enum import Enum
from typing import Any, NamedTuple

from fshard._config._schema import (
    HYBRID_STRATEGIES,
    RDZV_BACKENDS,
    AutoWrapPolicy,
    FSDPConfig,
    LaunchConfig,
    MixedPrecisionName,
    StateDictType,
)
from fshard._errors import ProblemList
from fshard._options import BackwardPrefetch
from fshard._strategy import ShardingStrategy, parse_strategy

__all__ = ["PARALLELISM_PREFIX", "parse_config"]

logger = logging.getLogger("fshard")


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
                if isinstance(value, str) and value in RDZV_BACKENDS:
                    launch[key] = value
                else:
                    parser.fail(key, value, f"one of {', '.join(RDZV_BACKENDS)}")
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
PARALLELISM_PREFIX = "parallelism_config_"


def _parse_parallelism(parser: _Parser, section: object) -> dict[str, int]:
    """The sizes of accelerate's ``parallelism_config`` section (1 where not given); see
    [Note: accelerate's parallelism_config]."""
    sizes = dict.fromkeys(_PARALLELISM_SIZES, 1)
    if section is None:
        return sizes
    if not isinstance(section, Mapping):
        parser.fail("parallelism_config", section, "a mapping of parallelism_config_* sizes")
        return sizes
    valid = sorted(PARALLELISM_PREFIX + name for name in (*_PARALLELISM_SIZES, *_PARALLELISM_OTHER))
    for key, value in section.items():
        prefixed = isinstance(key, str) and key.startswith(PARALLELISM_PREFIX)
        name = key.removeprefix(PARALLELISM_PREFIX) if prefixed else None
        if name in _PARALLELISM_SIZES:
            size = parser.integer(key, value, 1)
            if size is not None:
                sizes[name] = size
        elif name not in _PARALLELISM_OTHER:
            _unknown_key(parser, key, valid, "parallelism_config")
    for name, what in _NOT_DATA_PARALLEL.items():
        if sizes[name] > 1:
            parser.problems.add(
                f"{PARALLELISM_PREFIX}{name}: {sizes[name]} asks for {what}, which fshard does "
                f"not do (it shards data parallel only); set {PARALLELISM_PREFIX}{name}: 1 and "
                f"give those ranks to {PARALLELISM_PREFIX}dp_shard_size (or "
                f"{PARALLELISM_PREFIX}dp_replicate_size)"
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
    rep_key, shard_key = f"{PARALLELISM_PREFIX}dp_replicate_size", f"{PARALLELISM_PREFIX}dp_shard_size"
    total = replicas * shards * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    if num_processes is not None and total != num_processes:
        parser.problems.add(
            f"parallelism_config: {rep_key} {replicas} x {shard_key} {shards} is {total} "
            f"processes, but num_processes is {num_processes}; make the product equal "
            "num_processes (accelerate requires it too)"
        )
    strategy = values.get("sharding_strategy")
    if replicas > 1:
        if explicit_strategy is None or strategy in HYBRID_STRATEGIES:
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


def parse_config(data: Mapping[Any, Any], where: str, source: str | None) -> FSDPConfig:
    """The ``FSDPConfig`` that ``data`` (a whole accelerate file or its ``fsdp_config`` block)
    describes; every problem is reported in one ``ValueError`` whose message starts with
    ``where``. ``source`` is the file it was read from, if any (``.json``: a Trainer's block)."""
    return _build(_Parser(where), data, source)


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

    raf = _resolve_strategy(parser, values, keys)
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
    _resolve_wrap_policy(parser, values, keys, trainer)
    _check_what_has_no_effect(parser, values, keys)

    launch_config: LaunchConfig | None = None
    try:
        launch_config = LaunchConfig(**launch)
    except (TypeError, ValueError) as exc:
        parser.problems.add(str(exc).replace("LaunchConfig.", ""))
    parser.problems.raise_if_any(ValueError)
    return FSDPConfig(**values, launch=launch_config or LaunchConfig(), source=source)


def _resolve_strategy(parser: _Parser, values: dict[str, Any], keys: dict[str, str]) -> Any:
    """Fold ``reshard_after_forward`` (a bool, or an FSDP1 strategy) into ``sharding_strategy``,
    reporting a contradiction; returns the ``reshard_after_forward`` value given (or None)."""
    strategy = values.get("sharding_strategy")
    raf = values.pop("reshard_after_forward", None)
    if raf is None:
        return None
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
    return raf


def _resolve_wrap_policy(
    parser: _Parser, values: dict[str, Any], keys: dict[str, str], trainer: bool
) -> None:
    """Infer ``auto_wrap_policy`` from the wrap keys given when it is not set (a Trainer's
    block: TRANSFORMER_BASED_WRAP), and say which wrap keys the policy set ignores."""
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


def _check_what_has_no_effect(parser: _Parser, values: dict[str, Any], keys: dict[str, str]) -> None:
    """Checkpointing without a wrap policy is an error; keys that change nothing here are
    logged."""
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
