"""HuggingFace ``transformers`` models on fshard: load, save and train with the ``Trainer``.

Needs the ``hf`` extra (``pip install 'fshard[hf]'``: transformers and accelerate, at the versions
pinned there). ``import fshard`` does not import this module; ``import fshard.hf`` does.

- ``fshard.hf.from_pretrained(cls, path, ...)``: rank 0 reads the weights with ``from_pretrained``,
  the other ranks build the same architecture on the meta device, the model is sharded (by block
  class or by an accelerate config file) and rank 0's weights are broadcast, one parameter at a
  time ([Note: loading on rank 0 only]).
- ``fshard.hf.save_pretrained(model, path)``: every rank calls it; the weights are gathered one
  parameter at a time and rank 0 writes what ``model.save_pretrained`` writes for an unsharded
  model ([Note: saving what save_pretrained writes]).
- ``fshard.hf.Trainer``: ``transformers.Trainer`` training an fshard-sharded model
  ([Note: the Trainer on fshard]).

Calling ``model.save_pretrained`` itself on a model that ``fshard.hf`` sharded raises an error
naming ``fshard.hf.save_pretrained`` before anything is written ([Note: the one-rank
save_pretrained]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fshard
from fshard import _collectives

try:
    import transformers
    from accelerate.optimizer import (  # type: ignore[import-untyped]  # accelerate ships no types
        AcceleratedOptimizer,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"fshard.hf needs transformers and accelerate ({exc.name} is missing): "
        "pip install 'fshard[hf]'"
    ) from exc

__all__ = ["Trainer", "from_pretrained", "guard_save_pretrained", "save_pretrained"]

logger = logging.getLogger("fshard")

# Where the Trainer's checkpoints keep the model and optimizer shards (fshard.checkpoint.save),
# next to the Trainer's own scheduler / RNG / trainer_state files.
CHECKPOINT_DIR = "fshard_checkpoint"
# Set by `fshard launch --config_file F` to F.
CONFIG_ENV = "FSHARD_CONFIG_FILE"


def _require_dist(where: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where} is collective: initialise the default process group first "
            "(torch.distributed.init_process_group, or start the script with fshard launch / "
            "torchrun)"
        )
    return dist.get_rank(), dist.get_world_size()


def _agree(error: str | None, where: str) -> None:
    """Rank 0's ``error`` (or ``None``) raised on every rank: the other ranks would otherwise
    wait in the next collective for a rank 0 that has left."""
    error = _collectives.broadcast_objects(error, 0, None, label=where)
    if error is not None:
        raise RuntimeError(f"{where}: {error}\n(found on rank 0; every rank raises this error)")


# ------------------------------------------------------------------------------------ loading

# [Note: loading on rank 0 only]
# Rank 0 reads the checkpoint with the class's own from_pretrained (every transformers feature of
# loading applies there: key renames, dtype="auto", generation config). It then sends the other
# ranks what they need to build the *same* module tree on the meta device: the model class, its
# config and generation config, train/eval mode and each tensor's dtype (from_pretrained may keep
# some modules in fp32, or load in the checkpoint's dtype). No rank but 0 ever holds a full copy
# of the model. After sharding, each meta parameter gets storage for its shard only and rank 0
# scatters each parameter's rows (fshard.load_state_dict(..., broadcast_from_rank0=True)); the
# non-persistent buffers (rotary tables), which no state dict holds, come from rank 0's model too.
# Tied parameters (lm_head tied to the input embedding) are one Parameter object on every rank
# (post_init ties them on the meta device), so they are one sharded parameter and stay tied.


@dataclasses.dataclass(frozen=True)
class _Blueprint:
    """What rank 0 sends for the other ranks to build the model on the meta device."""

    cls: type[nn.Module]
    config: Any
    generation_config: Any
    training: bool
    dtypes: dict[str, torch.dtype]


def from_pretrained(
    model_cls: Any,
    path: str | os.PathLike[str],
    *,
    mesh: DeviceMesh | None = None,
    config_file: Mapping[str, Any] | str | os.PathLike[str] | fshard.FSDPConfig | None = None,
    by_class: Iterable[type[nn.Module] | str] | None = None,
    mp_policy: fshard.MixedPrecision | None = None,
    offload_policy: fshard.CPUOffload | None = None,
    reshard_after_forward: bool | int = True,
    **hf_kwargs: Any,
) -> Any:
    """Load a pretrained transformers model, sharded, with the weights read on rank 0 only.

    Collective: every rank calls it. ``model_cls`` is a model class or an auto class
    (``AutoModelForCausalLM``); ``path`` a directory written by ``save_pretrained`` (or a hub id
    rank 0 can reach); ``hf_kwargs`` go to rank 0's ``model_cls.from_pretrained``. Ranks 1..N-1
    build the same architecture on the meta device and never hold more than their shards plus
    one parameter's rows in flight. The model is sharded either by ``config_file`` (anything
    ``fshard.load_config`` takes; applied with ``fshard.from_config``, its weights broadcast as
    ``fsdp_cpu_ram_efficient_loading`` does; by default the file ``fshard launch --config_file``
    names, unless any of ``mesh``, ``by_class``, ``mp_policy``, ``offload_policy`` is given) or
    else one unit per block class (``by_class``,
    default: the model's ``_no_split_modules``, as accelerate's TRANSFORMER_BASED_WRAP) then
    the root, with ``mesh``, ``mp_policy``, ``offload_policy`` and ``reshard_after_forward``
    as ``fshard.fully_shard`` takes them. Tied weights stay tied. Calling ``save_pretrained``
    on the returned model raises an error pointing at ``fshard.hf.save_pretrained``.

    Example:
        >>> from transformers import AutoModelForCausalLM                      # doctest: +SKIP
        >>> model = fshard.hf.from_pretrained(AutoModelForCausalLM, "my-llama")  # doctest: +SKIP
        >>> model = fshard.hf.from_pretrained(                                 # doctest: +SKIP
        ...     AutoModelForCausalLM, "my-llama", config_file="fsdp.yaml")
    """
    where = "fshard.hf.from_pretrained"
    rank, _ = _require_dist(where)
    by_hand = (mesh, by_class, mp_policy, offload_policy)
    if config_file is None and all(x is None for x in by_hand) and os.environ.get(CONFIG_ENV):
        config_file = os.environ[CONFIG_ENV]  # fshard launch --config_file names it
    if config_file is not None and (
        mesh is not None
        or by_class is not None
        or mp_policy is not None
        or offload_policy is not None
    ):
        raise ValueError(
            f"{where}: config_file sets the mesh, the units, mixed precision and offload; pass "
            "either config_file or mesh / by_class / mp_policy / offload_policy, not both"
        )
    # Read before rank 0 spends time loading: a bad file fails at once, on every rank.
    cfg = None if config_file is None else fshard.load_config(config_file)
    model: nn.Module | None = None
    blueprint: _Blueprint | None = None
    error: str | None = None
    if rank == 0:
        try:
            model = model_cls.from_pretrained(path, **hf_kwargs)
            blueprint = _blueprint_of(model)
        except Exception as exc:  # agreed on below, so no rank is left waiting
            error = f"rank 0 could not load {os.fspath(path)!r}: {type(exc).__name__}: {exc}"
    _agree(error, where)
    blueprint = _collectives.broadcast_objects(blueprint, 0, None, label=f"{where}: blueprint")
    if model is None:
        model = _build_on_meta(blueprint)
    if cfg is not None:
        if not cfg.syncs_module_states:  # the other ranks have no weights: rank 0's are sent
            cfg = dataclasses.replace(cfg, cpu_ram_efficient_loading=True)
        fshard.from_config(model, cfg)  # shards, then broadcasts rank 0's weights
    else:
        rank0_state = model.state_dict() if rank == 0 else {}
        fshard.auto_shard(
            model,
            policy=_block_policy(model, by_class),
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
        _load_from_rank0(model, rank0_state)
    guard_save_pretrained(model)
    return model


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _blueprint_of(model: nn.Module) -> _Blueprint:
    return _Blueprint(
        cls=type(model),
        config=getattr(model, "config", None),
        generation_config=getattr(model, "generation_config", None),
        training=model.training,
        dtypes={name: t.dtype for name, t in _named_tensors(model)},
    )


def _build_on_meta(blueprint: _Blueprint) -> nn.Module:
    """The model rank 0 loaded, built from its config on the meta device (no weights)."""
    cls: Any = blueprint.cls
    with torch.device("meta"):
        model: nn.Module = cls._from_config(blueprint.config)
    if blueprint.generation_config is not None:
        model.generation_config = blueprint.generation_config
    model.train(blueprint.training)
    # Each tensor in rank 0's dtype (meta tensors: no data to convert). A tied parameter is
    # reached under each of its names and converted once, so it stays one object.
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                want = blueprint.dtypes.get(f"{prefix}.{name}" if prefix else name)
                if tensor is not None and want is not None and tensor.dtype != want:
                    tensor.data = tensor.data.to(want)
    return model


def _block_policy(model: nn.Module, classes: Iterable[type[nn.Module] | str] | None) -> Any:
    names = (
        list(classes)
        if classes is not None
        else list(getattr(model, "_no_split_modules", None) or ())
    )
    if not names:
        raise ValueError(
            f"fshard.hf.from_pretrained: {type(model).__name__} has no _no_split_modules; name its "
            "block class(es) with by_class=[...] (e.g. by_class=['LlamaDecoderLayer'])"
        )
    return fshard.by_class(*names).resolve(model)


def _load_from_rank0(model: nn.Module, rank0_state: Mapping[str, torch.Tensor]) -> None:
    """Rank 0's weights into every rank's shards (see [Note: loading on rank 0 only]): the
    load gives the meta ranks' shards storage itself, running no initialiser."""
    fshard.load_state_dict(model, rank0_state, broadcast_from_rank0=True)


