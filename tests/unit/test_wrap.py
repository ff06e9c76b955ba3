"""Wrapping policies select exactly the intended modules (pure: no process group).

The size policy is checked against FSDP1's own recursive wrapper (``torch.distributed.fsdp.wrap``)
on random module trees; the class policy and plain callables on hand-built corner cases.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

import fshard
from fshard._wrap import ByClass, BySize, WrapPolicy, checkpoint_forward, select_modules
from fshard.testing.models import Block, TinyTransformer, TransformerSpec


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Outer(Inner):
    """An ``Inner`` (by inheritance) that contains two more ``Inner``s: nested matches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = Inner()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Outer()
        self.head = nn.Linear(3, 2)


# ------------------------------------------------------------------------------ by_class


def test_by_class_selects_every_block_in_order() -> None:
    model = TinyTransformer(TransformerSpec(layers=3))
    assert select_modules(model, fshard.by_class(Block)) == ["blocks.0", "blocks.1", "blocks.2"]


def test_by_class_nested_matches_innermost_first() -> None:
    # Outer is an Inner subclass: by_class(Inner) matches it and both Inners inside it.
    assert select_modules(Net(), fshard.by_class(Inner)) == ["first.a", "first.b", "first"]
    assert select_modules(Net(), fshard.by_class(Outer)) == ["first"]


def test_by_class_several_classes() -> None:
    # 'first' matches too, but its linears took all its parameters: no empty unit for it.
    assert select_modules(Net(), fshard.by_class(Outer, nn.Linear)) == [
        "first.fc",
        "first.a.fc",
        "first.b.fc",
        "head",
    ]


def test_root_only_model() -> None:
    # The root is never listed: auto_shard shards it last, whatever the policy says.
    assert select_modules(Inner(), fshard.by_class(Inner)) == []
    assert select_modules(nn.Linear(4, 4), fshard.by_class(nn.Linear)) == []
    assert select_modules(nn.Linear(4, 4), fshard.by_size(0)) == []
    assert select_modules(Block(TransformerSpec()), fshard.by_class(Block)) == []


def test_by_class_names_resolve_against_the_model() -> None:
    model = TinyTransformer(TransformerSpec(layers=2))
    assert select_modules(model, fshard.by_class("Block")) == ["blocks.0", "blocks.1"]
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    assert select_modules(model, fshard.by_class(qualified)) == ["blocks.0", "blocks.1"]


def test_by_class_unknown_name_lists_the_model_classes() -> None:
    model = TinyTransformer(TransformerSpec(layers=2))
    with pytest.raises(ValueError, match=r"'BertLayer'.*TinyTransformer.*Block, Embedding, LayerNorm"):
        select_modules(model, fshard.by_class(Block, "BertLayer"))


@pytest.mark.parametrize("bad", [(), (3,), (nn.Linear(2, 2),), (int,)])
def test_by_class_rejects_non_classes(bad: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError, match=r"by_class expects one or more nn\.Module subclasses"):
        fshard.by_class(*bad)


def test_policies_answer_for_a_single_module() -> None:
    assert fshard.by_class(nn.Linear)(nn.Linear(2, 2)) is True
    assert fshard.by_class("Linear")(nn.Linear(2, 2)) is True
    assert fshard.by_class(nn.Linear)(nn.ReLU()) is False
    assert fshard.by_size(6)(nn.Linear(2, 2)) is True  # 4 + 2 parameters
    assert fshard.by_size(7)(nn.Linear(2, 2)) is False


# ------------------------------------------------------------------------------- by_size


def test_by_size_counts_only_unowned_parameters() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)),  # 110 + 110
        nn.Linear(10, 2),  # 22
    )
    # Both inner linears reach 100; their parent then owns nothing more; the root takes '1'.
    assert select_modules(model, fshard.by_size(100)) == ["0.0", "0.1"]
    # At 150 neither linear qualifies alone, their parent (220 unowned) does.
    assert select_modules(model, fshard.by_size(150)) == ["0"]
    assert select_modules(model, fshard.by_size(10_000)) == []


def test_by_size_counts_a_shared_parameter_once() -> None:
    model = TinyTransformer(TransformerSpec(vocab=50, dim=4, layers=1, tie_embeddings=True))
    # embed and head share one 50x4 weight: each alone has 200 parameters.
    assert select_modules(model, fshard.by_size(200)) == ["embed"]


