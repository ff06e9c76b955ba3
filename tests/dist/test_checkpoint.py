"""fshard.checkpoint: resharding round trips, atomicity, corruption, safety, consolidate."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import fshard
import fshard.checkpoint as ckpt
from fshard.checkpoint._load import optim_template
from fshard.checkpoint._manifest import manifest_bytes, read_manifest
from fshard.testing import RanksFailed, get_pool, mesh_for
from fshard.testing.models import TransformerSpec
from tests.dist import _sd_common as C

ROOT = Path(__file__).resolve().parents[2]
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _extra(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "step": step,
        "rank": rank,
        "rng": gen.get_state(),
        "loader": {"epoch": 1, "position": (3, 4), "order": [2, 0, 1], "done": None, "lr": 0.5},
        "counts": {7: "seven"},
        # safetensors has no complex128: stored as its bytes, back as it was (0-d too).
        "phase": torch.tensor([1 + 2j, -0.5j + rank], dtype=torch.complex128),
        "angle": torch.tensor(3 + 4j, dtype=torch.complex128),
    }


# ------------------------------------------------------------------------------------- tasks


def _save_task(path, mesh_shape):
    """Train, save, then keep going: the uninterrupted run to compare resumed runs with."""
    rank = dist.get_rank()
    model = C.build_sharded(mesh_shape)
    opt = C.make_optim(model)
    C.train(model, opt, range(STEPS_BEFORE))
    ckpt.save(path, model, opt, extra=_extra(rank, STEPS_BEFORE))
    saved = C.full_params(model), fshard.optim_state_dict(model, opt, full=True)
    C.train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return saved, C.full_params(model)


def _resume_task(path, mesh_shape):
    rank = dist.get_rank()
    model = C.build_sharded(mesh_shape, seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)  # hyperparameters come from the checkpoint
    extra = ckpt.load(path, model, opt)
    want = _extra(rank if rank < 4 else 0, STEPS_BEFORE)
    assert extra["step"] == want["step"] and extra["rank"] == want["rank"], extra
    assert torch.equal(extra["rng"], want["rng"]) and extra["rng"].dtype == torch.uint8
    assert extra["loader"] == want["loader"] and isinstance(extra["loader"]["position"], tuple)
    assert extra["counts"] == {7: "seven"}
    for key in ("phase", "angle"):
        assert extra[key].dtype == torch.complex128 and torch.equal(extra[key], want[key]), key
    loaded = C.full_params(model), fshard.optim_state_dict(model, opt, full=True)
    C.train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return loaded, C.full_params(model)


def _save_only_task(path, spec=C.SPEC, extra=None):
    model = C.build_sharded((dist.get_world_size(),), spec)
    opt = C.make_optim(model)
    C.train(model, opt, range(1), spec)
    ckpt.save(path, model, opt, extra=extra if extra is not None else {"step": 1})
    return C.full_params(model)


def _load_only_task(path, spec=C.SPEC, strict=True, verify=True, with_optim=True):
    model = C.build_sharded((dist.get_world_size(),), spec, seed=5)
    opt = C.make_optim(model) if with_optim else None
    extra = ckpt.load(path, model, opt, strict=strict, verify=verify)
    return extra, C.full_params(model)


def _load_differing_on_one_rank_task(path):
    model = C.build_sharded((dist.get_world_size(),), seed=5)
    if dist.get_rank() == 1:  # a rank that built another model (a config read differently)
        model.counter = torch.zeros(5, dtype=torch.float64)
    try:
        ckpt.load(path, model, C.make_optim(model))
    except ValueError as exc:
        return str(exc)
    return None


def test_a_problem_found_on_one_rank_is_raised_on_every_rank(saved_2):
    """The ranks agree on the checks before DCP reads anything: the others waited in the
    load to the process-group timeout, with gloo's error and no word of the cause."""
    for message in get_pool(2).run(_load_differing_on_one_rank_task, str(saved_2), timeout=60):
        assert message is not None and "key 'counter': shape mismatch" in message, message
        assert "found on rank 1" in message, message


def _bad_extra_task(path):
    extra = {"step": 1, "where": object()} if dist.get_rank() == 1 else {"step": 1}
    model = C.build_sharded((dist.get_world_size(),))
    ckpt.save(path, model, extra=extra)


def _numpy_lr_task(path):
    import numpy as np

    model = C.build_sharded((dist.get_world_size(),))
    opt = torch.optim.AdamW(model.parameters(), lr=np.float32(1e-3))
    ckpt.save(path, model, opt)


# ------------------------------------------------------------------------- round trips


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-2")
    results = get_pool(4).run(_save_task, path, (2, 2))
    (params, optim_state), continued = results[0]
    return path, params, optim_state, continued