# ------------------------------------------------------------------------------------- saving

# [Note: saving what save_pretrained writes]
# fshard.full_state_dict gathers one parameter at a time onto rank 0's CPU (a tied parameter is
# one tensor under both of its keys), and rank 0 then calls transformers' own save_pretrained
# with that dict (the class's method: the instance's is the guard below). So the files are
# exactly transformers': config.json, generation_config.json for models that generate,
# model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json above
# max_shard_size, tied weights once (transformers drops aliases by storage), key renames
# reverted. One fix-up: the index's metadata.total_parameters counts the parameters of the
# model it saves from, which on a sharded model are this rank's shards; it is rewritten with
# the full count.


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    **hf_kwargs: Any,
) -> None:
    """Write a sharded transformers model as ``save_pretrained`` writes the unsharded one.

    Collective: every rank calls it, with the same directory. The weights are gathered one
    parameter at a time onto rank 0's CPU and rank 0 writes ``config.json``,
    ``generation_config.json`` (models that generate) and the safetensors weights: one
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files and
    ``model.safetensors.index.json`` above ``max_shard_size``, tied weights once. The result
    loads with ``from_pretrained`` into a plain model. ``hf_kwargs`` go to transformers'
    ``save_pretrained`` (``variant``...). transformers 5 writes safetensors only, so
    ``safe_serialization=False`` is an error. If rank 0 fails to write, every rank raises.

    Example:
        >>> fshard.hf.save_pretrained(model, "out/my-model")   # every rank  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("out/my-model")  # later, unsharded  # doctest: +SKIP
    """
    where = "fshard.hf.save_pretrained"
    rank, _ = _require_dist(where)
    if not safe_serialization:
        raise ValueError(
            f"{where}: safe_serialization=False is not available: transformers "
            f"{transformers.__version__} writes safetensors files only"
        )
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"{where} expects a transformers PreTrainedModel, got {type(model).__name__}"
        )
    full = fshard.full_state_dict(model)  # collective; rank 0 gets the tensors, others {}
    error = None
    if rank == 0:
        try:
            type(model).save_pretrained(  # the class's method: the instance's is the guard
                model, save_directory, state_dict=full, max_shard_size=max_shard_size, **hf_kwargs
            )
            _fix_index_total(model, os.fspath(save_directory), hf_kwargs.get("variant"))
        except Exception as exc:
            error = (
                f"rank 0 could not write {os.fspath(save_directory)!r}: {type(exc).__name__}: {exc}"
            )
    del full
    _agree(error, where)


