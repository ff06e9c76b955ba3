"""Module and autograd hooks, the unit registry and the root of each sharded tree.

This is the only module that registers hooks. Each unit gets a forward pre-hook (gather), a
forward hook (free, and arm the backward), a gradient hook on its outputs (gather for backward)
and post-accumulate-grad hooks on its unsharded params (reduce once all gradients are in; see
[Note: when a unit's backward is done]). The root of a tree queues one callback per backward that
finishes whatever the per-unit triggers left open.

[Note: root init]
On the first forward of a tree's root (the outermost unit), the root collects every unit below
it, gives units and parameters their FQNs, moves a parameter shared by several modules to the
unit of the lowest module that contains all of them (tied embeddings), and checks across ranks,
with two small object all-gathers, that every rank built the same units with the same
parameters. Only then can any gradient collective run, so a divergent rank fails with a clear
error instead of hanging. The root also starts recording the collectives its units issue, and
compares them across ranks after the first backward (see [Note: Ranks must issue the same
collectives] in _collectives).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex

import torch
from torch import nn

from fshard._options import BackwardPrefetch
from fshard._runtime._checks import (
    _PEEK_TRANSFORMS,
    _refuse_functorch_differentiation,
    check_params_in_place,
)
from fshard._runtime._forward_io import (
    _SEQUENCE_NR,
    _any_requires_grad,
    _autograd_function_ctx,
    _cast_inputs,
    _made_since,
    _storage_ptr,
    _unwrap_returned_inputs,
    _wrap_inputs,
)
from fshard._runtime._optim_hooks import install_optimizer_hooks
from fshard._runtime._root import RootState, root_of
from fshard._runtime._root_init import _refuse_root_of_several, init_root
from fshard._trees import _cast_floating, _map_tensors, _tensors_in
from fshard._unit._group import ParamGroup, TrainingState
from fshard._unit._registry import attach_unit, in_backward, is_unit_module, units_under

logger = logging.getLogger("fshard")


def register_unit(group: ParamGroup) -> None:
    """Install ``group``'s hooks on its modules (and, once per process, the optimizer's)."""
    attach_unit(group)
    install_optimizer_hooks()
    for module in group.modules:
        module.register_forward_pre_hook(
            _UncompiledUnitHook(_pre_forward, group), prepend=True, with_kwargs=True
        )
        module.register_forward_hook(
            _UncompiledUnitHook(_post_forward, group), prepend=False, with_kwargs=True
        )
        module.register_forward_hook(_UncompiledUnitHook(_after_forward, group), always_call=True)
        index_param_owners(module)
        # What FSDP sets, and what other libraries look for: transformers' generate keeps every
        # rank stepping until all are done (synced_gpus) for such modules, and dynamo reads
        # parameters as they are when called (fshard swaps them), requiring use_orig_params
        # for FSDP1.
        module.__dict__["_is_fsdp_managed_module"] = True
        module.__dict__["_fsdp_use_orig_params"] = True
    hook_containers(group)


# [Note: calls into a unit from outside its forward]
# A unit gathers its parameters when its own forward runs. Code that calls a part of it directly
# (transformers' generate runs ``model.get_encoder()(...)`` on an encoder-decoder, whose
# embedding and final norm the root unit owns) would compute with this rank's shards. The
# modules of a unit that contain other units (encoder and decoder stacks) are the usual entry
# points, and there are few of them: each gets hooks that, outside the unit's forward, run the
# call as a forward of the unit. Leaf modules (an embedding called on its own) get none, so the
# unit's own blocks stay hook-free and compilable.
_CONTAINER_ATTR = "_fshard_container_hooked"


def hook_containers(group: ParamGroup) -> None:
    """Hook the modules below ``group``'s module that hold units but are none, and the units
    below it that read one of its parameters (a tied embedding that root init gave to the root,
    read by an encoder stack that is a unit: ``model.get_encoder()(...)`` must gather the root
    too). Idempotent."""
    stack = [child for top in group.modules for child in top.children()]
    while stack:
        module = stack.pop()
        if is_unit_module(module):
            if _CONTAINER_ATTR not in module.__dict__ and _reads_params_of(module, group):
                _hook_container(module, group)
            continue
        children = list(module.children())
        if _CONTAINER_ATTR not in module.__dict__ and any(
            is_unit_module(m) for m in module.modules()
        ):
            _hook_container(module, group)
        stack.extend(children)


def _hook_container(module: nn.Module, group: ParamGroup) -> None:
    """Calls of ``module`` from outside ``group``'s forward run as a forward of ``group``."""
    module.__dict__[_CONTAINER_ATTR] = True
    module.register_forward_pre_hook(
        _UncompiledUnitHook(_container_pre_forward, group), prepend=True, with_kwargs=True
    )
    module.register_forward_hook(
        _UncompiledUnitHook(_container_post_forward, group), prepend=False, with_kwargs=True
    )
    module.register_forward_hook(_UncompiledUnitHook(_container_after_forward, group), always_call=True)


