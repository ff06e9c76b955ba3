"""``fshard bench``: smoke runs on 2 ranks (the built-in GPT and a user model given as
``module:factory``), the JSON schema, and the measured bytes against the ZeRO theory; the
report, the flags and the trackers without ranks."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fshard._bench import _measure, run_command
from fshard._bench._gpt import GPT, GPTConfig
from fshard._bench._report import SCHEMA, format_table, summarize
from fshard._bench._spec import BenchSpec
from fshard._bench._theory import UnitShapes, collective_theory, persistent_theory
from fshard._bench._workload import compute_loss, wrap_plan
from fshard.cli import build_parser, main
from tests import _bench_model

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------- the schema

_IMPL_KEYS = {
    "step_s": {"median", "p25", "p75", "all"},
    "phase_s": {"forward", "backward", "optimizer"},
    "ratio_to_ddp": None,
    "persistent_bytes": {"per_rank", "max_rank"},
    "peak_live_bytes": {"per_rank"},
    "cuda_peak_allocated_bytes": None,
    "collectives": {"per_rank"},
    "theory": {"persistent", "collectives", "collective_padding_bytes"},
    "loss": {"final_mean", "max_abs_diff_vs_ddp"},
}
_MODEL_KEYS = {"name", "class", "params", "param_bytes", "param_element_bytes", "units",
               "unit_shapes", "reshard_after_forward", "param_dtype", "reduce_dtype"}  # fmt: skip
_CONFIG_EXTRA = {"world", "backend", "torch", "fshard"}


def check_schema(doc: dict[str, Any], impls: list[str], world: int, steps: int) -> None:
    """Every key the module docstring of fshard._bench documents, with the documented types."""
    assert doc["schema"] == SCHEMA
    assert set(doc) == {"schema", "config", "model", "results"}
    assert set(doc["config"]) == set(vars(BenchSpec())) | _CONFIG_EXTRA
    assert set(doc["model"]) == _MODEL_KEYS
    assert doc["model"]["units"][-1] == "" and set(doc["model"]["unit_shapes"]) == set(doc["model"]["units"])
    assert list(doc["results"]) == impls
    for name, entry in doc["results"].items():
        assert set(entry) == set(_IMPL_KEYS), name
        for key, sub in _IMPL_KEYS.items():
            if sub is not None:
                assert set(entry[key]) == sub, (name, key)
        assert len(entry["step_s"]["all"]) == steps
        assert 0 < entry["step_s"]["p25"] <= entry["step_s"]["median"] <= entry["step_s"]["p75"]
        assert all(v >= 0 for v in entry["phase_s"].values())
        per_rank = entry["persistent_bytes"]["per_rank"]
        assert len(per_rank) == world and all(set(p) == {"params", "grads", "optim"} for p in per_rank)
        assert all(isinstance(b, int) and b > 0 for b in entry["peak_live_bytes"]["per_rank"])
        assert len(entry["collectives"]["per_rank"]) == world
        for counts in entry["collectives"]["per_rank"]:
            assert all(set(c) == {"calls", "bytes"} for c in counts.values())
        assert set(entry["theory"]["persistent"]) == {"params", "grads", "optim", "padding"}
        assert (entry["ratio_to_ddp"] is None) == ("ddp" not in impls)


# ------------------------------------------------------------------------------ 2-rank runs


def bench(*args: str, timeout: float = 240) -> str:
    """``python -m fshard bench ARGS`` from the repository root; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "fshard", "bench", "--nproc", "2", *args]
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"fshard bench timed out after {timeout}s\n{exc.stdout}\n{exc.stderr}") from None
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _within(measured: int, theory: int, slack: int) -> bool:
    return theory <= measured <= theory + slack


