"""Wrapping policies: which submodules become units, and ``auto_shard`` to apply them.

A policy says which submodules of a model get their own ``fully_shard`` call. ``auto_shard``
visits the model bottom-up (children before parents), calls ``fully_shard`` on each selected
submodule, then on the root, which takes every parameter left over. The selection itself is a
pure function of the model (``select_modules``), so it is tested without any process group.

[Note: what a policy sees]
Policies are judged in post-order, so when a module is judged every selected module below it is
already known. ``by_class`` looks at the module's type only. ``by_size`` counts the module's
*unowned* parameters: those not taken by a selected descendant, not ignored and not already
sharded (each shared parameter counted once), the rule of FSDP1's size-based auto-wrap. A plain
callable gets the module and returns a bool. A selected module that would own no parameter is
skipped (it would be an empty unit); a selected ``nn.ModuleList`` / ``nn.ModuleDict`` is an
error, because containers have no forward and their unit could never gather.

[Note: modules that read their children's parameters]
``nn.MultiheadAttention.forward`` never calls its ``out_proj``: it passes ``out_proj.weight`` to
``F.multi_head_attention_forward`` directly. A unit made of ``out_proj`` would never be gathered,
and the attention would compute with this rank's shard (a wrong result, or a shape error
elsewhere). So no policy looks inside such a module (``READS_CHILDREN``), the root included:
it can be a unit itself (``by_class(nn.MultiheadAttention)``), or its parameters stay with the
unit that holds it. ``policy.descends(module)`` is asked of every module, the root too, before
looking inside it.
"""

from __future__ import annotations

import abc
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fshard._api import _CONTAINERS, fully_shard, ignored_param_list
from fshard._errors import ProblemList
from fshard._param import is_sharded
from fshard._runtime._root_init import READS_CHILDREN

__all__ = [
    "ByClass",
    "BySize",
    "WrapPolicy",
    "auto_shard",
    "by_class",
    "by_size",
    "select_modules",
    "checkpoint_forward",
]

logger = logging.getLogger("fshard")

M = TypeVar("M", bound=nn.Module)

# READS_CHILDREN: modules whose forward reads their children's parameters directly (without
# calling the children), so a unit below them would never be gathered: no policy looks inside
# them (see [Note: modules that read their children's parameters]; a unit placed there by hand
# is refused at the root's first forward). FSDP1's size policy does not wrap them either, so
# by_size never selects one.


class WrapPolicy(abc.ABC):
    """Base class of the built-in policies (``by_class``, ``by_size``).

    ``selects(module, unowned_numel)`` decides; ``descends(module)`` says whether to look inside
    ``module`` at all (asked of the root too). Whatever a policy says, nothing inside an
    ``nn.MultiheadAttention`` is selected: its forward reads ``out_proj.weight`` without calling
    ``out_proj``, so a unit there would never be gathered. Calling a policy on a module answers
    for the module alone (all its parameters counted as unowned). Any ``callable(module) ->
    bool`` is also a policy.

    Example:
        >>> import fshard, torch
        >>> fshard.by_size(10)(torch.nn.Linear(3, 3))
        True
    """

    @abc.abstractmethod
    def selects(self, module: nn.Module, unowned_numel: int) -> bool:
        """Whether ``module`` becomes a unit, given the parameters no unit below it took."""

    def descends(self, module: nn.Module) -> bool:
        return True

    def __call__(self, module: nn.Module) -> bool:
        numel = sum(p.numel() for p in _unique_params(module))
        return self.selects(module, numel)


