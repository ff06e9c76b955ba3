"""The controls that act on a sharded module after ``fully_shard``: gradient sync
(``no_sync``, ``set_requires_gradient_sync``), resharding (``set_reshard_after_forward`` /
``_backward``), the gradient divide factor, forward methods, explicit ``unshard``/``reshard``
and prefetch."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from fshard import _collectives
from fshard._api import post_forward_setting
from fshard._errors import RankMismatchError
from fshard._mesh import MeshInfo
from fshard._options import BackwardPrefetch
from fshard._runtime._hooks import ensure_root_initialised, hook_forward_method
from fshard._runtime._root import check_prefetch_targets, root_of
from fshard._runtime._root_init import check_prefetch_alike
from fshard._unit._group import ParamGroup, ShardedState
from fshard._unit._registry import unit_of, units_or_error, units_under

__all__ = [
    "set_coalescing",
    "no_sync",
    "set_requires_gradient_sync",
    "register_forward_method",
    "set_gradient_divide_factor",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "unshard",
    "reshard",
    "UnshardHandle",
    "set_prefetch",
]


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on or off for every unit in ``module`` (gradient accumulation).

    With sync off, backward keeps full (unsharded) gradients and communicates nothing; the next
    backward with sync on reduces the sum, which equals DDP's ``no_sync``.

    Example:
        >>> fshard.set_requires_gradient_sync(model, False)  # doctest: +SKIP
        >>> model(x1).sum().backward()                       # doctest: +SKIP
        >>> fshard.set_requires_gradient_sync(model, True)   # doctest: +SKIP
        >>> model(x2).sum().backward()                       # doctest: +SKIP
    """
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(
            f"set_requires_gradient_sync: requires_gradient_sync must be a bool, got "
            f"{requires_gradient_sync!r}"
        )
    for group in units_or_error(module, "set_requires_gradient_sync"):
        group.requires_gradient_sync = requires_gradient_sync
        group.reduce_scatter_while_accumulating = False


@contextlib.contextmanager
def no_sync(module: nn.Module, *, reduce_scatter: bool = False) -> Iterator[None]:
    """Accumulate gradients over several backward passes without synchronising them.

    Inside the context, backward does not reduce gradients; the first backward after it reduces
    the accumulated sum (equal to DDP's ``no_sync``). With ``reduce_scatter=True`` every
    micro-batch is reduce-scattered instead, so gradients stay sharded (1/N memory) while
    accumulating; on a 2D mesh only the cross-replica all-reduce waits for the sync step.
    Until that step the accumulated sum is fshard's, not in the parameters' ``.grad`` (which
    hold shards): ``optimizer.zero_grad()`` between micro-batches does not drop it (as in
    FSDP2; under DDP it would), so run every micro-batch you start to its synchronised step.
    (With ``reduce_scatter=True`` on a 1D mesh nothing waits: each micro-batch's shard is
    added to ``.grad`` at once, and ``zero_grad()`` drops it, as in FSDP2.)

    Example:
        >>> with fshard.no_sync(model):               # doctest: +SKIP
        ...     model(micro_batch_1).sum().backward()
        >>> model(micro_batch_2).sum().backward()     # reduces both  # doctest: +SKIP
    """
    if not isinstance(reduce_scatter, bool):
        raise TypeError(f"no_sync: reduce_scatter must be a bool, got {reduce_scatter!r}")
    groups = units_or_error(module, "no_sync")
    previous = [(g.requires_gradient_sync, g.reduce_scatter_while_accumulating) for g in groups]
    for g in groups:
        g.requires_gradient_sync = False
        g.reduce_scatter_while_accumulating = reduce_scatter
    try:
        yield
    finally:
        for g, (sync, scatter) in zip(groups, previous, strict=True):
            g.requires_gradient_sync = sync
            g.reduce_scatter_while_accumulating = scatter


