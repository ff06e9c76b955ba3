"""The BERT example (examples/hf_bert.py) trains under ``fshard launch`` and saves checkpoints.

It builds transformers' BertForSequenceClassification from a small BertConfig with random
weights and applies examples/accelerate_config.yaml (the HF FSDP guide's sample) through
``fshard.from_config``: BertLayer units, FULL_SHARD, CPU offload, bf16, rank 0's weights
broadcast. The example prints the units it finds on the sharded model (not what the config
asks for), so the checks below are of what ``from_config`` built. Each run also saves a
checkpoint with ``--save``, once per ``fsdp_state_dict_type``, and both files load back into a
fresh model. Needs the ``hf`` extra; ``make test`` installs it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

pytest.importorskip(
    "transformers",
    reason="examples/hf_bert.py needs transformers: pip install -e '.[hf]' (make test installs it)",
)

import fshard.checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "accelerate_config.yaml"
# Without dropout, so that a run can be compared step by step with a one-process reference.
MODEL_ARGS = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--dropout", "0"]
# The sample config on 2 ranks: FULL_SHARD is a 1D mesh of 2 with reshard_after_forward=True;
# bf16 computes and reduces in bf16, and the root returns fp32 (as accelerate's model does).
UNIT_SETTINGS = "mesh 2, reshard_after_forward=True, offload=True, mixed precision: param bfloat16, reduce bfloat16"
UNIT_LINE = re.compile(r"^unit (\S+) \[(\w+)\]: (.*)$", re.M)


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_bert_example", ROOT / "examples" / "hf_bert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(config: Path, save: Path, steps: int = 1) -> str:
    launcher = Path(sys.executable).with_name("fshard")
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "fshard"]
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("FSHARD_CONFIG_FILE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [*command, "launch", "--config_file", str(config), "examples/hf_bert.py",
         "--steps", str(steps), "--batch-size", "4", *MODEL_ARGS, "--save", str(save)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """One one-step run per fsdp_state_dict_type: {type: (rank 0's stdout, --save dir)}."""
    tmp = tmp_path_factory.mktemp("hf_bert")
    full_config = tmp / "full_state_dict.yaml"
    data = yaml.safe_load(SAMPLE.read_text())
    data["fsdp_config"]["fsdp_state_dict_type"] = "FULL_STATE_DICT"
    full_config.write_text(yaml.safe_dump(data))
    return {
        "SHARDED_STATE_DICT": (launch(SAMPLE, tmp / "sharded"), tmp / "sharded"),
        "FULL_STATE_DICT": (launch(full_config, tmp / "full"), tmp / "full"),
    }


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


def fresh_model(example: ModuleType) -> torch.nn.Module:
    return example.build_model(example.parse_args(MODEL_ARGS))


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_the_sharded_model_has_a_unit_per_bert_layer_and_the_root(runs, example, state_dict_type) -> None:
    out, _ = runs[state_dict_type]
    assert "2 rank(s)" in out and "FULL_SHARD, offload=True, mixed_precision=bf16" in out
    model = fresh_model(example)
    n_params = len(list(model.parameters()))
    assert f"sharded parameters: {n_params} of {n_params}" in out
    layers = [fqn for fqn, m in model.named_modules() if type(m).__name__ == "BertLayer"]
    assert layers == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    units = {fqn: (cls, settings) for fqn, cls, settings in UNIT_LINE.findall(out)}
    assert sorted(units) == sorted(["(root)", *layers]), out  # every BertLayer, the root, nothing else
    assert units["(root)"] == ("BertForSequenceClassification", f"{UNIT_SETTINGS}, output float32")
    for fqn in layers:
        assert units[fqn] == ("BertLayer", f"{UNIT_SETTINGS}, output -")
    loss = re.search(r"step 1/1  loss (\S+)", out)
    assert loss is not None, out
    # The sharded model's first loss is the unsharded model's (one process, the same weights and
    # each rank's batch) computed in bf16, as mixed_precision: bf16 asks.
    args = example.parse_args([*MODEL_ARGS, "--batch-size", "4"])
    model = example.build_model(args).to(torch.bfloat16)
    with torch.no_grad():
        losses = [model(**example.make_batch(args, 0, rank, torch.device("cpu"))).loss for rank in (0, 1)]
    reference = float(torch.stack(losses).float().mean())
    assert float(loss.group(1)) == pytest.approx(reference, abs=1e-4), (loss.group(1), reference)
    assert "done: 1 steps" in out


def one_process_losses(example: ModuleType, steps: int, world: int = 2) -> list[float]:
    """The example's training, in one process of the plain model in fp32: each step's loss is
    the mean over the ``world`` ranks' batches (their mean gradient is what the ranks apply)."""
    args = example.parse_args([*MODEL_ARGS, "--batch-size", "4"])
    model = example.build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(steps):
        batches = [example.make_batch(args, step, rank, torch.device("cpu")) for rank in range(world)]
        loss = torch.stack([model(**batch).loss for batch in batches]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_sharded_run_trains_as_one_process_does_in_fp32(example, tmp_path) -> None:
    """The sample config less mixed precision (offload kept): three steps, each loss equal to the
    one-process reference's to the printed precision (clipping and the optimizer included)."""
    config = tmp_path / "fp32.yaml"
    data = yaml.safe_load(SAMPLE.read_text())
    data["mixed_precision"] = "no"
    config.write_text(yaml.safe_dump(data))
    out = launch(config, tmp_path / "ckpt", steps=3)
    printed = [float(x) for x in re.findall(r"step \d/3  loss (\S+)", out)]
    reference = one_process_losses(example, steps=3)
    assert len(printed) == 3, out
    assert printed == pytest.approx(reference, abs=2e-4), (printed, reference)
    assert printed[2] != pytest.approx(printed[0], abs=1e-3)  # the steps did change the model


def test_both_checkpoints_load_back_into_a_fresh_model_and_agree(runs, example) -> None:
    from safetensors.torch import load_file

    sharded_out, sharded_dir = runs["SHARDED_STATE_DICT"]
    full_out, full_dir = runs["FULL_STATE_DICT"]
    assert f"saved SHARDED_STATE_DICT to {sharded_dir}" in sharded_out
    assert f"saved FULL_STATE_DICT to {full_dir / 'model.safetensors'}" in full_out
    sharded = fshard.checkpoint.consolidate(sharded_dir)  # offline, no process group
    full = load_file(str(full_dir / "model.safetensors"))

    initial = fresh_model(example).state_dict()
    for name, state in (("sharded", sharded), ("full", full)):
        model = fresh_model(example)
        model.load_state_dict(state, strict=True)  # every key, every shape
        trained = model.state_dict()
        moved = [k for k in initial if not torch.equal(initial[k], trained[k])]
        assert "classifier.weight" in moved and "bert.encoder.layer.1.output.dense.weight" in moved, name
    # The two runs trained alike; only the way they saved differs.
    assert sorted(sharded) == sorted(full)
    for key in full:
        assert torch.equal(sharded[key], full[key]), key
