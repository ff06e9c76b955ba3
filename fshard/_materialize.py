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

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fshard._errors import ProblemList, first_few, warn_user
from fshard._param import is_sharded, local_rows, set_data
from fshard._unit._module_state_dict import allocate_meta_shards
from fshard._unit._registry import units_under

__all__ = ["allocate_for_load", "materialize"]

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
    Hugging Face ``_init_weights`` style) needs ``init_fn`` doing the same per module. An
    initialiser that draws into a submodule's parameter (which holds this rank's shard by
    then) is an error naming it (elementwise changes such as ``nn.init.zeros_`` or ``mul_``
    are fine: they give the same rows), and a module that owns no parameters but has an
    initialiser, which materialize does not run (``nn.Transformer``'s), is named in a warning.
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
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    _warn_skipped_initialisers(model, meta_params, init_fn, names)
    with _rnn_weight_refs_dropped(model):
        _check_weakrefs(model)
        # 1. Real storage for every meta shard (zeros until initialised below).
        for group in groups:
            allocate_meta_shards(group)
        # 2. Initialise module by module, children before their parent (see the module
        # docstring).
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
            _init_module(module, needs, init_fn, done, device, names[id(module)])
    return model


def allocate_for_load(model: nn.Module) -> bool:
    """Storage without values for what ``model`` holds on the meta device, for a load that
    fills it next: each meta unit's shards (only this rank's rows), meta parameters fshard does
    not shard (ignored ones), and meta persistent buffers, on the mesh's device. No initialiser
    runs. Non-persistent buffers stay as they are (no state dict holds them: the caller gives
    them values or refuses them). Returns whether anything was on the meta device.

    See [Note: loading into a meta model] in ``fshard._state_dict._common``.
    """
    groups = units_under(model)
    if not groups:
        return False
    device = groups[0].mesh_info.device
    allocated = False
    fresh: dict[int, torch.Tensor] = {}  # a buffer registered under two modules: one tensor
    with _rnn_weight_refs_dropped(model):
        for group in groups:
            allocated = allocate_meta_shards(group) or allocated
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and param.is_meta and not is_sharded(param):
                    set_data(param, torch.empty_like(param, device=device))
                    allocated = True
            for name, buffer in module._buffers.items():
                if (
                    buffer is not None
                    and buffer.is_meta
                    and name not in module._non_persistent_buffers_set
                ):
                    if id(buffer) not in fresh:  # (every meta buffer is alive: ids unique)
                        fresh[id(buffer)] = torch.empty_like(buffer, device=device)
                    module._buffers[name] = fresh[id(buffer)]
                    allocated = True
    return allocated


@contextlib.contextmanager
def _rnn_weight_refs_dropped(model: nn.Module) -> Iterator[None]:
    """RNN modules (``nn.GRU``, ``nn.LSTM``) hold weak references to their parameters, and a
    tensor with weak references cannot be given storage in place (``torch.utils.swap_tensors``
    refuses it): drop them meanwhile, then let each module take its parameters again, as
    ``nn.RNNBase._apply`` does around ``module.to(...)``."""
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns:
            rnn._init_flat_weights()


def _check_weakrefs(model: nn.Module) -> None:
    """Before anything changes: a meta parameter something else holds a weak reference to
    cannot get storage in place."""
    problems = ProblemList("materialize")
    for name, param in model.named_parameters():
        if param.is_meta and weakref.getweakrefcount(param):
            problems.add(
                f"parameter {name!r} is held by a weak reference (from a module or a library "
                "that tracks it), so it cannot be given storage in place"
            )
    problems.raise_if_any(
        ValueError,
        hint="Build the module holding it on the device instead of under torch.device('meta').",
    )


def _warn_skipped_initialisers(
    model: nn.Module,
    meta_params: set[int],
    init_fn: Callable[[nn.Module], None] | None,
    names: dict[int, str],
) -> None:
    """A module that owns no meta tensors is not initialised, though it may have an
    initialiser that eager construction runs over its submodules (``nn.Transformer``'s
    ``_reset_parameters``): say so, since the result then differs from eager init."""
    if init_fn is not None:
        return
    skipped = []
    for module in model.modules():
        below = any(id(p) in meta_params for p in module.parameters())
        if below and not _owns_meta(module, meta_params) and _initialiser(module) is not None:
            skipped.append(f"{names[id(module)]!r} ({type(module).__name__})")
    if skipped:
        warn_user(
            f"fshard.materialize does not run the initialiser of module(s) {first_few(skipped)}: "
            "they own no parameters, and materialize initialises each module's own. If it "
            "(re)initialises its submodules, as eager construction may do, the result differs "
            "from eager init: pass init_fn doing that per module."
        )


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    """Each module once, after its children: the order eager construction initialises them
    (a module's ``reset_parameters()`` runs at the end of its ``__init__``, after its children
    were built and initialised), and the order of ``nn.Module.apply``."""
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module


def _owns_meta(module: nn.Module, meta_params: set[int]) -> bool:
    """Whether ``module`` itself (not a submodule) holds meta parameters or buffers, which
    materialize initialises with its initialiser."""
    return any(p is not None and id(p) in meta_params for p in module._parameters.values()) or any(
        b is not None and b.is_meta for b in module._buffers.values()
    )


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
        if _owns_meta(module, meta_params) and _initialiser(module) is None:
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
    fqn: str,
) -> None:
    originals = dict(module._parameters)
    for name, param in needs:
        shape = param.full_shape if is_sharded(param) else param.shape
        full = torch.empty(shape, dtype=param.dtype, device=device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    # The shards it must not touch: its submodules' (and its own that it does not initialise).
    guard = _ShardWrites([(n, p) for n, p in module.named_parameters() if is_sharded(p)])
    failed: Exception | None = None
    try:
        with torch.no_grad(), guard:
            if init_fn is not None:
                init_fn(module)
            else:
                initialiser = _initialiser(module)
                if initialiser is None:  # _check_initialisers rules this out
                    raise RuntimeError(f"materialize: {type(module).__name__} lost its reset_parameters()")
                initialiser()
    except Exception as exc:  # torch's own error about a write into a shard: say why, below
        if not guard.writes:
            raise
        failed = exc
    finally:
        initialised = dict(module._parameters)
        module._parameters.update(originals)
    if guard.writes:
        who = "init_fn" if init_fn is not None else f"{type(module).__name__}.{_initialiser(module).__name__}()"  # type: ignore[union-attr]  # checked above
        raise ValueError(
            f"materialize: {who} of module {fqn!r} draws or writes values into parameter(s) "
            f"{first_few(guard.writes)}, which are not its own to initialise (a submodule's) "
            "and hold this rank's shard by then: materialize initialises one module's own "
            "parameters at a time, on a full-size copy, so every rank would draw the same "
            "numbers for its rows (and nn.init would compute fans from the shard's shape). "
            "Elementwise changes there are fine (fills, mul_, clamp_). Make each module's "
            "initialiser draw only its own parameters (or pass init_fn doing that per module), "
            "or initialise the model before sharding it."
        ) from failed
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
                local = local_rows(value, layout)
                param.copy_(local.to(param.device))
            else:  # not sharded (ignored_params): the same object, now with real storage
                set_data(param, value.detach().to(device))


class _ShardWrites(TorchFunctionMode):
    """Records the draws and the writes by position into ``shards`` (or views of them) while a
    module's initialiser runs. An elementwise change (a fill, ``mul_``, ``clamp_``) gives the
    full tensor's rows whatever the shape; a draw (``normal_``, ``uniform_``, nn.init's
    initialisers, which also read the shape) or a write of another tensor's values (``copy_``,
    ``w[:] = ...``, ``w.data = ...``, ``out=w``) into a shard does not. Decided by the calls
    made, the same on every rank. Values computed elsewhere from the shard's shape and then
    added in (``w.add_(torch.randn(w.shape))``) are not seen."""

    _WRITES = frozenset(
        {
            # random draws, as tensor methods and as nn.init functions (the tensor by keyword)
            "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
            "cauchy_", "log_normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
            "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "eye_", "dirac_",
            # another tensor's values, or writes by position
            "copy_", "set_", "__setitem__", "index_fill_", "index_copy_", "index_add_",
            "index_put_", "index_reduce_", "fill_diagonal_", "scatter_", "scatter_add_",
            "scatter_reduce_", "masked_scatter_", "put_", "resize_", "resize_as_", "as_strided_",
            "t_", "transpose_", "swapdims_", "squeeze_", "unsqueeze_",
        }
    )  # fmt: skip

    def __init__(self, shards: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self._watched = {id(t): (name, t) for name, t in shards}  # holding t keeps its id
        self.writes: list[str] = []

    def _name_of(self, value: object) -> str | None:
        found = self._watched.get(id(value))
        return found[0] if found is not None and found[1] is value else None

    def _record(self, name: str, op: str) -> None:
        write = f"{name!r} ({op})"
        if write not in self.writes:
            self.writes.append(write)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = self._name_of(target)
        op = getattr(func, "__name__", "")
        writes = op in self._WRITES or (
            op == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"
        )
        if name is not None and writes:
            self._record(name, ".data =" if op == "__set__" else op)
        out_name = self._name_of(kwargs.get("out"))
        if out_name is not None:
            self._record(out_name, f"{op}(out=)")
        result = func(*args, **kwargs)  # (recorded first: it may raise on a shard)
        if (
            name is not None
            and not writes
            and isinstance(result, torch.Tensor)
            and torch._C._is_alias_of(result, target)  # type: ignore[attr-defined]  # private, stable since 1.x
        ):
            self._watched[id(result)] = (name, result)  # p.data, p.view(...), p[0]: writes count too
        return result
