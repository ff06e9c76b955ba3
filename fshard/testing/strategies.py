"""Hypothesis strategies for meshes and small models (needs ``pip install fshard[test]``).

Strategies are functions with keyword-only bounds and small defaults; they compose with
``.map``/``.flatmap`` and never filter, so shrinking stays fast.

Example:
    >>> from hypothesis import given
    >>> from fshard.testing import strategies as fst
    >>> @given(fst.mesh_shapes(world_size=4))
    ... def test_mesh(shape):
    ...     assert shape in [(4,), (1, 4), (2, 2), (4, 1)]
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fshard.testing.models import MLPSpec, ModelSpec, TransformerSpec

__all__ = [
    "divisor_pairs",
    "mesh_shapes",
    "mlp_specs",
    "transformer_specs",
    "model_specs",
    "param_shapes",
]


def divisor_pairs(n: int) -> list[tuple[int, int]]:
    """``(replicate, shard)`` pairs whose product is ``n``.

    Example:
        >>> from fshard.testing.strategies import divisor_pairs
        >>> divisor_pairs(4)
        [(1, 4), (2, 2), (4, 1)]
    """
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def mesh_shapes(*, world_size: int, allow_2d: bool = True) -> st.SearchStrategy[tuple[int, ...]]:
    """A 1D ``(world_size,)`` mesh or a 2D ``(replicate, shard)`` mesh over ``world_size`` ranks.

    Example:
        >>> import functools
        >>> from hypothesis import given
        >>> from fshard.testing import assert_equivalent_to_ddp, models
        >>> from fshard.testing.strategies import mesh_shapes
        >>> mesh_shapes(world_size=4)
        sampled_from([(4,), (1, 4), (2, 2), (4, 1)])
        >>> spec = models.MLPSpec()
        >>> @given(mesh_shapes(world_size=4))
        ... def test_mlp_matches_ddp(mesh_shape):
        ...     assert_equivalent_to_ddp(
        ...         functools.partial(models.build_model, spec),
        ...         batch_fn=functools.partial(models.make_batch, spec),
        ...         shard_fn=functools.partial(models.shard_model, spec),
        ...         world_size=4,
        ...         mesh_shape=mesh_shape,
        ...     )
    """
    if world_size < 1:
        raise ValueError(f"mesh_shapes: world_size must be >= 1, got {world_size}")
    options: list[tuple[int, ...]] = [(world_size,)]
    if allow_2d:
        options += divisor_pairs(world_size)
    return st.sampled_from(options)


def mlp_specs(
    *,
    max_layers: int = 3,
    max_width: int = 9,
    corner_cases: bool = True,
    dtype: torch.dtype = torch.float32,
) -> st.SearchStrategy[MLPSpec]:
    """MLP specs with widths that are rarely multiples of the world size.

    With ``corner_cases`` the spec may freeze layers, skip a layer on odd steps, call a unit
    twice per forward, add a 0-d parameter, or checkpoint around each layer.

    Example:
        >>> from hypothesis import given
        >>> from fshard.testing.models import build_model, compute_loss, make_batch
        >>> from fshard.testing.strategies import mlp_specs
        >>> @given(mlp_specs(max_layers=2))
        ... def test_loss_is_finite(spec):
        ...     loss = compute_loss(spec, build_model(spec), make_batch(spec, step=0, rank=0))
        ...     assert loss.isfinite()
        >>> mlp_specs(max_layers=0)
        Traceback (most recent call last):
            ...
        ValueError: mlp_specs: max_layers and max_width must be >= 1
    """
    if max_layers < 1 or max_width < 1:
        raise ValueError("mlp_specs: max_layers and max_width must be >= 1")

    @st.composite
    def build(draw: st.DrawFn) -> MLPSpec:
        n = draw(st.integers(1, max_layers))
        widths = tuple(draw(st.lists(st.integers(1, max_width), min_size=n, max_size=n)))
        spec = MLPSpec(
            in_dim=draw(st.integers(1, max_width)),
            widths=widths,
            bias=draw(st.booleans()),
            seed=draw(st.integers(0, 2**16)),
            batch_size=draw(st.integers(1, 4)),
            dtype=dtype,
        )
        if not corner_cases:
            return spec
        frozen = tuple(i for i in range(n) if draw(st.integers(0, 4)) == 0 and i < n - 1)
        skip = draw(st.none() | st.integers(0, n - 1))
        if n == 1 or (skip is not None and widths[skip] != (widths[skip - 1] if skip else spec.in_dim)):
            skip = None  # a skipped layer must preserve the width and leave another to train
        if skip is not None and all(i in frozen for i in range(n) if i != skip):
            skip = None  # (frozen layers train nothing: the loss would need no grad)
        repeat = draw(st.none() | st.integers(0, n - 1))
        return MLPSpec(
            in_dim=spec.in_dim,
            widths=widths,
            bias=spec.bias,
            frozen=frozen,
            skip_layer=skip,
            repeat_layer=repeat,
            scalar_param=draw(st.booleans()),
            checkpoint=draw(st.sampled_from(["none", "around"])),
            dtype=dtype,
            batch_size=spec.batch_size,
            seed=spec.seed,
        )

    return build()


def transformer_specs(
    *, max_layers: int = 2, dtype: torch.dtype = torch.float32
) -> st.SearchStrategy[TransformerSpec]:
    """Tiny GPT-style specs: odd vocabularies and widths, tied or untied, checkpointed (reentrant
    or not) or not, the final norm and head sharded as one unit or left to the root.

    Example:
        >>> from hypothesis import given
        >>> from fshard.testing.models import build_model, make_batch
        >>> from fshard.testing.strategies import transformer_specs
        >>> @given(transformer_specs(max_layers=1))
        ... def test_logits_shape(spec):
        ...     tokens, targets = make_batch(spec, step=0, rank=0)
        ...     logits = build_model(spec)(tokens)
        ...     assert logits.shape == (spec.batch_size, spec.seq, spec.vocab)
    """

    @st.composite
    def build(draw: st.DrawFn) -> TransformerSpec:
        heads = draw(st.integers(1, 2))
        checkpoint = draw(st.sampled_from(["none", "inside", "around"]))
        return TransformerSpec(
            vocab=draw(st.integers(3, 13)),
            dim=heads * draw(st.integers(3, 4)),  # LayerNorm over < 3 features has no gradient
            heads=heads,
            layers=draw(st.integers(1, max_layers)),
            seq=draw(st.integers(1, 5)),
            mlp_ratio=draw(st.integers(1, 3)),
            tie_embeddings=draw(st.booleans()),
            checkpoint=checkpoint,
            reentrant=checkpoint != "none" and draw(st.booleans()),
            tail_unit=draw(st.booleans()),
            dtype=dtype,
            batch_size=draw(st.integers(1, 3)),
            seed=draw(st.integers(0, 2**16)),
        )

    return build()


def model_specs(*, dtype: torch.dtype = torch.float32) -> st.SearchStrategy[ModelSpec]:
    """Either an MLP or a tiny transformer.

    Example:
        >>> import functools
        >>> import torch
        >>> from hypothesis import given
        >>> from fshard.testing import assert_equivalent_to_ddp, models
        >>> from fshard.testing.strategies import model_specs
        >>> @given(model_specs(dtype=torch.float64))
        ... def test_matches_ddp(spec):
        ...     skips = isinstance(spec, models.MLPSpec) and spec.skip_layer is not None
        ...     assert_equivalent_to_ddp(
        ...         functools.partial(models.build_model, spec),
        ...         batch_fn=functools.partial(models.make_batch, spec),
        ...         loss_fn=functools.partial(models.compute_loss, spec),
        ...         shard_fn=functools.partial(models.shard_model, spec),
        ...         ddp_kwargs={"find_unused_parameters": True} if skips else None,
        ...         rtol=1e-9,
        ...         atol=1e-11,
        ...     )
    """
    return st.one_of(mlp_specs(dtype=dtype), transformer_specs(dtype=dtype))


def param_shapes(*, max_dims: int = 3, max_side: int = 9) -> st.SearchStrategy[tuple[int, ...]]:
    """Parameter shapes including 0-d, empty dims and sides smaller than any world size.

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> from fshard.testing.strategies import param_shapes
        >>> from fshard.transforms import Layout, TensorLayout, shard, unshard
        >>> @given(param_shapes())
        ... def test_round_trip(shape):
        ...     placement = ("S(0)",) if shape else ("R",)  # a 0-d tensor can only be replicated
        ...     layout = Layout((3,), {"w": TensorLayout(shape, "float32", (3,), placement)})
        ...     sd = {"w": torch.rand(shape)}
        ...     shards = {coord: shard(sd, layout, coord) for coord in layout.coords()}
        ...     assert torch.equal(unshard(shards, layout)["w"], sd["w"])
    """
    return st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims).map(tuple)
