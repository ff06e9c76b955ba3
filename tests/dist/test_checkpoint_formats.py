"""fshard.checkpoint's other forms: FULL_STATE_DICT checkpoints (from the config or a keyword),
plain DCP directories written by torch's FSDP2, and consolidate streaming one tensor at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import fshard
import fshard.checkpoint as ckpt
from fshard._config import StateDictType
from fshard.checkpoint._safe_read import read_metadata
from fshard.testing import RanksFailed, get_pool, mesh_for
from tests.dist import _sd_common as C

ROOT = Path(__file__).resolve().parents[2]
BEFORE, AFTER = 2, 2


# ---------------------------------------------------------------------------- FULL_STATE_DICT


def _full_save_task(path, mesh_shape, how):
    if how == "config":
        model = fshard.from_config(C.build(), {"fsdp_state_dict_type": "FULL_STATE_DICT"})
    else:
        model = C.build_sharded(mesh_shape)
    opt = C.make_optim(model)
    C.train(model, opt, range(BEFORE))
    rank = dist.get_rank()
    if how == "config":
        ckpt.save(path, model, opt, extra={"step": BEFORE, "rank": rank})
    else:
        kind = StateDictType.FULL_STATE_DICT if mesh_shape == (2, 2) else "FULL_STATE_DICT"
        ckpt.save(path, model, opt, extra={"step": BEFORE, "rank": rank}, state_dict_type=kind)
    return C.full_params(model), fshard.optim_state_dict(model, opt, full=True)


def _full_load_task(path, mesh_shape):
    model = C.build_sharded(mesh_shape, seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)  # hyperparameters from the checkpoint
    extra = ckpt.load(path, model, opt)
    loaded = C.full_params(model), fshard.optim_state_dict(model, opt, full=True)
    C.train(model, opt, range(BEFORE, BEFORE + AFTER))
    return extra, loaded, C.full_params(model)


@pytest.mark.parametrize(
    ("how", "save_mesh", "load_mesh"),
    [("config", (2,), (2, 2)), ("keyword", (2, 2), (2,)), ("keyword", (2,), (3,))],
)
def test_full_state_dict_checkpoint_round_trips_at_another_world_size(tmp_path, how, save_mesh, load_mesh):
    path = str(tmp_path / "ckpt")
    world = 1
    for size in save_mesh:
        world *= size
    params, optim_state = get_pool(world).run(_full_save_task, path, save_mesh, how)[0]
    manifest = json.loads(Path(path, ckpt.MANIFEST).read_text())["body"]
    assert manifest["state_dict_type"] == "FULL_STATE_DICT"
    assert "model.safetensors" in manifest["files"]
    # The model is in model.safetensors, each key once as model.state_dict() lists it; DCP has
    # the optimizer only.
    C.assert_same_tensors(load_file(str(Path(path, "model.safetensors"))), params, what="model.safetensors")
    assert not [k for k in read_metadata(path).state_dict_metadata if k.startswith("model.")]
    load_world = 1
    for size in load_mesh:
        load_world *= size
    want = C.reference(BEFORE + AFTER)
    for rank, (extra, (got, got_optim), continued) in enumerate(get_pool(load_world).run(_full_load_task, path, load_mesh)):
        assert extra == {"step": BEFORE, "rank": rank if rank < world else 0}
        C.assert_same_tensors(got, params, what=f"loaded on rank {rank}")
        assert got_optim["param_groups"] == optim_state["param_groups"]
        for name, state in optim_state["state"].items():
            C.assert_same_tensors(got_optim["state"][name], state, what=f"optimizer {name}")
        C.assert_same_tensors(continued, want, exact=False, what=f"continued on rank {rank}")
    # Offline, both ways.
    C.assert_same_tensors(ckpt.consolidate(path), params, what="consolidate")
    out = tmp_path / "out.safetensors"
    ckpt.consolidate_to(path, out)
    C.assert_same_tensors(load_file(str(out)), params, what="consolidate_to")


def _keyword_overrides_config_task(path):
    model = fshard.from_config(C.build(), {"fsdp_state_dict_type": "FULL_STATE_DICT"})
    ckpt.save(path + "/sharded", model, state_dict_type="SHARDED_STATE_DICT")
    try:
        ckpt.save(path + "/bad", model, state_dict_type="FULL")
    except ValueError as exc:
        return str(exc)
    return None


def test_the_keyword_overrides_the_config_and_a_bad_name_is_an_error(tmp_path):
    for message in get_pool(2).run(_keyword_overrides_config_task, str(tmp_path)):
        assert message is not None and "state_dict_type='FULL'; expected 'SHARDED_STATE_DICT'" in message
    manifest = json.loads(Path(tmp_path, "sharded", ckpt.MANIFEST).read_text())["body"]
    assert manifest["state_dict_type"] == "SHARDED_STATE_DICT"
    assert not Path(tmp_path, "sharded", "model.safetensors").exists()


# ------------------------------------------------------------------------ plain DCP (FSDP2)


def _fsdp2_model(mesh_shape, seed=None):
    model = C.build(seed=seed)
    mesh = mesh_for(mesh_shape)
    for block in model.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(model, mesh=mesh)
    return model


def _fsdp2_full(model):
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()}


def _fsdp2_save_task(path, form):
    model = _fsdp2_model((dist.get_world_size(),))
    opt = C.make_optim(model)
    C.train(model, opt, range(BEFORE))
    if form == "nested":
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
    else:
        dcp.save(model.state_dict(), checkpoint_id=path)
    return _fsdp2_full(model)


def _fsdp2_load_task(path, form):
    model = C.build_sharded((dist.get_world_size(),), seed=99)
    opt = C.make_optim(model) if form == "nested" else None
    assert ckpt.load(path, model, opt) is None  # a plain DCP directory has no extra
    loaded = C.full_params(model)
    if opt is not None:
        C.train(model, opt, range(BEFORE, BEFORE + AFTER))
    return loaded, C.full_params(model)


@pytest.mark.parametrize(("form", "save_world", "load_world"), [("nested", 4, 2), ("top", 4, 2), ("nested", 2, 4)])
def test_a_dcp_checkpoint_of_torch_fsdp2_loads_at_another_world_size(tmp_path, form, save_world, load_world):
    path = str(tmp_path / "fsdp2")
    saved = get_pool(save_world).run(_fsdp2_save_task, path, form)[0]
    assert not Path(path, ckpt.MANIFEST).exists()
    want = C.reference(BEFORE + AFTER)
    for rank, (loaded, continued) in enumerate(get_pool(load_world).run(_fsdp2_load_task, path, form)):
        C.assert_same_tensors(loaded, saved, what=f"loaded on rank {rank}")
        if form == "nested":  # the optimizer state came too: training goes on as if uninterrupted
            C.assert_same_tensors(continued, want, exact=False, what=f"continued on rank {rank}")


def _plain_problem_task(path, with_optim, spec):
    model = C.build_sharded((dist.get_world_size(),), spec, seed=99)
    ckpt.load(path, model, C.make_optim(model) if with_optim else None)


def test_plain_dcp_problems_name_the_path_and_what_is_missing(tmp_path):
    path = str(tmp_path / "fsdp2")
    get_pool(2).run(_fsdp2_save_task, path, "top")
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_plain_problem_task, path, True, C.SPEC)
    for error in info.value.errors.values():
        assert "an optimizer was passed but the DCP checkpoint" in str(error) and path in str(error), error
    bigger = C.TransformerSpec(**{**C.SPEC.__dict__, "layers": 3})
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_plain_problem_task, path, False, bigger)
    for error in info.value.errors.values():
        assert f"the DCP checkpoint {path} lacks key(s) the model has: ['blocks.2." in str(error), error
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_plain_problem_task, str(empty), False, C.SPEC)
    for error in info.value.errors.values():
        assert "fshard.json is missing" in str(error) and "it has no .metadata" in str(error), error


# --------------------------------------------------------------------- streamed consolidate

BIG_ROWS, SMALL_ROWS, SMALLS, COLS = 4096, 64, 128, 4096  # 64 MiB, then 128 x 1 MiB (fp32)


class _OneBigManySmall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(BIG_ROWS, COLS))
        self.small = nn.ParameterList(nn.Parameter(torch.full((SMALL_ROWS, COLS), float(i))) for i in range(SMALLS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.big.mean() + sum(p.mean() for p in self.small))


def _big_save_task(path):
    model = _OneBigManySmall()
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2)).sum().backward()
    opt.step()
    ckpt.save(path, model, opt)


_PEAK_SCRIPT = """
import re, sys
import fshard.checkpoint as ckpt
from fshard._config import StateDictType
def status(name):
    return int(re.search(name + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from here
before = status("VmRSS")
done = ckpt.consolidate_to(sys.argv[1], sys.argv[2], optimizer=sys.argv[3] == "1")
print(status("VmHWM") - before, done.nbytes)
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("big") / "ckpt")
    get_pool(2).run(_big_save_task, path, timeout=300)
    return path


@pytest.mark.parametrize("optimizer", [False, True], ids=["model", "with_optimizer"])
def test_streamed_consolidate_peak_is_near_the_largest_tensor_not_the_model(big_checkpoint, tmp_path, optimizer):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to restart the RSS high-water mark")
    out = tmp_path / "out.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, big_checkpoint, str(out), "1" if optimizer else "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak, written = map(int, proc.stdout.split())
    largest = BIG_ROWS * COLS * 4
    model_bytes = largest + SMALLS * SMALL_ROWS * COLS * 4
    assert written == (3 * model_bytes if optimizer else model_bytes) + (4 * (1 + SMALLS) if optimizer else 0)
    print(f"consolidate peak {peak / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB; written {written / 2**20:.0f} MiB")
    assert peak < 2.5 * largest, (peak, largest, written)
    assert written > 2.5 * largest  # the measurement tells streaming from holding it all
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        # (one AdamW step of lr 0.1 moved every value by about 0.1)
        torch.testing.assert_close(f.get_slice("small.5")[0:1], torch.full((1, COLS), 5.0), atol=0.2, rtol=0)
        keys = list(f.keys())
        if optimizer:
            assert "optim.state.big.exp_avg" in keys and "optim.state.small.7.step" in keys
            groups = json.loads(f.metadata()["optim.param_groups"])
            assert groups[0]["lr"] == 0.1 and len(groups[0]["params"]) == 1 + SMALLS
        else:
            assert not [k for k in keys if k.startswith("optim.")]


def test_fshard_consolidate_optimizer_flag(big_checkpoint, tmp_path):
    out = tmp_path / "state.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "fshard", "consolidate", "--optimizer", big_checkpoint, str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {3 * (1 + SMALLS) + (1 + SMALLS)} tensors"), proc.stdout
