"""Models named on the command line: ``gpt``, ``pkg.module:factory`` or a Transformers config.

Shared by the commands that take a MODEL (``fshard estimate``); pure: nothing is built until a
factory is called (under ``torch.device("meta")`` by the caller, where memory matters).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fshard._config import load_config
from fshard._wrap import Policy, by_class, by_size

if TYPE_CHECKING:
    from fshard._estimate import Estimate

__all__ = ["ModelSource", "load_model", "load_callable", "load_policy", "write_json"]




class ModelSource(NamedTuple):
    """A model named on the command line: how to build it, and defaults for it."""

    factory: Callable[[], nn.Module]
    name: str
    policy: Policy | None
    batch_fn: Callable[[], Any] | None
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None


def load_model(
    spec: str, *, gpt: dict[str, int] | None = None, batch: int | None = None
) -> ModelSource:
    """Resolve ``fshard estimate``'s MODEL: ``gpt`` (fshard's test GPT with sizes ``gpt``),
    ``pkg.module:factory``, or a Transformers ``config.json`` (or a directory holding one).

    Example:
        >>> from fshard._model_source import load_model
        >>> load_model("gpt", gpt={"layers": 2}).name
        'gpt (layers 2, dim 128, heads 4, seq 64, vocab 128)'
    """
    if spec == "gpt":
        return _gpt_source(gpt or {}, batch)
    path = spec
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if path.endswith(".json") or os.path.isfile(path):
        return _transformers_source(path)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"MODEL must be 'gpt', pkg.module:factory or a Transformers config.json (or a "
            f"directory with one), got {spec!r}"
        )
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"MODEL {spec!r}: cannot find {attr!r} in {module_name!r}: {exc}") from None
    if not callable(found):
        raise ValueError(f"MODEL {spec!r} is a {type(found).__name__}, not a callable returning a module")
    return ModelSource(found, spec, None, None, None)


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``pkg.module:name`` -> the callable it names (``--batch-fn``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"{what} must be pkg.module:name, got {spec!r}")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{what} {spec!r} is not callable")
    return found  # (Any: checked callable above)


_GPT_DEFAULTS = {"layers": 4, "dim": 128, "heads": 4, "seq": 64, "vocab": 128}


def _gpt_source(sizes: dict[str, int], batch: int | None) -> ModelSource:
    from fshard.testing.models import Block, TinyTransformer, TransformerSpec

    values = {**_GPT_DEFAULTS, **{k: v for k, v in sizes.items() if v is not None}}
    spec = TransformerSpec(
        vocab=values["vocab"], dim=values["dim"], heads=values["heads"], layers=values["layers"],
        seq=values["seq"], batch_size=batch or 8,
    )

    def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, spec.vocab, (spec.batch_size, spec.seq + 1))
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = model(batch[0])
        return nn.functional.cross_entropy(logits.float().reshape(-1, spec.vocab), batch[1].reshape(-1))

    name = "gpt (" + ", ".join(f"{k} {v}" for k, v in values.items()) + ")"
    return ModelSource(lambda: TinyTransformer(spec), name, by_class(Block), batch_fn, loss_fn)


def _transformers_source(path: str) -> ModelSource:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"MODEL {path!r} is a Transformers config, which needs the transformers package: "
            "pip install 'fshard[hf]'"
        ) from None
    if not os.path.isfile(path):
        raise ValueError(f"MODEL {path!r}: no such file")
    config = transformers.AutoConfig.from_pretrained(path)

    def factory() -> nn.Module:
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
            try:
                model: nn.Module = auto.from_config(config)
            except ValueError:
                continue
            return model.to(torch.float32)  # fp32 master weights (the config's dtype is the checkpoint's)
        raise ValueError(f"MODEL {path!r}: no Transformers model class for {type(config).__name__}")

    return ModelSource(factory, f"{type(config).__name__.removesuffix('Config')} ({os.path.basename(os.path.dirname(os.path.abspath(path))) or path})", None, None, None)


def load_policy(model: nn.Module, *, by_class_names: list[str] | None, min_params: int | None, config_file: str | None) -> tuple[Policy | None, dict[str, Any]]:
    """The policy (and, from a config file, ``mp``/``offload``/``reshard_after_forward``) the
    command line names."""
    if by_class_names:
        return by_class(*by_class_names), {}
    if min_params is not None:
        return by_size(min_params), {}
    if config_file is not None:
        cfg = load_config(config_file)
        extra: dict[str, Any] = {"mp": cfg.mp_policy, "offload": cfg.offload_params}
        extra["reshard_after_forward"] = cfg.sharding_strategy.name in ("FULL_SHARD", "HYBRID_SHARD")
        return cfg.wrap_policy(model), extra
    return None, {}


def write_json(e: Estimate, path: str) -> None:
    with open(path, "w") as f:
        json.dump(e.to_dict(), f, indent=2)
        f.write("\n")
