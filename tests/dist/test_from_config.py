"""``fshard.from_config`` on real process groups: the units it builds and DDP equivalence.

The model is a small BERT-shaped module whose block class is called ``BertLayer``, so the two
sample accelerate configs (``TRANSFORMER_BASED_WRAP`` of ``BertLayer``) apply to it unchanged.
Each case applies a config on every rank of a 2-rank pool, checks the units and their options
there, and trains next to DDP (``fshard.testing.assert_equivalent_to_ddp``). The samples use
bf16; DDP runs in fp32, so the exact equivalence cases set ``mixed_precision: no``; with bf16
the units are checked and training is compared with DDP within bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fshard
from fshard._unit._registry import unit_of  # prefetch defaults: UnitInfo does not show them
from fshard.testing import RanksFailed, assert_equivalent_to_ddp, get_pool
from tests.accelerate_samples import sample
from tests.dist.probes import PinProbe

WORLD = 2
VOCAB, DIM, SEQ, BATCH = 16, 8, 5, 3


class BertLayer(nn.Module):
    forward_calls = 0  # over all instances: activation checkpointing runs forward twice

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        BertLayer.forward_calls += 1
        h = x + torch.tanh(self.attn(x))
        return self.norm(h + self.out(F.gelu(self.ff(h))))


class Encoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer() for _ in range(layers))


class ToyBert(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.encoder = Encoder(layers)
        self.pooler = nn.Linear(DIM, DIM)
        self.classifier = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def build(per_rank_init: bool = False) -> ToyBert:
    """``per_rank_init``: every rank draws different weights (only a broadcast can fix that)."""
    seed = 1234 + (dist.get_rank() if per_rank_init else 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ToyBert()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, 2, (BATCH,), generator=gen)


def loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(data[0]).float(), data[1])


@dataclass(frozen=True)
class Expect:
    units: tuple[str, ...]
    strategy: str = "FULL_SHARD"
    offload: bool = False
    mp: fshard.MixedPrecision | None = None
    forward_prefetch: bool = True  # fshard's default
    backward_prefetch: fshard.BackwardPrefetch = fshard.BackwardPrefetch.BACKWARD_PRE


LAYERS = ("", "encoder.layer.0", "encoder.layer.1")  # named_modules order: the root first
# strategy -> (reshard_after_forward, mesh shape on 2 ranks, with num_machines 2 for hybrids)
STRATEGY_LAYOUT = {
    "FULL_SHARD": (True, (2,)),
    "SHARD_GRAD_OP": (False, (2,)),
    "NO_SHARD": (False, (2, 1)),
    "HYBRID_SHARD": (True, (2, 1)),
    "HYBRID_SHARD_ZERO2": (False, (2, 1)),
}


def describe_units(model: nn.Module) -> list[tuple[Any, ...]]:
    """(FQN, reshard_after_forward, mesh shape, offload, mp, fwd prefetch, bwd prefetch) per unit."""
    rows = []
    for fqn, module in model.named_modules():
        group = unit_of(module)
        if group is not None:
            rows.append((
                fqn, group.reshard_after_forward, tuple(group.mesh_info.mesh.shape),
                group.offload_policy is not None, group.mp_policy,
                group.forward_prefetch_default, group.backward_prefetch_default,
            ))  # fmt: skip
    return rows


def apply_and_check(config: dict[str, Any] | str, expect: Expect, model: nn.Module, mesh: Any) -> None:
    """The ``shard_fn`` of the equivalence runs: apply the config, then check what it built.

    Offload is checked by what it does that a CPU run can see (``PinProbe``): every shard lives
    in a pinned host buffer, one per unit; without offload nothing is pinned."""
    with PinProbe() as pins:
        fshard.from_config(model, config)
    shards = {n: p.to_local() for n, p in model.named_parameters() if p.numel()}
    pinned = [n for n, local in shards.items() if pins.holds(local)]
    want_pinned = (list(shards), len(expect.units)) if expect.offload else ([], 0)
    if (pinned, len(pins.ranges)) != want_pinned:
        raise AssertionError(
            f"rank {dist.get_rank()}: offload={expect.offload}, but shards in pinned memory: {pinned} "
            f"({len(pins.ranges)} pinned buffers asked for)"
        )
    reshard, shape = STRATEGY_LAYOUT[expect.strategy]
    # The root returns fp32 under mixed precision, as accelerate's convert_outputs_to_fp32 does.
    root_mp = None if expect.mp is None else dataclasses.replace(expect.mp, output_dtype=torch.float32)
    want = [
        (fqn, reshard, shape, expect.offload, root_mp if fqn == "" else expect.mp,
         expect.forward_prefetch, expect.backward_prefetch)
        for fqn in expect.units
    ]  # fmt: skip
    got = describe_units(model)
    if got != want:
        raise AssertionError(f"rank {dist.get_rank()}: units differ\n got: {got}\nwant: {want}")
    if fshard.config_of(model) is None or fshard.config_of(model) != fshard.load_config(config):
        raise AssertionError("from_config did not record the applied config")


def check_equivalent(config: dict[str, Any] | str, expect: Expect, *, per_rank_init: bool = False, **kwargs: Any) -> None:
    assert_equivalent_to_ddp(
        functools.partial(build, per_rank_init),
        batch_fn=batch,
        loss_fn=loss,
        shard_fn=functools.partial(apply_and_check, config, expect),
        world_size=WORLD,
        steps=2,
        **kwargs,
    )


# --------------------------------------------------------------------- the two samples


def test_guide_sample_strategy_1_with_offload_trains_like_ddp() -> None:
    # Ranks start from different weights: sync_module_states must broadcast rank 0's (DDP
    # broadcasts them too), or the parameters differ after training.
    config = sample("guide", mixed_precision="no")
    expect = Expect(LAYERS, offload=True, forward_prefetch=False)
    check_equivalent(config, expect, per_rank_init=True)


def test_activation_checkpointing_recomputes_the_blocks_and_trains_like_ddp() -> None:
    config = sample("notes", mixed_precision="no")
    config["fsdp_config"]["fsdp_activation_checkpointing"] = True
    check_equivalent(config, Expect(LAYERS, forward_prefetch=False))
    assert get_pool(WORLD).run(_block_forwards_per_step, config) == [(4, list(ToyBert().state_dict()))] * WORLD


def _block_forwards_per_step(config: dict[str, Any]) -> tuple[int, list[str]]:
    model = fshard.from_config(build(), config)
    BertLayer.forward_calls = 0
    loss(model, batch(0, dist.get_rank())).backward()
    return BertLayer.forward_calls, list(fshard.state_dict(model))  # 2 blocks, twice each


def test_notes_sample_full_shard_without_offload_trains_like_ddp() -> None:
    config = sample("notes", mixed_precision="no")
    check_equivalent(config, Expect(LAYERS, offload=False, forward_prefetch=False), per_rank_init=True)


@pytest.mark.parametrize("name", ["guide", "notes"])
def test_samples_with_bf16_build_bf16_units(name: str) -> None:
    bf16 = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    expect = Expect(LAYERS, offload=name == "guide", mp=bf16, forward_prefetch=False)
    results = get_pool(WORLD).run(_bf16_units_and_losses, sample(name), expect)
    for losses in results:
        assert all(torch.isfinite(torch.tensor(losses))), losses


def _bf16_units_and_losses(config: dict[str, Any], expect: Expect) -> list[float]:
    model = build()
    apply_and_check(config, expect, model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        with torch.no_grad():
            out_dtype = model(batch(step, dist.get_rank())[0]).dtype
        if out_dtype != torch.float32:
            raise AssertionError("from_config's bf16 model must return fp32, as accelerate's does")
        value = loss(model, batch(step, dist.get_rank()))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(value))
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise AssertionError("bf16 mixed precision must keep fp32 shards (master weights)")
    return losses


def test_without_sync_ranks_that_built_different_weights_are_an_error() -> None:
    # The control for the two tests above: with different initial weights and no broadcast,
    # the first forward refuses to train (it trained a model none of the ranks built: issue 23,
    # case 4), so those tests do detect a missing sync.
    config = sample("notes", mixed_precision="no")
    config["fsdp_config"].update(fsdp_sync_module_states=False, fsdp_cpu_ram_efficient_loading=False)
    with pytest.raises(RanksFailed) as info:
        check_equivalent(config, Expect(LAYERS, forward_prefetch=False), per_rank_init=True)
    for exc in info.value.errors.values():
        assert isinstance(exc, fshard.RankMismatchError), exc
        assert "the ranks built different values" in str(exc) and "fsdp_sync_module_states" in str(exc)


# --------------------------------------------------------------------- other options


@pytest.mark.parametrize("strategy", [2, "NO_SHARD", 4, "HYBRID_SHARD_ZERO2"])
def test_strategies_trains_like_ddp(strategy: Any) -> None:
    # num_machines: 2 makes the hybrid strategies replicate over the 2 ranks: a (2, 1) mesh.
    config = {"distributed_type": "FSDP", "num_machines": 2,
              "fsdp_config": {"fsdp_sharding_strategy": strategy, "fsdp_sync_module_states": True,
                              "fsdp_transformer_layer_cls_to_wrap": "BertLayer"}}  # fmt: skip
    name = fshard.ShardingStrategy[strategy].name if isinstance(strategy, str) else fshard.ShardingStrategy(strategy).name
    check_equivalent(config, Expect(LAYERS, strategy=name), per_rank_init=True)


def test_size_based_wrap_and_prefetch_options() -> None:
    # A BertLayer has 72 + 16 + 144 + 136 = 368 parameters and none of its parts reaches 300,
    # so at 300 the layers are the units; the embedding table (128), the pooler and the
    # classifier stay with the root. The guide's spellings of the keys are used.
    config = {"fsdp_wrap_policy": "SIZED_BASED_WRAP", "min_num_param": 300,
              "fsdp_backward_prefetch": "BACKWARD_POST", "fsdp_forward_prefetch": True}  # fmt: skip
    expect = Expect(LAYERS, backward_prefetch=fshard.BackwardPrefetch.BACKWARD_POST, forward_prefetch=True)
    check_equivalent(config, expect)


def test_no_wrap_is_the_root_only() -> None:
    config = {"fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_backward_prefetch_policy": "NO_PREFETCH"}
    check_equivalent(config, Expect(("",), backward_prefetch=fshard.BackwardPrefetch.NO_PREFETCH))


def test_transformers_fsdp1_config_broadcasts_rank0_weights_as_the_trainer_does(tmp_path: Any) -> None:
    # TrainingArguments with fsdp_config "version": 1 passes sync_module_states "true" unless
    # the file says otherwise (and no backward or forward prefetch): ranks that start from
    # different weights must end up training rank 0's, like DDP.
    path = tmp_path / "fsdp_config.json"
    path.write_text('{"version": 1, "transformer_layer_cls_to_wrap": ["BertLayer"]}')
    expect = Expect(LAYERS, forward_prefetch=False, backward_prefetch=fshard.BackwardPrefetch.NO_PREFETCH)
    check_equivalent(str(path), expect, per_rank_init=True)


def test_config_from_a_yaml_path_and_errors_on_every_rank(tmp_path: Any) -> None:
    path = tmp_path / "fsdp.yaml"
    path.write_text("fsdp_transformer_layer_cls_to_wrap: GPT2Block\n")
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(WORLD).run(_apply_path, str(path))
    assert sorted(info.value.errors) == [0, 1]
    assert "no module of class 'GPT2Block' in ToyBert" in str(info.value.first)


def _apply_path(path: str) -> None:
    fshard.from_config(build(), path)


def _apply_twice(first: str) -> None:
    model = build()
    if first == "from_config":
        fshard.from_config(model, {"fsdp_transformer_layer_cls_to_wrap": "BertLayer"})
    else:
        fshard.fully_shard(model)
    fshard.from_config(model, {"fsdp_transformer_layer_cls_to_wrap": "BertLayer"})


@pytest.mark.parametrize(("first", "how"), [("from_config", "from_config was applied to it before"),
                                            ("fully_shard", "it is a unit already")])  # fmt: skip
def test_applying_a_config_to_a_sharded_model_names_from_config(first: str, how: str) -> None:
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(WORLD).run(_apply_twice, first, timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    assert str(info.value.errors[0]) == (
        f"from_config(ToyBert): the model is already sharded ({how}); apply a config once, to a "
        "model not sharded yet"
    )


@pytest.mark.parametrize("name", ["guide", "notes"])
def test_samples_in_bf16_train_close_to_ddp(name: str) -> None:
    # bf16 compute and reduction against fp32 DDP: equal up to bf16 rounding (about 5e-4 here).
    bf16 = fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    expect = Expect(LAYERS, offload=name == "guide", mp=bf16, forward_prefetch=False)
    check_equivalent(
        sample(name), expect, per_rank_init=True,
        optim_fn=functools.partial(torch.optim.SGD, lr=0.1), rtol=5e-3, atol=5e-3,
    )  # fmt: skip


def test_cpu_ram_efficient_loading_from_a_meta_model() -> None:
    # accelerate's cpu_ram_efficient_loading: only rank 0 holds real weights, the other ranks
    # build the model on the meta device; after from_config every rank has rank 0's values.
    results = get_pool(WORLD).run(_meta_load, sample("notes", mixed_precision="no"))
    want = results[0]["before"]
    for rank, result in enumerate(results):
        assert result["units"] == list(LAYERS), rank
        for name, value in want.items():
            torch.testing.assert_close(result["after"][name], value, rtol=0, atol=0, msg=f"rank {rank}: {name}")


def _meta_load(config: dict[str, Any]) -> dict[str, Any]:
    if dist.get_rank() == 0:
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = ToyBert()
        before = {}
    fshard.from_config(model, config)
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    units = [row[0] for row in describe_units(model)]
    return {"before": before, "after": after, "units": units}


class _NoResetNorm(nn.Module):
    """Like HF's RMSNorm: no reset_parameters()."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Rotaryish(nn.Module):
    """A non-persistent buffer computed in __init__ (in no state dict), and a custom norm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.norm = _NoResetNorm(6)
        self.register_buffer("freq", torch.arange(6, dtype=torch.float32) / 6, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x) * torch.cos(self.freq))


def _meta_load_without_initialisers() -> dict[str, Any]:
    config = {
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 10,
        "fsdp_sync_module_states": True,
        "fsdp_cpu_ram_efficient_loading": True,
    }
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        model = _Rotaryish()
        with torch.no_grad():
            model.norm.weight.mul_(3.0)  # a value no initialiser would give
    else:
        with torch.device("meta"):
            model = _Rotaryish()
    fshard.from_config(model, config)
    x = torch.ones(2, 6)
    return {"out": model(x).detach(), "freq": model.freq.clone()}


def test_meta_loading_needs_no_initialisers_and_brings_non_persistent_buffers() -> None:
    """The other ranks' meta model needs no reset_parameters() (every value comes from rank 0),
    and buffers no state dict holds come from rank 0's model too."""
    results = get_pool(WORLD).run(_meta_load_without_initialisers)
    for rank, result in enumerate(results):
        for key in ("out", "freq"):
            torch.testing.assert_close(result[key], results[0][key], rtol=0, atol=0, msg=f"rank {rank}: {key}")