def _reads_params_of(module: nn.Module, group: ParamGroup) -> bool:
    """Whether a module in ``module``'s subtree registers a parameter ``group`` owns."""
    for sub in module.modules():
        for param in sub._parameters.values():
            slot = param.__dict__.get("_fshard_slot") if param is not None else None
            if slot is not None and slot.group_ref() is group:
                return True
    return False


def _after_forward(group: ParamGroup, module: nn.Module, args: Any, output: Any) -> None:
    """Runs even when the forward raised: the root's forward raising (an out-of-memory error
    caught to retry smaller) frees what it left gathered at once, so that the modules show
    their shards again before an optimizer step, a state dict or a checkpoint load."""
    root = group.root
    if isinstance(root, RootState) and root.root is group and group.training_state is TrainingState.FORWARD:
        if group.nested_returned:
            # The root's forward called inside a method of the root that runs as its forward
            # (fshard.register_forward_method: generate's steps): the method goes on.
            group.nested_returned = False
        elif not in_backward():
            root.recover_from_aborted_forward()


def _container_pre_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if group.training_state is not TrainingState.IDLE:
        return None  # inside the unit's forward or backward: its own hooks gathered it
    if not in_backward():  # in backward (a checkpoint's recompute) it only gathers
        group.outside_calls.append(module)
    return _pre_forward(group, module, args, kwargs)


def _container_post_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    if not group.outside_calls or group.outside_calls[-1] is not module:
        return None
    group.outside_calls.pop()
    return _post_forward(group, module, args, kwargs, output)


def _container_after_forward(group: ParamGroup, module: nn.Module, args: Any, output: Any) -> None:
    """Runs even when the call raised: a call run as the unit's forward that raised (its post
    hook did not run) leaves the unit mid-forward; free what the model holds gathered, as
    after a model forward that raised (see _after_forward)."""
    if not group.outside_calls or group.outside_calls[-1] is not module:
        return  # (a call that returned: its post hook took it off)
    group.outside_calls.pop()
    root = group.root
    if isinstance(root, RootState) and not in_backward() and (
        root.root is group or root.root.training_state is not TrainingState.FORWARD
    ):
        root.recover_from_aborted_forward()  # (else the model's forward raises, and recovers)


# [Note: methods that run as a forward]
# fshard gathers a unit when its module is called. A method other than forward that reads the
# unit's parameters (generate, encode, a loss method) computes with the shards, and fails
# with a shape error deep inside torch. fshard.register_forward_method(module, name) puts a
# wrapper in the module's __dict__ that, outside the unit's forward, runs the call as one: the
# same hooks as a container's call (see [Note: calls into a unit from outside its forward]).
# A root whose method calls the root itself (generate's steps) runs those calls as nested
# forwards of the one the method began (see _pre_forward).
_METHODS_ATTR = "_fshard_forward_methods"