@pytest.mark.slow
def test_gpt_on_two_ranks_matches_the_zero_theory(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # Odd vocabulary and sequence: the embeddings' shards need padding on 2 ranks.
    stdout = bench(
        "--layers", "2", "--dim", "32", "--heads", "4", "--seq", "15", "--vocab", "65",
        "--batch", "2", "--steps", "2", "--warmup", "2", "--json", str(out),
    )  # fmt: skip
    impls = ["fshard", "ddp", "fsdp2"]
    rows = {line.split()[0]: line for line in stdout.splitlines() if line.split()}
    for name in impls:
        assert name in rows, stdout
    doc = json.loads(out.read_text())
    check_schema(doc, impls, world=2, steps=2)
    model, results = doc["model"], doc["results"]
    assert model["units"] == ["blocks.0", "blocks.1", ""]
    n_params = model["params"]
    p_bytes = 4 * n_params
    n_tensors = sum(len(s) for s in model["unit_shapes"].values())

    # DDP: everything on every rank, one all-reduce of every gradient per step.
    ddp = results["ddp"]
    for per_rank in ddp["persistent_bytes"]["per_rank"]:
        assert per_rank == {"params": p_bytes, "grads": p_bytes, "optim": 2 * p_bytes + 4 * n_tensors}
    for counts in ddp["collectives"]["per_rank"]:
        assert counts == {"all_reduce": {"calls": counts["all_reduce"]["calls"], "bytes": p_bytes}}

    for name in ("fshard", "fsdp2"):
        entry = results[name]
        theory = entry["theory"]["persistent"]
        for per_rank in entry["persistent_bytes"]["per_rank"]:
            # 16 P / N bytes for fp32 AdamW, within a row of padding per parameter.
            total = sum(per_rank.values())
            assert abs(total - (16 * n_params / 2 + 4 * n_tensors)) <= 4 * theory["padding"], (name, per_rank)
            for kind in ("params", "grads", "optim"):
                assert abs(per_rank[kind] - theory[kind]) <= 2 * theory["padding"], (name, kind, per_rank)
        slack = entry["theory"]["collective_padding_bytes"]
        expected = entry["theory"]["collectives"]
        root = sum(
            -(-s[0] // 2) * 2 * (torch.Size(s[1:]).numel()) for s in model["unit_shapes"][""]
        ) * 4  # fmt: skip
        for counts in entry["collectives"]["per_rank"]:
            assert set(counts) == {"all_gather", "reduce_scatter"}, (name, counts)
            assert _within(counts["reduce_scatter"]["bytes"], expected["reduce_scatter"], slack), (name, counts)
            gathered = counts["all_gather"]["bytes"]
            if name == "fshard":  # the root keeps its parameters from forward to backward
                # The two small blocks share one all-gather in forward and one in backward, and
                # all three units one reduce-scatter (fshard.set_coalescing's default).
                assert counts["all_gather"]["calls"] == 3 and counts["reduce_scatter"]["calls"] == 1
                assert _within(gathered, expected["all_gather"], slack), counts
            else:  # FSDP2 reshards the root too when asked to, and gathers it again
                assert _within(gathered, expected["all_gather"] + root, slack), counts
        # The same data and weights: every implementation's loss is DDP's up to rounding.
        assert entry["loss"]["max_abs_diff_vs_ddp"] < 1e-3, entry["loss"]
    # Sharding halves the peak of live tensor bytes' persistent part at least.
    assert max(results["fshard"]["peak_live_bytes"]["per_rank"]) < max(ddp["peak_live_bytes"]["per_rank"])


@pytest.mark.slow
def test_user_model_given_as_module_factory(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    with_plot = importlib.util.find_spec("matplotlib") is not None
    stdout = bench(
        "--model", "tests._bench_model:build", "--batch-fn", "tests._bench_model:make_batch",
        "--impl", "fshard,ddp", "--steps", "2", "--warmup", "1", "--json", str(out), "--coalesce", "0",
        *(["--plot", str(plot)] if with_plot else []),
    )  # fmt: skip
    assert "tests._bench_model:build (Stack)" in stdout, stdout
    doc = json.loads(out.read_text())
    check_schema(doc, ["fshard", "ddp"], world=2, steps=2)
    # The default units: one per entry of the model's nn.ModuleList, then the root.
    assert doc["model"]["units"] == ["layers.0", "layers.1", "layers.2", ""]
    fshard_ = doc["results"]["fshard"]
    assert fshard_["loss"]["max_abs_diff_vs_ddp"] < 1e-4
    counts = fshard_["collectives"]["per_rank"][0]  # a collective per unit: --coalesce 0
    assert counts["all_gather"]["calls"] == 2 * 3 + 1 and counts["reduce_scatter"]["calls"] == 4
    if with_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------- without any ranks


def _raw(impls: list[str]) -> dict[str, Any]:
    """Workers' figures for 2 ranks, 2 steps, as ``_worker.run`` returns them."""
    rank = {
        name: {
            "phases": [[0.01, 0.02, 0.003], [0.011, 0.02, 0.004]],
            "losses": [2.0, 1.5, 1.25],
            "persistent": {"params": 40, "grads": 40, "optim": 88},
            "peak_live_bytes": 500,
            "cuda_peak_bytes": None,
            "collectives": {"all_gather": {"calls": 3, "bytes": 240}},
        }
        for name in impls
    }
    return {
        "world": 2, "backend": "gloo", "torch": "x", "fshard": "y",
        "model": {
            "name": "m", "class": "M", "params": 20, "param_bytes": 80, "param_element_bytes": 4,
            "units": ["a", ""], "unit_shapes": {"a": [[4, 3]], "": [[8]]},
            "reshard_after_forward": True, "param_dtype": None, "reduce_dtype": None,
        },
        "ranks": [rank, rank],
    }  # fmt: skip


def test_summary_follows_the_schema_and_the_table_shows_it() -> None:
    impls = ["fshard", "ddp", "fsdp2"]
    doc = summarize(_raw(impls), BenchSpec(impls=tuple(impls), steps=2))
    check_schema(json.loads(json.dumps(doc)), impls, world=2, steps=2)
    assert doc["results"]["fshard"]["ratio_to_ddp"] == 1.0
    assert doc["results"]["fshard"]["step_s"]["median"] == pytest.approx(0.034)
    assert doc["results"]["ddp"]["theory"]["collectives"] == {"all_reduce": 80}
    table = format_table(doc)
    for text in ("x DDP", "fwd ms", "params/grads/optim", "peak live MiB", "all_gather", "theory MiB"):
        assert text in table


def test_theory_is_sixteen_bytes_per_parameter_over_n() -> None:
    units = [UnitShapes("b", ((8, 4), (8,))), UnitShapes("", ((6, 4),))]
    padded = 8 * 4 + 8 + 8 * 4  # the root's 6 rows pad to 8 on 4 ranks
    got = persistent_theory(units, shard=4, param_bytes=4)
    assert got["params"] + got["grads"] + got["optim"] == 16 * padded // 4 + 4 * 3  # + step counts
    assert got["padding"] == (4 + 1 + 4) * 4  # a row of each parameter
    comm = collective_theory(units, impl="fshard", mesh=(2, 4), reshard_after_forward=True,
                             param_bytes=4, gather_bytes=2, reduce_bytes=4)  # fmt: skip
    # 2 gathers of the block, 1 of the root (6 rows pad to 8), in bf16; reduction in fp32;
    # on 2x4 the sharded gradients are also all-reduced over the 2 replicas.
    assert comm == {"all_gather": (2 * 40 + 32) * 2, "reduce_scatter": 72 * 4, "all_reduce": 72 * 4 // 4}


def test_live_bytes_see_storages_freed_by_resizing() -> None:
    big = torch.zeros(1000)
    with _measure.LiveTensorBytes() as live:
        live.track([big])
        big.untyped_storage().resize_(0)  # freed the way FSDP frees an unsharded parameter
        x = torch.ones(250)
        y = x + 1
    assert live.peak_bytes == 4000  # never both at once: 4000 bytes, then 2000
    assert live.current_bytes() == 2000
    del x, y


def test_batch_contract() -> None:
    cpu = torch.device("cpu")
    stack = _bench_model.build()
    loss = compute_loss(stack, _bench_model.make_batch(0, 0, cpu), cpu)
    assert loss.ndim == 0 and loss.requires_grad
    keyword = _bench_model.WithLoss()
    assert compute_loss(keyword, _bench_model.make_dict_batch(0, 0, cpu), cpu).ndim == 0
    with pytest.raises(TypeError, match=r"\(inputs, target\) or a dict"):
        compute_loss(stack, [torch.zeros(1)], cpu)


def test_units_from_each_policy_flag(tmp_path: Path) -> None:
    gpt = GPT(GPTConfig(vocab=64, layers=2, dim=8, heads=2))
    blocks = ("blocks.0", "blocks.1")
    assert wrap_plan(BenchSpec(), gpt).fqns == blocks
    assert wrap_plan(BenchSpec(by_class=("Attention",)), gpt).fqns == ("blocks.0.attn", "blocks.1.attn")
    # A block has 872 parameters, the token embedding (tied to the head) 512: it stays in the root.
    assert wrap_plan(BenchSpec(min_params=800), gpt).fqns == blocks
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "mixed_precision: bf16\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: Block\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
    )
    plan = wrap_plan(BenchSpec(config_file=str(config)), gpt)
    assert plan.fqns == blocks and plan.reshard_after_forward is False
    assert plan.param_dtype == torch.bfloat16
    user = wrap_plan(BenchSpec(model="tests._bench_model:build", batch_fn="x:y"), _bench_model.build())
    assert user.fqns == ("layers.0", "layers.1", "layers.2") and user.param_dtype is None


def _bench_args(*words: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *words])


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--impl", "fshard,zero"], "--impl: unknown zero; choose from fshard,ddp,fsdp2"),
        (["--model", "m:f"], "--model needs --batch-fn MOD:FN"),
        (["--model", "nomodule", "--batch-fn", "a:b"], "--model must look like pkg.module:name"),
        (["--by-class", "Block", "--min-params", "10"], "--by-class and --min-params: give one way"),
        (["--nproc", "2", "--mesh", "2x2"], "--mesh 2x2 has 4 ranks, but --nproc is 2"),
        (["--model", "tests._bench_model:nothing", "--batch-fn", "tests._bench_model:make_batch"],
         "tests._bench_model has no callable 'nothing'"),
        (["--by-class", "Nothing"], "no module of class 'Nothing' in GPT"),
        (["--device", "cuda", "--nproc", "64"], "--device cuda needs a GPU per rank: --nproc 64"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_before_any_rank_starts(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *words]) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("the ranks were started before the missing extra was reported")

    monkeypatch.setattr(subprocess, "run", no_ranks)
    assert run_command(_bench_args("--plot", "x.png")) == 2
    assert "pip install 'fshard[plot]'" in capsys.readouterr().err