def _meta_on_rank0(config: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        with torch.device("meta"):
            model = ToyBert()
    else:
        model = build()
    fshard.from_config(model, config)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"fsdp_cpu_ram_efficient_loading": True}, "fsdp_cpu_ram_efficient_loading is true"),
        ({"fsdp_sync_module_states": "true"}, "fsdp_sync_module_states is true"),
    ],
)
def test_a_meta_model_on_rank0_is_an_error_on_every_rank_at_once(config: dict[str, Any], named: str) -> None:
    # Only rank 0 can see that its weights are not real; the others must not wait for the
    # weight broadcast until the process-group timeout, but raise the same error at once.
    from fshard.testing import RanksFailed

    config = {**config, "fsdp_transformer_layer_cls_to_wrap": "BertLayer"}
    pool = get_pool(WORLD)
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        pool.run(_meta_on_rank0, config, timeout=30)
    assert time.monotonic() - start < 15
    assert sorted(info.value.errors) == [0, 1], "every rank must raise"
    messages = {str(exc) for exc in info.value.errors.values()}
    assert len(messages) == 1, messages
    [message] = messages
    assert all(isinstance(exc, ValueError) for exc in info.value.errors.values())
    assert message.startswith(f"{named}: rank 0's weights are broadcast to every rank"), message
    assert "embeddings.weight" in message and "on the meta device on rank 0" in message
    assert "without torch.device('meta')" in message
    assert "every rank raises this error" in message
    other = "fsdp_sync_module_states" if "cpu_ram" in named else "fsdp_cpu_ram_efficient_loading"
    assert other not in message


