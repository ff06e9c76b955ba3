"""Meta-device initialisation: allocate only shards, initialise them as a full model would be.

[Note: materialize and the RNG]
``torch.manual_seed(s); model = Model()`` initialises each module in construction order, each
drawing its values from the global generator. To give *identical* shards without ever holding
the whole model, ``materialize`` walks the modules in the same order (children before their
parent: a module's ``reset_parameters()`` runs at the end of its ``__init__``, once its children
were built) and, for one module at a time, allocates that module's own parameters at full size,
runs its ``reset_parameters()`` (or ``init_fn``), keeps this rank's rows and frees the rest. Peak
extra memory is one module's parameters. A parameter shared by several modules (a tied head) is
initialised by the first of them in that order; later ones still run their initialiser on a
scratch tensor, so the generator advances exactly as in eager construction, where the head's own
weight was initialised and then replaced by the tie. (If the tie's source comes *after* the
module that adopts its weight, eager keeps the source's values and materialize the first
module's: a known difference.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fshard._errors import ProblemList
from fshard._hooks import units_under
from fshard._param import _set_data
from fshard._sharded import is_sharded

__all__ = ["materialize"]

logger = logging.getLogger("fshard")


def materialize(
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Allocate and initialise a meta-device model that ``fully_shard`` has sharded.

    Only this rank's shards are kept. Each module that owns meta parameters or buffers is
    initialised with ``init_fn(module)`` if given, else its ``reset_parameters()``, on a temporary
    full-size copy of *its own* parameters; this rank's rows are kept. With the same seed the
    result equals initialising the full model eagerly and then sharding it, *provided* all of the
    model's initialisation lives in its modules' ``reset_parameters()`` (or ``init_fn``): modules
    are initialised one at a time in construction order, drawing from the global generator as
    eager construction does. A model that re-initialises its weights in ``__init__`` (GPT-2 /
    Hugging Face ``_init_weights`` style) needs ``init_fn`` doing the same per module.
    Initialisers run on the mesh's device, so on a CUDA mesh they draw from the CUDA generator:
    the result equals a model built under ``torch.device("cuda")`` with the same seed, not one
    built on the CPU and moved. Returns ``model``.

    Example:
        >>> with torch.device("meta"):          # doctest: +SKIP
        ...     model = Transformer(config)
        >>> for block in model.blocks:          # doctest: +SKIP
        ...     fshard.fully_shard(block, mesh=mesh)
        >>> fshard.fully_shard(model, mesh=mesh)  # doctest: +SKIP
        >>> torch.manual_seed(0)                  # doctest: +SKIP
        >>> fshard.materialize(model)             # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize expects an nn.Module, got {type(model).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"materialize: init_fn must be callable(module) or None, got {init_fn!r}")
    groups = units_under(model)
    if not groups:
        raise ValueError(
            "materialize: the model has no fshard units; call fshard.fully_shard on it (and its "
            "blocks) first, or use model.to_empty(device=...) for an unsharded model"
        )
    device = groups[0].mesh_info.device
    meta_params = {id(p) for p in model.parameters() if p.is_meta}
    _check_initialisers(model, meta_params, init_fn)
    # 1. Real storage for every meta shard (zeros until initialised below).
    for group in groups:
        if any(b.flat_shard.is_meta for b in group.buckets):
            zeros = [
                torch.zeros(s.layout.local_shape, dtype=s.sharded_param.dtype, device=device)
                for s in group.slots
            ]
            group.set_slots(group.slots, zeros)
    # 2. Initialise module by module, children before their parent (see the module docstring).
    done: set[int] = set()
    for module in _post_order(model, set()):
        own = list(module._parameters.items())
        meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        needs = [(n, p) for n, p in own if p is not None and id(p) in meta_params]
        if not needs and not meta_buffers:
            continue
        for name in meta_buffers:
            buffer = module._buffers[name]
            module._buffers[name] = torch.empty_like(buffer, device=device)  # type: ignore[arg-type]  # not None above
        _init_module(module, needs, init_fn, done, device)
    return model


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    """Each module once, after its children: the order eager construction initialises them
    (a module's ``reset_parameters()`` runs at the end of its ``__init__``, after its children
    were built and initialised), and the order of ``nn.Module.apply``."""
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module


def _initialiser(module: nn.Module) -> Callable[[], None] | None:
    """``reset_parameters``, or the private ``_reset_parameters`` some torch modules use
    (``nn.MultiheadAttention``)."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _check_initialisers(
    model: nn.Module, meta_params: set[int], init_fn: Callable[[nn.Module], None] | None
) -> None:
    if init_fn is not None:
        return
    problems = ProblemList("materialize")
    for name, module in model.named_modules():
        owns_meta = any(p is not None and id(p) in meta_params for p in module._parameters.values())
        owns_meta = owns_meta or any(b is not None and b.is_meta for b in module._buffers.values())
        if owns_meta and _initialiser(module) is None:
            problems.add(
                f"module {name or '<root>'!r} ({type(module).__name__}) owns meta parameters or "
                "buffers but has no reset_parameters()"
            )
    problems.raise_if_any(
        ValueError, hint="Pass init_fn=callable(module) that initialises a module's own tensors."
    )


def _init_module(
    module: nn.Module,
    needs: list[tuple[str, nn.Parameter]],
    init_fn: Callable[[nn.Module], None] | None,
    done: set[int],
    device: torch.device,
) -> None:
    originals = dict(module._parameters)
    for name, param in needs:
        shape = param.full_shape if is_sharded(param) else param.shape
        full = torch.empty(shape, dtype=param.dtype, device=device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            else:
                initialiser = _initialiser(module)
                if initialiser is None:  # _check_initialisers rules this out
                    raise RuntimeError(f"materialize: {type(module).__name__} lost its reset_parameters()")
                initialiser()
    finally:
        initialised = dict(module._parameters)
        module._parameters.update(originals)
    for name, param in needs:
        if id(param) in done:
            continue  # tied: the first owner initialised it; this run only advanced the RNG
        done.add(id(param))
        value = initialised[name]
        if value is None:
            continue
        with torch.no_grad():
            if is_sharded(param):
                layout = param._fshard_slot.layout
                local = value if layout.replicated else value.narrow(0, layout.row_offset, layout.local_shape[0])
                param.copy_(local.to(param.device))
            else:  # not sharded (ignored_params): the same object, now with real storage
                _set_data(param, value.detach().to(device))
