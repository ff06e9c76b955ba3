"""``load_config``: read an accelerate config (a dict, or a YAML or JSON file) into a validated
``FSDPConfig``."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fshard._config._parse import parse_config
from fshard._config._schema import CONFIG_ENV, FSDPConfig

__all__ = ["load_config"]


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
    return parse_config(data, f"FSDP config {_describe(source)}", path)


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