def test_checkpoint_matches_the_unsharded_reference(saved_2x2):
    _, params, _, continued = saved_2x2
    C.assert_same_tensors(params, C.reference(STEPS_BEFORE), exact=False, what="at save")
    C.assert_same_tensors(continued, C.reference(STEPS_BEFORE + STEPS_AFTER), exact=False, what="continued")


@pytest.mark.parametrize(("world", "mesh_shape"), [(1, (1,)), (2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2))])
def test_resume_at_any_world_size_and_mesh(saved_2x2, world, mesh_shape):
    path, params, optim_state, continued = saved_2x2
    results = get_pool(world).run(_resume_task, path, mesh_shape)
    for rank, ((loaded_params, loaded_optim), resumed) in enumerate(results):
        C.assert_same_tensors(loaded_params, params, what=f"params on rank {rank}")
        assert loaded_optim["param_groups"] == optim_state["param_groups"]
        for name, state in optim_state["state"].items():
            C.assert_same_tensors(loaded_optim["state"][name], state, what=f"optimizer {name}")
        # Same mesh: bit-identical to the uninterrupted run. Other meshes add gradients in
        # another order, so they agree to rounding (fp64).
        C.assert_same_tensors(resumed, continued, exact=mesh_shape == (2, 2), what=f"resumed at {mesh_shape}")


def test_layout_and_files_are_recorded(saved_2x2):
    path = saved_2x2[0]
    manifest = json.loads(Path(path, ckpt.MANIFEST).read_text())["body"]
    assert manifest["world_size"] == 4
    assert manifest["model"]["mesh_shape"] == [2, 2]
    assert manifest["model"]["entries"]["blocks.0.fc.weight"]["placements"] == ["R", "S(0)"]
    names = set(manifest["files"])
    assert {".metadata", "extra/rank-00000.safetensors", "extra/rank-00003.safetensors"} <= names
    assert any(n.endswith(".distcp") for n in names)
    assert not [p for p in os.listdir(Path(path).parent) if ".tmp-" in p or ".old-" in p]


def test_consolidate_offline_equals_the_full_state_dict(saved_2x2):
    path, params, _, _ = saved_2x2
    full = ckpt.consolidate(path)  # this process has no process group
    assert list(full) == list(C.build().state_dict())
    C.assert_same_tensors(full, params, what="consolidated")
    unsharded = C.build(seed=42)
    unsharded.load_state_dict(full)  # strict: the unsharded model's own keys


def test_fshard_consolidate_command_writes_a_loadable_safetensors_file(saved_2x2, tmp_path):
    from safetensors.torch import load_file

    path, params, _, _ = saved_2x2
    out = tmp_path / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "fshard", "consolidate", path, str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = load_file(str(out))
    unsharded = C.build(seed=42)
    unsharded.load_state_dict(loaded)
    C.assert_same_tensors(dict(unsharded.state_dict()), params, what="via the command line")


def test_fshard_consolidate_output_problems_are_one_line_errors(saved_2x2, tmp_path, capsys):
    from fshard.cli import main

    path = saved_2x2[0]
    assert main(["consolidate", path, str(tmp_path), "--force"]) == 2
    assert f"{str(tmp_path)!r} is a directory; give the path of the file" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["consolidate", path, str(blocker / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fshard consolidate: cannot write") and "Traceback" not in err


def _complex_save_task(path):
    model = nn.Linear(3, 2, bias=False).to(torch.complex128)
    model.register_parameter("c64", nn.Parameter(torch.zeros(2, dtype=torch.complex64)))
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    ckpt.save(path, model)


def test_fshard_consolidate_names_dtypes_safetensors_cannot_store(tmp_path, capsys):
    """complex128 (and complex32) have no safetensors code: a one-line error naming the dtype
    and key and saying what to do, not safetensors' KeyError traceback; complex64 is fine."""
    from fshard.cli import main

    get_pool(1).run(_complex_save_task, str(tmp_path / "ckpt"))
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "safetensors cannot store complex128 ('weight')" in err, err
    assert "write a torch.save file instead: fshard consolidate CKPT model.pt" in err, err
    assert "Traceback" not in err and "complex64" not in err and not out.exists()
    # A .pt (.pth, .bin) output is a torch.save file, which stores any dtype.
    pt = tmp_path / "model.pt"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(pt)]) == 0
    loaded = torch.load(pt, weights_only=True)
    assert loaded["weight"].dtype == torch.complex128 and loaded["c64"].dtype == torch.complex64