# ------------------------------------------------------------------- attention modules


class AttnNet(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight in its forward without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(q, k, v)
        return self.out(h)


def _root_attention() -> nn.Module:
    return nn.MultiheadAttention(DIM, 2)


def _seeded(make: Any) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return make()


def _attn_batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(SEQ, BATCH, DIM, generator=gen)
    return (x, x, x)  # query, key, value: self-attention


def _attn_loss(model: nn.Module, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = model(*data)
    return (out[0] if isinstance(out, tuple) else out).pow(2).mean()


def _apply_expecting_units(config: dict[str, Any], units: tuple[str, ...], model: nn.Module, mesh: Any) -> None:
    fshard.from_config(model, config)
    got = tuple(row[0] for row in describe_units(model))
    if got != units:
        raise AssertionError(f"rank {dist.get_rank()}: units {got}, want {units}")


@pytest.mark.parametrize(
    ("make", "config", "units"),
    [
        # by_size(1) looked inside a root attention and made out_proj a unit: wrong outputs.
        (_root_attention, {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1}, ("",)),
        # by_class(Linear) selected attn.out_proj: a shape error in the forward.
        (AttnNet, {"fsdp_transformer_layer_cls_to_wrap": "Linear,NonDynamicallyQuantizableLinear"}, ("", "out")),
        (AttnNet, {"fsdp_transformer_layer_cls_to_wrap": "MultiheadAttention"}, ("", "attn")),
    ],
    ids=["size-root-attention", "linear-class-inner-attention", "attention-class"],
)
def test_attention_projections_stay_with_the_attention_and_train_like_ddp(
    make: Any, config: dict[str, Any], units: tuple[str, ...]
) -> None:
    assert_equivalent_to_ddp(
        functools.partial(_seeded, make),
        batch_fn=_attn_batch,
        loss_fn=_attn_loss,
        shard_fn=functools.partial(_apply_expecting_units, config, units),
        world_size=WORLD,
        steps=2,
    )


# ------------------------------------------------------------------------- hybrid layouts


def _apply_config(config: dict[str, Any] | str) -> None:
    fshard.from_config(build(), config)


@pytest.mark.parametrize("machines", [4, 3])
def test_hybrid_with_num_machines_not_dividing_the_world_names_num_machines(machines: int, tmp_path: Any) -> None:
    from fshard.testing import RanksFailed

    path = tmp_path / "accelerate.yaml"
    path.write_text(
        f"distributed_type: FSDP\nnum_machines: {machines}\nnum_processes: {2 * machines}\n"
        "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"
    )
    with pytest.raises(RanksFailed) as info:
        get_pool(WORLD).run(_apply_config, str(path), timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    assert all(isinstance(exc, ValueError) for exc in info.value.errors.values())
    message = str(info.value.errors[0])
    assert message == str(info.value.errors[1])
    assert message.startswith(f"FSDP config {str(path)!r}: HYBRID_SHARD keeps one replica per machine, "
                              f"but num_machines: {machines} does not divide the 2 processes this job runs; "
                              "set num_machines to the number of machines")  # fmt: skip
    assert "replicate_size" not in message


def _parallelism(replicas: int, shards: int, **block: Any) -> dict[str, Any]:
    """An accelerate FSDP2 file whose ranks are laid out by parallelism_config (HSDP)."""
    return {
        "distributed_type": "FSDP",
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": replicas,
            "parallelism_config_dp_shard_size": shards,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 1,
        },
        "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "BertLayer", **block},
    }


@pytest.mark.parametrize(
    ("replicas", "shards", "reshard", "strategy"),
    [(2, 1, True, "HYBRID_SHARD"), (2, 1, False, "HYBRID_SHARD_ZERO2"), (1, 2, True, "FULL_SHARD")],
)
def test_parallelism_config_sets_the_mesh_and_trains_like_ddp(replicas: int, shards: int, reshard: bool, strategy: str) -> None:
    # dp_replicate_size 2 replicates over the 2 ranks (a (2, 1) mesh); it was ignored, with a
    # warning that called it no FSDP option, and the ranks sharded instead.
    config = _parallelism(replicas, shards, fsdp_reshard_after_forward=reshard)
    check_equivalent(config, Expect(LAYERS, strategy=strategy))


def test_parallelism_config_that_does_not_fit_the_world_names_its_sizes() -> None:
    from fshard.testing import RanksFailed

    with pytest.raises(RanksFailed) as info:
        get_pool(WORLD).run(_apply_config, _parallelism(2, 2), timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    assert all(isinstance(exc, ValueError) for exc in info.value.errors.values())
    assert str(info.value.errors[0]) == (
        "FSDP config (dict): parallelism_config lays out 4 processes (parallelism_config_dp_replicate_size 2 x "
        "parallelism_config_dp_shard_size 2), but this job runs 2; make the sizes multiply to the number of "
        "processes (num_processes), or launch as many"
    )  # fmt: skip
