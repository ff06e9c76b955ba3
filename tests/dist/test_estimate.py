"""fshard.estimate against measurement: the predicted peak within 15% of the live tensor bytes
a real step holds, on a GPT, a BERT, a model with one huge embedding and one of large units with
almost no activations, 1D and 2x2, fp32 and bf16."""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
import torch
from torch import nn

import fshard
from fshard._memtrack import LiveBytes
from fshard.testing import get_pool, mesh_for

TOLERANCE = 0.15
BATCH, SEQ = 4, 32


# ---------------------------------------------------------------------------------- the models


class Mixer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


class HugeEmbedding(nn.Module):
    """A huge embedding table in the root and two small blocks: the root dominates the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30_000, 32)
        self.blocks = nn.ModuleList(Mixer(32) for _ in range(2))
        self.head = nn.Linear(32, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WideBlocks(nn.Module):
    """Large units and almost no activations: the peak is a unit's backward, where the next
    unit's prefetched all-gather output counts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.blocks = nn.ModuleList(Mixer(128) for _ in range(4))
        self.head = nn.Linear(128, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _gpt() -> nn.Module:
    from fshard.testing.models import TinyTransformer, TransformerSpec

    return TinyTransformer(TransformerSpec(vocab=256, dim=64, heads=4, layers=3, seq=SEQ))


def _gpt_checkpointed() -> nn.Module:
    from fshard.testing.models import TinyTransformer, TransformerSpec

    spec = TransformerSpec(vocab=256, dim=64, heads=4, layers=3, seq=SEQ, checkpoint="around")
    return TinyTransformer(spec)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def _policy(name: str) -> Any:
    blocks = fshard.by_class("Block")
    return {"gpt": blocks, "gpt-ckpt": blocks, "bert": fshard.by_class("BertLayer"),
            "embed": fshard.by_class(Mixer), "wide": fshard.by_class(Mixer)}[name]


def _factory(name: str):
    return {"gpt": _gpt, "gpt-ckpt": _gpt_checkpointed, "bert": _bert, "embed": HugeEmbedding, "wide": WideBlocks}[name]


def _batch(name: str):
    vocab = {"gpt": 256, "gpt-ckpt": 256, "bert": 512, "embed": 30_000, "wide": 64}[name]
    tokens = torch.randint(0, vocab, (2, 5) if name == "wide" else (BATCH, SEQ + 1))
    if name == "bert":
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if name in ("embed", "wide"):
        return (tokens[:, :-1], tokens[:, 1:] % 8)
    return (tokens[:, :-1], tokens[:, 1:])


def _loss(name: str, model: nn.Module, batch) -> torch.Tensor:
    if name == "bert":
        return model(**batch).loss
    logits = model(batch[0])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


# ---------------------------------------------------------------------------------- measuring


def _held_by(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a step starts with: shards, buffers, optimizer state, and the units' unsharded
    params (their storage is empty between steps and regrows: see fshard._memtrack)."""
    ids = {id(p) for p in model.parameters()}
    gathered = [
        o for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and getattr(o, "_fshard_gathered_of", None) is not None
        and (slot := o._fshard_gathered_of()) is not None and id(slot.sharded_param) in ids
    ]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *state, *gathered]


def _measure_worker(name: str, mesh_shape: tuple[int, ...], mp: str | None) -> int:
    torch.manual_seed(0)
    model = _factory(name)()
    policy = fshard.by_class(*_policy(name).classes)
    mp_policy = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if mp else None
    fshard.auto_shard(model, policy=policy, mesh=mesh_for(mesh_shape), mp_policy=mp_policy)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen_state = torch.random.get_rng_state()
    peak = 0
    for _ in range(3):  # the first records the order (prefetch from the second) and makes state
        torch.random.set_rng_state(gen_state)
        gc.collect()
        with LiveBytes(track=_held_by(model, optimizer)) as live:
            loss = _loss(name, model, _batch(name))
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()
        peak = live.peak
    return peak


def _predicted(name: str, mesh_shape: tuple[int, ...], mp: str | None) -> fshard.Estimate:
    nproc = 1
    for s in mesh_shape:
        nproc *= s
    return fshard.estimate(
        _factory(name), nproc=nproc, mesh=mesh_shape, policy=_policy(name), mp=mp,
        optimizer="adamw", batch_fn=lambda: _batch(name),
        loss_fn=lambda model, batch: _loss(name, model, batch), device="cpu",
    )


CASES = [
    (name, mesh, mp)
    for name in ("gpt", "bert", "embed", "wide")
    for mesh in ((2,), (2, 2))
    for mp in (None, "bf16")
] + [("gpt-ckpt", (2,), None)]  # activation checkpointing around each block


@pytest.mark.parametrize(("name", "mesh_shape", "mp"), CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_estimate_within_15_percent_of_measured_peak(name, mesh_shape, mp):
    if name == "bert":
        pytest.importorskip("transformers")
    world = 1
    for s in mesh_shape:
        world *= s
    measured = max(get_pool(world).run(_measure_worker, name, mesh_shape, mp))
    predicted = _predicted(name, mesh_shape, mp)
    error = predicted.peak_bytes / measured - 1
    assert abs(error) <= TOLERANCE, (
        f"{name} mesh {mesh_shape} mp {mp}: predicted {predicted.peak_bytes} bytes, measured "
        f"{measured} ({error:+.1%})\n{predicted}"
    )


if __name__ == "__main__":  # the guide's table: python -m tests.dist.test_estimate [--last]
    for case in CASES[-1:] if "--last" in sys.argv else CASES:
        world = 1
        for s in case[1]:
            world *= s
        got = max(get_pool(world).run(_measure_worker, *case))
        want = _predicted(*case).peak_bytes
        print(f"{case[0]:6} {'x'.join(map(str, case[1])):4} {case[2] or 'fp32':5} predicted {want:>10,} measured {got:>10,} {want / got - 1:+.1%}")
