"""Accelerate-style FSDP configs: parse them (pure) and apply them to a model (``from_config``).

Users arrive from HuggingFace Accelerate with a YAML file written by ``accelerate config``. Two
shapes are accepted: the whole file (top-level keys such as ``distributed_type: FSDP`` and
``num_processes``, with the FSDP options under ``fsdp_config``), or just the ``fsdp_config``
block. ``load_config`` turns either into a frozen ``FSDPConfig`` without touching any process
group; ``from_config`` applies one to a model.

Modules: ``_schema`` (the option enums, ``LaunchConfig``, ``FSDPConfig``), ``_parse`` (a mapping
into an ``FSDPConfig``: key spellings, values, contradictions), ``_load`` (``load_config``: dicts
and YAML/JSON files), ``_apply`` (``from_config``, ``config_of``).
"""

from fshard._config._apply import config_of, from_config
from fshard._config._load import load_config
from fshard._config._schema import (
    CONFIG_ENV,
    AutoWrapPolicy,
    FSDPConfig,
    LaunchConfig,
    MixedPrecisionName,
    StateDictType,
)

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