@dataclass(frozen=True)
class ByClass(WrapPolicy):
    """Select modules that are instances of ``classes`` (TRANSFORMER_BASED_WRAP).

    ``classes`` holds types, or class names (``"BertLayer"``, or a qualified
    ``"transformers.models.bert.modeling_bert.BertLayer"``) that ``auto_shard`` resolves against
    the classes present in the model; a name found nowhere in the model is an error. Modules
    inside an ``nn.MultiheadAttention`` are never selected (``by_class(nn.Linear)`` leaves its
    ``out_proj`` alone); the attention module itself may be.

    Example:
        >>> import fshard, torch
        >>> fshard.by_class(torch.nn.Linear)(torch.nn.Linear(2, 2))
        True
    """

    classes: tuple[type[nn.Module] | str, ...]

    def __post_init__(self) -> None:
        bad = [c for c in self.classes if not (isinstance(c, str) or _is_module_type(c))]
        if not self.classes or bad:
            got = ", ".join(repr(c) for c in bad) if bad else "nothing"
            raise TypeError(
                f"by_class expects one or more nn.Module subclasses or class names, got {got}"
            )

    def types(self) -> tuple[type[nn.Module], ...]:
        return tuple(c for c in self.classes if not isinstance(c, str))

    def names(self) -> tuple[str, ...]:
        return tuple(c for c in self.classes if isinstance(c, str))

    def selects(self, module: nn.Module, unowned_numel: int) -> bool:
        if isinstance(module, self.types()):
            return True
        names = self.names()
        return bool(names) and _class_matches(type(module), names)

    def resolve(self, model: nn.Module) -> ByClass:
        """Replace class names with the classes of ``model`` that carry them.

        Raises ``ValueError`` naming every name that matches no module class in ``model`` and
        listing the class names it has.
        """
        names = self.names()
        if not names:
            return self
        present: dict[str, type[nn.Module]] = {}
        for module in model.modules():
            cls = type(module)
            present.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
        found: list[type[nn.Module]] = []
        missing: list[str] = []
        for name in names:
            matches = [cls for cls in present.values() if _class_matches(cls, (name,))]
            if matches:
                found.extend(matches)
            else:
                missing.append(name)
        if missing:
            have = sorted({cls.__name__ for cls in present.values()})
            raise ValueError(
                f"by_class: no module of class {', '.join(repr(m) for m in missing)} in "
                f"{type(model).__name__}; its module classes are: {', '.join(have)}"
            )
        return ByClass(classes=(*self.types(), *dict.fromkeys(found)))


@dataclass(frozen=True)
class BySize(WrapPolicy):
    """Select modules whose unowned parameters number at least ``min_num_params`` (SIZE_BASED_WRAP).

    "Unowned" means not already taken by a selected module below (see [Note: what a policy
    sees]), so units come out at roughly ``min_num_params`` each, bottom-up, by the rule of
    FSDP1's ``size_based_auto_wrap_policy``. ``nn.ModuleList``/``nn.ModuleDict`` are never
    selected, and an ``nn.MultiheadAttention`` stays with its parent, whole, root or not (FSDP1
    treats it the same way). A parameter shared by several modules counts once, where FSDP1
    counts it in every module that holds it, so with tied weights the units can differ.

    Example:
        >>> import fshard, torch
        >>> fshard.by_size(100)(torch.nn.Linear(3, 3))  # 12 parameters
        False
    """

    min_num_params: int

    def __post_init__(self) -> None:
        n = self.min_num_params
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"by_size: min_num_params must be an int >= 0, got {n!r}")

    def selects(self, module: nn.Module, unowned_numel: int) -> bool:
        if isinstance(module, _CONTAINERS + READS_CHILDREN):
            return False
        return unowned_numel >= self.min_num_params

    def descends(self, module: nn.Module) -> bool:
        return not isinstance(module, READS_CHILDREN)


def by_class(*classes: type[nn.Module] | str) -> ByClass:
    """A policy selecting every submodule that is an instance of one of ``classes``.

    The TRANSFORMER_BASED_WRAP policy: pass the transformer block class(es). Nested matches are
    all selected, innermost first, except inside an ``nn.MultiheadAttention`` (its forward reads
    its ``out_proj`` parameters directly; they stay with the unit that holds the attention).
    Class names (strings) are resolved against the model by ``auto_shard``.

    Example:
        >>> import fshard
        >>> from fshard.testing.models import Block, TinyTransformer, TransformerSpec
        >>> model = TinyTransformer(TransformerSpec(layers=2))
        >>> fshard.select_modules(model, fshard.by_class(Block))
        ['blocks.0', 'blocks.1']
    """
    return ByClass(classes=tuple(classes))


def by_size(min_num_params: int) -> BySize:
    """A policy selecting submodules with at least ``min_num_params`` unowned parameters.

    The SIZE_BASED_WRAP policy (the rule of FSDP1's ``size_based_auto_wrap_policy``; accelerate's
    ``fsdp_version: 2`` counts differently); see ``BySize``.

    Example:
        >>> import fshard, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
        >>> fshard.select_modules(model, fshard.by_size(100))
        ['0']
    """
    return BySize(min_num_params=min_num_params)


Policy = WrapPolicy | Callable[[nn.Module], bool]


