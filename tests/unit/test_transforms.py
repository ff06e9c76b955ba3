"""Pure state-dict transforms: properties over drawn layouts and trees, no processes."""

from __future__ import annotations

import copy
import itertools
import pickle
from typing import Any

import optree
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from fshard import transforms as T
from fshard._placement import shard_layout
from fshard.testing.strategies import param_shapes

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]
MESH_SHAPES = [(1,), (2,), (3,), (4,), (2, 2), (1, 3), (3, 1), (2, 3)]


# ----------------------------------------------------------------------------------- helpers


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 10
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype)


def _assert_tree_equal(a: Any, b: Any) -> None:
    paths_a, leaves_a, spec_a = optree.tree_flatten_with_path(a, none_is_leaf=True)
    _, leaves_b, spec_b = optree.tree_flatten_with_path(b, none_is_leaf=True)
    assert spec_a == spec_b, f"structures differ:\n{spec_a}\n{spec_b}"
    for path, x, y in zip(paths_a, leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), path
            assert x.dtype == y.dtype and x.shape == y.shape, (path, x.dtype, y.dtype, x.shape, y.shape)
            assert torch.equal(x, y), path
        else:
            assert x == y, (path, x, y)


def _placements_for(draw: st.DrawFn, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[str, ...]:
    """fshard's own placements most of the time, general DTensor ones sometimes."""
    style = draw(st.sampled_from(["fshard", "fshard", "general"]))
    if len(shape) == 0:
        return tuple("R" for _ in mesh_shape)
    if style == "fshard":
        return ("S(0)",) if len(mesh_shape) == 1 else ("R", "S(0)")
    options = ["R"] + [f"S({d})" for d in range(len(shape))]
    return tuple(draw(st.sampled_from(options)) for _ in mesh_shape)


@st.composite
def layouts_and_trees(draw: st.DrawFn, *, mesh_shape: tuple[int, ...] | None = None):
    """A layout over a drawn mesh, a full model state dict for it and an optimizer-state tree."""
    if mesh_shape is None:
        mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    n = draw(st.integers(1, 4))
    entries: dict[str, T.TensorLayout] = {}
    model: dict[str, torch.Tensor] = {}
    for i in range(n):
        key = draw(st.sampled_from(["w", "layers.0.weight", "layers.1.bias", "embed.weight", "pos", "scale"]))
        key = f"{key}.{i}" if key in entries else key
        shape = draw(param_shapes(max_dims=3, max_side=7))
        dtype = draw(st.sampled_from(DTYPES))
        entries[key] = T.TensorLayout(shape, dtype, mesh_shape, _placements_for(draw, shape, mesh_shape))
        model[key] = _tensor(shape, dtype, seed=i)
    if draw(st.booleans()):
        model["buffer_not_in_layout"] = torch.arange(3)
    if draw(st.booleans()):
        # A buffer named like a level of the nesting: ("model", "w") and ("optim", "state", "w",
        # "exp_avg") pass a key called "model" or "state" before they reach "w". It is 0-d, so
        # it cuts alike with any other key it fits (both kept whole): never ambiguous.
        name = draw(st.sampled_from(["state", "model", "optim", "param_groups"]))
        entries[name] = T.TensorLayout((), "float32", mesh_shape, tuple("R" for _ in mesh_shape))
        model[name] = torch.tensor(1.5)
    layout = T.Layout(mesh_shape, entries)
    optim = {
        "state": {
            k: {
                "exp_avg": _tensor(tuple(v.shape), torch.float32, seed=100 + j),
                "step": torch.tensor(float(j + 1)),
                "note": ("adam", j),
            }
            for j, (k, v) in enumerate(model.items())
            if k in entries and draw(st.booleans())
        },
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": list(entries), "foreach": None}],
    }
    tree = draw(st.sampled_from(["model", "optim", "both"]))
    full = {"model": model, "optim": optim}[tree] if tree != "both" else {"model": model, "optim": optim}
    return layout, full


def _all_locals(full: Any, layout: T.Layout) -> dict[tuple[int, ...], Any]:
    return {c: T.shard(full, layout, c) for c in layout.coords()}


def _sharded_tensors(tree: Any) -> dict[str, list[torch.Tensor]]:
    """Per model key, its tensor and its optimizer state of the same shape in a drawn tree."""
    def is_optim(node: Any) -> bool:  # a model key may be called "param_groups": a tensor
        return isinstance(node, dict) and isinstance(node.get("param_groups"), list)

    if is_optim(tree):
        model, optim = {}, tree
    elif set(tree) == {"model", "optim"} and is_optim(tree["optim"]):
        model, optim = tree["model"], tree["optim"]
    else:
        model, optim = tree, {"state": {}}
    out: dict[str, list[torch.Tensor]] = {k: [v] for k, v in model.items()}
    for k, state in optim["state"].items():
        out.setdefault(k, []).append(state["exp_avg"])
    return out


# -------------------------------------------------------------------------------- properties


@given(layouts_and_trees())
@example(
    (
        T.Layout((4,), {"w": T.TensorLayout((5, 3), "float32", (4,), ("S(0)",))}),
        {"w": torch.arange(15.0).view(5, 3)},
    )
)
@example(
    (
        T.Layout((2, 2), {"w": T.TensorLayout((1,), "bfloat16", (2, 2), ("R", "S(0)"))}),
        {"state": {"w": {"exp_avg": torch.ones(1), "step": torch.tensor(3.0)}}, "param_groups": []},
    )
)
@example(  # ("optim", "state", "w", "exp_avg") passes a model key called "state" first
    (
        T.Layout(
            (2,),
            {
                "state": T.TensorLayout((), "float32", (2,), ("R",)),
                "w": T.TensorLayout((3, 2), "float32", (2,), ("S(0)",)),
            },
        ),
        {
            "model": {"state": torch.tensor(1.5), "w": torch.arange(6.0).view(3, 2)},
            "optim": {
                "state": {"w": {"exp_avg": torch.ones(3, 2), "step": torch.tensor(1.0)}},
                "param_groups": [{"lr": 0.1, "params": ["state", "w"]}],
            },
        },
    )
)
def test_unshard_of_shard_is_identity_and_inputs_are_untouched(case):
    layout, full = case
    before = copy.deepcopy(full)
    locals_ = _all_locals(full, layout)
    locals_before = copy.deepcopy(locals_)
    for c, local in locals_.items():  # a round trip alone passes if shard and unshard agree on a wrong key
        for key, tensors in _sharded_tensors(local).items():
            if key in layout:
                want = layout[key].local_shape(layout.entry_coord(key, c))
                assert [tuple(t.shape) for t in tensors] == [want] * len(tensors), (key, c)
    _assert_tree_equal(T.unshard(locals_, layout), full)
    _assert_tree_equal(full, before)
    _assert_tree_equal(locals_, locals_before)


@given(layouts_and_trees(), st.sampled_from(MESH_SHAPES), st.data())
def test_reshard_equals_shard_of_unshard(case, new_mesh, data):
    layout, full = case
    new_entries = {}
    for key, entry in layout.items():
        placements = data.draw(st.sampled_from([None, "fshard"]), label=f"placement {key}")
        if placements is None or not entry.full_shape:
            placements = tuple("R" for _ in new_mesh)
        else:
            placements = ("S(0)",) if len(new_mesh) == 1 else ("R", "S(0)")
        new_entries[key] = T.TensorLayout(entry.full_shape, entry.dtype, new_mesh, placements)
    new_layout = T.Layout(new_mesh, new_entries)
    locals_ = _all_locals(full, layout)
    before = copy.deepcopy(locals_)
    out = T.reshard(locals_, layout, new_layout)
    assert sorted(out) == new_layout.coords()
    expected_full = T.unshard(locals_, layout)
    for c in new_layout.coords():
        _assert_tree_equal(out[c], T.shard(expected_full, new_layout, c))
        _assert_tree_equal(out[c], T.shard(full, new_layout, c))
    _assert_tree_equal(locals_, before)


@given(st.sampled_from(MESH_SHAPES), param_shapes(max_dims=3, max_side=9), st.data())
def test_local_regions_match_dtensor(mesh_shape, shape, data):
    """Our slicing math equals DTensor's for the same placements (uneven and empty shards too)."""
    if not shape:
        placements: tuple[str, ...] = tuple("R" for _ in mesh_shape)
    else:
        placements = tuple(
            data.draw(st.sampled_from(["R"] + [f"S({d})" for d in range(len(shape))]))
            for _ in mesh_shape
        )
    entry = T.TensorLayout(shape, "float32", mesh_shape, placements)
    torch_placements = [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in placements]
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        offsets, lengths = entry.local_region(coord)
        want_shape, want_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), torch_placements
        )
        assert lengths == tuple(want_shape), (coord, lengths, want_shape)
        for dim, n in enumerate(lengths):
            if n:
                assert offsets[dim] == want_offset[dim], (coord, offsets, want_offset)