# ----------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("mode", ["during_write", "during_swap"])
def test_a_save_killed_part_way_leaves_a_loadable_checkpoint(tmp_path, mode):
    path = str(tmp_path / "ckpt")
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": python_path}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.dist._ckpt_crash_child", mode, path, str(tmp_path / "store")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])
    leftovers = sorted(os.listdir(tmp_path))
    v1 = dict(C.build().state_dict())
    v2 = {k: v + 1 if k != "counter" else v for k, v in v1.items()}
    if mode == "during_write":
        # The new save died inside DCP: the old checkpoint is untouched, the new one incomplete.
        assert any(".tmp-" in name for name in leftovers), leftovers
        incomplete = next(str(tmp_path / n) for n in leftovers if ".tmp-" in n)
        assert not ckpt.is_complete(incomplete)
        with pytest.raises(ckpt.CheckpointError, match=re.escape(incomplete) + r" is not a complete fshard checkpoint: fshard.json is missing"):
            ckpt.consolidate(incomplete)
        C.assert_same_tensors(ckpt.consolidate(path), v1, what="previous checkpoint")
    else:
        # Killed between moving the old one aside and renaming the new one: both are complete;
        # loading `path` finds the newer.
        assert "ckpt" not in leftovers, leftovers
        C.assert_same_tensors(ckpt.consolidate(path), v2, what="recovered checkpoint")
    assert ckpt.latest(str(tmp_path)) == path
    extra, _ = get_pool(1).run(_load_only_task, path, C.SPEC, True, True, False)[0]
    assert extra == {"version": 1 if mode == "during_write" else 2}
    # The next successful save cleans up what the crash left.
    get_pool(1).run(_save_only_task, path)
    after = os.listdir(tmp_path)
    assert "ckpt" in after and not [n for n in after if ".tmp-" in n or ".old-" in n], after


def test_latest_skips_incomplete_checkpoints(tmp_path):
    get_pool(2).run(_save_only_task, str(tmp_path / "step-1"), C.SPEC, {"step": 1})
    get_pool(2).run(_save_only_task, str(tmp_path / "step-2"), C.SPEC, {"step": 2})
    assert ckpt.latest(tmp_path) == str(tmp_path / "step-2")
    os.remove(tmp_path / "step-2" / ckpt.MANIFEST)  # as if that save never finished
    assert ckpt.latest(tmp_path) == str(tmp_path / "step-1")
    (tmp_path / "step-3.tmp-abc").mkdir()
    assert ckpt.latest(tmp_path) == str(tmp_path / "step-1")
    assert ckpt.latest(tmp_path / "nothing-here") is None


def test_a_save_removes_only_its_own_leftovers(tmp_path):
    """A save deletes what interrupted saves at its path left (``<path>.tmp-<12 hex>``), not a
    user's directory whose name merely starts the same way."""
    path = tmp_path / "ckpt"
    mine = [tmp_path / "ckpt.old-run1", tmp_path / "ckpt.tmp-notes", tmp_path / "ckpt.old-0123456789abX"]
    for directory in mine:
        directory.mkdir()
        (directory / "keep.txt").write_text("user data")
    (tmp_path / "ckpt.tmp-0123456789ab").mkdir()  # an interrupted save's
    get_pool(1).run(_save_only_task, str(path))
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *(d.name for d in mine)])
    assert all((d / "keep.txt").read_text() == "user data" for d in mine)


def _save_expecting_error(path):
    try:
        _save_only_task(path)
    except ckpt.CheckpointError as exc:
        return str(exc)
    return None


def test_a_save_replaces_only_a_checkpoint(tmp_path):
    """A path holding a user's files (a runs directory, a mistyped path) or a file is refused
    on every rank, and nothing in it is touched; an empty directory is fine."""
    runs = tmp_path / "runs"
    (runs / "step-100").mkdir(parents=True)
    (runs / "notes.txt").write_text("mine")
    (runs / "step-100" / "weights.bin").write_bytes(b"precious")
    a_file = tmp_path / "model.pt"
    a_file.write_bytes(b"torch.save output")
    link = tmp_path / "latest"
    link.symlink_to(runs)
    cases = ((runs, "is not an fshard checkpoint"), (a_file, "is not a directory"), (link, "is a symbolic link"))
    for path, why in cases:
        for message in get_pool(2).run(_save_expecting_error, str(path)):
            assert message is not None and why in message and str(path) in message, message
    assert (runs / "notes.txt").read_text() == "mine"
    assert (runs / "step-100" / "weights.bin").read_bytes() == b"precious"
    assert a_file.read_bytes() == b"torch.save output"
    (tmp_path / "empty").mkdir()
    get_pool(2).run(_save_only_task, str(tmp_path / "empty"))
    assert ckpt.is_complete(tmp_path / "empty")
    get_pool(2).run(_save_only_task, str(tmp_path / "empty"))  # and a checkpoint is replaced
    assert sorted(os.listdir(tmp_path)) == ["empty", "latest", "model.pt", "runs"]


