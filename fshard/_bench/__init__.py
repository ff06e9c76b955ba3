"""``fshard bench``: step time, memory and traffic of fshard next to DDP and torch's FSDP2.

Usage (``python -m fshard bench`` is the same)::

    fshard bench --nproc 2                                   # the built-in GPT, all three
    fshard bench --nproc 4 --mesh 2x2 --layers 8 --dim 384 --json out.json --plot out.png
    fshard bench --model mypkg.models:build --batch-fn mypkg.models:make_batch --by-class Block

The command starts its own ranks through ``torch.distributed.run`` on this machine (rendezvous
at 127.0.0.1, a free port; gloo on CPU, NCCL with ``--device cuda``), runs the workload under
each ``--impl`` with the same units (one per block + root, or ``--by-class`` /
``--min-params`` / ``--config_file``), interleaved step by step, and prints three tables: step
time (median, p25-p75 of the slowest rank, the forward/backward/optimizer split, the ratio to
DDP), memory per rank (persistent params/grads/AdamW state from the tensors' storages next to
the ZeRO theory, and the peak of live tensor bytes in one step, from a dispatch-mode tracker
that works on CPU; the CUDA allocator's peak on GPUs), and collectives per step (calls and
payload bytes per type, counted at the c10d dispatcher ops, next to the theory). See
``_worker`` for how a step is measured, ``_measure`` for the trackers, ``_theory`` for
[Note: ZeRO theory per rank and step] and ``_workload`` for [Note: the batch contract] of
``--model`` / ``--batch-fn``.

JSON schema (``--json FILE``; ``"schema": "fshard.bench/1"``). Bytes are ints, times seconds::

    {
      "schema": "fshard.bench/1",
      "config": {every BenchSpec field (impls, model, batch_fn, layers, dim, heads, seq, vocab,
                 batch, by_class, min_params, config_file, reshard_after_forward, nproc, mesh,
                 device, mp, steps, warmup, lr, seed), "world", "backend", "torch", "fshard"},
      "model": {"name", "class", "params", "param_bytes", "param_element_bytes",
                "units": [fqn, ..., ""],            # sharding order, the root ("") last
                "unit_shapes": {fqn: [[dim, ...], ...]},   # the parameters each unit owns
                "reshard_after_forward", "param_dtype", "reduce_dtype"},
      "results": {impl: {                          # impl in fshard, ddp, fsdp2
          "step_s": {"median", "p25", "p75", "all": [per measured step]},
          "phase_s": {"forward", "backward", "optimizer"},        # medians
          "ratio_to_ddp": float or null,
          "persistent_bytes": {"per_rank": [{"params", "grads", "optim"}], "max_rank": {...}},
          "peak_live_bytes": {"per_rank": [int]},
          "cuda_peak_allocated_bytes": null or {"per_rank": [int]},
          "collectives": {"per_rank": [{kind: {"calls", "bytes"}}]},  # one traced step
          "theory": {"persistent": {"params", "grads", "optim", "padding"},
                     "collectives": {kind: bytes}, "collective_padding_bytes": int},
          "loss": {"final_mean", "max_abs_diff_vs_ddp": float or null}}}
    }

``kind`` is ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast`` or another c10d
op's name; ``bytes`` is the payload (all-gather output, reduce-scatter input, else the tensors).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from fshard._bench._spec import BenchSpec, BenchUsageError, spec_from_args

__all__ = ["BenchSpec", "run_command", "torchrun_command"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(spec: BenchSpec, spec_path: str, out_path: str, port: int) -> list[str]:
    """The command that starts the ranks: one machine, rendezvous on 127.0.0.1.

    Example:
        >>> from fshard._bench import BenchSpec, torchrun_command
        >>> " ".join(torchrun_command(BenchSpec(nproc=2), "s.json", "o.json", 29500)[1:])
        '-m torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts 0 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id fshard-bench --local-addr 127.0.0.1 -m fshard._bench._worker s.json o.json'
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(spec.nproc), "--max-restarts", "0", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fshard-bench",
        "--local-addr", "127.0.0.1", "-m", "fshard._bench._worker", spec_path, out_path,
    ]  # fmt: skip


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # The ranks import fshard from where this process did, and the user's --model module from
    # the current directory.
    here = str(Path(__file__).resolve().parents[2])
    paths = [os.getcwd(), here, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback, like the rendezvous
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _check_workload(spec: BenchSpec) -> None:
    """Import --model / --batch-fn and pick the units here first, so that a typo or a policy
    that matches nothing is one line, not a traceback per rank. The model is built on the meta
    device (no memory); a factory that cannot build there is checked by the ranks instead."""
    import torch

    from fshard._bench._workload import load_workload, wrap_plan

    if spec.device == "cuda" and torch.cuda.device_count() < spec.nproc:
        raise BenchUsageError(
            f"--device cuda needs a GPU per rank: --nproc {spec.nproc}, but "
            f"{torch.cuda.device_count()} GPU(s) visible; use fewer ranks or --device cpu"
        )
    sys.path.insert(0, os.getcwd())
    try:
        workload = load_workload(spec)
        try:
            with torch.device("meta"):
                model = workload.make_model()
        except Exception:  # the factory may need real tensors (loading weights): the ranks see
            return
        try:
            wrap_plan(spec, model)
        except (ValueError, TypeError) as exc:
            where = f"--config_file {spec.config_file}: " if spec.config_file else ""
            raise BenchUsageError(f"{where}{exc}") from None
    finally:
        sys.path.pop(0)


def run_command(args: argparse.Namespace) -> int:
    """``fshard bench`` with parsed flags; returns the exit status."""
    from fshard._bench._report import format_table, summarize, write_plot

    try:
        spec = spec_from_args(args)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise BenchUsageError("--plot needs matplotlib: pip install 'fshard[plot]'")
        _check_workload(spec)
    except BenchUsageError as exc:
        print(f"fshard bench: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fshard-bench-") as tmp:
        spec_path, out_path = str(Path(tmp, "spec.json")), str(Path(tmp, "raw.json"))
        Path(spec_path).write_text(spec.to_json())
        cmd = torchrun_command(spec, spec_path, out_path, _free_port())
        status = subprocess.run(cmd, env=_environment(), check=False).returncode
        if status != 0 or not Path(out_path).exists():
            print(
                f"fshard bench: the ranks failed (exit status {status}); their output is above",
                file=sys.stderr,
            )
            return status or 1
        raw = json.loads(Path(out_path).read_text())
    doc = summarize(raw, spec)
    print(format_table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0