@given(param_shapes(max_dims=3, max_side=9), st.integers(1, 5), st.data())
def test_1d_layout_matches_engine_shard_layout(shape, shard_size, data):
    rank = data.draw(st.integers(0, shard_size - 1))
    engine = shard_layout(shape, shard_size, rank)
    placements = ("R",) if engine.replicated else ("S(0)",)
    entry = T.TensorLayout(shape, "float32", (shard_size,), placements)
    assert entry.local_shape((rank,)) == tuple(engine.local_shape)
    if not engine.replicated:
        assert entry.local_offsets((rank,))[0] == engine.row_offset


def test_unshard_needs_one_replica_of_each_shard_only():
    layout = T.Layout((2, 2), {"w": T.TensorLayout((5, 2), "float32", (2, 2), ("R", "S(0)"))})
    full = {"w": torch.arange(10.0).view(5, 2)}
    row1 = {c: T.shard(full, layout, c) for c in [(1, 0), (1, 1)]}
    _assert_tree_equal(T.unshard(row1, layout), full)


def test_mixed_mesh_entry_is_addressed_by_flat_index():
    layout = T.Layout(
        (2, 2),
        {
            "a": T.TensorLayout((5,), "float32", (4,), ("S(0)",)),  # a unit on a 1D mesh
            "b": T.TensorLayout((5,), "float32", (2, 2), ("R", "S(0)")),
        },
    )
    full = {"a": torch.arange(5.0), "b": torch.arange(5.0) + 10}
    locals_ = _all_locals(full, layout)
    assert locals_[(1, 0)]["a"].tolist() == [4.0]  # flat index 2 of chunk(5, 4) = [2, 2, 1, 0]
    assert locals_[(1, 0)]["b"].tolist() == [10.0, 11.0, 12.0]
    _assert_tree_equal(T.unshard(locals_, layout), full)


