"""Small models described by picklable specs, for property tests and users' own checks.

A spec is a frozen dataclass; ``build_model(spec)`` builds the model, ``make_batch(spec, step,
rank)`` a deterministic batch, ``compute_loss(spec, model, batch)`` the loss, and
``shard_model(spec, model, mesh, ...)`` applies ``fully_shard`` the way the spec says (one unit
per layer or block, then the root). Everything is a module-level function so it pickles to a
``RankPool``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "MLPSpec",
    "TransformerSpec",
    "ModelSpec",
    "MLP",
    "TinyTransformer",
    "build_model",
    "make_batch",
    "compute_loss",
    "shard_model",
]


@dataclass(frozen=True)
class MLPSpec:
    """A stack of linear layers; options exercise the engine's corner cases.

    ``frozen``: indices of layers whose parameters do not require grad. ``skip_layer``: a layer
    whose forward is skipped on odd steps. ``repeat_layer``: a layer called twice per forward.
    ``scalar_param``: add a 0-d learnable scale. ``checkpoint``: wrap each layer's call in
    ``torch.utils.checkpoint`` (``"around"`` the unit) or not (``"none"``).

    Example:
        >>> from fshard.testing.models import MLPSpec, build_model
        >>> spec = MLPSpec(in_dim=4, widths=(8, 2), frozen=(0,))
        >>> model = build_model(spec)
        >>> [(tuple(p.shape), p.requires_grad) for p in model.parameters()]
        [((8, 4), False), ((8,), False), ((2, 8), True), ((2,), True)]
    """

    in_dim: int = 5
    widths: tuple[int, ...] = (7, 3)
    bias: bool = True
    frozen: tuple[int, ...] = ()
    skip_layer: int | None = None
    repeat_layer: int | None = None
    scalar_param: bool = False
    checkpoint: str = "none"
    dtype: torch.dtype = torch.float32
    batch_size: int = 3
    seed: int = 0


@dataclass(frozen=True)
class TransformerSpec:
    """A tiny pre-norm GPT-style language model (tied embeddings optional).

    ``checkpoint``: activation checkpointing of each block's attention (``"inside"`` a unit) or of
    each block (``"around"`` the unit), reentrant or not (``reentrant``). ``tail_unit``:
    ``shard_model`` shards the final norm and the head as one unit
    (``fully_shard([model.norm, model.head])``, as torchtitan does).

    Example:
        >>> from fshard.testing.models import TransformerSpec, build_model
        >>> spec = TransformerSpec(vocab=11, dim=6, heads=2, layers=1, checkpoint="inside")
        >>> model = build_model(spec)
        >>> len(model.blocks), model.head.weight is model.embed.weight
        (1, True)
    """

    vocab: int = 11
    dim: int = 6
    heads: int = 2
    layers: int = 2
    seq: int = 5
    mlp_ratio: int = 2
    tie_embeddings: bool = True
    checkpoint: str = "none"  # "none" | "inside" (attention of each block) | "around" (each block)
    reentrant: bool = False  # checkpoint with use_reentrant=True (torch's older implementation)
    tail_unit: bool = False  # shard_model makes the final norm and the head one unit
    dtype: torch.dtype = torch.float32
    batch_size: int = 2
    seed: int = 0


ModelSpec = MLPSpec | TransformerSpec


# ------------------------------------------------------------------------------------- models


class MLP(nn.Module):
    """The model of an ``MLPSpec``: ``tanh`` between layers; ``forward(x, skip)`` skips
    ``spec.skip_layer`` when ``skip`` is true.

    Example:
        >>> import torch
        >>> from fshard.testing.models import MLP, MLPSpec
        >>> mlp = MLP(MLPSpec(in_dim=5, widths=(5, 3), skip_layer=0))
        >>> mlp(torch.zeros(2, 5)).shape, mlp(torch.zeros(2, 5), skip=True).shape
        (torch.Size([2, 3]), torch.Size([2, 3]))
    """

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.spec = spec
        dims = (spec.in_dim, *spec.widths)
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=spec.bias) for a, b in itertools.pairwise(dims)
        )
        if spec.repeat_layer is not None:
            # Called twice after layer `repeat_layer`: a unit used twice in one forward.
            width = dims[spec.repeat_layer + 1]
            self.square = nn.Linear(width, width, bias=spec.bias)
        self.scale = nn.Parameter(torch.tensor(1.5)) if spec.scalar_param else None
        for i in spec.frozen:
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        spec = self.spec
        for i, layer in enumerate(self.layers):
            if skip and i == spec.skip_layer:
                continue
            if spec.checkpoint == "around":
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            if i == spec.repeat_layer:
                x = torch.tanh(self.square(x))
                x = torch.tanh(self.square(x))
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        if self.scale is not None:
            x = x * self.scale
        return x


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.ln1 = nn.LayerNorm(spec.dim)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax ignores a per-row
        # constant), which turns Adam's update into amplified rounding noise.
        self.qkv = nn.Linear(spec.dim, 3 * spec.dim, bias=False)
        self.proj = nn.Linear(spec.dim, spec.dim)
        self.ln2 = nn.LayerNorm(spec.dim)
        self.fc = nn.Linear(spec.dim, spec.mlp_ratio * spec.dim)
        self.out = nn.Linear(spec.mlp_ratio * spec.dim, spec.dim)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.spec.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.checkpoint == "inside":
            x = x + checkpoint(self.attention, x, use_reentrant=self.spec.reentrant)
        else:
            x = x + self.attention(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """The model of a ``TransformerSpec``: token ids ``(batch, seq)`` to logits
    ``(batch, seq, vocab)``.

    Example:
        >>> import torch
        >>> from fshard.testing.models import TinyTransformer, TransformerSpec
        >>> model = TinyTransformer(TransformerSpec(vocab=11, seq=5))
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 11])
    """

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.pos = nn.Parameter(torch.randn(spec.seq, spec.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            if self.spec.checkpoint == "around":
                x = checkpoint(block, x, use_reentrant=self.spec.reentrant)
            else:
                x = block(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------- functions


def build_model(spec: ModelSpec, device: torch.device | str = "cpu") -> nn.Module:
    """Build the model for ``spec`` with its seed (identical on every rank).

    The global RNG state is left as it was.

    Example:
        >>> import torch
        >>> from fshard.testing.models import MLPSpec, build_model
        >>> spec = MLPSpec(dtype=torch.float64, seed=3)
        >>> a, b = build_model(spec), build_model(spec)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        True
        >>> a.layers[0].weight.dtype
        torch.float64
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = MLP(spec) if isinstance(spec, MLPSpec) else TinyTransformer(spec)
    return model.to(device=device, dtype=spec.dtype)


