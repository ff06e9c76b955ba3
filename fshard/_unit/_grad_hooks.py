"""The per-parameter autograd hooks of a unit.

Each parameter that requires grad gets, once, a post-accumulate-grad hook on its unsharded param
(gradient arrivals, counted by the unit: [Note: when a unit's backward is done] in
``_backward``) and one on its sharded param (a use outside the unit's forward: a warning). A
user's hooks on a sharded param run on the unsharded grad (``register_hook``) or once the sharded
grad lands (``register_post_accumulate_grad_hook``): see [Note: fshard tensors] in ``_param``.

Every hook holds its unit weakly: a hook held by a tensor on the C++ side hides its references
from the garbage collector, so a strong one would keep the model alive forever.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from fshard._errors import warn_user
from fshard._param import ParamSlot

__all__ = ["GradHookOwner", "ensure_grad_hooks", "forward_tensor_hooks", "run_user_grad_hooks"]


class _WarnsOnce(Protocol):
    warned_sharded_use: bool  # the sharded-use warning was given for this model


class GradHookOwner(Protocol):
    """What the hooks need of their unit (``ParamGroup``)."""

    @property
    def label(self) -> str: ...

    @property
    def root(self) -> _WarnsOnce | None: ...

    def on_grad_accumulated(self, param: torch.Tensor) -> None: ...


def ensure_grad_hooks(
    owner: GradHookOwner, slot: ParamSlot, handles: list[torch.utils.hooks.RemovableHandle]
) -> None:
    """Hook ``slot``'s unsharded param (its gradient arrivals go to ``owner``; the handle goes
    into ``handles``) and its sharded param (a use while sharded warns), once each."""
    unsharded = slot.unsharded_param
    if unsharded is None:
        return  # built on first unshard, hooked then
    if unsharded.requires_grad and not unsharded.__dict__.get("_fshard_hooked", False):
        unsharded._fshard_hooked = True  # type: ignore[attr-defined]  # marker on our own tensor
        ref = weakref.ref(owner)  # weakly: see the module docstring

        def hook(param: torch.Tensor) -> None:
            group = ref()
            if group is not None:
                group.on_grad_accumulated(param)

        handles.append(unsharded.register_post_accumulate_grad_hook(hook))
    sharded = slot.sharded_param
    hooks = sharded._post_accumulate_grad_hooks
    if sharded.__dict__.pop("_fshard_swapped", False) and hooks is not None:
        # A swapped-in tensor ([Note: swapped sharded parameters]): give it the hooks dict
        # (assigning it registers it with autograd), without the old tensor's internal hook.
        for key in [k for k, hook in hooks.items() if getattr(hook, "_fshard_internal", False)]:
            del hooks[key]
        sharded._post_accumulate_grad_hooks = hooks
    if sharded.requires_grad and not sharded.__dict__.get("_fshard_hooked", False):
        sharded._fshard_hooked = True  # marker, as above
        sharded.register_post_accumulate_grad_hook(
            _used_while_sharded(slot.fqn, owner.label, weakref.ref(owner))
        )


def _used_while_sharded(
    fqn: str, unit: str, group_ref: weakref.ref[GradHookOwner]
) -> Callable[[torch.Tensor], None]:
    """A hook for autograd accumulating into a *sharded* param: something outside the unit's
    forward used the registered parameter while it held only this rank's shard (no fshard
    computation puts a sharded param in the graph; ``to_local()`` is detached). Right for an
    elementwise use (a penalty over ``model.parameters()``: the shard's gradient is this
    rank's rows of the full one), wrong for one that mixes rows (``F.linear(h, embed.weight)``
    in the parent): a warning, once per model, since the two cannot be told apart here."""

    def hook(_param: torch.Tensor) -> None:
        group = group_ref()
        root = group.root if group is not None else None
        if root is None or root.warned_sharded_use:
            return
        root.warned_sharded_use = True
        warn_user(
            f"fshard: parameter {fqn!r} of unit {unit} got a gradient from a use outside its "
            "unit's forward, where it holds only this rank's shard. That is right for an "
            "elementwise use (a penalty such as sum(p.pow(2).sum() for p in "
            "model.parameters()); its value is this rank's part), and wrong for anything that "
            "mixes the parameter's rows, e.g. a tied head calling F.linear(h, self.embed.weight) "
            "in the parent: put the owner and the user in one unit (fully_shard their common "
            "parent only, or tie through an nn.Module sharing the weight). Warned once per model."
        )

    hook._fshard_internal = True  # type: ignore[attr-defined]  # marker: not run by run_user_grad_hooks
    return hook


def forward_tensor_hooks(slot: ParamSlot) -> None:
    """Make the hooks a user registered on a sharded param with ``register_hook`` run on its
    unsharded param's gradient, the one autograd computes (full shape, before the reduction, as
    DDP runs them before its all-reduce): autograd never computes a sharded param's own."""
    unsharded = slot.unsharded_param
    if unsharded is None or unsharded.__dict__.get("_fshard_forwards_hooks", False):
        return
    unsharded._fshard_forwards_hooks = True  # type: ignore[attr-defined]  # marker on our own tensor
    sharded_ref = weakref.ref(slot.sharded_param)  # weakly: see the module docstring

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        sharded = sharded_ref()
        hooks = sharded._backward_hooks if sharded is not None else None
        if not hooks:
            return None
        dtype = grad.dtype
        for user_hook in list(hooks.values()):
            changed = user_hook(grad)
            if changed is not None:
                grad = changed
        # A hook may promote (an fp32 mask on a bf16 gradient under MixedPrecision).
        return grad if grad.dtype == dtype else grad.to(dtype)

    unsharded.register_hook(hook)


def run_user_grad_hooks(param: torch.Tensor) -> None:
    """Run the post-accumulate-grad hooks users registered on a sharded param, once its sharded
    grad has landed in ``.grad`` (autograd never accumulates into a sharded param itself).
    This is what optimizer-in-backward (a per-parameter ``step()`` in such a hook) needs."""
    hooks = param._post_accumulate_grad_hooks
    if not hooks:
        return
    for hook in list(hooks.values()):
        if not getattr(hook, "_fshard_internal", False):
            hook(param)
