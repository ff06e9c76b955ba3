"""The ``fshard`` command line: ``fshard launch``, ``fshard consolidate`` and ``fshard bench``
(``fshard._bench``).

``fshard launch`` is a thin front end over ``torch.distributed.run`` (torchrun) for people who
arrive with an accelerate config file: it reads the process layout from the file
(``num_processes``, ``num_machines``, ``machine_rank``, ``main_process_ip``/``main_process_port``,
``rdzv_backend``), lets flags override it, runs torchrun's agent in this process, hands the
config file to the script through ``$FSHARD_CONFIG_FILE`` (so ``fshard.from_config(model)``
finds it) and exits with the script's own exit status (128 + the signal number when a signal
stopped the launch, once the workers are stopped).

The command that will run is built by a pure function (``plan_launch``), tested without
starting anything; ``--dry-run`` prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


from fshard._launch import (
    DEFAULT_RDZV,
    LAUNCH_DESCRIPTION,
    LAUNCH_EPILOG,
    MULTI_NODE_PORT,
    RDZV_BACKENDS,
    error,
    parse_launch,
    run_launch,
)

_DESCRIPTION = """\
fshard: functional, composable Fully Sharded Data Parallel (ZeRO-3) for PyTorch.
"""


_EPILOG = """\
examples:
  fshard launch --nproc 2 train.py --lr 1e-3
  fshard launch --config_file examples/accelerate_config.yaml examples/hf_bert.py
  fshard consolidate checkpoints/step_100 model.safetensors
  fshard bench --nproc 2 --json bench.json
  fshard estimate path/to/config.json --nproc 64 --mesh 8x8 --mp bf16

