"""``fshard launch`` end to end: real launcher processes, real torchrun agents, gloo on 127.0.0.1.

Each test writes a small training script into a temporary directory, runs ``fshard launch`` as a
subprocess (with a timeout, so nothing can hang the suite) and reads what every rank wrote.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.accelerate_samples import sample

pytestmark = pytest.mark.slow

TIMEOUT = 240

# Every rank: apply the config that `fshard launch --config_file` passed through the
# environment, train one step, and report.
TRAIN = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import fshard

    class BertLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(BertLayer() for _ in range(2))
            self.head = nn.Linear(6, 1)
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fshard.from_config(Model())  # no config argument: $FSHARD_CONFIG_FILE
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 6)).pow(2).mean()
    loss.backward()
    opt.step()
    total = torch.ones(1)
    dist.all_reduce(total)
    units = [u.fqn for u in fshard.units(model)]
    out = {
        "rank": dist.get_rank(), "world": int(total.item()), "args": sys.argv[1:],
        "config": os.environ.get("FSHARD_CONFIG_FILE"), "units": units, "loss": loss.item(),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "strategy": fshard.config_of(model).sharding_strategy.name,
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    print("trained on rank", dist.get_rank(), flush=True)
    dist.destroy_process_group()
    """
)

# Every rank joins the group, then rank 1 fails with status 3.
FAIL = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()  # rank 0 waits for the peer that is gone, until torchrun stops it
    """
)


def _fshard() -> list[str]:
    script = Path(sys.executable).with_name("fshard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fshard"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("FSHARD_CONFIG_FILE", None)
    # The launcher runs the workers with this interpreter; make the checkout importable even
    # without an editable install.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _results(directory: Path, world: int) -> list[dict]:
    files = sorted(directory.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(world)]
    return [json.loads(f.read_text()) for f in files]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_two_ranks_from_a_config_file(tmp_path: Path) -> None:
    config = _write(tmp_path, "accelerate.yaml", yaml.safe_dump(sample("notes", mixed_precision="no")))
    script = _write(tmp_path, "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    # num_processes: 2 in the file; the script's own arguments follow it unchanged. torchrun's
    # own --log-dir and --tee (whose value 3 is not SCRIPT) pass through to its agent.
    result = subprocess.run(
        [*_fshard(), "launch", "--config_file", str(config), f"--log-dir={logs}", "--tee", "3",
         str(script), str(out), "--flag", "x y"],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "fshard launch: FSHARD_CONFIG_FILE=" in result.stderr
    # <log-dir>/<run id>/attempt_0/<local rank>/stdout.log, and teed to the console as well.
    for rank in (0, 1):
        (stdout_log,) = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        assert f"trained on rank {rank}" in stdout_log.read_text()
        assert f"trained on rank {rank}" in result.stdout
    results = _results(out, 2)
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["world"] == 2
        assert r["args"] == [str(out), "--flag", "x y"]
        assert r["config"] == str(config.resolve())
        assert r["units"] == ["", "layers.0", "layers.1"]
        assert r["strategy"] == "FULL_SHARD"


def test_two_node_run_on_localhost(tmp_path: Path) -> None:
    # Two launchers, one process each, meeting through a c10d rendezvous on 127.0.0.1.
    config = _write(tmp_path, "fsdp.yaml", "fsdp_sharding_strategy: HYBRID_SHARD\nfsdp_transformer_layer_cls_to_wrap: BertLayer\n")
    script = _write(tmp_path, "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    launchers = [
        subprocess.Popen(
            [*_fshard(), "launch", "--config_file", str(config), "--nnodes", "2",
             "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--rdzv-backend", "c10d", str(script), str(out)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for _ in range(2)  # the same command on both "machines": c10d numbers them as they join
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT)[0] for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    for p, output in zip(launchers, outputs, strict=True):
        assert p.returncode == 0, output[-4000:]
        assert f"fshard launch: waiting for 2 machines (1 process(es) each, this one included) to join the c10d rendezvous 127.0.0.1:{port}" in output
    results = _results(out, 2)
    assert {r["world"] for r in results} == {2}
    # One process per node: HYBRID_SHARD replicates across the two "nodes".
    assert {r["local_world_size"] for r in results} == {"1"}
    assert {r["strategy"] for r in results} == {"HYBRID_SHARD"}


def test_failing_script_exit_status_propagates(tmp_path: Path) -> None:
    script = _write(tmp_path, "fail.py", FAIL)
    result = subprocess.run(
        [*_fshard(), "launch", "--nproc", "2", str(script)],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr[-4000:]
    assert "failed on rank 1 with exit code 3" in result.stderr


def test_a_stale_config_file_variable_does_not_reach_the_script(tmp_path: Path) -> None:
    # Left over from an earlier launch (or exported): without --config_file, from_config(model)
    # must not silently apply that file.
    script = _write(tmp_path, "show.py", "import os, sys\nprint('CFG', os.environ.get('FSHARD_CONFIG_FILE'))\n")
    env = {**_env(), "FSHARD_CONFIG_FILE": str(tmp_path / "old.yaml")}
    result = subprocess.run(
        [*_fshard(), "launch", "--nproc", "1", str(script)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CFG None" in result.stdout
    assert "fshard launch: env -u FSHARD_CONFIG_FILE python -m torch.distributed.run" in result.stderr


# Every rank writes its pid, then waits to be stopped.
WAIT = textwrap.dedent(
    """
    import os, sys, time
    with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_workers_and_exits_143_without_a_traceback(tmp_path: Path) -> None:
    # A job scheduler's SIGTERM: the workers are stopped, then fshard launch exits as a
    # process ended by SIGTERM reports itself (128 + 15), with no SignalException traceback.
    script = _write(tmp_path, "wait.py", WAIT)
    launcher = subprocess.Popen(
        [*_fshard(), "launch", "--nproc", "2", str(script), str(tmp_path)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("pid*"))) < 2 or any(not f.read_text() for f in tmp_path.glob("pid*")):
            assert launcher.poll() is None, launcher.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in sorted(tmp_path.glob("pid*"))]
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stderr[-4000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-4000:]
    assert not [pid for pid in pids if _alive(pid)], "workers outlived the launcher"


