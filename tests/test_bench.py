"""The benchmarks run under torchrun and report every variant (no timing asserted).

``fshard bench`` (which replaced ``benchmarks/step_bench.py``) is tested in test_bench_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_bench(script: str, *args: str, timeout: float = 120) -> tuple[str, dict[str, list[str]]]:
    """Run ``benchmarks/<script>`` on 2 gloo ranks; its stdout and table rows by first word."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(ROOT / "benchmarks" / script), *args,
    ]  # fmt: skip
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} timed out after {timeout}s\n{exc.stdout}\n{exc.stderr}") from None
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()}
    return result.stdout, rows


def test_accum_bench_smoke():
    stdout, rows = run_bench(
        "accum_bench.py", "--micro", "3", "--steps", "1", "--warmup", "0",
        "--layers", "1", "--dim", "32", "--seq", "8",
    )  # fmt: skip
    gathers = {name: int(rows[name][2]) for name in ("zero3", "zero3-keep", "zero2", "zero2-keep")}
    # One block and the root: ZeRO-2 with keep gathers each once per optimizer step.
    assert gathers["zero2-keep"] == 2 and gathers["zero2"] == 2 * 3, gathers
    assert gathers["zero3-keep"] < gathers["zero3"], gathers
    assert len({rows[name][4] for name in gathers}) == 1, stdout  # the same final loss


def test_sd_bench_smoke(tmp_path):
    out = tmp_path / "sd.json"
    stdout, rows = run_bench(
        "sd_bench.py", "--reps", "2", "--warmup", "0", "--layers", "1", "--dim", "32", "--seq", "16",
        "--batch", "2", "--dir", str(tmp_path), "--json", str(out), timeout=180,
    )  # fmt: skip
    variants = ("full_state_dict", "state_dict", "save", "save-model")
    for name in variants:
        assert name in rows, f"no table row for {name}:\n{stdout}"
    payload = json.loads(out.read_text())
    model, figures = payload["model"], payload["results"]
    assert set(figures) == set(variants)
    assert 0 < model["largest_param_bytes"] < model["model_bytes"], model
    for name, entry in figures.items():
        assert len(entry["time_ms_all"]) == 2 and 0 < entry["time_ms_min"] <= entry["time_ms_median"], name
        assert len(entry["alloc_peak_bytes_per_rank"]) == 2 and entry["rank0_rss_growth_bytes"] >= 0, name
    # Rank 0's full state dict is alive at the end of the call: at least the model, and about
    # one parameter more at most (the bound is loose: this is a smoke test).
    bound = model["model_bytes"] + model["largest_param_bytes"]
    assert model["model_bytes"] <= figures["full_state_dict"]["rank0_alloc_peak_bytes"] <= 2 * bound
    assert figures["state_dict"]["rank0_alloc_peak_bytes"] < model["model_bytes"]  # no copies
    # On disk: the weights, and with the optimizer AdamW's two moments on top.
    assert model["model_bytes"] <= figures["save-model"]["disk_bytes"] < figures["save"]["disk_bytes"]
    assert figures["save"]["disk_bytes"] >= 3 * model["model_bytes"]
    assert "disk_bytes" not in figures["state_dict"]
    assert list(tmp_path.iterdir()) == [out], "the benchmark left checkpoints behind"