def set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool) -> None:
    """Keep (``False``) or free (``True``, the default) every unit's gathered parameters after
    a backward without gradient sync (a gradient accumulation micro-batch), for the units in
    ``module``.

    With ``False`` a unit's gathered parameters outlive such a backward (the modules show the
    shards meanwhile), and its next forward uses them without an all-gather. With
    ``reshard_after_forward=False`` units, a gradient accumulation loop then gathers each unit
    once: in the first micro-batch's forward. A synchronised backward (the last micro-batch,
    or any step without ``no_sync``) frees them as usual, so the forward after an optimizer
    step always gathers the new values (fused optimizers and ``p.data`` edits change the shards
    without a trace fshard could check), and an ``optimizer.step()`` between micro-batches
    frees the kept units whose parameters it updates. Edits of the shards between
    micro-batches through the parameters (``p.to_local().mul_(...)``, a state dict load,
    ``p.data = ...``) are seen, and the next forward gathers afresh; in-place writes to
    ``p.data`` (``p.data.mul_(...)``) are not. The price is memory: every unit that ran stays
    gathered through the accumulation. What FSDP2's ``module.set_reshard_after_backward(False)``
    is used for; ``fshard.reshard(model)`` frees them.

    Setting it back to ``True`` frees nothing at once: what a backward kept is reused by the
    next forward and freed by the backward after it, so FSDP2's pattern (both flags on only for
    the last micro-batch) gathers each unit once per optimizer step when its
    ``reshard_after_forward`` is ``False``.

    Example:
        >>> for i, x in enumerate(micro_batches):              # doctest: +SKIP
        ...     last = i == len(micro_batches) - 1
        ...     fshard.set_requires_gradient_sync(model, last)
        ...     fshard.set_reshard_after_backward(model, last)
        ...     model(x).sum().backward()
        >>> fshard.set_reshard_after_backward(model, False)  # doctest: +SKIP
        >>> with fshard.no_sync(model):                      # doctest: +SKIP
        ...     for x in micro_batches[:-1]:
        ...         model(x).sum().backward()                # gathers only the first time
        >>> model(micro_batches[-1]).sum().backward()        # doctest: +SKIP
        >>> fshard.set_reshard_after_backward(model, True)   # doctest: +SKIP
        >>> opt.step()                                       # doctest: +SKIP
    """
    if not isinstance(reshard_after_backward, bool):
        raise TypeError(
            f"set_reshard_after_backward: reshard_after_backward must be a bool, got "
            f"{reshard_after_backward!r}"
        )
    for group in units_or_error(module, "set_reshard_after_backward"):
        # Turning it back on frees nothing now: a unit kept from the previous micro-batch's
        # backward is reused by the next forward (FSDP2's pattern flips it on before the last
        # micro-batch), and the backward after it frees it.
        group.reshard_after_backward = reshard_after_backward


