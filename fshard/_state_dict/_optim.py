"""Optimizer state dicts of sharded models: saving (sharded or full) and loading.

State is keyed by parameter name, so it loads at any mesh shape; shard-shaped state is a
DTensor laid out like its parameter. The checks of a state dict before a load are in
``_optim_checks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fshard import _collectives
from fshard._errors import ProblemList, internal_error
from fshard._mesh import in_src_row, replicate_src, src_rank
from fshard._param import ParamSlot, local_rows
from fshard._runtime._optim_hooks import check_optimizer_state, never_stepped
from fshard._state_dict._common import (
    Entry,
    LoadResult,
    broadcast_full,
    broadcast_meta,
    gather_full,
    meta_value_problems,
    model_entries,
    param_names,
    plain_value,
    ranks_agree,
    root_info,
    scatter_rows,
)
from fshard._state_dict._optim_checks import (
    OPTIMIZER_CLASS_KEY,
    OTHER_CLASS_HINT,
    STRICT_HINT,
    SavedOptim,
    check_recorded_class,
    check_state_shapes,
    check_unrecorded_kind,
    class_name,
    hyperparameters_of,
    match_groups,
    meta_state,
    saved_by_name,
)
from fshard._unit._module_state_dict import as_dtensor, full_tensor, same_layout

__all__ = ["load_optim_state_dict", "optim_state_dict"]

logger = logging.getLogger("fshard")


def _optim_params(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [list(group["params"]) for group in optim.param_groups]


def _is_shard_shaped(value: Any, slot: ParamSlot | None) -> bool:
    return (
        slot is not None
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == slot.layout.local_shape
        and value.dim() == len(slot.layout.full_shape)
    )


def _is_unsupported_state(value: Any, slot: ParamSlot | None) -> bool:
    """A non-scalar state tensor of a sharded param that is not shaped like its shard."""
    return (
        slot is not None
        and not slot.layout.replicated
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() > 0
    )


def _check_saved_state(
    optim: torch.optim.Optimizer, by_param: dict[int, tuple[str, ParamSlot | None]], where: str
) -> None:
    """Refuse state that ``optim_state_dict`` cannot save: tensors of a sharded parameter that
    are neither shaped like this rank's shard nor scalars (factored state, such as Adafactor's).

    Some of it is shaped like the shard on some ranks only (Adafactor's ``(1, 1)`` column
    statistics of a ``(3, 1)`` parameter, on the rank whose shard is ``(1, 1)``), so the caller
    makes the ranks agree ([Note: ranks agree on errors]).
    """
    problems = ProblemList(where)
    seen: set[str] = set()
    for params in _optim_params(optim):
        for p in params:
            name, slot = by_param[id(p)]
            if p not in optim.state or name in seen or slot is None:
                continue
            seen.add(name)
            for key, value in optim.state[p].items():
                if not _is_shard_shaped(value, slot) and _is_unsupported_state(value, slot):
                    problems.add(
                        f"state[{name!r}][{key!r}] of {type(optim).__name__} has shape "
                        f"{list(value.shape)}, neither this rank's shard of the parameter "
                        f"{list(slot.layout.local_shape)} on rank {dist.get_rank()} nor a scalar"
                    )
    problems.raise_if_any(
        ValueError,
        hint=(
            "fshard saves optimizer state shaped like the parameter plus scalars (factored state "
            "such as Adafactor's is not supported on sharded parameters): use an elementwise "
            "optimizer (SGD, Adam, AdamW, ...) for sharded parameters."
        ),
    )


def _named_params(
    model: nn.Module, optim: torch.optim.Optimizer, where: str
) -> tuple[list[list[tuple[str, ParamSlot | None]]], list[Entry]]:
    entries = model_entries(model, where)
    names = param_names(entries)
    problems = ProblemList(where)
    groups: list[list[tuple[str, ParamSlot | None]]] = []
    for g_index, params in enumerate(_optim_params(optim)):
        group = []
        for p_index, p in enumerate(params):
            named = names.get(id(p))
            if named is None:
                problems.add(
                    f"param_groups[{g_index}]['params'][{p_index}] (shape {list(p.shape)}) is not a "
                    "parameter of the model"
                )
                continue
            group.append(named)
        groups.append(group)
    problems.raise_if_any(
        ValueError, hint="Build the optimizer from model.parameters() of the sharded model."
    )
    return groups, entries


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    full: bool = False,
    rank0_only: bool = False,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, ``{"state": {name: {...}}, "param_groups"}``.

    Tensors shaped like a parameter's shard (Adam's ``exp_avg``, SGD's ``momentum_buffer``) are
    DTensors laid out like the parameter; other state (Adam's ``step``) is kept as it is, as
    replicated values. ``param_groups`` keep their hyperparameters, with ``params`` listing
    parameter names. With ``full=True`` shard-shaped state is gathered (one tensor at a time) into
    full CPU tensors, on every rank or, with ``rank0_only``, on rank 0 only (``{}`` elsewhere).
    A third key, ``"optimizer_class"``, names the optimizer's class
    (``"torch.optim.adamw.AdamW"``), so that ``load_optim_state_dict`` refuses to load the state
    into another kind of optimizer (torch's ``Optimizer.load_state_dict`` ignores the key).

    Collective, in both forms: every rank of the mesh calls it (the ranks agree on any error
    before returning), so not under ``if rank == 0:``. In the sharded form every trainable
    parameter has state: one the optimizer has no state for yet (none has, before the first
    step; a parameter that never got a gradient) gets the state a fresh optimizer starts its
    first step from (``step`` 0), as torch's ``get_optimizer_state_dict`` gives one step's. So
    a fresh run's dict serves as the template ``torch.distributed.checkpoint.load`` reads a
    checkpoint into, and checkpoints have every key such a template asks for. The optimizer
    itself is left as it is.

    Example:
        >>> osd = fshard.optim_state_dict(model, opt)          # doctest: +SKIP
        >>> osd["state"]["layers.0.weight"]["exp_avg"]         # doctest: +SKIP
        DTensor(local_tensor=..., placements=(Shard(dim=0),))
        >>> osd["optimizer_class"]                             # doctest: +SKIP
        'torch.optim.adamw.AdamW'
    """
    return optim_state(model, optim, full=full, rank0_only=rank0_only, placeholder=True)


