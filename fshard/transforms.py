"""Pure state-dict transforms: shard, unshard and reshard trees of tensors for a layout.

Nothing here touches a process group, and no function mutates its inputs: every function returns
new containers (tensors that need no change may be shared with the input, and a shard may be a
view of the full tensor it was cut from). Trees are any nesting of dicts, lists and tuples that
``optree`` understands, so a model state dict and an optimizer state dict go through the same
code.

[Note: layouts and coordinates]
A ``Layout`` describes a sharded model without naming a process group: per state-dict key, the
full shape and dtype, the mesh shape and one placement per mesh dim, ``"R"`` (replicate) or
``"S(d)"`` (shard tensor dim ``d`` with ``torch.chunk`` semantics, like DTensor's ``Shard(d)``).
Several ``S`` placements nest left to right, as DTensor does. A *coordinate* is a tuple with one
index per mesh dim of ``layout.mesh_shape``; rank ``r`` of an ``init_device_mesh`` mesh sits at
``numpy.unravel_index(r, mesh_shape)``. An entry whose own mesh shape differs from the layout's
(a unit sharded over a 1D mesh under a root on a 2D mesh over the same ranks) is addressed
through the row-major flat index of the coordinate.

[Note: which leaves are sharded]
A leaf's entry is found from its key path, in two ways:

- Inside an optimizer state dict (``state`` and ``param_groups``, as ``fshard.optim_state_dict``
  gives it), at the root of the tree or nested anywhere in it (``{"model": ..., "optim": osd}``),
  the position decides: a leaf at ``(..., "state", name, ...)`` belongs to ``name`` if the layout
  has it and to no entry otherwise, and ``param_groups`` belongs to no entry. Names further up or
  down the path (a model buffer called ``state``, ``optim`` or ``exp_avg``) do not count.
- Anywhere else, every string on the path that is a layout key is a *candidate*: ``("model",
  "w")`` has two if the model has a buffer called ``model``, ``("optim", "w", "exp_avg")`` (the
  per-parameter state of an optimizer state dict without its ``param_groups``) has ``w`` and maybe
  ``optim``. The leaf belongs to the candidate whose shape it *fits*: the entry's full shape
  (``shard``) or the local shape of every coordinate's piece (``unshard``). Two candidates that
  fit and cut the tensor differently (some coordinate holds another region) are an error naming
  the path and both keys: each reading needs one name to collide and one shape to agree by
  chance, so neither is safer to guess. Candidates that fit and cut alike give the same result
  (the deepest is taken). A leaf of a plain model state dict has one candidate, its own key.

If no candidate fits, a leaf that sits *at* a layout key (the last path element: a model state
dict's tensor) is an error naming the key, and a leaf only *below* keys is optimizer state of
another shape, kept whole (Adam's ``step``). Leaves with no candidate, and non-tensor leaves, are
replicated: ``shard`` passes them through and ``unshard`` takes the value of the first coordinate.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import optree
import torch

from fshard._errors import ProblemList
from fshard._placement import chunk_sizes

__all__ = [
    # layouts
    "TensorLayout",
    "Layout",
    "Coord",
    # sharding
    "shard",
    "unshard",
    "reshard",
    # keys and values
    "map_keys",
    "strip_prefix",
    "cast",
    "to_cpu",
    "to_local",
]

Coord = tuple[int, ...]
"""A rank's coordinate in a mesh: ``(shard_rank,)`` on 1D, ``(replicate_rank, shard_rank)`` on 2D.

Example:
    >>> from fshard.transforms import Coord
    >>> coord: Coord = (1, 0)  # replica 1, shard 0 of a 2x2 mesh
