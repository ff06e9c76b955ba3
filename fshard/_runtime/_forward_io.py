"""What a unit's forward takes and gives: inputs cast and passed through a waiter, inputs
returned as given, tensors the forward left in module attributes."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fshard._trees import _cast_floating, _map_tensors, _tensors_in
from fshard._unit._group import ParamGroup
from fshard._unit._registry import is_unit_module

logger = logging.getLogger("fshard")

class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward tells the unit those grads are ready."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.waiter = group.add_input_waiter()  # lives as long as this graph
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.on_inputs_grad_ready(ctx.waiter)
        return (None, *grads)


def _autograd_function_ctx() -> torch.autograd.function.FunctionCtx | None:
    """The ``ctx`` of the ``torch.autograd.Function`` whose ``forward`` the caller runs inside,
    as the segment of a reentrant checkpoint does (torch's, DeepSpeed's, Megatron's or
    FairScale's ``CheckpointFunction``): a frame named ``forward`` whose first argument is the
    Function's ``ctx``; None outside one. Only the forwards run without grad ask, so the walk
    costs nothing otherwise."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount > 0 and code.co_varnames[0] != "self":
            first = frame.f_locals.get(code.co_varnames[0])  # (modules' forwards skipped)
            if isinstance(first, torch.autograd.function.FunctionCtx):
                return first
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop; typeshed types f_back as FrameType
    return None


def _cast_inputs(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The floating-point inputs in ``MixedPrecision.param_dtype`` (with cast_forward_inputs)."""
    mp = group.mp_policy
    if mp is None or mp.param_dtype is None or not mp.cast_forward_inputs:
        return args, kwargs
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call
        dtype = mp.param_dtype
        return tuple(a.to(dtype) if a.is_floating_point() else a for a in args), kwargs
    cast: tuple[tuple[Any, ...], dict[str, Any]] = _cast_floating((args, kwargs), mp.param_dtype)
    return cast


def _any_requires_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    found = False

    def note(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        found = found or t.requires_grad
        return t

    _in_tuples((*args, *kwargs.values()), note)
    return found


def _wrap_inputs(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The inputs with those requiring grad passed through ``_InputsGradReady`` (a waiter of
    ``group``), or None if none requires grad.

    Arguments, keyword arguments and tuples in them, which a unit cannot change, so giving it
    new ones is invisible (a tensor passed twice is wrapped once). Not inside lists, dicts,
    dataclasses or other objects: a unit may write into the caller's container, so it must get
    that very object (such a unit is reduced when the backward ends).
    """
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call
        positions = [i for i, a in enumerate(args) if a.requires_grad]
        if not positions:
            return None
        wrapped = _InputsGradReady.apply(group, *(args[i] for i in positions))
        new_args = list(args)
        for i, tensor in zip(positions, wrapped, strict=True):
            new_args[i] = tensor
        group.passed_inputs = {id(w): (w, args[i]) for i, w in zip(positions, wrapped, strict=True)}
        return tuple(new_args), kwargs
    needing: dict[int, torch.Tensor] = {}
    _in_tuples(
        (*args, *kwargs.values()),
        lambda t: needing.setdefault(id(t), t) if t.requires_grad else t,
    )
    if not needing:
        return None
    wrapped = _InputsGradReady.apply(group, *needing.values())
    group.passed_inputs = {id(w): (w, t) for w, t in zip(wrapped, needing.values(), strict=True)}
    by_id = {i: w for i, w in zip(needing, wrapped, strict=True)}
    args = _in_tuples(args, lambda t: by_id.get(id(t), t))
    kwargs = {k: _in_tuples(v, lambda t: by_id.get(id(t), t)) for k, v in kwargs.items()}
    return args, kwargs


def _in_tuples(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` over ``x`` if it is a tensor, or over the tensors inside it if it is a (nested)
    tuple; a tuple comes back new only if one of them changed. Other objects are left alone."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        items = [_in_tuples(item, fn) for item in x]
        if all(new is old for new, old in zip(items, x, strict=True)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _unwrap_returned_inputs(
    output: Any, passed: dict[int, tuple[torch.Tensor, torch.Tensor]], handed_back: set[int]
) -> Any:
    """``output`` with each input the unit returned as it got it (an adapter switched off,
    ``return x``) replaced by the tensor it was given, as it would be without fshard.

    The unit got its inputs through ``_InputsGradReady``, whose outputs autograd forbids
    changing in place: the caller's ``nn.ReLU(inplace=True)`` on such an output raised torch's
    "Output 0 of _InputsGradReady is a view". The replaced tensor depends on none of the
    unit's parameters, so it needs no hook of the unit (their ids go into ``handed_back``);
    the Function's node, now unused, goes with the returned copy and its waiter with it. (A
    view of an input, ``x[:, :3]``, stays a view of the copy.)
    """

    def original(t: torch.Tensor) -> torch.Tensor:
        found = passed.get(id(t))
        if found is None or found[0] is not t:
            return t
        handed_back.add(id(found[1]))
        return found[1]

    if type(output) is torch.Tensor:
        return original(output)
    if not any(id(t) in passed for t in _tensors_in(output)):
        return output
    return _map_tensors(original, output)


# The number autograd gives the next node it creates (private; absent, attribute tensors are
# not looked for): a node made in a unit's forward has at least the number read when it began.
_SEQUENCE_NR: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 where it has none to compare: sparse, meta, ...)."""
    if t.layout is not torch.strided or t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _own_modules(group: ParamGroup) -> list[nn.Module]:
    """The unit's module and those below it that no other unit owns (cached)."""
    if group.own_modules is None:
        found = list(group.modules)
        stack = [child for top in group.modules for child in top.children()]
        while stack:
            module = stack.pop()
            if not is_unit_module(module):
                found.append(module)
                stack.extend(module.children())
        group.own_modules = found
        group.attr_index = []
    return group.own_modules


# Public attribute values looked at on every forward: containers a tensor may sit in, and what
# an attribute may hold until a forward puts a tensor there without adding an attribute (None,
# a number: `self.aux_loss = 0.0`).
_MAY_BECOME = (list, tuple, dict, float, int)


def _made_since(group: ParamGroup, start: int) -> list[torch.Tensor]:
    """Tensors with autograd history created since sequence number ``start`` that the unit's own
    modules hold in attributes, directly or in a public list, tuple or dict attribute.

    Which attributes can hold one (or become one: None, a number) is worked out per module
    once, and again only when the module gains or loses attributes: a scan of every attribute
    of every module on every forward would cost more than the rest of the unit's hooks."""
    found: list[torch.Tensor] = []
    modules = _own_modules(group)
    index = group.attr_index
    if len(index) != len(modules):
        index[:] = [(-1, ())] * len(modules)
    for i, module in enumerate(modules):
        attrs = module.__dict__
        size, names = index[i]
        if size != len(attrs):
            names = tuple(
                name
                for name, value in attrs.items()
                if type(value) is torch.Tensor
                or (not name.startswith("_") and (value is None or type(value) in _MAY_BECOME))
            )
            index[i] = (len(attrs), names)
        for name in names:
            value = attrs.get(name)
            if type(value) is torch.Tensor:
                candidates: Any = (value,)
            elif type(value) in (list, tuple):
                candidates = value
            elif type(value) is dict:
                candidates = value.values()
            else:
                continue
            for t in candidates:
                if type(t) is torch.Tensor and t.grad_fn is not None and t.grad_fn._sequence_nr() >= start:
                    found.append(t)
    return found