def set_coalescing(module: nn.Module, max_bytes: int) -> None:
    """Let adjacent small units in ``module`` share their collectives: units the forward (or
    the backward) runs one after another are all-gathered in one collective, and their gradients
    reduce-scattered in one (on a 2D mesh also all-reduced across replicas in one), while the
    shared buffer stays within ``max_bytes``
    (1 MiB by default; ``0`` gives every unit its own collectives, as FSDP2 does).

    Each collective costs a fixed latency besides its bytes (about 0.1-0.2 ms over gloo, tens of
    microseconds over NCCL), paid twice per unit in every step, so a model of many small units
    spends its step waiting rather than computing: on 2 CPU ranks, a GPT of 64 blocks of width
    64 steps in 218 ms with coalescing where it took 333 ms without. What you wrapped does not
    change: each unit is still gathered before its forward and backward and freed after them,
    and its gradients land as if reduced alone (the same sums; a collective over more than two
    ranks may add an element's terms in another order). Only units whose all-gather output is
    at most ``max_bytes`` join, and those of one all-gather are held from its issue (prefetched
    together), as are the gradients of one reduce-scatter until its issue: the price is up to
    about ``2 * max_bytes`` of memory more in backward. Units with more than one parameter
    dtype, ``reshard_after_forward=<int>`` or explicit ``set_prefetch`` lists gather alone,
    and gradients carrying ``no_sync`` sums are reduced alone. Set it alike on every rank.

    Example:
        >>> fshard.set_coalescing(model, 4 << 20)   # doctest: +SKIP
        >>> fshard.set_coalescing(model, 0)         # doctest: +SKIP
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise TypeError(f"set_coalescing: max_bytes must be an int >= 0, got {max_bytes!r}")
    groups = units_or_error(module, "set_coalescing")
    for group in groups:
        group.coalesce_bytes = max_bytes
    if groups[0].root is not None:  # the model has run: the ranks must agree (else checked then)
        check_prefetch_alike(root_of(groups[0]), "set_coalescing")


def set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool | int) -> None:
    """Change ``reshard_after_forward`` of every unit in ``module`` after ``fully_shard``: from
    the next forward on, each frees its gathered parameters after its forward (``True``) and
    gathers them again for its backward, or keeps them until its backward (``False``). Every
    rank must set the same. FSDP2's ``module.set_reshard_after_forward(flag)``.

    Keeping them costs memory for the whole forward and saves an all-gather per unit in
    backward: worth it for the last micro-batches of a step, or for a forward with a short
    backward. The root's parameters are kept either way (its backward starts first). An int
    reshards to that many ranks, as ``fully_shard``'s does.

    Example:
        >>> fshard.set_reshard_after_forward(model, False)  # ZeRO-2 for this step  # doctest: +SKIP
        >>> model(x).sum().backward()                       # doctest: +SKIP
        >>> fshard.set_reshard_after_forward(model, True)   # doctest: +SKIP
    """
    where = "set_reshard_after_forward"
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"{where}: reshard_after_forward must be a bool, or an int (the number of ranks to "
            f"reshard to after forward), got {reshard_after_forward!r}"
        )
    groups = units_or_error(module, where)
    settings = [post_forward_setting(reshard_after_forward, g.mesh_info, where) for g in groups]
    for group, setting in zip(groups, settings, strict=True):
        group.reshard_after_forward = setting


def set_gradient_divide_factor(module: nn.Module, factor: float | None) -> None:
    """Divide the gradients' sum over the data-parallel ranks by ``factor`` instead of their
    number, for the units in ``module``: ``factor=1.0`` gives the sum, ``None`` (the default)
    the average, as DDP. Every rank must set the same factor.

    For a loss that is already normalised globally (summed over tokens and divided by the
    global token count, as FSDP2 users do with ``set_gradient_divide_factor(1.0)``), or a
    gradient scale of your own. FSDP2's ``module.set_gradient_divide_factor(factor)``, which
    sets it for that module's unit only; here every unit under ``module`` gets it (pass a
    unit's module to set one). With half-precision reductions part of the division still
    happens before the sum (by a power of two depending on the number of ranks, not on
    ``factor``), so a sum does not overflow where the average would not.

    Example:
        >>> fshard.set_gradient_divide_factor(model, 1.0)  # doctest: +SKIP
        >>> (loss_sum / global_tokens).backward()          # doctest: +SKIP
    """
    if factor is not None and (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not math.isfinite(factor)
        or factor <= 0
    ):
        raise ValueError(
            f"set_gradient_divide_factor: factor must be a positive finite number (or None for "
            f"the average over ranks), got {factor!r}"
        )
    for group in units_or_error(module, "set_gradient_divide_factor"):
        group.gradient_divide_factor = None if factor is None else float(factor)


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run as a forward of ``module``'s unit: called from
    outside the unit's forward it gathers the parameters first and frees them after (or
    keeps them for the backward, as a forward would), so that methods other than ``forward``
    that read the unit's parameters (``generate``, ``encode``, a loss method) compute with the
    full parameters rather than this rank's shards. Called inside the unit's forward, it runs
    as it is. FSDP2's ``register_fsdp_forward_method``.

    ``module`` must be a module that ``fshard.fully_shard`` was called on (the root, for a
    method of the model). A method of the root that calls the model itself (generate's
    decoding steps) runs those calls inside the one forward it began: the root is gathered
    once for the whole method. Every rank must call the method (it is a forward: a
    collective). Registering the same method again does nothing (a method put in its place
    since is wrapped in turn). Generator functions are refused: their body runs after the call
    returns. Called with grad, a method whose model calls all run without grad (transformers'
    ``generate`` is decorated with ``torch.no_grad``) and whose result requires no grad frees
    the units, as a forward without grad does.

    Example:
        >>> fshard.fully_shard(model)                           # doctest: +SKIP
        >>> fshard.register_forward_method(model, "generate")  # doctest: +SKIP
        >>> with torch.no_grad():                              # doctest: +SKIP
        ...     tokens = model.generate(prompt, max_new_tokens=20)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_forward_method expects an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        name = getattr(method_name, "__name__", None) if callable(method_name) else None
        hint = f": pass its name, {name!r}" if isinstance(name, str) else ""
        raise TypeError(
            f"register_forward_method: method_name must be the method's name as a str, got "
            f"{method_name!r}{hint}"
        )
    group = unit_of(module)
    if group is None:
        raise ValueError(
            f"register_forward_method: {type(module).__name__} is not an fshard unit: call "
            f"fshard.fully_shard on it first (for a method of the model: on the model, the root), "
            "then register its methods"
        )
    if method_name == "forward":
        raise ValueError(
            f"register_forward_method: {type(module).__name__}.forward already runs as the unit's "
            "forward; register other methods (generate, encode, ...)"
        )
    method = getattr(module, method_name, None)
    if not callable(method) or isinstance(method, nn.Module):
        what = "has no attribute" if method is None else f"has {type(method).__name__}"
        raise ValueError(
            f"register_forward_method: {type(module).__name__} {what} {method_name!r}, not a "
            "method: name a method of the module"
        )
    if inspect.isgeneratorfunction(method) or inspect.isasyncgenfunction(method):
        raise ValueError(
            f"register_forward_method: {type(module).__name__}.{method_name} is a generator "
            "function: its body runs after the call returns, outside the forward the call ran "
            "as, and would compute with this rank's shards. Register a method that returns its "
            "result (one decoding step, say) and yield from a loop around it"
        )
    hook_forward_method(group, module, method_name)


class UnshardHandle:
    """Returned by ``fshard.unshard(module, async_op=True)``; ``wait()`` finishes the gather.

    Example:
        >>> handle = fshard.unshard(model, async_op=True)  # doctest: +SKIP
        >>> overlap_other_work()                           # doctest: +SKIP
        >>> handle.wait()                                  # full params now  # doctest: +SKIP
    """

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            if group.sharded_state is ShardedState.UNSHARDING:
                group.unshard()  # waits (or gathers afresh if the shards changed since)
        self._groups = []


def unshard(module: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """Gather the full parameters of every unit in ``module`` (collective on the mesh).

    The module then holds full parameters until ``fshard.reshard(module)`` (or the end of the
    next forward/backward, as the unit's settings say). With ``async_op=True`` the all-gathers are
    issued and a handle is returned; call ``handle.wait()`` before using the parameters.

    Every rank must call it with the same module (not under ``if rank == 0:``). A blocking call
    first checks, with one tiny all-gather, that the ranks gather the same units in the same
    state, and raises ``RankMismatchError`` where they do not (gathers of equal-sized units
    would otherwise exchange rows silently).

    Example:
        >>> fshard.unshard(model)           # doctest: +SKIP
        >>> model.fc.weight.shape           # full shape now  # doctest: +SKIP
        >>> fshard.reshard(model)           # doctest: +SKIP
    """
    groups = units_or_error(module, "unshard")
    ensure_root_initialised(groups[0])  # the outermost unit: its tree gets names and checks
    if not async_op:
        _check_same_unshard(groups)
    for group in groups:
        group.unshard(async_op=async_op)
    handle = UnshardHandle(groups)
    if async_op:
        return handle
    handle.wait()
    return None


def _check_same_unshard(groups: list[ParamGroup]) -> None:
    """Before a blocking ``fshard.unshard``: the ranks of each shard group agree on the units
    it gathers and on which of them are gathered already, with one tiny all-gather.

    Called on some ranks only (``if rank == 0: fshard.unshard(block)``), or after such a call
    left a unit gathered on one rank, the gathers would pair with the other ranks' next ones:
    units of equal size (transformer blocks) exchange each other's rows without an error. Here
    the ranks that disagree raise, and a rank elsewhere meets a collective of another size.
    (``async_op=True``, for prefetching every step, skips it: reading the result would make the
    host wait.)
    """
    by_group: dict[int, tuple[MeshInfo, list[ParamGroup]]] = {}
    for group in groups:
        by_group.setdefault(id(group.mesh_info.shard_group), (group.mesh_info, []))[1].append(group)
    for info, members in by_group.values():
        if info.shard_size == 1:
            continue
        plan = [(g.label, g.sharded_state is ShardedState.SHARDED) for g in members]
        digest = hashlib.blake2b(repr(plan).encode(), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64, device=info.device)
        everyone = torch.empty(info.shard_size, dtype=torch.int64, device=info.device)
        _collectives.all_gather_into(everyone, mine, info.shard_group, label="fshard.unshard")
        if bool((everyone != mine).any()):
            gathered = [label for label, sharded in plan if not sharded]
            raise RankMismatchError(
                f"fshard.unshard: the ranks of the shard group asked for different units, or "
                f"units gathered on some ranks only; this rank unshards {[p[0] for p in plan]}"
                + (f", of which {gathered} are gathered already" if gathered else "")
                + ". It is collective: call it with the same module on every rank (not under "
                "`if rank == 0:`), and reshard on every rank too."
            )


def reshard(module: nn.Module, *, writeback: bool = False) -> None:
    """Free the gathered parameters of every unit in ``module`` (local, no communication).

    By default changes made to the gathered (full) parameters are dropped, as they are after a
    forward. With ``writeback=True`` each rank first copies its rows of every gathered
    parameter into its shard, so edits made between ``unshard`` and ``reshard`` are kept (what
    FSDP1's ``summon_full_params(writeback=True)`` does); make the same edit on every rank.
    It refuses units that gather in a lower ``MixedPrecision.param_dtype`` than the shards.
    Where a unit's gathered parameters are its shards themselves (one rank per shard group:
    world size 1 or ``NO_SHARD``, with no dtype cast and no CPU offload) there is no copy, and
    edits are made to the shards whatever ``writeback`` says; code that must keep its edits on
    every mesh passes ``writeback=True``.

    Example:
        >>> fshard.unshard(model)                    # doctest: +SKIP
        >>> with torch.no_grad():                    # doctest: +SKIP
        ...     model.fc.weight.mul_(0.5)            # the full parameter, on every rank
        >>> fshard.reshard(model, writeback=True)    # doctest: +SKIP
    """
    if not isinstance(writeback, bool):
        raise TypeError(f"fshard.reshard: writeback must be a bool, got {writeback!r}")
    groups = units_or_error(module, "reshard")
    if writeback:
        for group in groups:  # all or nothing
            group.write_back(check_only=True)
        for group in groups:
            group.write_back()
    for group in groups:
        group.reshard()


def set_prefetch(
    module: nn.Module,
    *,
    forward: Sequence[nn.Module] | nn.ModuleList | bool | None = None,
    backward: Sequence[nn.Module] | nn.ModuleList | BackwardPrefetch | enum.Enum | str | None = None,
) -> None:
    """Choose which units' all-gathers are issued early, overriding the recorded order.

    By default each unit prefetches the next unit of the order recorded on the first forward:
    in forward when it starts, in backward when its backward starts (``BACKWARD_PRE``).

    Lists act on this unit only: ``forward=[a, b]`` issues ``a`` and ``b``'s all-gathers when this
    unit's forward starts, ``backward=[c]`` issues ``c``'s when this unit's backward starts, and
    ``[]`` disables prefetch from this unit (a tuple or ``ModuleList``, such as
    ``model.blocks[1:3]``, is a list too). A bool or a ``BackwardPrefetch`` (or its name:
    ``"BACKWARD_PRE"``, ``"BACKWARD_POST"``, ``"NO_PREFETCH"``; torch's FSDP1
    ``torch.distributed.fsdp.BackwardPrefetch`` works too) sets the default policy of every
    unit in ``module``'s subtree (call it on the root for the whole model).

    Call it alike on every rank: the order of the all-gathers follows it. Once the model has
    run, the call is collective: the ranks compare their settings with one object all-gather
    and raise ``RankMismatchError`` where they differ (ranks issuing their gathers in other
    orders would exchange the rows of units of one size without an error).

    Example:
        >>> blocks = list(model.blocks)                                    # doctest: +SKIP
        >>> fshard.set_prefetch(blocks[0], forward=blocks[1:3], backward=[])  # doctest: +SKIP
        >>> fshard.set_prefetch(model, forward=False, backward="BACKWARD_POST")  # doctest: +SKIP
    """
    where = f"set_prefetch({type(module).__name__})"
    group = unit_of(module)
    if group is None:
        raise ValueError(f"{where}: the module is not an fshard unit; call fully_shard on it first")

    def targets(name: str, modules: list[nn.Module]) -> list[ParamGroup]:
        found = []
        for m in modules:
            g = unit_of(m)
            if g is None:
                raise ValueError(
                    f"{where}: {name} contains {type(m).__name__}, which is not an fshard unit"
                )
            found.append(g)
        return found

    subtree = units_under(module)
    if isinstance(forward, (tuple, nn.ModuleList)):  # model.blocks[1:3] is a ModuleList
        forward = list(forward)
    if isinstance(backward, (tuple, nn.ModuleList)):
        backward = list(backward)
    if isinstance(backward, enum.Enum) and not isinstance(backward, BackwardPrefetch):
        # torch's FSDP1 enum (torch.distributed.fsdp.BackwardPrefetch), whose names are ours
        backward = backward.name
    if isinstance(forward, list):
        group.explicit_forward_prefetch = targets("forward", forward)
    elif isinstance(forward, bool):
        for g in subtree:
            g.forward_prefetch_default = forward
    elif forward is not None:
        raise TypeError(
            f"{where}: forward must be a list of units (modules fully_shard was called on), a "
            f"bool or None, got {forward!r}"
        )
    if isinstance(backward, list):
        group.explicit_backward_prefetch = targets("backward", backward)
    elif isinstance(backward, (BackwardPrefetch, str)):
        try:
            policy = BackwardPrefetch(backward)
        except ValueError:
            valid = ", ".join(repr(b.value) for b in BackwardPrefetch)
            raise ValueError(f"{where}: backward={backward!r} is not one of {valid}") from None
        for g in subtree:
            g.backward_prefetch_default = policy
    elif backward is not None:
        raise TypeError(
            f"{where}: backward must be a list of units (modules fully_shard was called on), "
            f"fshard.BackwardPrefetch (or torch's, or a name such as 'BACKWARD_PRE') or None, "
            f"got {backward!r}"
        )
    if group.root is not None:  # the model has run: its units are known (else checked then)
        root = root_of(group)
        check_prefetch_targets(root.groups)
        check_prefetch_alike(root)