"""
PathKey = tuple[Any, ...]

_SHARD_RE = re.compile(r"^S\((\d+)\)$")
DEFAULT_PREFIXES = ("module.", "_orig_mod.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected e.g. 'float32' or 'bfloat16'")
    return dtype


# ------------------------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class TensorLayout:
    """How one state-dict entry is laid out over a mesh: full shape, dtype, mesh shape and one
    placement per mesh dim, ``"R"`` (replicate) or ``"S(d)"`` (shard dim ``d`` like
    ``torch.chunk``, as DTensor's ``Shard(d)``).

    Example:
        >>> from fshard.transforms import TensorLayout
        >>> w = TensorLayout(full_shape=(5, 3), dtype="float32", mesh_shape=(4,), placements=("S(0)",))
        >>> [w.local_shape((r,)) for r in range(4)]
        [(2, 3), (2, 3), (1, 3), (0, 3)]
        >>> w.local_offsets((2,))
        (4, 0)
    """

    full_shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]  # one per mesh dim: "R" or "S(d)"

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
        object.__setattr__(self, "placements", tuple(str(p) for p in self.placements))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        _dtype_from_name(self.dtype)
        if any(s < 0 for s in self.full_shape):
            raise ValueError(f"TensorLayout: full_shape must be non-negative, got {self.full_shape}")
        if not self.mesh_shape or any(s < 1 for s in self.mesh_shape):
            raise ValueError(f"TensorLayout: mesh_shape must be positive sizes, got {self.mesh_shape}")
        if len(self.placements) != len(self.mesh_shape):
            raise ValueError(
                f"TensorLayout: needs one placement per mesh dim ({len(self.mesh_shape)}), got "
                f"{self.placements}"
            )
        for p in self.placements:
            if p == "R":
                continue
            m = _SHARD_RE.match(p)
            if m is None:
                raise ValueError(f"TensorLayout: placement {p!r} is neither 'R' nor 'S(<dim>)'")
            if int(m.group(1)) >= len(self.full_shape):
                raise ValueError(
                    f"TensorLayout: placement {p!r} shards dim {m.group(1)} of a "
                    f"{len(self.full_shape)}-d tensor of shape {self.full_shape}"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_from_name(self.dtype)

    @property
    def is_sharded(self) -> bool:
        """True if some mesh dim shards this tensor."""
        return any(p != "R" for p in self.placements)

    def _shard_dims(self) -> list[tuple[int, int]]:
        """``(mesh_dim, tensor_dim)`` for every ``S`` placement, in mesh-dim order."""
        out = []
        for mesh_dim, p in enumerate(self.placements):
            m = _SHARD_RE.match(p)
            if m is not None:
                out.append((mesh_dim, int(m.group(1))))
        return out

    def local_region(self, coord: Coord) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, lengths)`` per tensor dim of the piece held at ``coord`` (this entry's mesh)."""
        offsets = [0] * len(self.full_shape)
        lengths = list(self.full_shape)
        for mesh_dim, dim in self._shard_dims():
            n = self.mesh_shape[mesh_dim]
            index = coord[mesh_dim]
            slot = -(-lengths[dim] // n)
            offsets[dim] += min(index * slot, lengths[dim])
            lengths[dim] = chunk_sizes(lengths[dim], n)[index]
        return tuple(offsets), tuple(lengths)

    def local_shape(self, coord: Coord) -> tuple[int, ...]:
        return self.local_region(coord)[1]

    def local_offsets(self, coord: Coord) -> tuple[int, ...]:
        return self.local_region(coord)[0]

    def shard_index(self, coord: Coord) -> tuple[int, ...]:
        """Which chunk ``coord`` holds along each sharding mesh dim (replicas share an index)."""
        return tuple(coord[mesh_dim] for mesh_dim, _ in self._shard_dims())

    def to_json(self) -> dict[str, Any]:
        return {
            "full_shape": list(self.full_shape),
            "dtype": self.dtype,
            "mesh_shape": list(self.mesh_shape),
            "placements": list(self.placements),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorLayout:
        return cls(
            full_shape=tuple(data["full_shape"]),
            dtype=str(data["dtype"]),
            mesh_shape=tuple(data["mesh_shape"]),
            placements=tuple(data["placements"]),
        )


@dataclass(frozen=True)
class Layout(Mapping[str, TensorLayout]):
    """The picklable layout of a sharded model: a read-only mapping ``key -> TensorLayout``.

    ``mesh_shape`` is the shape of the mesh that coordinates refer to (the root's mesh).
    ``fshard.layout_of(model)`` builds one from a sharded model; you can also write one by hand.

    Example:
        >>> from fshard.transforms import Layout, TensorLayout
        >>> layout = Layout((2,), {"w": TensorLayout((3,), "float32", (2,), ("S(0)",))})
        >>> list(layout), layout["w"].local_shape((1,)), layout.coords()
        (['w'], (1,), [(0,), (1,)])
    """

    mesh_shape: tuple[int, ...]
    entries: tuple[tuple[str, TensorLayout], ...] = field(default=())

    def __init__(
        self,
        mesh_shape: Sequence[int],
        entries: Mapping[str, TensorLayout] | Iterable[tuple[str, TensorLayout]] = (),
    ) -> None:
        items = tuple(entries.items()) if isinstance(entries, Mapping) else tuple(entries)
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in mesh_shape))
        object.__setattr__(self, "entries", items)
        if not self.mesh_shape or any(s < 1 for s in self.mesh_shape):
            raise ValueError(f"Layout: mesh_shape must be positive sizes, got {self.mesh_shape}")
        numel = math.prod(self.mesh_shape)
        problems = ProblemList("Layout")
        seen: set[str] = set()
        for key, entry in items:
            if not isinstance(entry, TensorLayout):
                problems.add(f"entry {key!r} is a {type(entry).__name__}, expected TensorLayout")
                continue
            if key in seen:
                problems.add(f"key {key!r} appears twice")
            seen.add(key)
            if math.prod(entry.mesh_shape) != numel:
                problems.add(
                    f"entry {key!r} has mesh shape {entry.mesh_shape}, which does not cover the "
                    f"same number of ranks as the layout's mesh {self.mesh_shape}"
                )
        problems.raise_if_any(ValueError)

    @cached_property
    def _by_key(self) -> dict[str, TensorLayout]:
        return dict(self.entries)

    def __getitem__(self, key: str) -> TensorLayout:
        return self._by_key[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __hash__(self) -> int:
        return hash((self.mesh_shape, self.entries))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self.mesh_shape == other.mesh_shape and self.entries == other.entries

    def coords(self) -> list[Coord]:
        """Every coordinate of the mesh, in row-major (rank) order."""
        return [tuple(c) for c in itertools.product(*(range(s) for s in self.mesh_shape))]

    def entry_coord(self, key: str, coord: Coord) -> Coord:
        """``coord`` (on the layout's mesh) as a coordinate of ``key``'s own mesh."""
        entry = self[key]
        if entry.mesh_shape == self.mesh_shape:
            return coord
        flat = 0
        for index, size in zip(coord, self.mesh_shape, strict=True):
            flat = flat * size + index
        out = []
        for size in reversed(entry.mesh_shape):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh_shape": list(self.mesh_shape),
            "entries": {k: v.to_json() for k, v in self.entries},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        return cls(
            tuple(data["mesh_shape"]),
            {k: TensorLayout.from_json(v) for k, v in data["entries"].items()},
        )


def _check_coord(coord: Coord | int, mesh_shape: tuple[int, ...], where: str) -> Coord:
    """``coord`` checked against the mesh; an int is a rank, at its row-major coordinate (as
    ``init_device_mesh`` places ranks)."""
    if isinstance(coord, bool):
        raise TypeError(f"{where}: pass a coordinate tuple or a rank (an int), got {coord!r}")
    if isinstance(coord, int):
        size = math.prod(mesh_shape)
        if not 0 <= coord < size:
            raise ValueError(
                f"{where}: rank {coord} is not on the layout's mesh of shape {mesh_shape} "
                f"({size} ranks); pass a rank in 0..{size - 1} or a coordinate tuple"
            )
        rank, coords = coord, []
        for extent in reversed(mesh_shape):
            coords.append(rank % extent)
            rank //= extent
        return tuple(reversed(coords))
    coord = tuple(int(c) for c in coord)
    if len(coord) != len(mesh_shape) or not all(
        0 <= c < s for c, s in zip(coord, mesh_shape, strict=True)
    ):
        raise ValueError(
            f"{where}: coordinate {coord} is not on the layout's mesh of shape {mesh_shape}; pass "
            f"one index per mesh dim, each in range (e.g. {tuple(0 for _ in mesh_shape)})"
        )
    return coord


# ----------------------------------------------------------------------------- tree plumbing


def _flatten(tree: Any) -> tuple[list[PathKey], list[Any], optree.PyTreeSpec]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [tuple(p) for p in paths], leaves, spec


class _Candidate(NamedTuple):
    """A layout key on a leaf's path: ``exact`` if the leaf sits at it, not below it."""

    key: str
    exact: bool


def _optim_root_depth(tree: Any, path: PathKey) -> int | None:
    """How deep on ``path`` the outermost optimizer state dict sits, or None if none does.

    Only dicts, lists and tuples are walked into (optree's path entries index them); a leaf
    below any other node is looked up as outside an optimizer state dict.
    """
    node = tree
    for depth, element in enumerate(path):
        if _is_optim_state_dict(node):
            return depth
        if isinstance(node, Mapping) and element in node:
            node = node[element]
        elif isinstance(node, (list, tuple)) and isinstance(element, int) and element < len(node):
            node = node[element]
        else:
            return None
    return None


def _candidates(tree: Any, paths: list[PathKey], layout: Layout) -> list[list[_Candidate]]:
    """Per leaf of ``tree``, the layout keys it may belong to, outermost first (see [Note:
    which leaves are sharded])."""
    out: list[list[_Candidate]] = []
    for path in paths:
        depth = _optim_root_depth(tree, path)
        if depth is None:
            positions: Iterable[int] = range(len(path))
        elif path[depth] == "state":
            positions = [depth + 1] if depth + 1 < len(path) else []  # the parameter name only
        else:
            positions = []  # param_groups, optimizer_class
        out.append(
            [
                _Candidate(path[i], i == len(path) - 1)
                for i in positions
                if isinstance(path[i], str) and path[i] in layout
            ]
        )
    return out


def _choose(
    path: PathKey,
    candidates: list[_Candidate],
    fits: Callable[[str], bool],
    layout: Layout,
    problems: ProblemList,
) -> _Candidate | None:
    """The candidate a tensor leaf belongs to, given which keys' shapes it ``fits``; None if it
    is replicated or ambiguous (then a problem names the path and the keys). A returned
    candidate that does not fit is ``exact``: the caller reports its shape.

    [Note: which leaves are sharded] gives the rule.
    """
    fitting = [c for c in candidates if fits(c.key)]
    if len(fitting) > 1 and len({_cut(layout, c.key) for c in fitting}) > 1:
        keys = ", ".join(repr(k) for k in dict.fromkeys(c.key for c in fitting))
        problems.add(
            f"the tensor at {_path_str(path)} fits layout keys {keys}, which lay it out "
            "differently, so which one it belongs to is ambiguous; transform the model and the "
            "optimizer state dicts separately, give optimizer state as fshard.optim_state_dict "
            "does ('state' and 'param_groups', read by position), or rename the colliding keys "
            "(transforms.map_keys)"
        )
        return None
    if fitting:
        return fitting[-1]
    if candidates and candidates[-1].exact:
        return candidates[-1]
    return None


def _cut(layout: Layout, key: str) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The region of ``key``'s tensor each coordinate holds: two keys alike here cut alike."""
    entry = layout[key]
    return tuple(entry.local_region(layout.entry_coord(key, c)) for c in layout.coords())


def _at(path: PathKey, key: str, unfit: Iterable[_Candidate] = ()) -> str:
    """Where the leaf of an error about ``key`` sits, unless at the top level, and which other
    candidates it does not fit either."""
    if path == (key,):
        return ""
    others = list(dict.fromkeys(repr(c.key) for c in unfit if c.key != key))
    if not others:
        return f" (the tensor at {_path_str(path)})"
    return (
        f" (the tensor at {_path_str(path)}, which does not fit layout key(s) "
        f"{', '.join(others)} above it either)"
    )


def _path_str(path: PathKey) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def _slices(offsets: Sequence[int], lengths: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))


def _shard_key(
    path: PathKey,
    leaf: Any,
    candidates: list[_Candidate],
    layout: Layout,
    problems: ProblemList,
) -> str | None:
    """The layout key whose entry cuts ``leaf`` (a full tensor), or None to keep it whole."""
    if not isinstance(leaf, torch.Tensor) or not candidates:
        return None
    shape = tuple(leaf.shape)
    chosen = _choose(
        path, candidates, lambda key: shape == layout[key].full_shape, layout, problems
    )
    if chosen is None:
        return None
    entry = layout[chosen.key]
    if shape != entry.full_shape:  # only an exact candidate comes back without fitting
        problems.add(
            f"key {chosen.key!r} has shape {list(shape)}, but the layout says its full shape is "
            f"{list(entry.full_shape)}" + _at(path, chosen.key, candidates)
        )
        return None
    return chosen.key if entry.is_sharded else None


def _shard_piece(leaf: torch.Tensor, layout: Layout, key: str, coord: Coord) -> torch.Tensor:
    """The view of ``leaf`` (full, under ``key``) held at ``coord`` of the layout's mesh."""
    offsets, lengths = layout[key].local_region(layout.entry_coord(key, coord))
    return leaf[_slices(offsets, lengths)]


def _unshard_leaf(
    path: PathKey,
    pieces: Mapping[Coord, Any],
    candidates: list[_Candidate],
    layout: Layout,
    problems: ProblemList,
) -> Any:
    coords = sorted(pieces)
    first = pieces[coords[0]]
    if not isinstance(first, torch.Tensor) or not candidates:
        return first

    def expected(key: str) -> dict[Coord, tuple[int, ...]]:
        return {c: layout[key].local_shape(layout.entry_coord(key, c)) for c in coords}

    def fits(key: str) -> bool:
        want = expected(key)
        return all(
            isinstance(pieces[c], torch.Tensor) and tuple(pieces[c].shape) == want[c]
            for c in coords
        )

    chosen = _choose(path, candidates, fits, layout, problems)
    if chosen is None:
        return first
    key = chosen.key
    if not fits(key):  # only an exact candidate comes back without fitting
        want = expected(key)
        wrong = [
            f"{c}: {list(getattr(pieces[c], 'shape', ()))} (expected {list(want[c])})"
            for c in coords
            if tuple(getattr(pieces[c], "shape", ())) != want[c]
        ]
        problems.add(
            f"key {key!r} has local shapes that do not fit the layout at "
            + ", ".join(wrong)
            + _at(path, key, candidates)
        )
        return first
    entry = layout[key]
    if not entry.is_sharded:
        return first
    own = {c: layout.entry_coord(key, c) for c in coords}
    needed = {entry.shard_index(layout.entry_coord(key, c)) for c in layout.coords()}
    have: dict[tuple[int, ...], Coord] = {}
    for c in coords:
        have.setdefault(entry.shard_index(own[c]), c)
    missing = sorted(needed - set(have))
    if missing:
        problems.add(
            f"key {key!r} cannot be unsharded: no coordinate holds its shard(s) {missing} "
            "(pass the local state dicts of a full set of shard coordinates)"
            + _at(path, key)
        )
        return first
    full = torch.empty(entry.full_shape, dtype=first.dtype, device=first.device)
    for c in have.values():
        offsets, lengths = entry.local_region(own[c])
        full[_slices(offsets, lengths)] = pieces[c]
    return full


def _flatten_by_coord(
    local_sds_by_coord: Mapping[Coord, Any], mesh_shape: tuple[int, ...], where: str
) -> tuple[list[Coord], list[PathKey], dict[Coord, list[Any]], optree.PyTreeSpec]:
    if not local_sds_by_coord:
        raise ValueError(f"{where}: needs the local state dict of at least one coordinate")
    by_coord: dict[Coord, Any] = {}
    for given, tree in local_sds_by_coord.items():
        coord = _check_coord(given, mesh_shape, where)
        if coord in by_coord:
            raise ValueError(
                f"{where}: coordinate {coord} is given twice (as {given!r} and as another key); "
                "give each coordinate's local state dict once"
            )
        by_coord[coord] = tree
    coords = sorted(by_coord)
    paths, _, spec = _flatten(by_coord[coords[0]])
    leaves: dict[Coord, list[Any]] = {}
    for c in coords:
        _, c_leaves, c_spec = _flatten(by_coord[c])
        if c_spec != spec:
            raise ValueError(
                f"{where}: the state dict of coordinate {c} has a different structure than that of "
                f"coordinate {coords[0]}:\n  {c_spec}\nvs\n  {spec}\nEvery rank's local state dict "
                "must have the same keys and nesting."
            )
        leaves[c] = c_leaves
    return coords, paths, leaves, spec


# ---------------------------------------------------------------------------------- sharding


def shard(full_sd: Any, layout: Layout, coord: Coord | int) -> Any:
    """The local state dict of mesh coordinate ``coord``, cut from a full (nested) state dict.

    ``coord`` is a coordinate tuple, or a rank (an int: its row-major coordinate on the mesh,
    where ``init_device_mesh`` puts that rank, so rank 3 of a ``(2, 2)`` mesh is ``(1, 1)``).

    Sharded leaves come back as views of ``full_sd``'s tensors; replicated leaves are the input
    objects themselves. A leaf at a layout key must be a full-shaped tensor; optimizer state
    below a key is sharded like the parameter when its shape matches and kept whole otherwise
    (Adam's ``step``).

    Example:
        >>> import torch
        >>> from fshard.transforms import Layout, TensorLayout, shard
        >>> layout = Layout((2,), {"w": TensorLayout((3, 2), "float32", (2,), ("S(0)",))})
        >>> sd = {"w": torch.arange(6.).view(3, 2), "step": 7}
        >>> shard(sd, layout, (1,))
        {'w': tensor([[4., 5.]]), 'step': 7}
    """
    coord = _check_coord(coord, layout.mesh_shape, "transforms.shard")
    paths, leaves, spec = _flatten(full_sd)
    problems = ProblemList("transforms.shard")
    candidates = _candidates(full_sd, paths, layout)
    out = []
    for path, leaf_candidates, leaf in zip(paths, candidates, leaves, strict=True):
        key = _shard_key(path, leaf, leaf_candidates, layout, problems)
        out.append(leaf if key is None else _shard_piece(leaf, layout, key, coord))
    problems.raise_if_any(ValueError, hint="Pass a full state dict of the model the layout came from.")
    return optree.tree_unflatten(spec, out)


def unshard(local_sds_by_coord: Mapping[Coord, Any], layout: Layout) -> Any:
    """The full state dict assembled from local state dicts keyed by mesh coordinate (or by
    rank, as in ``shard``).

    Along replicated mesh dims one coordinate is enough; every sharded key needs all its shards.
    Sharded tensors come back as new tensors, replicated leaves as the first coordinate's objects.

    Example:
        >>> import torch
        >>> from fshard.transforms import Layout, TensorLayout, unshard
        >>> layout = Layout((2,), {"w": TensorLayout((3,), "float32", (2,), ("S(0)",))})
        >>> unshard({(0,): {"w": torch.tensor([1., 2.])}, (1,): {"w": torch.tensor([3.])}}, layout)
        {'w': tensor([1., 2., 3.])}
    """
    coords, paths, leaves, spec = _flatten_by_coord(
        local_sds_by_coord, layout.mesh_shape, "transforms.unshard"
    )
    problems = ProblemList("transforms.unshard")
    candidates = _candidates(next(iter(local_sds_by_coord.values())), paths, layout)
    out = [
        _unshard_leaf(path, {c: leaves[c][i] for c in coords}, candidates[i], layout, problems)
        for i, path in enumerate(paths)
    ]
    problems.raise_if_any(ValueError)
    return optree.tree_unflatten(spec, out)


def reshard(
    local_sds_by_coord: Mapping[Coord, Any], old_layout: Layout, new_layout: Layout
) -> dict[Coord, Any]:
    """Local state dicts for every coordinate of ``new_layout``'s mesh, from those of the old.

    Equal to ``{c: shard(unshard(x, old_layout), new_layout, c) for c in new_layout.coords()}``
    but assembled one leaf at a time, so at most one full tensor is alive at once, and the new
    shards are compact copies (they keep no full tensor alive).

    Example:
        >>> import torch
        >>> from fshard.transforms import Layout, TensorLayout, reshard
        >>> old = Layout((2,), {"w": TensorLayout((3,), "float32", (2,), ("S(0)",))})
        >>> new = Layout((3,), {"w": TensorLayout((3,), "float32", (3,), ("S(0)",))})
        >>> out = reshard({(0,): {"w": torch.tensor([1., 2.])}, (1,): {"w": torch.tensor([3.])}}, old, new)
        >>> [out[c]["w"].tolist() for c in new.coords()]
        [[1.0], [2.0], [3.0]]
    """
    coords, paths, leaves, spec = _flatten_by_coord(
        local_sds_by_coord, old_layout.mesh_shape, "transforms.reshard"
    )
    new_coords = new_layout.coords()
    problems = ProblemList("transforms.reshard")
    out: dict[Coord, list[Any]] = {c: [] for c in new_coords}
    tree = next(iter(local_sds_by_coord.values()))
    old_candidates = _candidates(tree, paths, old_layout)
    new_candidates = _candidates(tree, paths, new_layout)
    for i, path in enumerate(paths):
        pieces = {c: leaves[c][i] for c in coords}
        full = _unshard_leaf(path, pieces, old_candidates[i], old_layout, problems)
        # Resolved once per leaf, so a problem is reported once, not once per new coordinate.
        key = _shard_key(path, full, new_candidates[i], new_layout, problems)
        for c in new_coords:
            out[c].append(full if key is None else _shard_piece(full, new_layout, key, c).clone())
    problems.raise_if_any(ValueError)
    return {c: optree.tree_unflatten(spec, out[c]) for c in new_coords}


# ---------------------------------------------------------------------------- keys and values


_OPTIM_KEYS = frozenset({"state", "param_groups", "optimizer_class"})


def _is_optim_state_dict(tree: Any) -> bool:
    """``fshard.optim_state_dict``'s form: ``state``, ``param_groups`` and ``optimizer_class``.

    Constant time for a mapping without both ``state`` and ``param_groups`` (a model state dict
    of any size), since ``_candidates`` asks at every level of every leaf's path.
    """
    return (
        isinstance(tree, Mapping)
        and "state" in tree
        and "param_groups" in tree
        and all(key in _OPTIM_KEYS for key in tree)
    )


def _rename_mapping(mapping: Mapping[Any, Any], fn: Callable[[str], str], where: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    origin: dict[Any, Any] = {}
    problems = ProblemList(where)
    for key, value in mapping.items():
        new = fn(key) if isinstance(key, str) else key
        if new in out:
            problems.add(f"keys {origin[new]!r} and {key!r} both become {new!r}")
            continue
        out[new] = value
        origin[new] = key
    problems.raise_if_any(ValueError, hint="Rename keys so that no two map to the same name.")
    return out


def map_keys(tree: Mapping[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """Rename the keys of a state dict with ``fn``; values are kept as they are.

    For an optimizer state dict from ``fshard.optim_state_dict`` (keys ``state`` and
    ``param_groups``, and ``optimizer_class``, kept as it is) the parameter names are renamed:
    the keys of ``state`` and the names in each group's ``params`` and ``param_names`` (which
    torch records for an optimizer built from ``named_parameters()``). Two keys that map to the
    same name are an error naming both.

    Example:
        >>> from fshard.transforms import map_keys
        >>> map_keys({"a.w": 1, "b": 2}, lambda k: k.replace("a.", "enc."))
        {'enc.w': 1, 'b': 2}
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"transforms.map_keys expects a mapping, got {type(tree).__name__}")
    if _is_optim_state_dict(tree):
        groups = []
        for group in tree["param_groups"]:
            new_group = dict(group)
            for names in ("params", "param_names"):
                if names in group:
                    new_group[names] = [fn(p) if isinstance(p, str) else p for p in group[names]]
            groups.append(new_group)
        return {
            **tree,
            "state": _rename_mapping(tree["state"], fn, "transforms.map_keys(state)"),
            "param_groups": groups,
        }
    return _rename_mapping(tree, fn, "transforms.map_keys")


def strip_prefix(
    tree: Mapping[str, Any], prefixes: str | Sequence[str] = DEFAULT_PREFIXES
) -> dict[str, Any]:
    """Remove leading ``module.`` (DDP) and ``_orig_mod.`` (``torch.compile``) prefixes from keys.

    Prefixes are stripped repeatedly, in any order, so ``module._orig_mod.w`` becomes ``w``.
    ``torch.compile`` applied to a submodule leaves ``_orig_mod.`` inside a key instead; use
    ``map_keys(sd, lambda k: k.replace("._orig_mod.", "."))`` for that.

    Example:
        >>> from fshard.transforms import strip_prefix
        >>> strip_prefix({"module._orig_mod.fc.weight": 1})
        {'fc.weight': 1}
    """
    chosen = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    if not all(isinstance(p, str) and p for p in chosen):
        raise ValueError(f"transforms.strip_prefix: prefixes must be non-empty strings, got {prefixes!r}")

    def strip(key: str) -> str:
        changed = True
        while changed:
            changed = False
            for p in chosen:
                if key.startswith(p):
                    key = key[len(p) :]
                    changed = True
        return key

    return map_keys(tree, strip)


def cast(
    tree: Any,
    dtype: torch.dtype,
    *,
    floating_only: bool = True,
    skip_keys: Collection[str] = ("step",),
) -> Any:
    """Cast the tensors of ``tree`` to ``dtype`` (only floating-point ones by default).

    Leaves stored under a key in ``skip_keys`` are left as they are. The default, ``("step",)``,
    keeps optimizer step counters exact (Adam's ``state[name]["step"]`` is a float32 tensor, and
    bfloat16 counts exactly only up to 256, float16 up to 2048). The key is the leaf's own key,
    the last one on its path: a model buffer ``blocks.0.step`` is cast, a top-level ``step`` is
    not. Pass ``skip_keys=()`` to cast everything.

    Example:
        >>> import torch
        >>> from fshard.transforms import cast
        >>> out = cast({"w": torch.ones(2), "n": torch.tensor(3)}, torch.bfloat16)
        >>> out["w"].dtype, out["n"].dtype
        (torch.bfloat16, torch.int64)
        >>> osd = {"state": {"w": {"step": torch.tensor(257.), "exp_avg": torch.ones(2)}}}
        >>> cast(osd, torch.bfloat16)["state"]["w"]["step"]
        tensor(257.)
        >>> cast(osd, torch.bfloat16, skip_keys=())["state"]["w"]["step"]
        tensor(256., dtype=torch.bfloat16)
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"transforms.cast: dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(skip_keys, str):
        raise TypeError(
            f"transforms.cast: skip_keys must be a collection of keys, got the string "
            f"{skip_keys!r}; pass ({skip_keys!r},)"
        )
    skipped = frozenset(skip_keys)
    paths, leaves, spec = _flatten(tree)

    def fn(path: PathKey, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if floating_only and not leaf.is_floating_point():
            return leaf
        if path and isinstance(path[-1], str) and path[-1] in skipped:
            return leaf
        return leaf.to(dtype)

    return optree.tree_unflatten(spec, [fn(p, leaf) for p, leaf in zip(paths, leaves, strict=True)])


def to_cpu(tree: Any) -> Any:
    """Move every tensor of ``tree`` to the CPU (CPU tensors are returned as they are).

    Example:
        >>> import torch
        >>> from fshard.transforms import to_cpu
        >>> to_cpu({"w": torch.ones(1)})["w"].device
        device(type='cpu')
    """
    return optree.tree_map(
        lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, tree, none_is_leaf=True
    )


def to_local(tree: Any) -> Any:
    """Replace every DTensor of ``tree`` by its local tensor (no communication).

    This turns ``fshard.state_dict(model)`` on one rank into the local state dict that
    ``unshard`` and ``reshard`` take for that rank's coordinate.

    Example:
        >>> import torch
        >>> from fshard.transforms import to_local
        >>> to_local({"w": torch.ones(1)})
        {'w': tensor([1.])}
    """
    from torch.distributed.tensor import DTensor

    return optree.tree_map(
        lambda leaf: leaf.to_local() if isinstance(leaf, DTensor) else leaf, tree, none_is_leaf=True
    )