def _save_per_rank_path_task(base):
    return _save_expecting_error(f"{base}/step-{dist.get_rank()}")  # a rank (or a time) in it


def test_ranks_passing_different_paths_is_an_error_that_writes_nothing(tmp_path):
    for message in get_pool(2).run(_save_per_rank_path_task, str(tmp_path)):
        assert message is not None and "every rank must pass the same path" in message, message
        assert f"rank 0 passed '{tmp_path}/step-0', rank 1 passed '{tmp_path}/step-1'" in message
    assert os.listdir(tmp_path) == []


def _failing_write_task(path):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data
    if dist.get_rank() == 1:

        def full_disk(self, *args, **kwargs):
            raise OSError("No space left on device")

        FileSystemWriter.write_data = full_disk
    try:
        return _save_expecting_error(path)
    finally:
        FileSystemWriter.write_data = original


def test_a_failed_save_removes_its_temporary_directory(tmp_path):
    """A full disk fails the save on every rank as a CheckpointError, keeps the previous
    checkpoint and removes the partial copy (which would keep the disk full)."""
    path = str(tmp_path / "ckpt")
    get_pool(2).run(_save_only_task, path)
    for message in get_pool(2).run(_failing_write_task, path):
        assert message is not None and "writing the shards to" in message, message
        assert "No space left on device" in message, message
    assert os.listdir(tmp_path) == ["ckpt"]
    assert ckpt.is_complete(path)


def _rank_buffers_task(path):
    rank = dist.get_rank()
    model = C.build_sharded((dist.get_world_size(),))
    for i in range(4):  # statistics each rank kept on its own data (BatchNorm without sync)
        model.register_buffer(f"stat{i}", torch.full((5,), float(rank)))
    ckpt.save(path, model)
    reloaded = C.build_sharded((dist.get_world_size(),))
    for i in range(4):
        reloaded.register_buffer(f"stat{i}", torch.full((5,), -1.0))
    ckpt.load(path, reloaded)
    return [getattr(reloaded, f"stat{i}").tolist() for i in range(4)]


def test_buffers_are_saved_from_rank_0(tmp_path):
    """As full_state_dict and DDP's buffer broadcast: one rank's buffers, not each buffer from
    whichever rank DCP chose to write it (it spreads duplicates to balance the writes)."""
    path = str(tmp_path / "ckpt")
    for buffers in get_pool(2).run(_rank_buffers_task, path):
        assert buffers == [[0.0] * 5] * 4
    consolidated = ckpt.consolidate(path)
    assert [consolidated[f"stat{i}"].tolist() for i in range(4)] == [[0.0] * 5] * 4


# ---------------------------------------------------------------------- corruption and keys


@pytest.fixture(scope="module")
def saved_2(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt2") / "ckpt"
    get_pool(2).run(_save_only_task, str(path))
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(path: Path, edit) -> None:
    outer = json.loads((path / ckpt.MANIFEST).read_text())
    body = outer["body"]
    edit(body)
    (path / ckpt.MANIFEST).write_bytes(manifest_bytes(body))


def _refresh_file_entry(path: Path, rel: str) -> None:
    data = (path / rel).read_bytes()

    def edit(body):
        body["files"][rel] = {"size": len(data), "crc32": zlib.crc32(data)}

    _rewrite_manifest(path, edit)


def test_truncated_file_is_an_error_naming_it(saved_2, tmp_path):
    path = _copy(saved_2, tmp_path / "c")
    victim = path / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:20_000])  # inside the model entries
    pattern = re.escape(str(victim)) + r" is truncated"
    with pytest.raises(ckpt.CheckpointError, match=pattern):
        ckpt.consolidate(path)
    with pytest.raises(ckpt.CheckpointError, match=pattern):
        ckpt.consolidate(path, verify=False)  # the reader checks sizes on its own too
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_only_task, str(path))
    assert sorted(info.value.errors) == [0, 1]
    for error in info.value.errors.values():
        assert isinstance(error, ckpt.CheckpointError) and re.search(pattern, str(error)), error


def test_corrupted_bytes_are_an_error_naming_the_file(saved_2, tmp_path):
    path = _copy(saved_2, tmp_path / "c")
    victim = path / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(victim)) + r" is corrupted: its CRC32"):
        ckpt.consolidate(path)


