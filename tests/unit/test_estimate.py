"""fshard.estimate without processes: exact bytes of a small model against a hand count, the
command line (a module:factory, a Transformers config, the --json schema), the 70B plan's
runtime, and the live-bytes tracker."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from torch import nn

import fshard
from fshard._memtrack import LiveBytes
from fshard.cli import main


class Small(nn.Module):
    """A root parameter of 7 and a Linear(4, 3) unit: uneven chunks over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(7))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.p[:3]


def small_model() -> nn.Module:
    return Small()


def small_batch() -> torch.Tensor:
    return torch.randn(2, 4)


class HugeRoot(nn.Module):
    """An embedding as large as the activations, left in the root: kept gathered through the
    activation peak at the start of the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8_000, 64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


def _small(**kwargs):
    kwargs.setdefault("nproc", 2)
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("coalesce_bytes", 0)  # the hand counts are of a collective per unit
    return fshard.estimate(small_model, policy=fshard.by_class(nn.Linear), **kwargs)


# ----------------------------------------------------------------------------- the arithmetic


def test_small_model_bytes_match_the_hand_count():
    # Linear(4, 3) over 2 ranks: weight rows [2, 1] -> slots of 2 rows (8 elements), bias [2, 1]
    # -> slots of 2: a flat shard of 10 fp32 per rank, unsharded 2 x 10. Root p (7): slots of 4.
    e = _small()
    assert [(u.name, u.numel, u.unsharded_bytes, u.shard_bytes) for u in e.units] == [
        ("<root>", 7, 2 * 4 * 4, 4 * 4),
        ("lin", 15, 2 * 10 * 4, 10 * 4),
    ]
    assert e.params_by_dtype == {"float32": (10 + 4) * 4}
    # Sharded grads view the reduce-scatter output: the padded slots and one flag per param.
    assert e.grads_by_dtype == {"float32": (10 + 2) * 4 + (4 + 1) * 4}
    # AdamW on rank 0 (the larger shards: 8 + 2 + 4 elements), two moments and a 4-byte step each.
    assert e.rank == 0
    assert e.optimizer_by_dtype == {"float32": 2 * (8 + 2 + 4) * 4 + 3 * 4}
    assert e.persistent_bytes == 56 + 68 + 124
    # Peak: the unit's reduce-scatter in the backward, with the root kept gathered and the
    # root's unsharded grads alive: shards 56 + state 124 + root 32 + root grads 28 + the
    # unit's grads 60 + reduce input 2 x 12 x 4 + output 12 x 4.
    assert (e.peak_bytes, e.peak_phase) == (56 + 124 + 32 + 28 + 60 + 96 + 48, "backward")
    assert e.largest_unit == "lin" and e.largest_unit_bytes == 80
    assert e.root_bytes == 32 and e.prefetch_bytes == 0
    assert e.zero_bytes == 22 * 16 // 2


def chain() -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))


@pytest.mark.parametrize(("device", "held"), [("cpu", 0), ("cuda", 72)])
def test_prefetch_and_reduce_scatter_buffers_in_the_backward(device, held):
    # Three units of a 4x4 weight over 2 ranks: a flat shard of 8, unsharded 2 x 8 x 4 = 64
    # bytes, unsharded grads 64, reduce-scatter input 2 x (8 + 1 flag) x 4 = 72, output 36.
    e = fshard.estimate(
        chain, nproc=2, policy=fshard.by_class(nn.Linear), optimizer="none", device=device, coalesce_bytes=0
    )
    assert [u.unsharded_bytes for u in e.units] == [0, 64, 64, 64]
    # The peak is the middle unit's reduce-scatter: shards 3 x 32, the first unit's all-gather
    # output (prefetched), the middle unit's grads and reduce-scatter input and output, the last
    # unit's sharded grads, and on CUDA the last unit's reduce-scatter input, held until waited.
    assert (e.peak_bytes, e.peak_phase) == (96 + 64 + 64 + 72 + 36 + 36 + held, "backward")
    assert e.prefetch_bytes == 64


def test_coalesced_units_hold_their_shared_buffers():
    """With the default fshard.set_coalescing limit the three units share one all-gather in the
    backward (outputs 3 x 64 and the concatenated flat shards 3 x 32, held until the last copies
    out) and one reduce-scatter at the end of the backward: the peak is there, with shards 96,
    the three units' reduce-scatter inputs 3 x 72 held, their concatenation 216 and the output
    3 x 36 (where a collective per unit peaks at 368)."""
    kwargs = dict(nproc=2, policy=fshard.by_class(nn.Linear), optimizer="none", device="cpu")
    alone = fshard.estimate(chain, coalesce_bytes=0, **kwargs)
    together = fshard.estimate(chain, **kwargs)
    assert (alone.peak_bytes, together.peak_bytes) == (368, 96 + 3 * 72 + 216 + 3 * 36)
    # A limit below two units' reduce-scatter inputs: the reduce-scatters go one by one again.
    two = fshard.estimate(chain, coalesce_bytes=100, **kwargs)
    assert two.peak_bytes < together.peak_bytes
    # A limit of one input (72 of 100): each unit's input waits for the next unit's, which does
    # not fit beside it, and is issued then. On CUDA, where a reduce-scatter in flight holds its
    # input, the peak is in the first unit's backward: shards 96, the last unit's input and
    # output in flight (72 + 36), the middle unit's input held (72), and the first unit's grads
    # and input (64 + 72).
    one = fshard.estimate(chain, coalesce_bytes=100, **{**kwargs, "device": "cuda"})
    assert (one.peak_bytes, one.peak_phase) == (96 + 72 + 36 + 72 + 64 + 72, "backward")
    with pytest.raises(ValueError, match="coalesce_bytes must be an int >= 0"):
        fshard.estimate(chain, coalesce_bytes=-1, **kwargs)


def test_zero2_keeps_every_unit_gathered_from_forward_to_backward():
    kwargs = dict(nproc=2, policy=fshard.by_class(nn.Linear), optimizer="none", device="cpu", coalesce_bytes=0)
    zero3 = fshard.estimate(chain, **kwargs)
    zero2 = fshard.estimate(chain, reshard_after_forward=False, **kwargs)
    # The first unit reduced (the last to run forward) has the other two still gathered: shards
    # 96, two unsharded units 2 x 64, its grads 64, reduce-scatter input and output 108.
    assert (zero3.peak_bytes, zero2.peak_bytes) == (368, 96 + 2 * 64 + 64 + 108)


def test_mixed_precision_gathers_in_bf16_and_keeps_fp32_shards():
    e = _small(mp="bf16")
    assert e.params_by_dtype == {"float32": 56}
    assert [u.unsharded_bytes for u in e.units] == [2 * 4 * 2, 2 * 10 * 2]
    assert e.grads_by_dtype == {"float32": 68}  # reduced in bf16, landed in the shard's dtype


def test_hsdp_shards_over_the_shard_dimension_only():
    one_d, hsdp = _small(nproc=2), _small(nproc=8, mesh=(4, 2))
    assert hsdp.shard_size == 2
    assert hsdp.persistent_bytes == one_d.persistent_bytes
    assert _small(nproc=8).persistent_bytes < one_d.persistent_bytes


def test_optimizers_and_offload():
    assert _small(optimizer="sgd").optimizer_bytes == 0
    assert _small(optimizer="sgd-momentum").optimizer_bytes == (8 + 2 + 4) * 4
    off = _small(offload=True)
    assert off.host_bytes == off.persistent_bytes and off.peak_bytes < _small().peak_bytes


def test_activations_under_fake_tensors_and_the_model_is_left_alone():
    model = Small()
    before = [p for p in model.parameters()]
    e = fshard.estimate(model, nproc=2, policy=fshard.by_class(nn.Linear), batch_fn=small_batch, device="cpu")
    assert e.activation_bytes is not None and e.activation_bytes > 0
    assert e.peak_bytes > _small().peak_bytes
    assert [p for p in model.parameters()] == before and all(p.device.type == "cpu" for p in before)


def tokens() -> torch.Tensor:
    return torch.randint(0, 8_000, (32, 128))


def test_a_huge_root_embedding_is_flagged_with_a_wrapping_that_lowers_the_peak():
    e = fshard.estimate(HugeRoot, nproc=4, policy=fshard.by_class(nn.Linear), batch_fn=tokens)
    assert len(e.notes) == 1
    assert "the root keeps" in e.notes[0] and "Wrap 'embed'" in e.notes[0]
    wrapped = fshard.estimate(
        HugeRoot, nproc=4, policy=fshard.by_class(nn.Linear, nn.Embedding), batch_fn=tokens
    )
    assert wrapped.peak_bytes < e.peak_bytes and _mib(wrapped.peak_bytes) in e.notes[0]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 4, "mesh": (3, 2)}, "mesh 3x2 has 6 ranks but nproc is 4"),
        ({"nproc": 2, "optimizer": "lion"}, "optimizer must be one of"),
        ({"nproc": 2, "mp": "int8"}, "mp must be fshard.MixedPrecision"),
        ({"nproc": 0}, "nproc must be an int >= 1"),
    ],
)
def test_bad_arguments_say_what_is_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fshard.estimate(small_model, **kwargs)


def test_str_is_a_table():
    text = str(_small())
    for row in ("sharded params", "optimizer state", "= persistent", "root, kept gathered",
                "largest unit, unsharded", "prefetch on top", "= predicted peak", "ZeRO formula"):
        assert row in text


# ---------------------------------------------------------------------------- command line


JSON_KEYS = {
    "model", "nproc", "mesh", "shard_size", "params", "mp", "optimizer", "offload", "device",
    "rank", "params_by_dtype", "grads_by_dtype", "optimizer_by_dtype", "buffer_bytes",
    "persistent_bytes", "host_bytes", "units", "largest_unit", "largest_unit_bytes",
    "prefetch_bytes", "root_bytes", "activation_bytes", "peak_bytes", "peak_phase", "zero_bytes",
    "notes", "param_bytes", "grad_bytes", "optimizer_bytes",
}


def test_cli_on_a_module_factory_writes_the_json_schema(tmp_path, capsys):
    out = tmp_path / "e.json"
    code = main([
        "estimate", "tests.unit.test_estimate:small_model", "--nproc", "2", "--by-class", "Linear",
        "--device", "cpu", "--batch-fn", "tests.unit.test_estimate:small_batch", "--json", str(out),
    ])
    assert code == 0
    assert "= predicted peak" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data) == JSON_KEYS
    assert set(data["units"][0]) == {"name", "numel", "unsharded_bytes", "shard_bytes"}
    assert data["params_by_dtype"] == {"float32": 56} and data["activation_bytes"] > 0
    assert data["mesh"] == [2] and isinstance(data["notes"], list)


def test_cli_on_a_transformers_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )
    config.save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--nproc", "4", "--mesh", "2x2", "--mp", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "Llama" in out and "model.layers.0" in out and "shard group 2" in out


def test_cli_without_transformers_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["estimate", str(tmp_path), "--nproc", "2"]) == 2
    assert "fshard[hf]" in capsys.readouterr().err


def test_cli_takes_policy_and_precision_from_an_accelerate_config(tmp_path, capsys):
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: Linear\n"
    )
    out = tmp_path / "e.json"
    args = ["estimate", "tests.unit.test_estimate:small_model", "--nproc", "2", "--json", str(out)]
    assert main([*args, "--config_file", str(config)]) == 0
    data = json.loads(out.read_text())
    assert [u["name"] for u in data["units"]] == ["<root>", "lin"]
    assert data["mp"] == "bfloat16 compute, bfloat16 reduce"
    assert data["units"][1]["unsharded_bytes"] == 2 * 10 * 2


def test_cli_gpt_counts_activations(capsys):
    assert main(["estimate", "gpt", "--nproc", "2", "--layers", "2", "--dim", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0" in out and "fake-tensor fwd+bwd" in out


def test_cli_bad_model_is_an_error(capsys):
    assert main(["estimate", "no_such_module:build", "--nproc", "2"]) == 2
    assert "cannot find 'build' in 'no_such_module'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ 70B


LLAMA_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
)


def test_llama_70b_on_an_8x8_mesh_in_under_30_seconds(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(**LLAMA_70B).save_pretrained(tmp_path)
    start = time.perf_counter()
    from fshard._model_source import load_model

    source = load_model(str(tmp_path))
    e = fshard.estimate(source.factory, nproc=64, mesh=(8, 8), mp="bf16", optimizer="adamw")
    assert time.perf_counter() - start < 30
    assert e.shard_size == 8 and len(e.units) == 81 and e.params == 70_553_706_496
    # Every dim divides by 8: no padding, so the persistent bytes are the ZeRO formula's.
    assert e.params_by_dtype == {"float32": e.params * 4 // 8}
    assert abs(e.persistent_bytes - e.zero_bytes) < 1 << 20
    assert e.peak_phase == "optimizer step"  # foreach AdamW's sqrt of every local shard


# ---------------------------------------------------------------------------- the tracker


def test_live_bytes_sees_storage_resizes_and_ignores_views_of_older_tensors():
    older = torch.empty(1000)
    with LiveBytes() as live:
        view = older[10:] * 1  # a new 990-element tensor; older itself is not counted
        buffer = torch.empty(500)
        buffer.untyped_storage().resize_(0)  # how fshard frees an unsharded buffer
        torch.empty(0)  # the next operator sees the resize
        assert live.current == 990 * 4
        buffer.untyped_storage().resize_(8000)
        torch.empty(0)
        assert live.current == 990 * 4 + 8000
        del view
    assert (live.peak, live.current) == (990 * 4 + 8000, 8000)


def test_cli_coalesce_sets_the_limit(tmp_path, capsys):
    """``--coalesce BYTES`` is ``coalesce_bytes``; a negative one is an error naming it."""
    peaks = []
    for limit in ("0", str(1 << 20)):
        out = tmp_path / f"e{limit}.json"
        args = ["estimate", "tests.unit.test_estimate:chain", "--nproc", "2", "--by-class", "Linear",
                "--optimizer", "none", "--device", "cpu", "--coalesce", limit, "--json", str(out)]  # fmt: skip
        assert main(args) == 0
        peaks.append(json.loads(out.read_text())["peak_bytes"])
    assert peaks == [368, 636]  # as test_coalesced_units_hold_their_shared_buffers counts
    assert main(["estimate", "gpt", "--nproc", "2", "--coalesce", "-1"]) == 2
    assert "coalesce_bytes must be an int >= 0" in capsys.readouterr().err