def hook_forward_method(group: ParamGroup, module: nn.Module, name: str) -> None:
    """Make ``module.<name>(...)`` run as a forward of ``group`` (idempotent while the method
    in place is the wrapper: a method put there since is wrapped in turn)."""
    hooked: dict[str, Callable[..., Any]] = module.__dict__.setdefault(_METHODS_ATTR, {})
    if name in hooked and module.__dict__.get(name) is hooked[name]:
        return
    original = getattr(module, name)
    ref = weakref.ref(group)

    @functools.wraps(original)
    def run_as_forward(*args: Any, **kwargs: Any) -> Any:
        unit = ref()
        if unit is None or unit.training_state is not TrainingState.IDLE:
            return original(*args, **kwargs)  # inside the unit's forward or backward
        outside = not in_backward()
        with_grad = torch.is_grad_enabled()
        changed = _method_pre_forward(unit, module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        root = unit.root
        before = (root.grad_forwards, root.grad_forward_pending) if isinstance(root, RootState) else None
        try:
            output = original(*args, **kwargs)
        except BaseException:
            if outside:
                _method_failed(unit, module, args, None)
            raise
        if not outside:
            return output
        result = _method_post_forward(unit, module, args, kwargs, output)
        output = output if result is None else result
        if with_grad and before is not None and isinstance(root, RootState):
            _release_after_gradless_call(root, before, output)
        return output

    module.__dict__[name] = run_as_forward
    hooked[name] = run_as_forward


def _release_after_gradless_call(root: RootState, before: tuple[int, bool], output: Any) -> None:
    """A registered method called with grad that ran every forward inside it without grad
    (transformers' generate is decorated with torch.no_grad) and returned nothing requiring
    grad: no backward can come for it, so free what its call kept for one, as after a forward
    without grad."""
    grad_forwards, pending = before
    if root.grad_forwards != grad_forwards or root.root.training_state is TrainingState.FORWARD:
        return  # (a forward inside ran with grad; or called inside the model's forward)
    leaves = [output] if isinstance(output, torch.Tensor) else _tensors_in(output)
    if any(t.requires_grad for t in leaves):
        return
    for group in root.groups:
        if group.training_state is TrainingState.IDLE and (group.is_hidden() or group.holds_kept_rows()):
            group.reshard()
    root.grad_forward_pending = pending


# (Eager under torch.compile, as the hooks are: see _UncompiledUnitHook.)
_method_pre_forward = torch.compiler.disable(_container_pre_forward)


_method_post_forward = torch.compiler.disable(_container_post_forward)


_method_failed = torch.compiler.disable(_container_after_forward)


_HOOKED_ATTR = "_fshard_state_dict_hooked"


def index_param_owners(module: nn.Module) -> None:
    """Hook ``state_dict()`` / ``load_state_dict()`` of every module under ``module`` that
    registers a sharded parameter, so that each gives DTensors and takes full tensors for its
    own parameters (see [Note: model.state_dict() on a sharded model] in
    _unit._module_state_dict)."""
    for sub in module.modules():
        if not sub.__dict__.get(_HOOKED_ATTR) and owned_slots(sub):
            sub.__dict__[_HOOKED_ATTR] = True
            sub.register_state_dict_post_hook(_owner_state_dict_post)
            sub.register_load_state_dict_pre_hook(_owner_load_state_dict_pre)


def owned_slots(module: nn.Module) -> dict[str, Any]:
    """The sharded parameters ``module`` registers now, by attribute name: looked up when asked,
    since a weight tied after ``fully_shard`` (``head.weight = embed.weight``) replaces the one
    there then, and a gathered unit registers its gathered copies in their place."""
    found = {}
    for name, param in module._parameters.items():
        if param is None:
            continue
        slot = param.__dict__.get("_fshard_slot")
        if slot is None and (of := param.__dict__.get("_fshard_gathered_of")) is not None:
            slot = of()
            if slot is not None and slot.unsharded_param is param:
                found[name] = slot
        elif slot is not None and slot.sharded_param is param:
            found[name] = slot
    return found


def _owner_state_dict_post(
    module: nn.Module, destination: dict[str, Any], prefix: str, _meta: Any
) -> None:
    from fshard._unit._module_state_dict import on_module_state_dict

    on_module_state_dict(owned_slots(module), destination, prefix)


def _owner_load_state_dict_pre(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    _strict: bool,
    _missing_keys: list[str],
    _unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    from fshard._unit._module_state_dict import on_module_load_state_dict

    on_module_load_state_dict(
        module, owned_slots(module), state_dict, prefix, local_metadata, error_msgs
    )


def _call_hook(hook: _UnitHook, *args: Any) -> Any:
    target = hook.ref()
    if target is None:
        return None
    return hook.fn(target, *args)


class _UnitHook:
    """``fn(group, *hook_args)`` as a hook that holds the unit weakly (a no-op once it is gone).

    An object rather than a closure so that pickling or copying a module that holds it fails
    with the unit's own explanation, not pickle's "Can't pickle local object".
    """

    def __init__(self, fn: Callable[..., Any], group: ParamGroup) -> None:
        self.fn = fn
        self.ref = weakref.ref(group)
        self.__name__ = f"fshard_{fn.__name__.lstrip('_')}"

    __call__ = _call_hook

    def _refuse(self) -> TypeError:
        target = self.ref()
        if target is None:
            return TypeError("cannot copy or pickle a hook of an fshard unit that no longer exists")
        return target.refuse_copy()

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        raise self._refuse()

    def __deepcopy__(self, memo: dict[int, object]) -> _UnitHook:
        raise self._refuse()


class _UncompiledUnitHook(_UnitHook):
    """A ``_UnitHook`` for forward hooks: under torch.compile of a model that contains units,
    they run eagerly (a graph break around each), since they issue collectives and swap
    parameters, which dynamo cannot trace."""

    __call__ = torch.compiler.disable(_call_hook)


def _call_pre_backward(hook: _PreBackwardHook, grad: torch.Tensor | None) -> None:
    target = hook.ref()
    if target is not None:
        _pre_backward(target, grad, hook.versions, hook.step)


class _PreBackwardHook(_UnitHook):
    """The pre-backward hook on one forward's outputs, with the version counters of the shards
    that forward read (the backward of an earlier forward checks against its own: a later
    forward, after an edit, refilled the storage that autograd saved for it) and the step it
    ran in (``RootState.steps``: a backward of a graph kept from an earlier step)."""

    def __init__(self, group: ParamGroup, versions: tuple[int, ...] | None, step: int) -> None:
        super().__init__(_pre_backward, group)
        self.versions = versions
        self.step = step

    __call__ = torch.compiler.disable(_call_pre_backward)


def _pre_forward_in_recompute(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An activation checkpoint's recompute inside backward: gather and cast as the forward
    did, but arm nothing, except, for a reentrant checkpoint's recompute of a forward that ran
    without grad on inputs requiring it, the waiter that forward could not arm: the nested
    backward that follows computes those inputs' gradients."""
    group.unshard()
    args, kwargs = _cast_inputs(group, args, kwargs)
    if group.checkpointed_calls > 0 and torch.is_grad_enabled():
        wrapped = _wrap_inputs(group, args, kwargs)
        if wrapped is not None:
            group.consume_segment()
            return wrapped
    return args, kwargs


def _note_gradless_segment(
    group: ParamGroup, root: RootState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A forward without grad inside a forward with grad, or on inputs requiring grad, and
    within an autograd.Function's forward: a reentrant checkpoint's segment. Its recompute, if
    one comes in backward, arms the waiter; until then the unit's backward is not done (every
    rank alike). The claim lives on the Function's node, so it goes with a graph no backward
    comes for (an evaluation with grad, a skipped step). (Under a plain torch.no_grad(), a
    target computed by the model itself, no backward ever comes: the unit is freed as after
    inference.)"""
    ctx = None
    if root.grad_forward_pending or _any_requires_grad(args, kwargs):
        ctx = _autograd_function_ctx()
    if ctx is not None:
        root.note_run(group)
        group.claim_segment(ctx)
        group.backward_may_come = True


def _pre_forward(
    group: ParamGroup, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if _PEEK_TRANSFORMS is not None and _PEEK_TRANSFORMS() is not None:
        _refuse_functorch_differentiation(group)
    if group.root is None:
        _refuse_root_of_several(group)
        check_params_in_place(units_under(group.module), before_init=group.module)
        ensure_root_initialised(group)
    root = root_of(group)
    if in_backward():
        return _pre_forward_in_recompute(group, args, kwargs)
    if root.root is group and not (
        group.training_state is TrainingState.FORWARD and group.forward_depth > 0
    ):
        # (Not for the root's forward inside a method of the root that runs as its forward:
        # see register_forward_method.)
        root.on_root_pre_forward()
    group.pre_forward()
    root.record(group)
    # (Before any collective of the unit's: a departure from the first step's order is agreed on
    # first. Only the unit's first call in the model's forward counts, as for prefetch below.)
    first_call = group.forward_mark != root.forwards and root.root.training_state is TrainingState.FORWARD
    if first_call:
        root.follow(group)
    group.unshard()
    if torch.is_grad_enabled():
        root.grad_forwards += 1
        group.note_forward_versions()
        if _SEQUENCE_NR is not None:
            group.forward_seq = _SEQUENCE_NR()
    if first_call:
        # Prefetch once per model forward, at the unit's first call: a later call (a module of
        # a unit of several, a block run twice) would gather the unit after its first call in
        # the recorded order, which ran and was freed already, and hold it to the end of the
        # backward. A unit called outside the model's forward prefetches nothing: no end of
        # a model's forward frees what it would prefetch.
        group.forward_mark = root.forwards
        root.prefetch_for_forward(group)
    args, kwargs = _cast_inputs(group, args, kwargs)
    if not torch.is_grad_enabled():
        _note_gradless_segment(group, root, args, kwargs)
        return args, kwargs
    group.grad_forward_ran = True
    group.backward_may_come = True
    root.note_run(group)
    if group.forward_depth > 1:
        # Inside another call of this unit (a unit of several modules): that call's inputs
        # tell when both are done. A waiter of its own would let the unit be freed (parked,
        # then released by a unit the outer call ran before it) while the outer call's
        # backward still reads its parameters.
        return args, kwargs
    # The inputs' gradients tell when the unit's backward is done: [Note: when a unit's
    # backward is done].
    wrapped = _wrap_inputs(group, args, kwargs)
    if wrapped is None:
        group.unwaited_forward = True
        return args, kwargs
    return wrapped


def _post_forward(
    group: ParamGroup,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    passed, group.passed_inputs = group.passed_inputs, None  # (also a recompute's: dropped)
    if in_backward():
        # An activation checkpoint's recompute: cast the output as the forward did, so that the
        # ops after the unit see the dtypes they saw then (and saved tensors match).
        mp = group.mp_policy
        if mp is not None and mp.output_dtype is not None:
            return _cast_floating(output, mp.output_dtype)
        return None
    root = root_of(group)
    group.forward_depth = max(group.forward_depth - 1, 0)
    group.modules_to_run.discard(id(module))
    nested = group.forward_depth > 0  # inside another module's forward of this unit
    grad_enabled = torch.is_grad_enabled()
    handed_back: set[int] = set()  # inputs returned as given: no hook of this unit on them
    if passed is not None:
        output = _unwrap_returned_inputs(output, passed, handed_back)
    # The root's backward starts right after forward ends and needs its parameters first, so it
    # keeps them rather than free and re-gather them (as FSDP2 does); without grad, free all.
    keep = group is root.root or not group.reshard_after_forward
    mp = group.mp_policy
    if mp is not None and mp.output_dtype is not None:
        output = _cast_floating(output, mp.output_dtype)
    leaves = [output] if type(output) is torch.Tensor else _tensors_in(output)
    gathered = group.gathered_storage_ptrs()
    if gathered and any(_storage_ptr(t) in gathered for t in leaves):
        # A view of a gathered param (a row of the weight, weight.t(), the weight itself)
        # would outlive the memory freeing the unit takes away: return a copy, which autograd
        # differentiates like the view.
        output = _map_tensors(lambda t: t.clone() if _storage_ptr(t) in gathered else t, output)
        leaves = [output] if type(output) is torch.Tensor else _tensors_in(output)
    if grad_enabled and not keep and _PEEK_TRANSFORMS is not None and _PEEK_TRANSFORMS() is not None:
        # Inside torch.func.vmap: the outputs are batched wrappers, whose hooks the backward
        # outside the transform never runs, so nothing would gather the unit again for it.
        # Keep it gathered instead; the end of the backward reduces and frees it.
        keep = True
    if grad_enabled:
        hook = _PreBackwardHook(group, group.forward_versions, root.steps)
        for leaf in leaves:
            if leaf.requires_grad and id(leaf) not in handed_back:
                leaf.register_hook(hook)
        if not keep and _SEQUENCE_NR is not None:
            # Tensors the forward made and left in module attributes (an MoE's auxiliary loss,
            # a penalty) may reach the loss without passing the outputs: their backward needs
            # the params too, and may run first.
            returned = {id(t) for t in leaves}  # (the tensors it was handed are not its own)
            for tensor in _made_since(group, group.forward_seq):
                if id(tensor) not in returned:
                    tensor.register_hook(hook)
        if not leaves and group.may_need_params_in_backward():
            # No tensor returned to hang the re-gather on (the result went into an attribute,
            # or an object fshard cannot look into), yet autograd may have saved the gathered
            # params: keep them until the unit's gradients are reduced (or the backward ends).
            keep = True
    if nested:
        # The outer module's forward goes on with the unit gathered and its passed inputs.
        group.passed_inputs = group.outer_passed.pop() if group.outer_passed else None
        group.nested_returned = True
        return output
    if group.post_forward(
        free=not grad_enabled or not keep,
        grad_enabled=grad_enabled,
        model_forward_running=root.root.training_state is TrainingState.FORWARD,
    ):
        root.hidden_kept = True  # rows kept for the backward: the next model forward drops them
    root.record_finish(group)
    if root.root is group:
        root.on_root_post_forward()
    elif grad_enabled and keep and root.root.training_state is not TrainingState.FORWARD:
        # A unit called on its own, outside the model's forward: nothing later hides its kept
        # params, so this does, as the root's post-forward does for the model's units.
        group.hide_unsharded()
        root.hidden_kept = True
    return output


def _pre_backward(
    group: ParamGroup, grad: torch.Tensor | None, versions: tuple[int, ...] | None, step: int
) -> None:
    root = root_of(group)
    root.recover_if_backward_aborted()  # (then this graph is one from before, as after a step)
    root.check_step_order()  # the first pre-backward of a backward: before its collectives
    group.check_unchanged_since_forward(versions)
    if torch.is_grad_enabled():
        # Autograd runs hooks with grad mode on only in a backward with create_graph=True.
        raise RuntimeError(
            f"fshard: a backward with create_graph=True reached unit {group.label} (a gradient "
            "penalty, double backward or Hessian-vector product): fshard frees the gathered "
            "parameters when the backward ends, and the graph it builds would read them later. "
            "Higher-order gradients are not supported through sharded units."
        )
    if step != root.steps:
        _pre_backward_of_earlier_graph(group, root)
        return None
    if group.grads_reduced or group.freed_in_backward:
        # Its backward is over here: every gradient arrived (it was freed, on the ranks where
        # the count is complete) or it was reduced. A later hook (an output made before its
        # params were read, an input kept in an attribute) needs no params, and gathering
        # again only here would leave the other ranks' all-gathers unpaired.
        return None
    root.ensure_final_callback()
    if root._parked:
        root.release_parked(group)
    if group.backward_task is None:
        group.backward_task = torch._C._current_graph_task_id()
    group.pre_backward()
    root.prefetch_for_backward(group, BackwardPrefetch.BACKWARD_PRE)
    return None


def _pre_backward_of_earlier_graph(group: ParamGroup, root: RootState) -> None:
    """A backward reached the output of a forward that ran before the last backward ended: a
    graph kept with ``retain_graph=True`` and traversed again, or one the last backward did
    not reach (two forwards, the first loss's backward, then both). That backward reset the
    unit's bookkeeping, so nothing tells when this one is done with the params: gather them
    once more and keep them, with their gradients reduced (and added to the ones a reduce in
    this backward gave already) when the backward ends.

    Decided by the hook alone, which every rank reaches alike: every rank frees what it holds
    and gathers anew (whether a rank freed the unit in this backward depends on its own count
    of arrived gradients), then nothing frees or reduces the unit early.
    """
    root.ensure_final_callback()
    if group.earlier_graph and not group.grads_reduced:
        return  # gathered for such a graph in this backward, and kept
    group.earlier_graph = True
    group.backward_may_come = True
    group.grads_reduced = False
    group.freed_in_backward = False
    group.reshard()
    group.pre_backward()


def ensure_root_initialised(group: ParamGroup) -> None:
    """Root init (see [Note: root init]) if ``group`` has no root yet: for the first forward and
    for APIs that need FQNs and placement before it. Then the hooks root init calls for: the
    state-dict hooks of modules attached since ``fully_shard`` (a head tied to a unit's), and
    the container hooks of units made after others (see [Note: calls into a unit from outside
    its forward])."""
    if group.root is not None:
        return
    init_root(group)
    index_param_owners(group.module)
    for g in units_under(group.module):
        hook_containers(g)