def test_corrupted_metadata_manifest_and_extra_are_errors_naming_them(saved_2, tmp_path):
    path = _copy(saved_2, tmp_path / "meta")
    (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:50])
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(path / ".metadata")) + r" is truncated or corrupted"):
        ckpt.consolidate(path, verify=False)

    path = _copy(saved_2, tmp_path / "manifest")
    text = (path / ckpt.MANIFEST).read_text()
    (path / ckpt.MANIFEST).write_text(text.replace('"world_size": 2', '"world_size": 3'))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(path / ckpt.MANIFEST)) + r" is corrupted \(checksum mismatch\)"):
        ckpt.consolidate(path)

    path = _copy(saved_2, tmp_path / "extra")
    victim = path / "extra" / "rank-00001.safetensors"
    victim.write_bytes(b"{not safetensors")
    _refresh_file_entry(path, "extra/rank-00001.safetensors")  # get past verification
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_only_task, str(path))
    assert re.search(re.escape(str(victim)) + " is corrupted", str(info.value.errors[1])), info.value.errors[1]


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {_Boom.marker}",))


def test_loading_never_unpickles_arbitrary_objects(saved_2, tmp_path):
    path = _copy(saved_2, tmp_path / "evil")
    _Boom.marker = str(tmp_path / "pwned")
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    _refresh_file_entry(path, ".metadata")
    with pytest.raises(ckpt.CheckpointError, match=r"refusing to load posix.system"):
        ckpt.consolidate(path)
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_only_task, str(path))
    assert all("refusing to load posix.system" in str(e) for e in info.value.errors.values())
    assert not os.path.exists(_Boom.marker)


