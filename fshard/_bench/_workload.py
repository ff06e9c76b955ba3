"""The model, batches, loss and units ``fshard bench`` runs: the built-in GPT or the user's.

[Note: the batch contract]
``--batch-fn MOD:FN``: ``FN(step, rank, device)`` returns this rank's batch for ``step``
(deterministic, so that every implementation trains on the same data):

- ``(inputs, target)``: the model is called as ``model(inputs)`` (``model(*inputs)`` when
  ``inputs`` is a tuple or list); the loss is ``cross_entropy`` of the output (flattened to
  ``(-1, classes)``) against an integer ``target``, else ``mse_loss`` against a float one.
- a dict: the model is called as ``model(**batch)`` and returns the loss, either a scalar tensor
  or an object with a ``loss`` attribute or key (Hugging Face models given ``labels``).

Tensors are moved to ``device`` if they are not on it already.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import fshard
from fshard._bench._gpt import GPT, Block, GPTConfig, gpt_batch
from fshard._bench._spec import BenchSpec, BenchUsageError

__all__ = ["Workload", "WrapPlan", "compute_loss", "default_units", "load_workload", "wrap_plan"]

BatchFn = Callable[[int, int, torch.device], Any]


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: BatchFn


@dataclass(frozen=True)
class WrapPlan:
    """The units (module FQNs, sharded in this order, then the root) and their settings, the
    same for fshard and FSDP2."""

    fqns: tuple[str, ...]
    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None


def resolve(ref: str, flag: str) -> Callable[..., Any]:
    """The callable ``pkg.module:name`` names; ``BenchUsageError`` saying what is missing."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BenchUsageError(
            f"{flag} {ref}: cannot import {module_name!r} ({exc}); run fshard bench from the "
            "directory that holds it, or put it on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise BenchUsageError(f"{flag} {ref}: {module_name} has no callable {attr!r}")
    return fn


def load_workload(spec: BenchSpec) -> Workload:
    if spec.model is None:
        cfg = GPTConfig(vocab=spec.vocab, seq=spec.seq, dim=spec.dim, heads=spec.heads, layers=spec.layers)

        def batch(step: int, rank: int, device: torch.device) -> Any:
            return gpt_batch(cfg, spec.batch, step, rank, device)

        return Workload(f"GPT {spec.layers}x{spec.dim}", lambda: GPT(cfg), batch)
    factory = resolve(spec.model, "--model")
    make_batch = resolve(spec.batch_fn or "", "--batch-fn")

    def make_model() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):
            raise BenchUsageError(f"--model {spec.model} returned a {type(model).__name__}, not an nn.Module")
        return model

    return Workload(spec.model, make_model, make_batch)


def default_units(model: nn.Module) -> list[str]:
    """One unit per block: the children of the model's largest ``nn.ModuleList`` (by
    parameters), or none (root only) when it has no ``nn.ModuleList``.

    Example:
        >>> from fshard._bench._gpt import GPT, GPTConfig
        >>> from fshard._bench._workload import default_units
        >>> default_units(GPT(GPTConfig(layers=2)))
        ['blocks.0', 'blocks.1']
    """
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return [f"{name}.{i}" for i, child in enumerate(blocks) if any(True for _ in child.parameters())]


def wrap_plan(spec: BenchSpec, model: nn.Module) -> WrapPlan:
    """The units for ``model`` from ``--by-class`` / ``--min-params`` / ``--config_file`` /
    the default, and the reshard and precision settings."""
    bf16 = torch.bfloat16 if spec.mp == "bf16" else None
    param_dtype, reduce_dtype = bf16, (torch.float32 if bf16 else None)
    raf = spec.reshard_after_forward
    if spec.config_file:
        cfg = fshard.load_config(spec.config_file)
        strategy = fshard.ShardingStrategy
        if cfg.sharding_strategy == strategy.NO_SHARD:
            raise BenchUsageError(f"--config_file {spec.config_file}: NO_SHARD is DDP; use --impl ddp")
        raf = cfg.sharding_strategy in (strategy.FULL_SHARD, strategy.HYBRID_SHARD)
        policy = cfg.wrap_policy(model)
        fqns = fshard.select_modules(model, policy) if policy is not None else []
        if cfg.mp_policy is not None:
            param_dtype = cfg.mp_policy.param_dtype
            reduce_dtype = cfg.mp_policy.reduce_dtype
    elif spec.by_class:
        fqns = fshard.select_modules(model, fshard.by_class(*spec.by_class))
    elif spec.min_params:
        fqns = fshard.select_modules(model, fshard.by_size(spec.min_params))
    elif spec.model is None:
        fqns = fshard.select_modules(model, fshard.by_class(Block))
    else:
        fqns = default_units(model)
    return WrapPlan(tuple(fqns), raf, param_dtype, reduce_dtype)


def _to_device(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def compute_loss(model: nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
    """The loss of ``model`` on ``batch`` (see [Note: the batch contract])."""
    batch = _to_device(batch, device)
    if isinstance(batch, dict):
        out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "fshard bench: with a dict batch the model must return the loss (a scalar "
                f"tensor, or an object with .loss); it returned {type(out).__name__}"
            )
        return loss
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            "fshard bench: the batch function must return (inputs, target) or a dict, got "
            f"{type(batch).__name__}"
        )
    inputs, target = batch
    out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
    if not isinstance(out, torch.Tensor):
        out = getattr(out, "logits", None)
        if not isinstance(out, torch.Tensor):
            raise TypeError("fshard bench: with (inputs, target) the model must return a tensor (or .logits)")
    if target.is_floating_point():
        return F.mse_loss(out.float(), target.float())
    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())