def make_batch(spec: ModelSpec, step: int, rank: int, device: torch.device | str = "cpu") -> tuple[Any, ...]:
    """A deterministic batch for ``step`` on ``rank`` (ranks see different data).

    An MLP batch is ``(x, skip)`` (``skip`` is true on odd steps when the spec skips a layer); a
    transformer batch is ``(tokens, targets)``, the targets being the tokens shifted by one.

    Example:
        >>> import torch
        >>> from fshard.testing.models import MLPSpec, TransformerSpec, make_batch
        >>> x, skip = make_batch(MLPSpec(widths=(5, 3), skip_layer=0), step=1, rank=0)
        >>> x.shape, skip
        (torch.Size([3, 5]), True)
        >>> spec = MLPSpec()
        >>> torch.equal(make_batch(spec, 0, rank=0)[0], make_batch(spec, 0, rank=0)[0])
        True
        >>> torch.equal(make_batch(spec, 0, rank=0)[0], make_batch(spec, 0, rank=1)[0])
        False
        >>> tokens, targets = make_batch(TransformerSpec(), step=0, rank=0)
        >>> tokens.shape, torch.equal(tokens[:, 1:], targets[:, :-1])
        (torch.Size([2, 5]), True)
    """
    gen = torch.Generator().manual_seed(10_000 * (spec.seed + 1) + 100 * step + rank)
    if isinstance(spec, MLPSpec):
        x = torch.randn(spec.batch_size, spec.in_dim, generator=gen, dtype=spec.dtype)
        skip = spec.skip_layer is not None and step % 2 == 1
        return (x.to(device), skip)
    tokens = torch.randint(0, spec.vocab, (spec.batch_size, spec.seq + 1), generator=gen)
    return (tokens[:, :-1].to(device), tokens[:, 1:].to(device))


def model_inputs(spec: ModelSpec, batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """The positional arguments of ``model(...)`` for ``batch``."""
    return batch if isinstance(spec, MLPSpec) else batch[:1]


def compute_loss(spec: ModelSpec, model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    """Forward ``batch`` through ``model`` and return the scalar loss.

    The mean square of the output for an MLP, next-token cross-entropy for a transformer; both
    computed in float32.

    Example:
        >>> from fshard.testing.models import (
        ...     MLPSpec, TransformerSpec, build_model, compute_loss, make_batch,
        ... )
        >>> for spec in (MLPSpec(), TransformerSpec()):
        ...     model = build_model(spec)
        ...     loss = compute_loss(spec, model, make_batch(spec, step=0, rank=0))
        ...     loss.backward()
        ...     print(type(spec).__name__, loss.shape, loss.dtype)
        MLPSpec torch.Size([]) torch.float32
        TransformerSpec torch.Size([]) torch.float32
    """
    output = model(*model_inputs(spec, batch))
    if isinstance(spec, MLPSpec):
        return output.float().pow(2).mean()
    return F.cross_entropy(output.float().reshape(-1, spec.vocab), batch[1].reshape(-1))


def shard_model(spec: ModelSpec, model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """One unit per layer (MLP) or block (transformer, and one for its final norm and head
    together if ``spec.tail_unit``), then the root.

    ``kwargs`` go to every ``fshard.fully_shard`` call (``reshard_after_forward``,
    ``mp_policy``, ...). Returns ``model``.

    Example:
        >>> from fshard.testing import mesh_for
        >>> from fshard.testing.models import MLPSpec, build_model, shard_model
        >>> spec = MLPSpec(in_dim=5, widths=(7, 3))
        >>> mesh = mesh_for((2,))  # on each rank of a 2-rank pool  # doctest: +SKIP
        >>> model = shard_model(spec, build_model(spec), mesh)  # doctest: +SKIP
        >>> w = model.layers[0].weight  # doctest: +SKIP
        >>> w.full_shape, w.to_local().shape  # on rank 0  # doctest: +SKIP
        (torch.Size([7, 5]), torch.Size([4, 5]))
    """
    import fshard

    if isinstance(spec, MLPSpec):
        for layer in model.layers:  # type: ignore[union-attr]  # MLP
            fshard.fully_shard(layer, mesh=mesh, **kwargs)
        if spec.repeat_layer is not None:
            fshard.fully_shard(cast(MLP, model).square, mesh=mesh, **kwargs)
    else:
        for block in model.blocks:  # type: ignore[union-attr]  # TinyTransformer
            fshard.fully_shard(block, mesh=mesh, **kwargs)
        if spec.tail_unit:
            tiny = cast(TinyTransformer, model)
            fshard.fully_shard([tiny.norm, tiny.head], mesh=mesh, **kwargs)
    return fshard.fully_shard(model, mesh=mesh, **kwargs)