@pytest.mark.parametrize("name", ["state", "param_groups"])
def test_optimizer_state_follows_its_parameter_when_a_model_key_is_named_state(name):
    """An optimizer state dict keeps a parameter's state at ("state", param, ...): the param
    decides how it is cut, not a model buffer that happens to be called "state"."""
    layout = T.Layout(
        (2,),
        {
            name: T.TensorLayout((3,), "float32", (2,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    full = {
        "state": {"w": {"exp_avg": torch.arange(8.0).view(4, 2), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    locals_ = _all_locals(full, layout)
    assert locals_[(1,)]["state"]["w"]["exp_avg"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert locals_[(1,)]["state"]["w"]["step"].item() == 3.0
    _assert_tree_equal(T.unshard(locals_, layout), full)
    new = T.Layout(
        (1,),
        {
            name: T.TensorLayout((3,), "float32", (1,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (1,), ("S(0)",)),
        },
    )
    _assert_tree_equal(T.reshard(locals_, layout, new)[(0,)], full)


def _nested(form: str, model: dict[str, Any], osd: dict[str, Any]) -> Any:
    """A model and an optimizer state dict in one tree, as checkpoints and users nest them."""
    if form == "dict":
        return {"model": model, "optim": osd}
    if form == "list":
        return [model, osd]
    return {"model": model, "optim": osd["state"]}  # fshard.checkpoint's: per-parameter state only


@pytest.mark.parametrize("form", ["dict", "list", "bare_state"])
@pytest.mark.parametrize("name", ["state", "model", "optim", "param_groups"])
def test_nested_optimizer_state_follows_its_parameter_when_a_model_key_is_named_like_a_level(
    name, form
):
    """In ``{"model": sd, "optim": osd}`` the path ("optim", "state", "w", "exp_avg") passes
    "optim" and "state" before "w", and ("model", "w") passes "model": a buffer named like one
    of them took the leaf, which then did not fit and was kept whole (every coordinate got all
    of exp_avg, and unshard returned coordinate 0's rows as the full tensor)."""
    layout = T.Layout(
        (2,),
        {
            name: T.TensorLayout((3,), "float32", (2,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    model = {name: torch.arange(3.0), "w": torch.arange(8.0).view(4, 2)}
    osd = {
        "state": {
            "w": {"exp_avg": torch.arange(8.0).view(4, 2) + 100, "step": torch.tensor(3.0)},
            name: {"exp_avg": torch.arange(3.0) + 50, "step": torch.tensor(3.0)},
        },
        "param_groups": [{"lr": 0.1, "params": [name, "w"]}],
    }
    full = _nested(form, model, osd)
    locals_ = _all_locals(full, layout)
    model_key, optim_key = (0, 1) if form == "list" else ("model", "optim")
    model_at_1, optim_at_1 = locals_[(1,)][model_key], locals_[(1,)][optim_key]
    state_at_1 = optim_at_1 if form == "bare_state" else optim_at_1["state"]
    assert model_at_1["w"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert state_at_1["w"]["exp_avg"].tolist() == [[104.0, 105.0], [106.0, 107.0]]
    assert state_at_1["w"]["step"].item() == 3.0
    assert model_at_1[name].tolist() == [0.0, 1.0, 2.0]
    assert state_at_1[name]["exp_avg"].tolist() == [50.0, 51.0, 52.0]
    _assert_tree_equal(T.unshard(locals_, layout), full)

    def on(mesh: tuple[int, ...]) -> T.Layout:
        placements = ("S(0)",) if len(mesh) == 1 else ("R", "S(0)")
        return T.Layout(
            mesh,
            {
                name: T.TensorLayout((3,), "float32", mesh, tuple("R" for _ in mesh)),
                "w": T.TensorLayout((4, 2), "float32", mesh, placements),
            },
        )

    _assert_tree_equal(T.reshard(locals_, layout, on((1,)))[(0,)], full)
    for mesh in [(3,), (2, 2)]:
        new = on(mesh)
        out = T.reshard(locals_, layout, new)
        for c in new.coords():
            _assert_tree_equal(out[c], T.shard(full, new, c))
        _assert_tree_equal(T.unshard(out, new), full)


def test_candidates_that_fit_and_cut_alike_are_not_ambiguous():
    layout = T.Layout(
        (2,),
        {
            "optim": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    full = {"optim": {"w": {"exp_avg": torch.arange(8.0).view(4, 2)}}}
    locals_ = _all_locals(full, layout)
    assert locals_[(1,)]["optim"]["w"]["exp_avg"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    _assert_tree_equal(T.unshard(locals_, layout), full)


# ------------------------------------------------------------------------------------ errors


def test_a_leaf_that_fits_two_keys_cut_differently_is_an_error_naming_path_and_keys():
    """("optim", "w", "exp_avg") is w's state, or the state "w" of a parameter called "optim":
    with both shapes fitting, the transforms say so instead of guessing."""
    layout = T.Layout(
        (2,),
        {
            "optim": T.TensorLayout((4, 2), "float32", (2,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    full = {"optim": {"w": {"exp_avg": torch.zeros(4, 2)}}}
    ambiguous = r"the tensor at \['optim'\]\['w'\]\['exp_avg'\] fits layout keys 'optim', 'w'"
    with pytest.raises(ValueError, match=ambiguous):
        T.shard(full, layout, (0,))
    # Local pieces of (2, 2) fit both a replicated (2, 2) and a row-sharded (4, 2).
    layout = T.Layout(
        (2,),
        {
            "optim": T.TensorLayout((2, 2), "float32", (2,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    locals_ = {c: {"optim": {"w": {"exp_avg": torch.zeros(2, 2)}}} for c in layout.coords()}
    with pytest.raises(ValueError, match=ambiguous):
        T.unshard(locals_, layout)
    with pytest.raises(ValueError, match=ambiguous):
        T.reshard(locals_, layout, layout)


def test_a_nested_tensor_of_the_wrong_shape_at_a_key_is_an_error_naming_its_path():
    """Below a key called "model", a mis-shaped tensor at "w" was kept whole without a word."""
    layout = T.Layout(
        (2,),
        {
            "model": T.TensorLayout((3,), "float32", (2,), ("R",)),
            "w": T.TensorLayout((4, 2), "float32", (2,), ("S(0)",)),
        },
    )
    full_shape = (
        r"key 'w' has shape \[5, 2\], but the layout says its full shape is \[4, 2\] \(the tensor "
        r"at \['model'\]\['w'\], which does not fit layout key\(s\) 'model' above it either\)"
    )
    with pytest.raises(ValueError, match=full_shape):
        T.shard({"model": {"w": torch.zeros(5, 2)}}, layout, (0,))
    local_shapes = r"key 'w' has local shapes .*\(the tensor at \['model'\]\['w'\]"
    with pytest.raises(ValueError, match=local_shapes):
        T.unshard({c: {"model": {"w": torch.zeros(3, 2)}} for c in layout.coords()}, layout)


def test_shard_rejects_wrong_full_shape_naming_every_key():
    layout = T.Layout(
        (2,),
        {
            "a": T.TensorLayout((4,), "float32", (2,), ("S(0)",)),
            "b": T.TensorLayout((3, 2), "float32", (2,), ("S(0)",)),
        },
    )
    with pytest.raises(ValueError, match=r"2 problems") as info:
        T.shard({"a": torch.zeros(5), "b": torch.zeros(2, 3)}, layout, (0,))
    assert "'a'" in str(info.value) and "'b'" in str(info.value)
    assert "[4]" in str(info.value) and "[3, 2]" in str(info.value)


def test_unshard_missing_shard_names_the_key_and_shards():
    layout = T.Layout((3,), {"w": T.TensorLayout((6,), "float32", (3,), ("S(0)",))})
    locals_ = _all_locals({"w": torch.arange(6.0)}, layout)
    del locals_[(1,)]
    with pytest.raises(ValueError, match=r"key 'w' cannot be unsharded.*\[\(1,\)\]"):
        T.unshard(locals_, layout)


def test_unshard_wrong_local_shape_names_key_and_coord():
    layout = T.Layout((2,), {"w": T.TensorLayout((4,), "float32", (2,), ("S(0)",))})
    with pytest.raises(ValueError, match=r"key 'w' has local shapes.*\(1,\): \[3\] \(expected \[2\]\)"):
        T.unshard({(0,): {"w": torch.zeros(2)}, (1,): {"w": torch.zeros(3)}}, layout)


def test_unshard_structure_mismatch_names_the_coordinate():
    layout = T.Layout((2,), {"w": T.TensorLayout((4,), "float32", (2,), ("S(0)",))})
    with pytest.raises(ValueError, match=r"coordinate \(1,\) has a different structure"):
        T.unshard({(0,): {"w": torch.zeros(2)}, (1,): {"w": torch.zeros(2), "x": 1}}, layout)


def test_bad_coordinates_and_layouts_are_clear_errors():
    layout = T.Layout((2, 2), {})
    with pytest.raises(ValueError, match=r"coordinate \(2, 0\) is not on the layout's mesh of shape \(2, 2\)"):
        T.shard({}, layout, (2, 0))
    with pytest.raises(ValueError, match=r"placement 'S\(1\)' shards dim 1 of a 1-d tensor"):
        T.TensorLayout((3,), "float32", (2,), ("S(1)",))
    with pytest.raises(ValueError, match=r"one placement per mesh dim \(2\)"):
        T.TensorLayout((3,), "float32", (2, 2), ("S(0)",))
    with pytest.raises(ValueError, match=r"unknown dtype name 'float33'"):
        T.TensorLayout((3,), "float33", (2,), ("S(0)",))
    with pytest.raises(ValueError, match=r"entry 'w' has mesh shape \(3,\)"):
        T.Layout((2, 2), {"w": T.TensorLayout((3,), "float32", (3,), ("S(0)",))})


def test_a_rank_stands_for_its_row_major_coordinate():
    """As init_device_mesh places ranks: rank 3 of a (2, 2) mesh is (1, 1), rank 2 is (1, 0)."""
    layout = T.Layout((2, 2), {"w": T.TensorLayout((4,), "float32", (2, 2), ("R", "S(0)"))})
    full = {"w": torch.arange(4.0)}
    for rank, coord in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        torch.testing.assert_close(T.shard(full, layout, rank), T.shard(full, layout, coord))
    by_rank = {rank: T.shard(full, layout, rank) for rank in (2, 3)}
    torch.testing.assert_close(T.unshard(by_rank, layout), full)
    with pytest.raises(ValueError, match=r"rank 4 is not on the layout's mesh of shape \(2, 2\) \(4 ranks\)"):
        T.shard(full, layout, 4)


def test_a_coordinate_given_twice_is_an_error():
    layout = T.Layout((2,), {"w": T.TensorLayout((3,), "float32", (2,), ("S(0)",))})
    one = {"w": torch.tensor([1.0, 2.0])}
    with pytest.raises(ValueError, match=r"coordinate \(0,\) is given twice"):
        T.unshard({0: one, (0,): {"w": torch.tensor([9.0, 9.0])}, 1: {"w": torch.tensor([3.0])}}, layout)


def test_layout_pickles_and_round_trips_through_json():
    layout = T.Layout(
        (2, 2),
        {
            "w": T.TensorLayout((5, 3), torch.bfloat16, (2, 2), ("R", "S(0)")),
            "s": T.TensorLayout((), "float32", (2, 2), ("R", "R")),
        },
    )
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert T.Layout.from_json(layout.to_json()) == layout
    assert layout["w"].dtype == "bfloat16" and layout["w"].torch_dtype == torch.bfloat16
    assert list(layout) == ["w", "s"] and len(layout) == 2 and "w" in layout


# ------------------------------------------------------------------------ keys and dtypes


def test_strip_prefix_and_map_keys():
    sd = {"module._orig_mod.fc.weight": torch.ones(1), "_orig_mod.module.b": 2, "c": 3}
    before = copy.deepcopy(sd)
    out = T.strip_prefix(sd)
    assert list(out) == ["fc.weight", "b", "c"]
    assert out["fc.weight"] is sd["module._orig_mod.fc.weight"]
    assert T.strip_prefix(sd, "module.") == {"_orig_mod.fc.weight": sd["module._orig_mod.fc.weight"], "_orig_mod.module.b": 2, "c": 3}
    _assert_tree_equal(sd, before)
    with pytest.raises(ValueError, match=r"keys 'module.a' and 'a' both become 'a'"):
        T.strip_prefix({"module.a": 1, "a": 2})


def test_map_keys_renames_optimizer_state_and_groups():
    osd = {
        "state": {"module.w": {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["module.w", "module.b"]}],
    }
    before = copy.deepcopy(osd)
    out = T.strip_prefix(osd)
    assert out == {"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
    assert osd == before


@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float64]))
def test_cast_and_to_cpu_touch_only_what_they_should(dtype):
    tree = {"w": torch.randn(3), "n": torch.tensor([1, 2]), "nested": [torch.ones(2, dtype=torch.float64), "x", None]}
    before = copy.deepcopy(tree)
    out = T.cast(tree, dtype)
    assert out["w"].dtype == dtype and out["nested"][0].dtype == dtype
    assert out["n"] is tree["n"] and out["nested"][1:] == ["x", None]
    assert T.cast(tree, dtype, floating_only=False)["n"].dtype == dtype
    moved = T.to_cpu(tree)
    assert moved["w"] is tree["w"]  # already on the CPU: no copy
    _assert_tree_equal(tree, before)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        T.cast(tree, "float16")  # type: ignore[arg-type]


def test_cast_leaves_optimizer_step_counters_alone():
    """Adam's float32 ``step`` of 257 became 256 in bfloat16."""
    osd = {
        "state": {"w": {"step": torch.tensor(257.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"params": ["w"], "lr": 0.1}],
    }
    out = T.cast(osd, torch.bfloat16)
    assert out["state"]["w"]["step"] is osd["state"]["w"]["step"]
    assert out["state"]["w"]["exp_avg"].dtype == torch.bfloat16
    assert T.cast({"blocks.0.step": torch.ones(1)}, torch.float16)["blocks.0.step"].dtype == torch.float16
    everything = T.cast(osd, torch.bfloat16, skip_keys=())
    assert everything["state"]["w"]["step"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"skip_keys must be a collection of keys, got the string 'step'"):
        T.cast(osd, torch.bfloat16, skip_keys="step")


def test_map_keys_keeps_the_optimizer_class_and_renames_param_names():
    osd = {
        "state": {"module.w": {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["module.w"], "param_names": ["module.w"]}],
        "optimizer_class": "torch.optim.adamw.AdamW",
    }
    assert T.strip_prefix(osd) == {
        "state": {"w": {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["w"], "param_names": ["w"]}],
        "optimizer_class": "torch.optim.adamw.AdamW",
    }


def test_to_local_unwraps_only_dtensors():
    tree = {"w": torch.ones(2), "k": 3}
    out = T.to_local(tree)
    assert out["w"] is tree["w"] and out["k"] == 3