def test_ctrl_c_stops_the_workers_in_one_line_and_exits_130(tmp_path: Path) -> None:
    # Ctrl-C in a terminal: SIGINT to the launcher's whole process group. One line says so (no
    # KeyboardInterrupt traceback from each rank, no per-worker shutdown log), then exit 130.
    script = _write(tmp_path, "wait.py", WAIT)
    launcher = subprocess.Popen(
        [*_fshard(), "launch", "--nproc", "2", str(script), str(tmp_path)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("pid*"))) < 2 or any(not f.read_text() for f in tmp_path.glob("pid*")):
            assert launcher.poll() is None, launcher.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in sorted(tmp_path.glob("pid*"))]
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, stderr[-4000:]
    after = stderr[stderr.index("OMP_NUM_THREADS") :].splitlines()[2:]  # past torchrun's banner
    assert after == ["fshard launch: interrupted (Ctrl-C); the workers on this machine were stopped"], stderr[-4000:]
    assert not [pid for pid in pids if _alive(pid)], "workers outlived the launcher"


def test_a_machine_that_never_comes_is_named_then_given_up_on(tmp_path: Path) -> None:
    # --nnodes 2 with only this machine: say whom it waits for and for how long, then give up
    # in one line (no RendezvousTimeoutError traceback).
    script = _write(tmp_path, "wait.py", WAIT)
    port = _free_port()
    start = time.monotonic()
    result = subprocess.run(
        [*_fshard(), "launch", "--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--rdzv-conf", "join_timeout=3", str(script), str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-4000:]
    assert time.monotonic() - start < 60
    assert (f"waiting for 2 machines (1 process(es) each, this one included) to join the c10d rendezvous "
            f"127.0.0.1:{port} (id 'fshard'; the same command on each machine, in any order); gives up after 3 s "
            "if they do not come (join_timeout in --rdzv-conf sets it)") in result.stderr  # fmt: skip
    assert result.stderr.rstrip().endswith("(--rdzv-conf join_timeout=SECONDS)"), result.stderr[-4000:]
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("pid*"))