def test_by_size_skips_containers_and_stays_out_of_attention() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # 72 each
    model.attn = nn.MultiheadAttention(8, 2)  # out_proj is a Linear read directly by attn
    # The attention block (288 parameters) stays with the root, whole, as in FSDP1.
    assert select_modules(model, fshard.by_size(50)) == ["layers.0", "layers.1"]
    model.scales = nn.ParameterList([nn.Parameter(torch.ones(60)), nn.Parameter(torch.ones(60))])
    model.gates = nn.ParameterDict({"a": nn.Parameter(torch.ones(60))})
    assert select_modules(model, fshard.by_size(50)) == ["layers.0", "layers.1"]


class _AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)  # forward reads out_proj.weight, never calls it
        self.out = nn.Linear(8, 8)


class _NeverDescends(WrapPolicy):
    """Selects every module, but looks inside none (so nothing below the root)."""

    def selects(self, module: nn.Module, unowned_numel: int) -> bool:
        return True

    def descends(self, module: nn.Module) -> bool:
        return False


# out_proj is an nn.Linear (of class NonDynamicallyQuantizableLinear), over 1 parameter.
ANY_LINEAR = [fshard.by_class(nn.Linear), fshard.by_class("NonDynamicallyQuantizableLinear"), fshard.by_size(1),
              lambda m: isinstance(m, nn.Linear)]  # fmt: skip
ANY_LINEAR_IDS = ["by_class", "by_class_name", "by_size", "callable"]


@pytest.mark.parametrize("policy", ANY_LINEAR, ids=ANY_LINEAR_IDS)
def test_no_policy_looks_inside_a_root_multihead_attention(policy: Any) -> None:
    # A unit of out_proj would never be gathered: the attention would compute with the shard.
    assert select_modules(nn.MultiheadAttention(8, 2), policy) == []
    assert _fsdp1_selection(nn.MultiheadAttention(8, 2), 1) == []  # FSDP1 does not look inside either


@pytest.mark.parametrize("policy", ANY_LINEAR, ids=ANY_LINEAR_IDS)
def test_no_policy_selects_inside_a_multihead_attention(policy: Any) -> None:
    linear_named_linear = not isinstance(policy, ByClass) or nn.Linear in policy.classes
    assert select_modules(_AttnNet(), policy) == (["out"] if linear_named_linear else [])
    deeper = nn.Sequential(nn.Sequential(_AttnNet()), nn.Linear(8, 8))
    want = ["0.0.out", "1"] if linear_named_linear else []
    if isinstance(policy, BySize):  # the attention's parameters make its holder a unit too
        want = ["0.0.out", "0.0", "1"]
    assert select_modules(deeper, policy) == want


def test_the_attention_module_itself_may_be_a_unit() -> None:
    assert select_modules(_AttnNet(), fshard.by_class(nn.MultiheadAttention)) == ["attn"]
    assert select_modules(_AttnNet(), fshard.by_class(nn.MultiheadAttention, nn.Linear)) == ["attn", "out"]
    assert select_modules(_AttnNet(), lambda m: True) == ["attn", "out"]


def test_the_root_is_asked_whether_to_descend() -> None:
    assert select_modules(_AttnNet(), _NeverDescends()) == []
    assert select_modules(nn.Sequential(nn.Linear(2, 2)), _NeverDescends()) == []


def test_ignored_params_do_not_count() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    assert select_modules(model, fshard.by_size(100)) == ["0", "1"]
    ignored = [model[0].weight]
    assert select_modules(model, fshard.by_size(100), ignored_params=ignored) == ["1"]


def test_select_modules_rejects_one_tensor_as_ignored_params() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    with pytest.raises(TypeError, match=r"select_modules\(Sequential\): ignored_params takes an iterable of parameters, got one tensor; pass \[param\]"):
        select_modules(model, fshard.by_size(100), ignored_params=model[0].weight)  # type: ignore[arg-type]


def test_select_modules_takes_a_generator_of_ignored_params() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    assert select_modules(model, fshard.by_size(100), ignored_params=model[0].parameters()) == ["1"]