Run `fshard COMMAND --help` for the options of each command.
"""


_CONSOLIDATE_DESCRIPTION = """\
Read the checkpoint CKPT (written by fshard.checkpoint.save, sharded or FULL_STATE_DICT, at
any world size or mesh shape) in this one process, without a process group, and write the
full state dict to OUT (same keys as the unsharded model's state_dict()): a .safetensors
file, written one tensor at a time (peak memory near the largest tensor, not the model), or,
if OUT ends in .pt, .pth or .bin, a torch.save file (for torch.load; it holds the whole model
in memory). --optimizer adds the optimizer state, under optim.state.<param>.<name>.
"""


_CONSOLIDATE_EPILOG = """\
example:
  fshard consolidate checkpoints/step_100 model.safetensors
  python -c "from safetensors.torch import load_file; print(list(load_file('model.safetensors')))"
  fshard consolidate checkpoints/step_100 model.pt
  fshard consolidate --optimizer checkpoints/step_100 train_state.safetensors
"""



_COMMANDS = ("launch", "consolidate", "bench", "estimate")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def build_parser() -> argparse.ArgumentParser:
    """The ``fshard`` argument parser (sub-commands ``launch`` and ``consolidate``).

    Example:
        >>> from fshard.cli import build_parser
        >>> build_parser().parse_args(["launch", "--nproc", "2", "train.py", "--lr", "1"]).script_args
        ['--lr', '1']
    """
    from fshard import __version__

    parser = argparse.ArgumentParser(
        prog="fshard", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"fshard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    launch = commands.add_parser(
        "launch",
        help="start a training script on N processes (torchrun), optionally with an "
        "accelerate config file that fshard.from_config(model) applies",
        description=LAUNCH_DESCRIPTION,
        epilog=LAUNCH_EPILOG,
        formatter_class=_Formatter,
    )
    launch.add_argument(
        "--config_file", "--config-file", metavar="FILE",
        help="accelerate-style config (YAML): process layout for the launcher, FSDP options "
        "for fshard.from_config(model)",
    )
    launch.add_argument(
        "--nproc", "--nproc-per-node", "--nproc_per_node", type=int, metavar="N",
        help="processes per machine (default: the file's num_processes / num_machines, else 1)",
    )
    launch.add_argument(
        "--nnodes", "--num_machines", type=int, metavar="N",
        help="number of machines (default: the file's num_machines, else 1)",
    )
    launch.add_argument(
        "--node-rank", "--node_rank", "--machine_rank", type=int, metavar="R",
        help="this machine's rank, 0..nnodes-1 (static rendezvous; default: machine_rank, else 0)",
    )
    launch.add_argument(
        "--master-addr", "--master_addr", "--main_process_ip", metavar="HOST",
        help="address of node 0 / the rendezvous (default: 127.0.0.1 on one machine; on "
        "several, main_process_ip, which is then required)",
    )
    launch.add_argument(
        "--master-port", "--master_port", "--main_process_port", type=int, metavar="PORT",
        help=f"port of the rendezvous (default: main_process_port, else a free port on one "
        f"machine or {MULTI_NODE_PORT} on several)",
    )
    launch.add_argument(
        "--rdzv-backend", "--rdzv_backend", choices=RDZV_BACKENDS, metavar="BACKEND",
        help=f"rendezvous backend: {', '.join(RDZV_BACKENDS)} (default: the file's "
        f"rdzv_backend, else {DEFAULT_RDZV})",
    )
    launch.add_argument(
        "--rdzv-id", "--rdzv_id", metavar="ID", default="fshard",
        help="job id shared by all machines (c10d/etcd rendezvous; default: fshard)",
    )
    launch.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
        help="restarts of the whole worker group after a failure (default: 0)",
    )
    launch.add_argument(
        "-m", "--module", action="store_true",
        help="SCRIPT is a module name, run like `python -m SCRIPT`",
    )
    launch.add_argument(
        "--dry-run", "--dry_run", action="store_true",
        help="print the torch.distributed.run command and environment, and exit",
    )
    launch.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    script_args = launch.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )
    # argparse marks a REMAINDER positional required, so a bare `fshard launch` would say
    # "required: SCRIPT, ARGS"; the script's arguments are optional.
    script_args.required = False
    # torchrun's own options before SCRIPT: main() takes them out of the command line before
    # this parser sees it (see _split_launch_words).
    launch.set_defaults(torchrun_options=())

    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded fshard checkpoint as one .safetensors file, offline",
        description=_CONSOLIDATE_DESCRIPTION,
        epilog=_CONSOLIDATE_EPILOG,
        formatter_class=_Formatter,
    )
    consolidate.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (fshard.checkpoint.save)")
    consolidate.add_argument(
        "output", metavar="OUT", help="the file to write: .safetensors, or .pt / .pth / .bin (torch.save)"
    )
    consolidate.add_argument(
        "--force", action="store_true", help="overwrite OUT if it exists"
    )
    consolidate.add_argument(
        "--optimizer",
        action="store_true",
        help="include the optimizer state (keys optim.state.<param>.<name>; the param groups in "
        "the file's metadata under optim.param_groups, as JSON)",
    )
    from fshard._bench._spec import add_bench_parser  # bench's flags live with bench

    add_bench_parser(commands, _Formatter)
    _add_estimate_parser(commands)
    return parser






def _newest_inside_hint(path: str) -> str:
    """For a directory that holds checkpoints rather than being one (a run's --checkpoint-dir,
    with step-000003/, step-000006/ inside): a hint naming the newest complete one, else ''."""
    from fshard.checkpoint import MANIFEST, latest

    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST)):
        return ""
    newest = latest(path)
    if newest is None:
        return ""
    return f"; did you mean {newest} (the newest complete checkpoint there)?"


def _chmod_like_a_new_file(path: Path) -> None:
    """Give ``path`` the mode of a file made by ``open(path, "w")`` (0o666 less the umask).

    safetensors creates its file with mode 0600, so a consolidated model would be unreadable by
    the group and others that can read everything else the user writes.
    """
    umask = os.umask(0)  # reading the umask means setting it; restored at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _run_consolidate(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.is_dir():
        error(f"consolidate: {str(output)!r} is a directory; give the path of the file to write")
        return 2
    if output.exists() and not args.force:
        error(f"consolidate: {str(output)!r} exists; pass --force to overwrite it")
        return 2
    from safetensors import SafetensorError

    from fshard.checkpoint import CheckpointError, consolidate_to

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error(f"consolidate: cannot write {str(output)!r}: {type(exc).__name__}: {exc}")
        return 2
    try:
        # A checkpoint dir briefly missing after a crash mid-save is recovered by consolidate.
        # One tensor at a time: [Note: streamed consolidate].
        done = consolidate_to(args.checkpoint, output, optimizer=args.optimizer)
    except CheckpointError as exc:
        error(f"consolidate: {exc}{_newest_inside_hint(args.checkpoint)}")
        return 2
    except TypeError as exc:  # a dtype safetensors has no code for
        error(
            f"consolidate: {exc}; write a torch.save file instead: fshard consolidate CKPT "
            f"{output.with_suffix('.pt').name}"
        )
        return 2
    except (OSError, SafetensorError, KeyError, ValueError, RuntimeError) as exc:
        error(f"consolidate: cannot write {str(output)!r}: {type(exc).__name__}: {exc}")
        return 2
    _chmod_like_a_new_file(output)
    print(f"wrote {done.tensors} tensors ({done.nbytes / 2**20:.1f} MiB) to {output}")
    return 0


_ESTIMATE_DESCRIPTION = """\
Predict the memory per rank of one training step of MODEL under fshard, from a meta-device
build: no process group, no parameter memory. MODEL is `gpt` (fshard's test GPT; sizes from
--layers --dim --heads --seq --vocab --batch), pkg.module:factory (a callable returning the
module, built under torch.device("meta")), or a Transformers config.json or a directory holding
one (built with AutoModelForCausalLM.from_config in float32: fp32 master weights; needs the
`hf` extra).

Per rank it prints the persistent bytes (sharded params, grads, optimizer state, by dtype),
the root's parameters kept gathered, the largest unit's unsharded bytes and the prefetch on
top, the activation peak when --batch-fn is given (a forward and backward under fake tensors),
and the predicted peak, with the ZeRO formula beside it; a unit that dominates the peak is
flagged with a wrapping that lowers it.
"""


_ESTIMATE_EPILOG = """\
examples:
  fshard estimate gpt --nproc 4 --layers 8 --dim 384 --vocab 8192 --seq 128 --batch 4
  fshard estimate llama70b/config.json --nproc 64 --mesh 8x8 --mp bf16 --json est.json
  fshard estimate mypkg.models:build --nproc 8 --by-class Block --batch-fn mypkg.data:one_batch
"""


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or RxS (e.g. 8x8), got {text!r}") from None
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected N or RxS with sizes >= 1, got {text!r}")
    return shape


def _add_estimate_parser(commands: Any) -> None:
    estimate = commands.add_parser(
        "estimate",
        help="predict memory per rank of a training step, from a meta-device build",
        description=_ESTIMATE_DESCRIPTION,
        epilog=_ESTIMATE_EPILOG,
        formatter_class=_Formatter,
    )
    estimate.add_argument("model", metavar="MODEL", help="gpt, pkg.module:factory, or a Transformers config.json / directory")
    estimate.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks in all")
    estimate.add_argument("--mesh", type=_mesh_arg, metavar="N|RxS", help="1D N, or RxS (replicate x shard, HSDP); default: --nproc")
    policy = estimate.add_mutually_exclusive_group()
    policy.add_argument("--by-class", "--by_class", action="append", metavar="NAME", help="module class to make units of (repeatable)")
    policy.add_argument("--min-params", "--min_params", type=int, metavar="N", help="units by size (SIZE_BASED_WRAP)")
    policy.add_argument("--config_file", "--config-file", metavar="FILE", help="accelerate-style YAML: wrap policy, mixed precision, offload, strategy")
    estimate.add_argument("--mp", choices=("bf16", "fp16", "fp32"), help="mixed precision: compute and reduce in that dtype, fp32 master shards (default: the config file's, else fp32)")
    estimate.add_argument("--offload", action="store_true", default=None, help="CPU offload of shards, grads and optimizer state")
    estimate.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum", "none"), default="adamw", help="optimizer state to count (default: adamw)")
    estimate.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the step runs: which optimizer implementation torch picks (default: cuda)")
    estimate.add_argument("--batch-fn", "--batch_fn", metavar="pkg.module:fn", help="fn() -> one rank's micro-batch (args tuple, kwargs dict or a tensor), for the activation peak")
    estimate.add_argument("--coalesce", type=int, metavar="BYTES", help="fshard.set_coalescing's limit: small units share collectives up to BYTES (default 1 MiB; 0: one per unit)")
    estimate.add_argument("--json", metavar="FILE", help="also write the estimate as JSON")
    for flag, default in (("layers", 4), ("dim", 128), ("heads", 4), ("seq", 64), ("vocab", 128), ("batch", 8)):
        estimate.add_argument(f"--{flag}", type=int, metavar="N", help=f"gpt: {flag} (default: {default})")


def _run_estimate(args: argparse.Namespace) -> int:
    import torch

    from fshard._estimate import estimate
    from fshard._model_source import load_callable, load_model, load_policy, write_json

    gpt = {k: getattr(args, k) for k in ("layers", "dim", "heads", "seq", "vocab")}
    try:
        source = load_model(args.model, gpt=gpt, batch=args.batch)
        with torch.device("meta"):
            model = source.factory()
        policy, extra = load_policy(
            model, by_class_names=args.by_class, min_params=args.min_params, config_file=args.config_file
        )
        batch_fn = load_callable(args.batch_fn, "--batch-fn") if args.batch_fn else source.batch_fn
        result = estimate(
            model,
            nproc=args.nproc,
            mesh=args.mesh,
            policy=policy if policy is not None else source.policy,
            mp=args.mp if args.mp is not None else extra.get("mp"),
            offload=args.offload if args.offload is not None else bool(extra.get("offload", False)),
            optimizer=args.optimizer,
            batch_fn=batch_fn,
            loss_fn=source.loss_fn if batch_fn is source.batch_fn else None,
            reshard_after_forward=extra.get("reshard_after_forward", True),
            device=args.device,
            name=source.name,
            **({} if args.coalesce is None else {"coalesce_bytes": args.coalesce}),
        )
    except (ValueError, TypeError) as exc:
        error(f"estimate: error: {exc}")
        return 2
    print(result)
    if args.json:
        write_json(result, args.json)
    return 0






def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fshard`` command; returns the exit status.

    Example:
        >>> from fshard.cli import main
        >>> main(["launch", "--dry-run", "--nproc", "2", "train.py"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # The top-level parser has no option that takes a value, so the first word is the command.
    command = next((word for word in words if not word.startswith("-")), None)
    if command == "launch":
        args = parse_launch(parser, words, words.index(command))
    else:
        args = parser.parse_args(words)
    if args.command == "launch":
        return run_launch(args)
    if args.command == "consolidate":
        return _run_consolidate(args)
    if args.command == "bench":
        from fshard._bench import run_command  # starts ranks: imported only when asked for

        return run_command(args)
    if args.command == "estimate":
        return _run_estimate(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
