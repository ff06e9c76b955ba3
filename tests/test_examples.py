"""The examples run as users run them: under torchrun, on gloo ranks."""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import pty
import socket
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(ROOT / script), *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise AssertionError(f"{script} timed out after {timeout}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}") from None


@pytest.mark.parametrize(("nproc", "mesh", "ratio"), [(4, "4", "0.250"), (4, "2x2", "0.500")])
def test_train_gpt_demo(nproc, mesh, ratio):
    result = torchrun(nproc, "examples/train_gpt.py", "--mesh", mesh, "--steps", "3", "--layers", "2", "--dim", "32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train:" not in result.stderr  # stderr is a pipe here: no progress bar on any rank
    lines = result.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step")]
    assert len(steps) == 3
    for line in steps:  # fshard's loss next to DDP's, equal to the printed precision
        parts = line.split()
        assert parts[3] == parts[6], line
    rows = [line.split() for line in lines if line.strip()[:1].isdigit() and len(line.split()) == 7]
    assert len(rows) == nproc and all(row[-1] == ratio for row in rows), result.stdout


@functools.cache
def load_train_gpt() -> ModuleType:
    """examples/train_gpt.py as a module (registered first: its dataclass looks itself up)."""
    name = "train_gpt_example"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--steps", "0", "argument --steps: must be at least 1, got 0"),
        ("--steps", "-3", "argument --steps: must be at least 1, got -3"),
        ("--checkpoint-every", "-1", "argument --checkpoint-every: must be at least 0, got -1"),
    ],
)
def test_train_gpt_rejects_counts_out_of_range_before_starting(flag, value, message, capsys):
    # --steps 0 used to train nothing and then fail with an UnboundLocalError in the report.
    train_gpt = load_train_gpt()
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.main([flag, value])  # fails in argparse, before any process group exists
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every writer of the terminal has closed it
            return
        if not chunk:
            return
        into.append(chunk)


def run_ranks_on_terminals(world: int, *args: str, timeout: float = 120) -> list[tuple[int, str, str]]:
    """Start ``world`` ranks of train_gpt.py as torchrun would (env:// rendezvous), each with its
    stderr on a pseudo-terminal of its own; (exit status, stdout, terminal text) per rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, terminals, readers, received = [], [], [], []
    for rank in range(world):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        env = {
            **os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        }  # fmt: skip
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--device", "cpu", *args],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
        ))  # fmt: skip
        os.close(slave)
        chunks: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(master, chunks), daemon=True)
        reader.start()
        terminals.append(master)
        readers.append(reader)
        received.append(chunks)
    results = []
    try:
        for proc, reader, chunks in zip(procs, readers, received, strict=True):
            out, _ = proc.communicate(timeout=timeout)
            reader.join(timeout=10)
            results.append((proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for fd in terminals:
            os.close(fd)
    return results


def test_train_gpt_shows_one_progress_bar_on_rank_0_only():
    pytest.importorskip("tqdm", reason="the progress bar needs tqdm: pip install -e '.[examples]'")
    results = run_ranks_on_terminals(2, "--steps", "3", "--layers", "1", "--dim", "16", "--no-ddp")
    for rank, (code, _, terminal) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}\n{terminal[-3000:]}"
    (_, out0, terminal0), (_, out1, terminal1) = results
    # A bar redraws itself with "\r" on one line and ends it with a newline when it closes, so one
    # bar is one line; the step lines go to stdout (tqdm.write), not through the bar.
    bar_lines = [line for line in terminal0.split("\n") if "train:" in line]
    assert len(bar_lines) == 1, repr(terminal0)
    final = bar_lines[0].rstrip("\r").rsplit("\r", 1)[-1]
    assert final.startswith("train: 100%") and "| 3/3 [" in final, repr(final)
    assert [line.split()[1] for line in out0.splitlines() if line.startswith("step")] == ["0", "1", "2"]
    assert "train:" not in terminal1 and "it/s" not in terminal1, repr(terminal1)  # rank 1: no bar
    assert not any(line.startswith("step") for line in out1.splitlines())
