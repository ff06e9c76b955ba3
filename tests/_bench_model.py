"""A user's model for ``fshard bench --model tests._bench_model:build`` (tests only).

Not a transformer: a stack of residual MLP layers in an ``nn.ModuleList`` (the default units:
one per layer), odd widths so that dim-0 shards need padding, and float targets (MSE loss).
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 13


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, WIDTH)
        self.layers = nn.ModuleList(Residual() for _ in range(layers))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build() -> nn.Module:
    return Stack()


def make_batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=gen).to(device), torch.randn(4, 2, generator=gen).to(device)


def make_dict_batch(step: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    inputs, target = make_batch(step, rank, device)
    return {"x": inputs, "target": target}


class WithLoss(nn.Module):
    """Takes keyword arguments and returns its loss, as a Hugging Face model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack(layers=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.stack(x), target)