def select_modules(
    model: nn.Module,
    policy: Policy,
    *,
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> list[str]:
    """The FQNs of the submodules ``auto_shard(model, policy=policy)`` makes units, in order.

    The order is the order of the ``fully_shard`` calls: post-order, children before parents,
    each child subtree in registration order. The root is never listed (``auto_shard`` always
    shards it last). Nothing inside an ``nn.MultiheadAttention`` is listed, nor anything below a
    module (the root included) whose ``policy.descends(module)`` is false. Pure: no process
    group, the model is not changed.

    Example:
        >>> import fshard, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> fshard.select_modules(model, lambda m: isinstance(m, torch.nn.Linear))
        ['0']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"select_modules expects an nn.Module, got {type(model).__name__}")
    policy = _check_policy(policy, "select_modules")
    if isinstance(policy, ByClass):
        policy = policy.resolve(model)
    owned: set[int] = {id(p) for p in ignored_param_list(ignored_params, f"select_modules({type(model).__name__})")}
    owned.update(id(p) for p in model.parameters() if is_sharded(p))
    visited: set[int] = {id(model)}
    selected: list[str] = []
    problems = ProblemList(f"select_modules({type(model).__name__})")

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) in visited:
                continue
            visited.add(id(child))
            fqn = f"{prefix}{name}"
            if _descends(policy, child):
                visit(child, fqn + ".")
            unowned = [p for p in _unique_params(child) if id(p) not in owned]
            if not _selects(policy, child, sum(p.numel() for p in unowned), fqn):
                continue
            if isinstance(child, _CONTAINERS):
                problems.add(
                    f"the policy selected {fqn!r}, a {type(child).__name__}; containers have no "
                    "forward, so their unit would never be gathered: select the modules inside "
                    "it instead"
                )
                continue
            if not unowned:
                logger.debug("select_modules: %r owns no parameters; not a unit", fqn)
                continue
            owned.update(id(p) for p in unowned)
            selected.append(fqn)

    if _descends(policy, model):
        visit(model, "")
    problems.raise_if_any(ValueError)
    return selected


def auto_shard(model: M, *, policy: Policy, **fully_shard_kwargs: Any) -> M:
    """Apply ``fully_shard`` to the submodules ``policy`` selects, bottom-up, then to the root.

    ``policy`` is ``fshard.by_class(...)``, ``fshard.by_size(n)`` or any
    ``callable(module) -> bool``; ``fully_shard_kwargs`` (``mesh``, ``reshard_after_forward``,
    ``mp_policy``, ``offload_policy``, ``ignored_params``) go to every call. Returns ``model``.
    ``fshard.select_modules(model, policy)`` lists the units it will make, without sharding.

    Example:
        >>> import fshard                                                    # doctest: +SKIP
        >>> from transformers.models.bert.modeling_bert import BertLayer    # doctest: +SKIP
        >>> fshard.auto_shard(model, policy=fshard.by_class(BertLayer), mesh=mesh)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_shard expects an nn.Module, got {type(model).__name__}")
    try:
        inspect.signature(fully_shard).bind(model, **fully_shard_kwargs)
    except TypeError as exc:
        valid = ", ".join(p for p in inspect.signature(fully_shard).parameters if p != "module")
        raise TypeError(f"auto_shard: {exc}; fully_shard takes: {valid}") from None
    ignored = fully_shard_kwargs.get("ignored_params")
    if ignored is not None:
        # Listed once: a generator must feed both select_modules and every fully_shard call.
        ignored = ignored_param_list(ignored, f"auto_shard({type(model).__name__})")
        fully_shard_kwargs["ignored_params"] = ignored
    fqns = select_modules(model, policy, ignored_params=ignored)
    logger.info(
        "auto_shard(%s): %d unit(s) below the root: %s",
        type(model).__name__,
        len(fqns),
        ", ".join(fqns) if fqns else "-",
    )
    for fqn in fqns:
        fully_shard(model.get_submodule(fqn), **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


# ------------------------------------------------------------------------------------ helpers


def _is_module_type(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _class_matches(cls: type, names: tuple[str, ...]) -> bool:
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(name in (cls.__name__, qualified) for name in names)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    # named_parameters() de-duplicates shared parameters by identity.
    return [p for _, p in module.named_parameters()]


def _check_policy(policy: object, where: str) -> Policy:
    if isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, type) or not callable(policy):
        hint = (
            f"; to select by class use fshard.by_class({getattr(policy, '__name__', policy)})"
            if _is_module_type(policy)
            else ""
        )
        raise TypeError(
            f"{where}: policy must be fshard.by_class(...), fshard.by_size(n) or a "
            f"callable(module) -> bool, got {policy!r}{hint}"
        )
    return policy


def _descends(policy: Policy, module: nn.Module) -> bool:
    """Whether ``select_modules`` looks inside ``module`` (see [Note: modules that read their
    children's parameters])."""
    if isinstance(module, READS_CHILDREN):
        return False
    return policy.descends(module) if isinstance(policy, WrapPolicy) else True


def _selects(policy: Policy, module: nn.Module, unowned_numel: int, fqn: str) -> bool:
    if isinstance(policy, WrapPolicy):
        return policy.selects(module, unowned_numel)
    answer = policy(module)
    if not isinstance(answer, bool):
        raise TypeError(
            f"policy {policy!r} returned {answer!r} for {fqn!r} ({type(module).__name__}); a "
            "policy must return True or False"
        )
    return answer


# ------------------------------------------------------------------- activation checkpointing


def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward during backward instead of keeping its activations.

    What accelerate's ``fsdp_activation_checkpointing`` does with torch's ``checkpoint_wrapper``,
    but without a wrapper module: the forward is run through non-reentrant
    ``torch.utils.checkpoint.checkpoint``, and the module keeps its class, its FQNs and its
    ``state_dict()`` keys. When ``module`` is an fshard unit, its hooks gather the parameters
    before the checkpointed forward, and its backward gathers them again before the
    recomputation. In training, the KV-cache arguments of Transformers layers
    (``use_cache``, ``past_key_values``, ``past_key_value``, ``layer_past``, and ``cache`` for
    a Transformers layer) are dropped, with
    one warning per class, as Transformers' own checkpointing does: the recompute would write
    to the cache a second time. The instance's ``forward`` attribute is set (a ``functools.partial``, so the
    module still deep-copies and pickles); a module whose ``forward`` is already set on the
    instance is an error.
    """
    if "forward" in module.__dict__:
        raise ValueError(
            f"checkpoint_forward: {type(module).__name__} already has a forward set on the "
            "instance (checkpointed twice, or patched by other code); leave it out"
        )
    module.forward = functools.partial(_checkpointed_forward, module)


# Arguments through which Transformers layers append to a KV cache (named per model and per
# Transformers release: 5.x layers take a plain ``cache``, too generic a name to drop from any
# module but a Transformers layer, which says so with ``_can_checkpoint_with_cache``).
_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")
_TRANSFORMERS_CACHE_ARGS = ("cache",)
_WARNED_CACHE: set[type] = set()


_POSITIONS: weakref.WeakKeyDictionary[type, dict[str, int]] = weakref.WeakKeyDictionary()


def _positions(cls: type[nn.Module]) -> dict[str, int]:
    """Where ``use_cache`` and the cache arguments of ``cls.forward`` sit among the positional
    arguments after ``self`` (GPT-2's blocks take the cache second)."""
    found = _POSITIONS.get(cls)
    if found is not None:
        return found
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    found = {
        p.name: i
        for i, p in enumerate(params)
        if p.kind in positional and p.name in (*_CACHE_ARGS, *_TRANSFORMERS_CACHE_ARGS, "use_cache")
    }
    _POSITIONS[cls] = found
    return found


def _without_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments without a KV cache to write to: the recompute in backward would append
    the layer's keys and values to it a second time (a shape error, or a wrong cache). What
    Transformers' own gradient checkpointing does for its layers (the ones that only read the
    cache say so with ``_can_checkpoint_with_cache``), with one warning per layer class."""
    positions = _positions(type(module))
    new_args, new_kwargs = list(args), dict(kwargs)
    dropped = []

    def replace(name: str, value: object) -> None:
        at = positions.get(name)
        if at is not None and at < len(new_args):
            new_args[at] = value
        else:
            new_kwargs[name] = value

    def given(name: str) -> object:
        at = positions.get(name)
        return new_args[at] if at is not None and at < len(new_args) else kwargs.get(name)

    if given("use_cache"):
        replace("use_cache", False)
        dropped.append("use_cache=False")
    can_keep = getattr(module, "_can_checkpoint_with_cache", None)
    if not can_keep:
        names = _CACHE_ARGS if can_keep is None else (*_CACHE_ARGS, *_TRANSFORMERS_CACHE_ARGS)
        for name in names:
            if given(name) is not None:
                replace(name, None)
                dropped.append(f"{name}=None")
    if not dropped:
        return args, kwargs
    if type(module) not in _WARNED_CACHE:
        _WARNED_CACHE.add(type(module))
        logger.warning(
            "fshard: %s is checkpointed (fsdp_activation_checkpointing), which a KV cache does "
            "not survive: its recompute would write to the cache again. Training with %s (pass "
            "use_cache=False to the model to silence this).",
            type(module).__name__,
            ", ".join(dropped),
        )
    return tuple(new_args), new_kwargs


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if module.training and torch.is_grad_enabled():
        args, kwargs = _without_cache(module, args, kwargs)
    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)