def optim_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    full: bool,
    rank0_only: bool,
    placeholder: bool,
) -> dict[str, Any]:
    """``optim_state_dict``; without ``placeholder`` an optimizer that has not stepped gives
    an empty state (what a checkpoint saves: the next step starts it as a fresh one would)."""
    where = "fshard.optim_state_dict"
    info = root_info(model, where)
    # The ranks agree before any gather, and before the caller's next collective (a checkpoint's
    # broadcast): see [Note: ranks agree on errors].
    with ranks_agree(info, where):
        named_groups, entries = _named_params(model, optim, where)
        check_optimizer_state(optim)  # state made before fully_shard: sharded now, or an error
        by_param: dict[int, tuple[str, ParamSlot | None]] = {}
        for params, named in zip(_optim_params(optim), named_groups, strict=True):
            for p, n in zip(params, named, strict=True):
                by_param[id(p)] = n
        _check_saved_state(optim, by_param, where)
    keep = not rank0_only or dist.get_rank() == src_rank(info)
    states: Mapping[torch.Tensor, Mapping[str, Any]] = optim.state
    if placeholder and not full:
        made = _placeholder_state(optim)
        if made:
            states = {**optim.state, **made}
    state: dict[str, dict[str, Any]] = {}
    # In the model's order, not the param groups' (which may differ between ranks: a
    # set of parameters): with ``full`` the ranks gather one tensor at a time, in step.
    position = {e.key: i for i, e in enumerate(entries)}
    held = [p for params in _optim_params(optim) for p in params if p in states]
    held.sort(key=lambda p: position.get(by_param[id(p)][0], len(position)))
    for p in held:
        name, slot = by_param[id(p)]
        if name in state:
            continue
        out: dict[str, Any] = {}
        for key, value in states[p].items():
            if _is_shard_shaped(value, slot):
                assert_slot: ParamSlot = slot  # type: ignore[assignment]  # checked above
                if full:
                    gathered = gather_full(
                        assert_slot,
                        value,
                        rank0_only=rank0_only,
                        label=f"optim_state_dict({name}.{key})",
                    )
                    if gathered is not None:
                        out[key] = gathered.cpu()
                else:
                    out[key] = as_dtensor(assert_slot, value)
            elif isinstance(value, torch.Tensor) and full:
                out[key] = value.detach().to("cpu", copy=True)  # a snapshot, as gathered ones
            else:
                out[key] = value
        state[name] = out
    if not keep:
        return {}
    param_groups = []
    for group, named in zip(optim.param_groups, named_groups, strict=True):
        copy = {k: v for k, v in group.items() if k != "params"}
        copy["params"] = [n for n, _ in named]
        param_groups.append(copy)
    return {"state": state, "param_groups": param_groups, OPTIMIZER_CLASS_KEY: class_name(optim)}