def _plant_in_data_file(path: Path, fqn: str, payload: bytes) -> Path:
    """Make ``payload`` the stored value of ``fqn``: appended to the ``.distcp`` file that holds
    the value, DCP's index pointed at it, and the manifest's sizes and CRCs updated (as whoever
    tampers with a checkpoint would). Returns the data file."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, written by DCP
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    victim = path / info.relative_path
    offset = victim.stat().st_size
    with open(victim, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    for rel in (info.relative_path, ".metadata"):
        _refresh_file_entry(path, rel)
    return victim


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dumps"])
def test_a_pickled_object_inside_a_data_file_is_refused_naming_the_file(tmp_path, writer):
    """DCP stores values that are not tensors (a module's extra state: its string here) as
    pickles inside the ``.distcp`` files, and its own reader unpickles them freely."""
    path = tmp_path / "evil"
    get_pool(2).run(_extra_state_task, str(path), True)
    _Boom.marker = str(tmp_path / "pwned")
    buffer = io.BytesIO()
    if writer == "torch.save":
        torch.save(_Boom(), buffer)
    else:  # a bare pickle (torch.load's legacy format); protocol 2, which its unpickler reads
        buffer.write(pickle.dumps(_Boom(), protocol=2))
    victim = _plant_in_data_file(path, "model.0._extra_state.tag", buffer.getvalue())
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_extra_state_task, str(path), False)
    assert sorted(info.value.errors) == [0, 1]
    for error in info.value.errors.values():
        assert isinstance(error, ckpt.CheckpointError), error
        message = str(error)
        assert str(victim) in message and "'model.0._extra_state.tag'" in message, message
        assert "posix.system" in message, message
    assert not os.path.exists(_Boom.marker)
    # The payload is live: DCP's own reader runs it (so the check above can fail).
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
            dcp.load(
                {"model": {"0._extra_state": {"tag": ""}}},
                checkpoint_id=str(path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
    except (Exception, CheckpointException):  # a bare pickle runs, then fails torch's format check
        assert writer == "pickle.dumps"
    assert os.path.exists(_Boom.marker)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (TransformerSpec(**{**C.SPEC.__dict__, "layers": 3}), r"the checkpoint lacks key\(s\) the model has: \['blocks.2.ln1.weight'"),
        (TransformerSpec(**{**C.SPEC.__dict__, "layers": 1}), r"the checkpoint has key\(s\) the model lacks: \['blocks.1.ln1.weight'"),
        (TransformerSpec(**{**C.SPEC.__dict__, "vocab": 17}), r"key 'embed.weight': shape mismatch, the checkpoint has \[13, 8\] but the model has \[17, 8\]"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_key_and_shape_mismatches_name_the_key(saved_2, spec, pattern):
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_only_task, str(saved_2), spec, True, True, False)
    assert sorted(info.value.errors) == [0, 1]
    for error in info.value.errors.values():
        assert isinstance(error, ValueError) and re.search(pattern, str(error)), error


def test_non_strict_load_takes_the_common_keys(saved_2):
    spec = TransformerSpec(**{**C.SPEC.__dict__, "layers": 3})
    results = get_pool(2).run(_load_only_task, str(saved_2), spec, False, True, False)
    want = ckpt.consolidate(saved_2)
    for extra, params in results:
        assert extra == {"step": 1}
        C.assert_same_tensors({k: params[k] for k in want}, want, what="common keys")


def _load_per_rank_path_task(path):
    model = C.build_sharded((dist.get_world_size(),), seed=5)
    mine = path if dist.get_rank() == 0 else f"{path}-rank{dist.get_rank()}"
    try:
        ckpt.load(mine, model)
    except ValueError as exc:
        return str(exc)
    return None


def test_load_with_another_path_on_some_rank_is_an_error_on_every_rank(saved_2):
    """As ``save`` refuses per-rank paths: ``load`` read rank 0's checkpoint everywhere,
    whatever path the other ranks named."""
    for message in get_pool(2).run(_load_per_rank_path_task, str(saved_2)):
        assert message is not None and f"every rank must pass the same path: rank 0 passed {str(saved_2)!r}, rank 1 passed" in message


def test_missing_checkpoint_and_unsupported_extra_are_clear_errors(tmp_path):
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_load_only_task, str(tmp_path / "nope"))
    assert all(re.search(r"no checkpoint at .*nope", str(e)) for e in info.value.errors.values())
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_bad_extra_task, str(tmp_path / "bad"))
    for error in info.value.errors.values():
        assert isinstance(error, TypeError)
        assert re.search(r"extra\['where'\] is a builtins.object: fshard.checkpoint stores None, ", str(error)), error
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_numpy_lr_task, str(tmp_path / "numpy"))
    for error in info.value.errors.values():  # the key is named, and nothing blames "extra"
        assert re.search(
            r"optimizer param_groups\[0\]\['lr'\] is a numpy.float32: fshard.checkpoint stores None, .*"
            r"\(convert numpy scalars with float\(...\)",
            str(error),
        ), error


class _WithExtraState(torch.nn.Module):
    """State kept through ``get_extra_state`` (as fp8 scaling metadata is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.amax = torch.zeros(3)
        self.tag = "init"

    def get_extra_state(self) -> dict:
        return {"amax": self.amax.clone(), "tag": self.tag}

    def set_extra_state(self, state: dict) -> None:
        self.amax, self.tag = state["amax"].clone(), state["tag"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _extra_state_task(path, save):
    from fshard.testing import mesh_for

    torch.manual_seed(0)
    model = torch.nn.Sequential(_WithExtraState(), torch.nn.Linear(4, 2))
    mesh = mesh_for((dist.get_world_size(),))
    fshard.fully_shard(model[0], mesh=mesh)
    fshard.fully_shard(model, mesh=mesh)
    if save:
        model[0].amax, model[0].tag = torch.tensor([1.0, 2.0, 3.0]), "trained"
        ckpt.save(path, model)
    else:
        ckpt.load(path, model)
    return model[0].amax.tolist(), model[0].tag


def test_module_extra_state_round_trips(tmp_path):
    path = str(tmp_path / "extra-state")
    get_pool(2).run(_extra_state_task, path, True)
    assert get_pool(1).run(_extra_state_task, path, False) == [([1.0, 2.0, 3.0], "trained")]


class _NumpyExtraState(_WithExtraState):
    def get_extra_state(self) -> dict:
        return {"history": np.zeros(3), "tag": self.tag}


def _numpy_extra_state_task(path):
    from fshard.testing import mesh_for

    model = torch.nn.Sequential(_NumpyExtraState(), torch.nn.Linear(4, 2))
    fshard.fully_shard(model, mesh=mesh_for((dist.get_world_size(),)))
    ckpt.save(path, model)


def test_extra_state_that_load_would_refuse_is_refused_by_save(tmp_path):
    """``load`` reads values that are not tensors with ``torch.load(weights_only=True)``: a
    module extra state holding a numpy array was saved, and then no load could read it."""
    path = tmp_path / "numpy-extra-state"
    with pytest.raises(RanksFailed) as info:
        get_pool(2).run(_numpy_extra_state_task, str(path))
    assert sorted(info.value.errors) == [0, 1]
    for error in info.value.errors.values():
        assert isinstance(error, ckpt.CheckpointError)
        assert "'model.0._extra_state.history' is a ndarray, which load could not read back" in str(error)
        assert "Unsupported global: GLOBAL numpy" in str(error)
        assert "return tensors, numbers, strings, lists or dicts from get_extra_state" in str(error)
    assert not os.path.exists(path) and not any(tmp_path.iterdir())  # no partial directory


def _one_rank_unstorable_extra_task(path, kind):
    if dist.get_rank() == 1:
        value = {"sparse": torch.eye(3).to_sparse(), "meta": torch.empty(3, device="meta")}[kind]
    else:
        value = torch.zeros(3)
    model = C.build_sharded((dist.get_world_size(),))
    try:
        ckpt.save(path, model, extra={"stats": value})
    except TypeError as exc:
        message = str(exc)
    dist.barrier()  # the ranks go on together
    return message


@pytest.mark.parametrize(("kind", "says"), [("sparse", "is a torch.sparse_coo tensor; pass a dense one"),
                                            ("meta", "is on the meta device")])  # fmt: skip
def test_extra_one_rank_cannot_store_fails_on_every_rank(tmp_path, kind, says):
    """A value only one rank cannot store (it raised a RuntimeError there, not the TypeError
    the ranks agree on): every rank raises, none waits for the others until the timeout."""
    messages = get_pool(2).run(_one_rank_unstorable_extra_task, str(tmp_path / "x"), kind, timeout=30)
    assert messages[0] == messages[1]
    assert f"extra['stats'] {says}" in messages[0] and "(on rank(s) [1])" in messages[0]


# --------------------------------------------------------------- optimizer: class and strict


def _other_optimizer_task(path, cls_name):
    model = C.build_sharded((dist.get_world_size(),), seed=5)
    opt = getattr(torch.optim, cls_name)(model.parameters(), lr=0.01)
    before = C.full_params(model)
    with pytest.raises(ValueError) as info:
        ckpt.load(path, model, opt)
    C.assert_same_tensors(C.full_params(model), before, what="model after the refused load")
    assert not opt.state  # nothing loaded
    return str(info.value)


@pytest.mark.parametrize(("cls_name", "qualified"), [("Adamax", "torch.optim.adamax.Adamax"), ("RAdam", "torch.optim.radam.RAdam")])
def test_loading_into_another_optimizer_class_names_both_and_loads_nothing(saved_2, cls_name, qualified):
    """AdamW's state loaded into Adamax failed at its first step (KeyError 'exp_inf'), and into
    RAdam (the same state keys) trained on silently."""
    for message in get_pool(2).run(_other_optimizer_task, str(saved_2), cls_name):
        assert "saved from a torch.optim.adamw.AdamW" in message, message
        assert f"this optimizer is a {qualified}" in message, message
        assert "without the optimizer" in message, message


def test_a_checkpoint_without_the_optimizer_class_is_checked_by_its_state_keys(saved_2, tmp_path):
    """Checkpoints of older fshard versions record no class: AdamW's keys do not fit Adamax."""
    path = _copy(saved_2, tmp_path / "no-class")
    _rewrite_manifest(path, lambda body: body["optimizer"].pop("class"))
    for message in get_pool(2).run(_other_optimizer_task, str(path), "Adamax"):
        assert re.search(r"state\['.*'\] has keys \['exp_avg', 'exp_avg_sq', 'step'\], but torch\.optim\.adamax\.Adamax", message), message
        assert "makes ['exp_avg', 'exp_inf', 'step']" in message, message
    # The optimizer class that saved it still loads.
    results = get_pool(2).run(_load_only_task, str(path))
    assert all(extra == {"step": 1} for extra, _ in results)


def _non_strict_optim_task(path, layers):
    world = dist.get_world_size()
    reference = C.build_sharded((world,), seed=5)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1.0)
    ckpt.load(path, reference, reference_opt)
    want = fshard.optim_state_dict(reference, reference_opt, full=True)
    spec = TransformerSpec(**{**C.SPEC.__dict__, "layers": layers})
    model = C.build_sharded((world,), spec, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)  # hyperparameters come from the checkpoint
    ckpt.load(path, model, opt, strict=False)
    got = fshard.optim_state_dict(model, opt, full=True)
    C.train(model, opt, range(1, 2), spec)
    after = fshard.optim_state_dict(model, opt, full=True)
    return want, got, after, [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("layers", [1, 3], ids=["layer_removed", "layer_added"])
def test_non_strict_load_with_an_optimizer_takes_the_common_parameters(saved_2, layers):
    """strict=False covers the optimizer too: the state of parameters both sides hold loads,
    state of parameters the model lost is skipped, and new parameters start fresh."""
    for want, got, after, names in get_pool(2).run(_non_strict_optim_task, str(saved_2), layers):
        common = [n for n in names if n in want["state"]]
        assert sorted(got["state"]) == sorted(common)
        assert len(common) < len(want["state"]) if layers == 1 else len(common) < len(names)
        for name in common:
            C.assert_same_tensors(got["state"][name], want["state"][name], what=f"optimizer {name}")
        assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"] == 0.05
        for name in names:  # one more step: loaded counters go on, new ones start at 1
            assert after["state"][name]["step"].item() == (2 if name in common else 1), name


def test_saving_again_to_a_path_keeps_the_files_the_user_added(tmp_path):
    """One ``ckpt/last`` directory saved every N steps, with the model's ``config.json`` and a
    tokenizer beside fshard's files (the Hugging Face habit): a save replaces fshard's files and
    keeps the user's, also those a crash mid-swap left in the replaced checkpoint."""
    path = tmp_path / "last"
    get_pool(2).run(_save_only_task, str(path), C.SPEC, {"step": 1})
    (path / "config.json").write_text('{"n_layer": 2}')
    (path / "tokenizer").mkdir()
    (path / "tokenizer" / "vocab.txt").write_text("a b c")
    (path / "extra" / "notes.txt").write_text("inside fshard's directory")
    fshard_files = sorted(os.listdir(path))
    get_pool(2).run(_save_only_task, str(path), C.SPEC, {"step": 2})
    assert (path / "config.json").read_text() == '{"n_layer": 2}'
    assert (path / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert (path / "extra" / "notes.txt").read_text() == "inside fshard's directory"
    assert sorted(os.listdir(path)) == fshard_files
    assert sorted(os.listdir(tmp_path)) == ["last"]
    extra, _ = get_pool(2).run(_load_only_task, str(path))[0]
    assert extra == {"step": 2}
    # A crash after the swap moved the previous checkpoint aside, before it was cleared: the
    # user's file it still holds is kept by the next save.
    aside = tmp_path / "last.old-0123456789ab"
    shutil.copytree(path, aside)
    (aside / "README.md").write_text("model card")
    get_pool(1).run(_save_only_task, str(path), C.SPEC, {"step": 3})
    assert (path / "README.md").read_text() == "model card"
    assert (path / "config.json").read_text() == '{"n_layer": 2}'
    assert sorted(os.listdir(tmp_path)) == ["last"]
    # The stale rank-1 files of the 2-rank checkpoint are not carried into the 1-rank one.
    assert not (path / "extra" / "rank-00001.safetensors").exists()


def _compiled_keys_task(path: str, save_inner: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    compiled = torch.compile(model, backend="eager")  # nothing compiles until it is called
    ckpt.save(path, compiled._orig_mod if save_inner else compiled)
    keys = sorted(ckpt.consolidate(path)) if dist.get_rank() == 0 else None
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    fshard.fully_shard(plain, mesh=mesh_for((2,)))
    try:
        ckpt.load(path, plain)
    except ValueError as exc:
        return keys, str(exc)
    return keys, torch.equal(plain[0].weight.full_tensor(), model[0].weight.full_tensor())


def test_a_compiled_model_saves_under_its_prefixed_keys_and_its_inner_module_under_plain_ones(tmp_path):
    """The guide: torch.compile(model)'s checkpoint has _orig_mod. keys (its state_dict()'s) and
    does not load into the plain model; the module it wraps (the one sharded) saves plainly."""
    prefixed = get_pool(2).run(_compiled_keys_task, str(tmp_path / "compiled"), False)
    assert prefixed[0][0] == ["_orig_mod.0.bias", "_orig_mod.0.weight", "_orig_mod.1.bias", "_orig_mod.1.weight"]
    assert all("_orig_mod.0.weight" in message for _, message in prefixed)
    inner = get_pool(2).run(_compiled_keys_task, str(tmp_path / "inner"), True)
    assert inner[0][0] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all(loaded is True for _, loaded in inner)


class _WithScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))  # 0-d: held whole by every rank

    def forward(self, x):
        return self.lin(x) * self.scale


def _zero_dim_step_task(path):
    model = _WithScale()
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ckpt.save(path, model, opt)
    fresh = _WithScale()
    fshard.fully_shard(fresh, mesh=mesh_for((2,)))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    # The template's step: on the CPU, plain, as torch's Adam keeps it (not on the param's
    # device because the 0-d param's step is shaped like the param, hence saved as its shard).
    template = optim_template(fresh, fresh_opt, read_manifest(path)["optimizer"], "load", strict=True)
    step = template["scale"]["step"]
    ckpt.load(path, fresh, fresh_opt)
    loaded = fresh_opt.state[fresh.scale]
    return (
        type(step) is torch.Tensor and step.device.type == "cpu",
        loaded["step"].device.type == "cpu" and float(loaded["step"]) == 1.0,
        torch.equal(loaded["exp_avg"], opt.state[model.scale]["exp_avg"]),
    )


def test_the_step_of_a_zero_dim_parameter_loads_onto_the_cpu(tmp_path):
    for result in get_pool(2).run(_zero_dim_step_task, str(tmp_path / "ckpt")):
        assert result == (True, True, True)
