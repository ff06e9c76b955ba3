"""The built-in workload: a small GPT-style language model and its synthetic batches.

The same model as ``examples/train_gpt.py`` (the demo), kept here so that ``fshard bench`` works
from an installed package: token and position embeddings, ``layers`` pre-norm blocks, a final
norm and a head tied to the token embedding (so the tied weight belongs to the root unit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "GPTConfig", "gpt_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "dim", "heads", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig: dim ({self.dim}) must be a multiple of heads ({self.heads})")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``.

    Example:
        >>> import torch
        >>> from fshard._bench._gpt import GPT, GPTConfig
        >>> GPT(GPTConfig(vocab=11, seq=5, dim=8, heads=2, layers=1))(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 11])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: belongs to the root unit
        for module in self.modules():  # GPT-2 style init: small weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt_batch(
    cfg: GPTConfig, batch: int, step: int, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` from a fixed random bigram table: learnable, different per rank.

    Example:
        >>> import torch
        >>> from fshard._bench._gpt import GPTConfig, gpt_batch
        >>> tokens, targets = gpt_batch(GPTConfig(seq=6), 2, step=0, rank=0, device=torch.device("cpu"))
        >>> tokens.shape, torch.equal(tokens[:, 1:], targets[:, :-1])
        (torch.Size([2, 6]), True)
    """
    table = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=table)
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=gen)
    choice = torch.randint(0, 4, (batch, cfg.seq), generator=gen)
    for t in range(cfg.seq):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
