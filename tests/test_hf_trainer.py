"""fshard.hf.Trainer: a transformers Trainer script trains as with DDP and resumes at another size.

The script (tests/_hf_trainer_script.py) is a plain Trainer script; ``--mode fshard`` changes its
Trainer import to ``fshard.hf.Trainer`` and sets ``fsdp=True, fsdp_config={...}``. Each run is a
torchrun job on gloo CPU ranks: 10 optimizer steps, gradient accumulation 2, ``max_grad_norm``
0.5 (below the gradient norms, so every step clips), the same global batch at every world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install -e '.[hf]'")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_hf_trainer_script.py"


def run_script(nproc: int, *args: str, config_file: Path | None = None, timeout: float = 300) -> dict:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("FSHARD_CONFIG_FILE", None)
    if config_file is not None:
        env["FSHARD_CONFIG_FILE"] = str(config_file)  # as `fshard launch --config_file` sets it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(SCRIPT),
        *args,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    logs = {}
    for line in result.stdout.splitlines():
        if line.startswith("LOG "):
            entry = json.loads(line[4:])
            logs[entry["step"]] = entry
    evals = [
        json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("EVAL ")
    ]
    assert "DONE" in result.stdout and len(evals) == 1, result.stdout[-3000:]
    return {"steps": logs, "eval_loss": evals[0]["eval_loss"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf_trainer") / "llama")


def test_trainer_on_fshard_gives_the_losses_of_the_trainer_on_ddp(model_dir, tmp_path) -> None:
    ddp = run_script(
        2, "--mode", "ddp", "--model-dir", model_dir, "--output-dir", str(tmp_path / "ddp")
    )
    ours = run_script(
        2, "--mode", "fshard", "--model-dir", model_dir, "--output-dir", str(tmp_path / "fshard")
    )
    assert sorted(ours["steps"]) == sorted(ddp["steps"]) == list(range(1, 11))
    print("step  fshard loss  DDP loss    fshard grad_norm  DDP grad_norm")
    for step in range(1, 11):
        a, b = ours["steps"][step], ddp["steps"][step]
        print(
            f"{step:>4}  {a['loss']:.7f}   {b['loss']:.7f}  {a['grad_norm']:.7f}         {b['grad_norm']:.7f}"
        )
        # The norm of the full gradient (a local shard's norm would be about 1/sqrt(2) of it).
        assert b["grad_norm"] > 0.5  # so every step clipped
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), step
    assert ours["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-5)
    assert ours["steps"][10]["loss"] < ours["steps"][1]["loss"]  # it trained


def test_a_save_steps_checkpoint_written_at_world_4_resumes_at_world_2(model_dir, tmp_path) -> None:
    """Configured by an accelerate config file ($FSHARD_CONFIG_FILE) this time."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\n"
        "fsdp_config:\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n"
    )
    first = tmp_path / "world4"
    full = run_script(
        4,
        "--mode",
        "fshard-file",
        "--model-dir",
        model_dir,
        "--output-dir",
        str(first),
        "--save-steps",
        "5",
        config_file=config,
    )
    checkpoint = first / "checkpoint-5"
    names = set(os.listdir(checkpoint))
    # fshard's shards of model and optimizer, beside the Trainer's own files (and the full
    # weights too: fsdp_state_dict_type is FULL_STATE_DICT).
    assert {
        "fshard_checkpoint",
        "scheduler.pt",
        "trainer_state.json",
        "model.safetensors",
        "config.json",
    } <= names
    assert {f"rng_state_{rank}.pth" for rank in range(4)} <= names
    assert "optimizer.pt" not in names  # not rank 0's optimizer shard passed off as the optimizer

    final = tmp_path / "final"
    resumed = run_script(
        2, "--mode", "fshard-file", "--model-dir", model_dir, "--output-dir", str(tmp_path / "world2"),
        "--resume", str(checkpoint), "--save-model", str(final), config_file=config,
    )  # fmt: skip
    # Steps 6..10 at world 2 repeat the uninterrupted run's: the model, the Adam moments, the
    # scheduler and the data position were restored (step 7 on needs the moments).
    for step in range(6, 11):
        a, b = resumed["steps"][step], full["steps"][step]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), step
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-5)

    # save_model wrote what save_pretrained writes; a plain model loads it.
    from transformers import LlamaForCausalLM

    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(os.listdir(final))
    plain = LlamaForCausalLM.from_pretrained(str(final))
    start = LlamaForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(
        plain.model.layers[1].mlp.down_proj.weight, start.model.layers[1].mlp.down_proj.weight
    )
    assert plain.lm_head.weight is plain.model.embed_tokens.weight


def test_the_example_trains_under_fshard_launch_with_the_guide_config(tmp_path) -> None:
    """examples/hf_trainer.py as the README runs it: the guide's config (LlamaDecoderLayer
    units, CPU offload, bf16), the Trainer's logs on rank 0 only, checkpoints and a saved model
    that a plain model loads with the Trainer's evaluation loss."""
    launcher = Path(sys.executable).with_name("fshard")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "fshard"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("FSHARD_CONFIG_FILE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [*command, "launch", "--config_file", "examples/hf_trainer.yaml", "examples/hf_trainer.py",
         "--output-dir", str(tmp_path), "--steps", "15"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    out = result.stdout
    assert "units ['(root)', 'model.layers.0', 'model.layers.1']" in out, out
    losses = [float(line.split("'loss': '")[1].split("'")[0]) for line in out.splitlines() if "'loss': '" in line]
    assert len(losses) == 3 and losses[-1] < losses[0], out  # logging_steps=5, on rank 0 only
    assert sorted(os.listdir(tmp_path / "checkpoint-15")) == [
        "fshard_checkpoint", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json",
    ]  # fmt: skip  # SHARDED_STATE_DICT: the model is in fshard_checkpoint/ only
    line = next(line for line in out.splitlines() if line.startswith("eval loss: "))
    trainer_loss, plain_loss = (float(part.split()[-1]) for part in line.split(","))
    assert plain_loss == pytest.approx(trainer_loss, abs=0.02)  # bf16 vs fp32 forward