def _fix_index_total(model: nn.Module, directory: str, variant: str | None) -> None:
    """The index's ``total_parameters`` of the full model (see [Note: saving what
    save_pretrained writes])."""
    name = "model.safetensors.index.json"
    if variant:
        name = f"model.safetensors.index.{variant}.json"
    index_path = os.path.join(directory, name)
    if not os.path.isfile(index_path):
        return
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    total = sum(
        p.full_shape.numel() if fshard.is_sharded(p) else p.numel() for p in model.parameters()
    )
    index.setdefault("metadata", {})["total_parameters"] = total
    with open(index_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


# [Note: the one-rank save_pretrained]
# model.save_pretrained on a sharded model would save this rank's shards as if they were the
# weights (transformers fails on them with a storage error, after writing config.json). The
# usual script calls it on rank 0 only ("if rank == 0: model.save_pretrained(...)"), so the
# right save (a collective) cannot be run instead: the other ranks are not in it and would not
# come. fshard.hf therefore replaces the method on each model it shards (an instance
# attribute: the class and unsharded models are untouched) with one that raises at once, before
# anything is written, naming fshard.hf.save_pretrained. Only the ranks that made the call can
# raise: telling the others would need a collective they are not in.


def guard_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(...)`` raise an error naming ``fshard.hf.save_pretrained``.

    ``fshard.hf.from_pretrained`` and ``fshard.hf.Trainer`` call it on the models they shard;
    call it on a model you sharded yourself (``fshard.from_config``, ``fshard.auto_shard``).

    Example:
        >>> fshard.from_config(model, "fsdp.yaml")     # doctest: +SKIP
        >>> fshard.hf.guard_save_pretrained(model)     # doctest: +SKIP
        >>> model.save_pretrained("out")               # doctest: +SKIP
        Traceback (most recent call last):
        RuntimeError: model.save_pretrained cannot save a model sharded by fshard ...
    """
    if hasattr(model, "save_pretrained"):
        # An instance attribute, past nn.Module.__setattr__ (typed for tensors and modules).
        refuse = functools.partial(_refuse_save_pretrained, type(model).__name__)
        object.__setattr__(model, "save_pretrained", refuse)


def _refuse_save_pretrained(cls_name: str, *args: Any, **kwargs: Any) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    raise RuntimeError(
        f"[rank {rank}] {cls_name}.save_pretrained cannot save a model sharded by fshard: each "
        "rank holds only its shards of the weights. Call fshard.hf.save_pretrained(model, "
        "path) on every rank instead (not only on rank 0): it gathers one parameter at a time "
        "and rank 0 writes the files. Nothing was written."
    )


# ------------------------------------------------------------------------------------- Trainer

# [Note: the Trainer on fshard]
# transformers.Trainer (5.x) runs on accelerate: Accelerator.prepare wraps the model in DDP (or
# accelerate's FSDP when TrainingArguments.fsdp is set) and Accelerator.clip_grad_norm_ clips.
# fshard.hf.Trainer keeps the Trainer's loop (gradient accumulation, logging, evaluation,
# callbacks, save_steps, resume) and changes only the extension points that touch the model:
# - __init__ shards the model before the Trainer sees it (fshard.from_config with the FSDP
#   config: TrainingArguments.fsdp_config when args.fsdp is set, else the accelerate config file
#   of `fshard launch --config_file`, or fshard_config=), and the Accelerator is created without
#   accelerate's FSDP plugin;
# - the Accelerator's prepare_model returns the sharded model as it is (no DDP: fshard reduces
#   the gradients) and its clip_grad_norm_ is fshard.clip_grad_norm_ (the norm of the full
#   gradient; torch's would clip each rank by its own shards' norm);
# - save_model writes with fshard.hf.save_pretrained; a save_steps checkpoint keeps model and
#   optimizer in CHECKPOINT_DIR (fshard.checkpoint.save) beside the Trainer's scheduler, RNG and
#   trainer_state files (and the full weights too when fsdp_state_dict_type is FULL_STATE_DICT);
#   resume_from_checkpoint reads it with fshard.checkpoint.load, at any world size.
# Micro-batches before the last of an accumulation window reduce their gradients too (the
# Trainer's no_sync is accelerate's, which only DDP honours): the result is the same, at the
# cost of one reduce-scatter per micro-batch.


def _trainer_config(args: Any, given: Any, *, required: bool = True) -> fshard.FSDPConfig | None:
    """The FSDP config the Trainer applies (see ``Trainer``); ``None`` if there is none and
    ``required`` is false."""
    if given is not None:
        return fshard.load_config(given)
    if getattr(args, "fsdp", None):
        block = dict(args.fsdp_config or {})
        if "mixed_precision" not in block and (args.bf16 or args.fp16):
            block["mixed_precision"] = "bf16" if args.bf16 else "fp16"
        return fshard.load_config(block)
    if os.environ.get(CONFIG_ENV):
        return fshard.load_config(None)
    if not required:
        return None
    raise ValueError(
        "fshard.hf.Trainer needs an FSDP config: set fsdp=True and fsdp_config={...} in "
        "TrainingArguments, start the script with `fshard launch --config_file fsdp.yaml`, or "
        "pass fshard_config= (a dict, a YAML path or an fshard.FSDPConfig)"
    )


@contextlib.contextmanager
def _without_accelerate_fsdp(args: Any) -> Iterator[None]:
    """Create the Accelerator without accelerate's FSDP (fshard shards the model instead)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    env = os.environ.pop("ACCELERATE_USE_FSDP", None)
    args.fsdp_plugin_args = None
    try:
        yield
    finally:
        args.fsdp_plugin_args = plugin_args
        if env is not None:
            os.environ["ACCELERATE_USE_FSDP"] = env


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains an fshard-sharded model; use it in its place.

    Takes the Trainer's arguments, plus ``fshard_config`` (anything ``fshard.load_config``
    takes). The FSDP config is, in order: ``fshard_config``, ``TrainingArguments(fsdp=True,
    fsdp_config={...})`` (the Trainer's own keys; ``bf16``/``fp16`` give mixed precision), or
    the accelerate config file of ``fshard launch --config_file``. A model not sharded yet is
    sharded with ``fshard.from_config``; one from ``fshard.hf.from_pretrained`` is used as it
    is (then the config, its own or one of the above, says only how checkpoints are written). It
    needs a distributed run (``TrainingArguments(use_cpu=True)`` without CUDA). The loop is the Trainer's: gradient accumulation, ``max_grad_norm`` clipping (by the
    full gradient's norm, ``fshard.clip_grad_norm_``), logging, evaluation, callbacks.
    ``save_model`` writes with ``fshard.hf.save_pretrained``; ``save_steps`` checkpoints hold
    the model and optimizer shards (``fshard.checkpoint``, in ``fshard_checkpoint/``) with the
    Trainer's scheduler, RNG and state files, and ``train(resume_from_checkpoint=...)`` resumes
    from them at any world size. See [Note: the Trainer on fshard].

    Example:
        >>> from fshard.hf import Trainer            # instead of transformers' Trainer  # doctest: +SKIP
        >>> args = TrainingArguments("out", fsdp=True,                                # doctest: +SKIP
        ...     fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
        >>> Trainer(model=model, args=args, train_dataset=ds).train()                # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *rest: Any,
        fshard_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None or args is None:
            raise TypeError(
                "fshard.hf.Trainer needs model= and args= (model_init is not supported)"
            )
        _ = args.device  # sets up the process group (accelerate's PartialState) under torchrun
        _, world = _require_dist("fshard.hf.Trainer")
        if world > 1 and args.parallel_mode != transformers.training_args.ParallelMode.DISTRIBUTED:
            # Each rank would train on the whole data set and log and save as rank 0.
            if "LOCAL_RANK" not in os.environ:
                fix = "start the script with fshard launch or torchrun (which set LOCAL_RANK)"
            else:
                fix = "without CUDA, pass TrainingArguments(use_cpu=True)"
            raise ValueError(
                f"fshard.hf.Trainer: the job has {world} ranks but TrainingArguments run "
                f"{args.parallel_mode.name}, not DISTRIBUTED (every rank would train on all the "
                f"data and save as rank 0); transformers runs distributed only when {fix}"
            )
        self.fshard_config: fshard.FSDPConfig
        cfg: fshard.FSDPConfig | None
        if any(fshard.is_sharded(p) for p in model.parameters()):
            # Sharded already: the config only says how checkpoints are written.
            cfg = fshard.config_of(model) or _trainer_config(args, fshard_config, required=False)
            self.fshard_config = cfg or fshard.load_config({})
        else:
            self.fshard_config = fshard.load_config(_trainer_config(args, fshard_config))
            fshard.from_config(model, self.fshard_config)
        guard_save_pretrained(model)
        super().__init__(model, args, *rest, **kwargs)

    # -------------------------------------------------------------- model and accelerator

    def create_accelerator_and_postprocess(self) -> None:
        with _without_accelerate_fsdp(self.args):
            super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        prepare_model = accelerator.prepare_model

        def prepare_sharded(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            if not any(fshard.is_sharded(p) for p in model.parameters()):
                return prepare_model(model, *args, **kwargs)
            if model not in accelerator._models:
                accelerator._models.append(model)
            return model  # no DDP: fshard reduce-scatters the gradients

        def clip_grad_norm_(
            parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
        ) -> torch.Tensor:
            accelerator.unscale_gradients()
            return fshard.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

        accelerator.prepare_model = prepare_sharded
        accelerator.clip_grad_norm_ = clip_grad_norm_

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not any(fshard.is_sharded(p) for p in model.parameters()):
            super()._move_model_to_device(model, device)
        # A sharded model stays where fshard put it (its mesh's device, or CPU with offload).

    # ---------------------------------------------------------------------------- saving

    @property
    def _sharded(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("fshard.hf.Trainer: the trainer has no model")
        return self.model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as ``save_pretrained`` writes it (every rank calls it, as in the Trainer)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if output_dir is None:
            raise ValueError(
                "fshard.hf.Trainer.save_model: no output_dir given or in the arguments"
            )
        if _internal_call:  # from _save_checkpoint: see _save_optimizer_and_scheduler
            if self.args.save_only_model:
                fshard.checkpoint.save(os.path.join(output_dir, CHECKPOINT_DIR), self._sharded)
            if self.fshard_config.state_dict_type != "FULL_STATE_DICT":
                return
        save_pretrained(self._sharded, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        path = os.path.join(output_dir, CHECKPOINT_DIR)
        fshard.checkpoint.save(path, self._sharded, _unwrapped(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    # -------------------------------------------------------------------------- resuming

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        path = os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ValueError(
                f"fshard.hf.Trainer: {resume_from_checkpoint!r} has no {CHECKPOINT_DIR}/: resume "
                "from a checkpoint that fshard.hf.Trainer wrote (save_steps / save_strategy)"
            )
        fshard.checkpoint.load(path, self._sharded if model is None else model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        fshard.checkpoint.load(path, self._sharded, _unwrapped(self.optimizer))
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