@pytest.mark.parametrize("bad", [-1, 1.5, "100", True])
def test_by_size_rejects_bad_thresholds(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"by_size: min_num_params must be an int >= 0, got"):
        fshard.by_size(bad)


# A random module tree: a Linear (its sizes), a ReLU (no parameters), an attention leaf, or a
# container (Sequential / ModuleList) of subtrees.
_leaves = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 6), st.integers(1, 6)),
    st.just(("relu",)),
    st.just(("mha",)),
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.tuples(st.sampled_from(["seq", "list"]), st.lists(kids, min_size=1, max_size=3)),
    max_leaves=10,
)


def _build(spec: tuple[Any, ...]) -> nn.Module:
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(spec[1], spec[2])
    if kind == "relu":
        return nn.ReLU()
    if kind == "mha":
        return nn.MultiheadAttention(4, 2)
    children = [_build(s) for s in spec[1]]
    return nn.Sequential(*children) if kind == "seq" else nn.ModuleList(children)


def _fsdp1_selection(model: nn.Module, min_num_params: int) -> list[str]:
    """What FSDP1's recursive auto-wrap would wrap, recorded instead of wrapped."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    wrapped: list[str] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        wrapped.append(names[id(module)])
        return module

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    _recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)
    return wrapped


@given(spec=_trees, min_num_params=st.integers(1, 120), wrap_root=st.booleans())
def test_by_size_matches_fsdp1_auto_wrap(spec: tuple[Any, ...], min_num_params: int, wrap_root: bool) -> None:
    # wrap_root=False: the tree's own top module is the root (an attention, a container, ...).
    root = nn.Sequential(_build(spec)) if wrap_root else _build(spec)
    assert select_modules(root, fshard.by_size(min_num_params)) == _fsdp1_selection(root, min_num_params)


def test_by_size_counts_tied_parameters_once_where_fsdp1_counts_each_user() -> None:
    # embed and head share one 50x4 weight. FSDP1 counts it in each: both reach 200 and are
    # recorded; fshard counts it once, so head (all of it owned by embed's unit) is no unit.
    model = TinyTransformer(TransformerSpec(vocab=50, dim=4, layers=1, tie_embeddings=True))
    assert select_modules(model, fshard.by_size(200)) == ["embed"]
    assert _fsdp1_selection(model, 200) == ["embed", "head"]


# ----------------------------------------------------------------------- plain callables


def test_callable_policy() -> None:
    model = TinyTransformer(TransformerSpec(layers=2))
    assert select_modules(model, lambda m: isinstance(m, nn.LayerNorm)) == [
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "norm",
    ]


def test_callable_policy_must_return_a_bool() -> None:
    with pytest.raises(TypeError, match=r"returned 1 for 'embed' \(Embedding\); a policy must return True or False"):
        select_modules(TinyTransformer(TransformerSpec()), lambda m: 1)


def test_selecting_a_container_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"selected 'blocks', a ModuleList; containers have no forward"):
        select_modules(TinyTransformer(TransformerSpec()), lambda m: isinstance(m, nn.ModuleList))
    model = nn.Sequential(nn.Linear(3, 3))
    model.scales = nn.ParameterList([nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match=r"selected 'scales', a ParameterList; containers"):
        select_modules(model, lambda m: not isinstance(m, nn.Sequential))


def test_modules_without_parameters_are_not_units() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert select_modules(model, lambda m: True) == ["0", "2"]


def test_a_module_registered_twice_is_selected_once() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert select_modules(model, fshard.by_class(nn.Linear)) == ["0"]


@pytest.mark.parametrize("bad", [Block, None, "Block", 3])
def test_policy_must_be_a_policy(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"policy must be fshard.by_class\(...\), fshard.by_size\(n\) or a callable"):
        select_modules(TinyTransformer(TransformerSpec()), bad)


def test_passing_a_class_as_policy_hints_by_class() -> None:
    with pytest.raises(TypeError, match=r"fshard.by_class\(Block\)"):
        select_modules(TinyTransformer(TransformerSpec()), Block)


# ----------------------------------------------------------------------------- auto_shard


def test_auto_shard_rejects_unknown_fully_shard_arguments_before_sharding() -> None:
    model = TinyTransformer(TransformerSpec())
    with pytest.raises(TypeError, match=r"auto_shard: .*'mseh'.*fully_shard takes: mesh, reshard_after_forward"):
        fshard.auto_shard(model, policy=fshard.by_class(Block), mseh=None)
    assert not any(fshard.is_sharded(p) for p in model.parameters())


def test_auto_shard_rejects_one_tensor_as_ignored_params_before_sharding() -> None:
    # list(tensor) would give its rows, so the parameter would silently be sharded after all.
    model = TinyTransformer(TransformerSpec())
    with pytest.raises(TypeError, match=r"auto_shard\(TinyTransformer\): ignored_params takes an iterable of parameters, got one tensor; pass \[param\] \(or a module's \.parameters\(\)\)"):
        fshard.auto_shard(model, policy=fshard.by_class(Block), ignored_params=model.blocks[0].fc.weight)
    assert not any(fshard.is_sharded(p) for p in model.parameters())


def test_auto_shard_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match=r"auto_shard expects an nn\.Module, got int"):
        fshard.auto_shard(3, policy=fshard.by_size(1))  # type: ignore[type-var]


# ------------------------------------------------------------------- activation checkpointing


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x)) * scale


def test_checkpoint_forward_recomputes_in_backward_and_keeps_the_module() -> None:
    torch.manual_seed(0)
    plain = _Counted()
    recomputed = copy.deepcopy(plain)
    checkpoint_forward(recomputed)
    assert type(recomputed) is _Counted
    assert list(recomputed.state_dict()) == list(plain.state_dict()) == ["lin.weight", "lin.bias"]
    x = torch.randn(2, 3, requires_grad=True)
    for module in (plain, recomputed):
        module(x, scale=2.0).sum().backward()
    assert (plain.calls, recomputed.calls) == (1, 2)  # forward, then again in backward
    torch.testing.assert_close(recomputed.lin.weight.grad, plain.lin.weight.grad, rtol=0, atol=0)
    # A deep copy recomputes its own forward, not the original's.
    clone = copy.deepcopy(recomputed)
    clone(x).sum().backward()
    assert (clone.calls, recomputed.calls) == (4, 2)
    with pytest.raises(ValueError, match="already has a forward set on the instance"):
        checkpoint_forward(recomputed)


class _CacheWriter(nn.Module):
    """A layer that appends to a KV cache it is given, under the argument names of Transformers
    4.x (``past_key_values``) and 5.x (``cache``); ``_can_checkpoint_with_cache`` marks a
    Transformers layer (``None``: any other module)."""

    _can_checkpoint_with_cache: bool | None = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(
        self,
        x: torch.Tensor,
        cache: list[torch.Tensor] | None = None,
        past_key_values: list[torch.Tensor] | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        y = self.lin(x)
        for kv in (cache, past_key_values):
            if kv is not None:
                kv.append(y.detach())  # written in forward and again in a recompute
        return y


class _PlainCacheArg(_CacheWriter):
    _can_checkpoint_with_cache = None  # not a Transformers layer: ``cache`` is its own argument


@pytest.mark.parametrize("positional", [False, True])
def test_checkpointed_transformers_layer_drops_its_kv_cache(positional: bool) -> None:
    layer = _CacheWriter()
    checkpoint_forward(layer)
    x = torch.randn(2, 3, requires_grad=True)
    cache: list[torch.Tensor] = []
    past: list[torch.Tensor] = []
    if positional:
        layer(x, cache, past, True).sum().backward()
    else:
        layer(x, cache=cache, past_key_values=past, use_cache=True).sum().backward()
    assert (cache, past) == ([], [])  # dropped in training: the recompute would append again
    with torch.no_grad():  # no backward to replay: the cache is kept
        layer(x, cache=cache, past_key_values=past, use_cache=True)
    assert (len(cache), len(past)) == (1, 1)


def test_checkpointed_plain_module_keeps_an_argument_named_cache() -> None:
    layer = _PlainCacheArg()
    checkpoint_forward(layer)
    cache: list[torch.Tensor] = []
    past: list[torch.Tensor] = []
    layer(torch.randn(2, 3), cache=cache, past_key_values=past).sum().backward()
    assert len(cache) >= 1 and past == []  # its own ``cache`` is passed (the recompute may stop early)