def _placeholder_state(optim: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The state of a fresh optimizer for each trainable parameter ``optim`` holds no state
    for, leaving ``optim`` as it is: tensors for ``torch.distributed.checkpoint.load`` to read
    a checkpoint into.

    An empty state would make the DCP resume recipe (template, ``dcp.load``, then
    ``load_optim_state_dict``) load no optimizer state at all, silently: Adam's moments and step
    start again. So the optimizer's own step (not its hooks: an EMA post-hook must not see it)
    runs once over those parameters only, with zero gradients, the learning rates and weight
    decays at 0 (the params do not change); the state it made is taken out again, with the
    gradients and the groups restored, and set back to what the first step starts from
    (``_as_fresh``), so a checkpoint saved before any step resumes as a fresh run would. A run
    whose optimizer has stepped gets such entries for the parameters that never had a
    gradient (a pooler an MLM loss does not use), so its checkpoints have the keys a fresh
    run's template asks for. An optimizer without ``lr`` in every group, or whose step needs a
    closure (LBFGS), gets none.
    """
    groups = optim.param_groups
    chosen = [[p for p in g["params"] if p.requires_grad and p not in optim.state] for g in groups]
    if not any(chosen) or any("lr" not in g for g in groups):
        return {}
    saved_params: list[list[torch.Tensor]] = []
    saved_hyper: list[dict[str, Any]] = []
    saved_grads = []
    for group, params in zip(groups, chosen, strict=True):
        saved_params.append(group["params"])
        group["params"] = params
        saved_hyper.append({k: group[k] for k in ("lr", "weight_decay") if k in group})
        for k, v in saved_hyper[-1].items():
            if isinstance(v, torch.Tensor):
                group[k] = torch.zeros_like(v)
            elif isinstance(v, (int, float)):
                group[k] = 0.0
        for p in params:
            saved_grads.append((p, p.grad))
            p.grad = torch.zeros_like(p)
    step = type(optim).step
    step = getattr(step, "__wrapped__", step)  # torch's wrapper runs the step hooks
    made: dict[torch.Tensor, dict[str, Any]] = {}
    failed = False
    try:
        step(optim)
    except Exception as exc:  # a step that needs a closure (LBFGS): no placeholder
        logger.debug("fshard: no placeholder optimizer state (%s: %s)", type(exc).__name__, exc)
        failed = True
    finally:
        for group, params, hyper in zip(groups, saved_params, saved_hyper, strict=True):
            for p in group["params"]:  # only these can have state made here
                per = optim.state.pop(p, None)
                if per and not failed:
                    made[p] = _as_fresh(optim, per, hyper)
            group["params"] = params
            group.update(hyper)
        for p, grad in saved_grads:
            p.grad = grad
    return made


def _as_fresh(
    optim: torch.optim.Optimizer, state: Mapping[str, Any], hyper: Mapping[str, Any]
) -> dict[str, Any]:
    """One step's state, with zero gradients at learning rate 0, set back to what the first
    step starts from: ``step`` 0 (Adam, RMSprop, Adadelta, Adamax, RAdam, Adagrad then step
    exactly as fresh ones), and for torch's optimizers whose state starts from the learning
    rate or from 1, those values (Rprop's ``step_size``, ASGD's ``eta``, ``mu`` and ``ax``,
    NAdam's ``mu_product``). SGD's momentum buffer stays zeros: a fresh SGD copies the first
    gradient instead, which is the same unless ``dampening`` is set."""
    out = dict(state)
    if "step" in out:
        value = out["step"]
        out["step"] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
    lr = float(hyper.get("lr", 0.0))
    kind = type(optim)
    fresh: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    if kind is torch.optim.Rprop:
        fresh = {"step_size": lambda t: torch.full_like(t, lr), "prev": torch.zeros_like}
    elif kind is torch.optim.ASGD:
        fresh = {
            "eta": lambda t: torch.full_like(t, lr),
            "mu": torch.ones_like,
            "ax": torch.zeros_like,
        }
    elif kind is torch.optim.NAdam:
        fresh = {"mu_product": torch.ones_like}
    for key, make in fresh.items():
        if isinstance(out.get(key), torch.Tensor):
            out[key] = make(out[key])
    return out


def load_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> LoadResult:
    """Load an optimizer state dict (sharded or full, from any mesh) into ``optim``.

    ``state_dict`` is keyed by parameter name (``fshard.optim_state_dict``, of this run or of
    another mesh), or it is a plain ``opt.state_dict()`` of an unsharded run, keyed by position
    (state ``0..n-1``, ``param_groups[i]["params"]`` lists of ints). Positions are mapped to this
    optimizer's parameters in param-group order, as ``torch.optim.Optimizer.load_state_dict``
    does, so build the optimizer with the same groups, in the same order, as the run that saved
    it; the group count and sizes must match.

    The saved ``param_groups`` must hold the same parameter names as ``optim``'s groups (in any
    order); their hyperparameters are restored. DTensor state is resharded to this rank's shard,
    full tensors shaped like a parameter are sliced, other values are loaded as they are. State
    of another optimizer class is refused, naming both classes: by the ``"optimizer_class"`` that
    ``fshard.optim_state_dict`` records, and, for state dicts without it, by comparing each
    parameter's state keys with the ones this optimizer makes (for ``torch.optim``'s classes).

    With ``strict=False`` (for a model that gained or lost parameters) only the state of the
    parameters both sides hold is loaded: saved state of parameters the optimizer does not hold
    is skipped, and parameters that no saved group lists keep their current state (none, for a
    fresh optimizer). Each of ``optim``'s groups takes the hyperparameters of the saved group
    that lists its parameters; a group none of whose parameters were saved keeps its own, and a
    group whose parameters were saved in different groups is an error. Shape mismatches and
    another optimizer class are errors either way. The skipped names come back in a
    ``LoadResult``: ``missing_keys`` (held, not saved) and ``unexpected_keys`` (saved, not held).

    A saved state of zero steps (``step`` 0: the entry ``optim_state_dict`` makes for a
    parameter without state) is not loaded for a parameter the optimizer holds no state for:
    its first step starts it as a fresh optimizer would, from the learning rate of then.

    The optimizer gets its own copies: it never shares a tensor with ``state_dict`` (or with
    the optimizer that produced it), so stepping one cannot change the other.

    With ``broadcast_from_rank0=True`` only rank 0 (of the mesh) needs the state dict, a full
    one (``fshard.optim_state_dict(model, opt, full=True, rank0_only=True)``, or an unsharded
    run's ``opt.state_dict()``); other ranks pass anything (``{}``). Rank 0 sends each tensor
    in turn, scattering the rows of those shaped like their parameter, so no rank holds more
    than one full tensor of it at a time.

    Example:
        >>> osd = fshard.optim_state_dict(model, opt)         # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, osd)     # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> plain = unsharded_opt.state_dict()                # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, plain)   # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> full = fshard.optim_state_dict(model, opt, full=True, rank0_only=True)  # doctest: +SKIP
        >>> fshard.load_optim_state_dict(model, opt, full, broadcast_from_rank0=True)  # doctest: +SKIP
        LoadResult(missing_keys=[], unexpected_keys=[])
    """
    if broadcast_from_rank0:
        where = "fshard.load_optim_state_dict(broadcast_from_rank0=True)"
        received = _optim_from_rank0(model, optim, state_dict, where)
        return load_optim(model, optim, received, copy=False, strict=strict, where=where)
    return load_optim(model, optim, state_dict, copy=True, strict=strict)


def _optim_from_rank0(
    model: nn.Module, optim: torch.optim.Optimizer, state_dict: Any, where: str
) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank, name-keyed, parameter-shaped state as
    DTensors of this rank's rows (the load then takes them without communication)."""
    info = root_info(model, where)
    src = src_rank(info)
    is_src = dist.get_rank() == src
    problems: list[str] = []
    skeleton: dict[str, Any] | None = None
    saved: SavedOptim | None = None
    if is_src:
        try:
            if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
                raise ValueError(
                    f"{where}: rank {src} must pass a full optimizer state dict (a mapping with "
                    "'state' and 'param_groups'), got "
                    f"{type(state_dict).__name__}"
                )
            saved = saved_by_name(state_dict, _named_params(model, optim, where)[0], where)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            described: dict[str, Any] = {}
            on_meta: list[str] = []
            for name, entries in saved.state.items():
                if not isinstance(entries, Mapping):
                    problems.append(f"{where}: the state of {name!r} is not a mapping")
                    continue
                described[name] = {}
                for key, value in entries.items():
                    meta = broadcast_meta(f"state[{name!r}][{key!r}]", value, problems, on_meta)
                    if meta is not None:
                        described[name][key] = meta
            problems.extend(meta_value_problems(on_meta))
            skeleton = {"param_groups": [dict(g) for g in saved.groups], "state": described}
            if OPTIMIZER_CLASS_KEY in state_dict:
                skeleton[OPTIMIZER_CLASS_KEY] = state_dict[OPTIMIZER_CLASS_KEY]
    everyone = _collectives.all_gather_objects_by_rank(
        (dist.get_rank(), problems, skeleton), info, label=where
    )
    failed = ProblemList(where)
    for _, rank_problems, _ in everyone:
        failed.extend(p.removeprefix(f"{where}: ") for p in rank_problems)
    failed.raise_if_any(ValueError)
    skeleton = next(item[2] for item in everyone if item[0] == src)
    if skeleton is None:  # rank src had no problems, so it described its state dict
        raise internal_error(f"{where}: rank {src} sent no description of its state dict")
    slots = {name: slot for name, slot in param_names(model_entries(model, where)).values() if slot is not None}
    in_row = in_src_row(info, src)
    rep_src = replicate_src(info, src)
    state: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, entries in skeleton["state"].items():
            state[name] = {}
            for key, meta in entries.items():
                if meta[0] == "object":
                    state[name][key] = meta[1]
                    continue
                source = saved.state[name][key] if saved is not None else None
                slot = slots.get(name)
                label = f"{where}: {name}.{key}"
                if slot is not None and not slot.layout.replicated and meta[1] == tuple(slot.layout.full_shape):
                    rows = scatter_rows(slot, src, in_row, rep_src, source, meta[2], label)
                    state[name][key] = as_dtensor(slot, rows)
                else:
                    state[name][key] = broadcast_full(info, src, in_row, rep_src, source, meta, label)
    return {**skeleton, "state": state}


def load_optim(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    copy: bool,
    strict: bool = True,
    check_only: bool = False,
    where: str = "fshard.load_optim_state_dict",
) -> LoadResult:
    """``load_optim_state_dict``; ``copy=False`` when the caller owns fresh tensors (checkpoints).

    ``check_only`` validates ``state_dict`` (its keys, shapes and optimizer class; the values are
    not read) and loads nothing, so a checkpoint can be checked before anything is read. The
    ranks agree on the checks before anything is loaded ([Note: ranks agree on errors]).
    """
    with ranks_agree(root_info(model, where), where):
        if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
            raise ValueError(
                f"{where}: expected a mapping with 'state' and 'param_groups' (from "
                f"fshard.optim_state_dict, or an unsharded run's opt.state_dict()), got "
                f"{type(state_dict).__name__} with keys "
                f"{sorted(state_dict) if isinstance(state_dict, Mapping) else '-'}"
            )
        named_groups, _ = _named_params(model, optim, where)
        recorded = check_recorded_class(optim, state_dict, where)
        saved = saved_by_name(state_dict, named_groups, where)
        problems = ProblemList(where)
        matched, missing, unexpected = match_groups(saved, named_groups, strict, problems)
        check_state_shapes(saved, named_groups, problems)
        problems.raise_if_any(ValueError, hint=STRICT_HINT if strict else "")
        if not check_only:  # (the values of a checkpoint are not read yet)
            problems.extend(meta_value_problems(meta_state(saved, named_groups)))
            problems.raise_if_any(ValueError)
        if not recorded:
            check_unrecorded_kind(optim, saved, named_groups, matched, problems)
            problems.raise_if_any(ValueError, hint=OTHER_CLASS_HINT)
    if check_only:
        return LoadResult(missing, unexpected)

    saved_names = {n for group in saved.groups for n in group.get("params", [])}
    torch_state: dict[int, dict[str, Any]] = {}
    torch_groups: list[dict[str, Any]] = []
    index = 0
    for g_index, (current, s_index) in enumerate(zip(named_groups, matched, strict=True)):
        params = optim.param_groups[g_index]["params"]
        ids = []
        for (name, slot), param in zip(current, params, strict=True):
            ids.append(index)
            if name in saved.state and never_stepped(saved.state[name]) and param not in optim.state:
                # Saved as a placeholder (fshard.optim_state_dict's entry for a parameter
                # without state: step 0), loaded into an optimizer that starts this parameter
                # without state: leave it so, and the first step starts it as a fresh optimizer
                # does, from the learning rate of then (ASGD's eta, Rprop's step size: the
                # placeholder has the one of the save).
                pass
            elif name in saved.state:
                torch_state[index] = {
                    key: _local_state(value, slot, name, key, where, copy=copy)
                    for key, value in saved.state[name].items()
                }
            elif name not in saved_names and param in optim.state:
                torch_state[index] = dict(optim.state[param])  # strict=False: not saved, kept
            index += 1
        group = dict(optim.param_groups[g_index])
        if s_index is not None:
            group.update(hyperparameters_of(saved.groups[s_index]))
        group["params"] = ids
        torch_groups.append(group)
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})
    return LoadResult(missing, unexpected)


def _local_state(
    value: Any, slot: ParamSlot | None, name: str, key: str, where: str, *, copy: bool
) -> Any:
    """This rank's piece of one optimizer-state value; a copy unless ``copy`` is False."""
    shard_shaped = (
        slot is not None
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() == len(slot.layout.full_shape) > 0
    )
    if isinstance(value, DTensor):
        if slot is None:
            local = plain_value(value)
        elif same_layout(value, slot):
            local = value.to_local()
        else:
            return local_rows(full_tensor(value), slot.layout).clone()  # already a fresh tensor
    elif shard_shaped and value.shape == slot.layout.full_shape:  # type: ignore[union-attr]  # shard_shaped
        # A full tensor: keep only this rank's rows, never a view of the whole.
        return local_rows(value, slot.layout).clone()  # type: ignore[union-attr]  # shard_shaped: slot is set
    elif shard_shaped:
        # check_state_shapes refused every other shape on every rank, before any loading.
        raise internal_error(
            f"{where}: state[{name!r}][{key!r}] of shape {list(value.shape)} passed the checks"
        )
    else:
        local = value  # replicated state (Adam's step) or a non-tensor
    if copy and isinstance(local, torch.Tensor):
        return local.detach().clone()
    return local
