"""Checks a unit's hooks run before gathering: the module still holds fshard's parameters, no
torch.func transform differentiates through the unit."""

from __future__ import annotations

import logging

import torch
from torch import nn

from fshard._param import is_sharded
from fshard._unit._group import ParamGroup

logger = logging.getLogger("fshard")

_functorch = torch._C._functorch


_PEEK_TRANSFORMS = getattr(_functorch, "peek_interpreter_stack", None)


_DIFFERENTIATING = {
    getattr(getattr(_functorch, "TransformType", None), name, None) for name in ("Grad", "Jvp")
} - {None}


def _refuse_functorch_differentiation(group: ParamGroup) -> None:
    """``torch.func.grad`` / ``vjp`` / ``jacrev`` / ``jvp`` differentiate at their own level,
    outside the autograd hooks that gather a unit for its backward."""
    stack = _functorch.get_interpreter_stack() or []
    if any(interpreter.key() in _DIFFERENTIATING for interpreter in stack):
        raise RuntimeError(
            f"fshard: unit {group.label} ran inside a torch.func transform that differentiates "
            "(grad, vjp, jacrev, jacfwd, jvp), which fshard does not support: such a transform "
            "differentiates outside the autograd hooks that gather the unit's parameters for "
            "its backward. Use torch.autograd.grad (for gradients with respect to inputs) or "
            "torch.autograd.functional.jacobian on the model instead; torch.func.vmap alone "
            "works."
        )


def check_params_in_place(groups: list[ParamGroup], *, before_init: nn.Module | None = None) -> None:
    """Each module still holds the parameter fshard manages (its shard, or its gathered
    copy). One put there since (``block.lin.weight = nn.Parameter(...)``, weights tied
    anew) would be silently replaced by the old shard at the next gather, and a tensor
    substituted for the call (``torch.func.functional_call``) would be overwritten by the
    gathered copy: refuse both. Before root init (``before_init``: the root module, which names
    them) a sharded parameter put there is a tie made since ``fully_shard``
    (``tie_weights()``), which root init places: only other tensors and unsharded parameters
    are refused."""
    for group in groups:
        for slot in group.slots:
            for module, name in slot.registrations:
                current = module._parameters.get(name)
                if current is None:
                    if before_init is not None:
                        continue  # moved (a parametrization registered since): root init finds it
                elif (
                    current is slot.sharded_param
                    or current is slot.unsharded_param
                    or (before_init is not None and is_sharded(current))
                ):
                    continue
                fqn, unit = slot.fqn, group.label
                if before_init is not None:  # no FQNs yet
                    names = {id(m): n for n, m in before_init.named_modules()}
                    fqn = f"{names[id(module)]}.{name}".lstrip(".")
                    unit = repr(names[id(group.module)]) if names[id(group.module)] else "<root>"
                if current is None:
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} was removed from its module "
                        f"after the model ran ({type(module).__name__}.{name} is no longer a "
                        "parameter there: torch.nn.utils.parametrize.register_parametrization, "
                        "parametrizations.weight_norm or prune move it); fshard would put its "
                        "gathered copy back where the module no longer reads it. Apply them "
                        "before the first forward (best, before calling fully_shard)."
                    )
                if not isinstance(current, nn.Parameter):
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} holds another "
                        f"tensor ({type(module).__name__}.{name} is a "
                        f"{type(current).__name__} of shape {list(current.shape)}), as "
                        "torch.func.functional_call and torch.nn.utils.stateless put there "
                        "for one call; fshard would overwrite it with the gathered parameter "
                        "and compute with the model's own weights. Calling a sharded model "
                        "with substituted parameters is not supported: copy the values into "
                        "the shards instead (fshard.load_state_dict, or with torch.no_grad(): "
                        "p.to_local().copy_(...)), or call an unsharded copy of the module."
                    )
                if slot.sharded_param.is_meta and not current.is_meta:
                    raise ValueError(
                        f"fshard: parameter {fqn!r} of unit {unit} was replaced after "
                        f"fully_shard by a new one on {current.device} while fshard's shard is "
                        "still on the meta device: module.to_empty(device=...) after fully_shard "
                        "does this. To initialise a model built on the meta device after "
                        "sharding, call fshard.materialize(model) instead of to_empty (it gives "
                        "the shards storage in place and runs each module's reset_parameters, or "
                        "your init_fn)."
                    )
                raise ValueError(
                    f"fshard: parameter {fqn!r} of unit {unit} was replaced "
                    f"after fully_shard ({type(module).__name__}.{name} = another "
                    "Parameter); fshard manages the one it sharded and would put it back. "
                    "Change its values in place instead (with torch.no_grad(): "
                    "p.to_local().copy_(...), or fshard.load_state_dict), or replace it "
                    "before calling fully_shard."
                )
