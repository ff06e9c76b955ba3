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
import ipaddress
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["LaunchPlan", "build_parser", "main", "plan_launch"]

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

_LAUNCH_DESCRIPTION = """\
Start SCRIPT on every process through torch.distributed.run (torchrun) and exit with the
script's exit status.

With --config_file (an `accelerate config` YAML file, or just its fsdp_config block), the
process layout comes from the file: num_processes (the total over all machines, as in
accelerate), num_machines, machine_rank, main_process_ip, main_process_port, rdzv_backend
and gpu_ids. Flags override the file. The file's path reaches the script as
$FSHARD_CONFIG_FILE, so `fshard.from_config(model)` with no config argument applies it.

torchrun's other launcher options (--tee, --redirects, --log-dir, --local-ranks-filter,
--monitor-interval, --start-method, --role, --rdzv-conf, --run-path, --no-python, ...: those
of the installed torch, see `python -m torch.distributed.run --help`) may come before SCRIPT,
spelled in full, as --flag VALUE or --flag=VALUE; they are passed on to torchrun in the
order given, before SCRIPT (--dry-run shows them). torchrun's --rdzv-endpoint and
--standalone are refused, since fshard launch sets the rendezvous from its own flags; a
--local-addr replaces the 127.0.0.1 that fshard launch passes for a loopback rendezvous.

Everything after SCRIPT is passed to the script, except that an option there which is an
ambiguous abbreviation of a launcher option stops the launch (as with torchrun); see the
launching guide for the `--` that passes such options through.
"""

_LAUNCH_EPILOG = """\
examples:
  # two processes on this machine
  fshard launch --nproc 2 examples/hf_bert.py --steps 5

  # the layout and FSDP options of an accelerate config file
  fshard launch --config_file examples/accelerate_config.yaml examples/hf_bert.py

  # torchrun's own options pass through: each rank's output to logs/, and also to the console
  fshard launch --nproc 2 --log-dir logs --tee 3 train.py

  # two machines, 8 processes each: run the same command on both (c10d rendezvous at
  # 10.0.0.1, the first machine; nodes may start in any order)
  fshard launch --nnodes 2 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 train.py

  # the same with static rendezvous: each machine states its rank
  fshard launch --rdzv-backend static --nnodes 2 --node-rank 1 --nproc 8 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py

Without a config file or flags, one process runs on this machine (torchrun's default).
Rendezvous: 'static' (node ranks from --node-rank, node 0 hosts the store at
--master-addr:--master-port) or 'c10d' (nodes join in any order at that address); the
default is the file's rdzv_backend, else c10d.
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

_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
_DEFAULT_RDZV = "c10d"

_IN_THE_FILE = "put it in the --config_file YAML (an `accelerate config` file) instead"
# `accelerate launch` flags that fshard launch has not -> how to say the same here. Flags
# starting with --fsdp_ get _IN_THE_FILE too.
_ACCELERATE_FLAGS = {
    "--num_processes": "--num_processes is accelerate's total over all machines: fshard launch "
    "takes --nproc N per machine (and --nnodes M for several machines), or num_processes in "
    "the --config_file YAML",
    "--mixed_precision": f"--mixed_precision: {_IN_THE_FILE} (mixed_precision: bf16)",
    "--use_fsdp": "--use_fsdp: fshard launch always runs FSDP, so leave it out; the FSDP "
    "options go in the --config_file YAML (distributed_type: FSDP with an fsdp_config block)",
    "--multi_gpu": "--multi_gpu is not needed: --nproc N starts N processes",
    "--num_cpu_threads_per_process": "--num_cpu_threads_per_process: set OMP_NUM_THREADS in the "
    "environment instead (torchrun keeps it)",
    "--gpu_ids": f"--gpu_ids: {_IN_THE_FILE} (gpu_ids: 0,1), or set CUDA_VISIBLE_DEVICES",
    "--cpu": f"--cpu: {_IN_THE_FILE} (use_cpu: true)",
    "--use_cpu": f"--use_cpu: {_IN_THE_FILE} (use_cpu: true)",
}
_MULTI_NODE_PORT = 29500


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
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
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
        f"machine or {_MULTI_NODE_PORT} on several)",
    )
    launch.add_argument(
        "--rdzv-backend", "--rdzv_backend", choices=_RDZV_BACKENDS, metavar="BACKEND",
        help=f"rendezvous backend: {', '.join(_RDZV_BACKENDS)} (default: the file's "
        f"rdzv_backend, else {_DEFAULT_RDZV})",
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


# ------------------------------------------------------------------------------------ launch


@dataclass(frozen=True)
class LaunchPlan:
    """What ``fshard launch`` runs: torchrun's arguments, the extra environment, and the
    variables removed from the environment (``unset``)."""

    torchrun_args: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ()

    def command(self) -> str:
        """The equivalent shell command (what ``--dry-run`` prints)."""
        prefix = ["env", *(f"-u {name}" for name in self.unset)] if self.unset else []
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        words = ["python", "-m", "torch.distributed.run", *self.torchrun_args]
        return " ".join([*prefix, *assignments, *(shlex.quote(w) for w in words)])


class LaunchError(ValueError):
    """A bad combination of ``fshard launch`` flags and config values."""


class TorchrunOption(NamedTuple):
    """One of torchrun's own options given to ``fshard launch`` before SCRIPT, passed on as given."""

    dest: str  # torchrun's name for it (``log_dir``)
    words: tuple[str, ...]  # ("--log-dir", "logs"), ("--log-dir=logs",) or ("--no-python",)


class LaunchWords(NamedTuple):
    """``fshard launch``'s command line split for the two parsers (see ``_split_launch_words``)."""

    fshard: list[str]  # fshard launch's own options, SCRIPT and the script's arguments
    torchrun: tuple[TorchrunOption, ...]  # torchrun's options to pass on, in the order given


# torchrun options that fshard launch sets itself (torchrun dest -> what to pass instead). Its
# own flags take torchrun's spellings too (--nproc_per_node, --max_restarts, ...); a spelling
# only a newer torch knows lands here rather than being passed twice. (--local-addr is not here:
# a given one replaces fshard's, see plan_launch.)
_SET_BY_FSHARD = {
    **{
        dest: f"fshard launch sets it from its own {flag}; pass that instead"
        for dest, flag in {
            "nnodes": "--nnodes",
            "nproc_per_node": "--nproc",
            "node_rank": "--node-rank",
            "master_addr": "--master-addr",
            "master_port": "--master-port",
            "rdzv_backend": "--rdzv-backend",
            "rdzv_id": "--rdzv-id",
            "max_restarts": "--max-restarts",
            "module": "--module",
        }.items()
    },
    "rdzv_endpoint": "fshard launch sets it from --master-addr and --master-port; pass "
    "--master-addr HOST --master-port PORT instead",
    "standalone": "fshard launch sets the rendezvous itself, and on one machine it already is a "
    "local one (127.0.0.1 at a free port); leave --standalone out (--master-port PORT picks the port)",
}


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Option string -> action (argparse keeps them only in ``_actions``)."""
    return {option: action for action in parser._actions for option in action.option_strings}


def _value_count(action: argparse.Action) -> int:
    """How many words after the option are its values (without ``=VALUE``)."""
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    # '?', '*', '+': a value only in the --flag=VALUE form, so that SCRIPT is never taken for one.
    return 0


def _looks_like_an_option(word: str) -> bool:
    # As argparse sees it: neither parser has an option that looks like a negative number.
    return word.startswith("-") and not re.fullmatch(r"-\d+|-\d*\.\d+", word)


def _split_launch_words(
    words: Sequence[str], launch: argparse.ArgumentParser, torchrun: argparse.ArgumentParser
) -> LaunchWords:
    """Take torchrun's own options out of ``fshard launch``'s words (those after ``launch``).

    Only the options before SCRIPT are looked at: SCRIPT is the first word that is neither an
    option nor an option's value, or the one after ``--``. An option of fshard launch (any
    spelling its parser has, or an abbreviation of one) stays for fshard's parser. One that
    torchrun's parser knows by that exact spelling is passed on, as ``--flag VALUE`` or
    ``--flag=VALUE`` (bare when it takes no value). Anything else stays for fshard's parser,
    which refuses it. Raises ``LaunchError`` naming the option for a torchrun option that fshard
    launch sets itself, or for a missing or unexpected value.

    Example:
        >>> from torch.distributed.run import get_args_parser
        >>> from fshard.cli import _split_launch_words, _subparser, build_parser
        >>> split = _split_launch_words(["--nproc", "2", "--tee", "3", "train.py", "--tee", "1"],
        ...                             _subparser(build_parser(), "launch"), get_args_parser())
        >>> split.fshard
        ['--nproc', '2', 'train.py', '--tee', '1']
        >>> split.torchrun
        (TorchrunOption(dest='tee', words=('--tee', '3')),)
    """
    fshard_actions = _option_actions(launch)
    torchrun_actions = _option_actions(torchrun)
    kept: list[str] = []
    passed: list[TorchrunOption] = []
    i = 0
    while i < len(words) and words[i] != "--" and _looks_like_an_option(words[i]):
        word = words[i]
        name, equals, value = word.partition("=")
        short = word[:2]
        if (
            not equals and not word.startswith("--") and len(word) > 2 and short not in fshard_actions
            and short in torchrun_actions and _value_count(torchrun_actions[short])
        ):  # fmt: skip
            name, equals, value = short, "=", word[2:]  # -t3, as argparse reads it
        action = fshard_actions.get(name)
        if action is None and name in torchrun_actions:
            dest = torchrun_actions[name].dest
            if dest in _SET_BY_FSHARD:
                raise LaunchError(f"argument {name}: {_SET_BY_FSHARD[dest]}")
            torchrun_action = torchrun_actions[name]
            count = 0 if equals else _value_count(torchrun_action)
            if equals and torchrun_action.nargs == 0:
                raise LaunchError(f"argument {name}: ignored explicit argument {value!r}")
            values = words[i + 1 : i + 1 + count]
            if len(values) < count or any(_looks_like_an_option(v) for v in values):
                expected = "one argument" if count == 1 else f"{count} arguments"
                raise LaunchError(f"argument {name}: expected {expected}")
            passed.append(TorchrunOption(dest, (word, *values)))
            i += 1 + count
            continue
        if action is None and name.startswith("--"):
            # An abbreviation that fshard's parser expands (--nnode 2): its value is skipped too.
            matches = {fshard_actions[option] for option in fshard_actions if option.startswith(name)}
            action = matches.pop() if len(matches) == 1 else None
        # An option of fshard launch, or one that its parser refuses (with the accelerate hints).
        count = 0 if equals or action is None else _value_count(action)
        kept += [word, *words[i + 1 : i + 1 + count]]
        i += 1 + count
    return LaunchWords(fshard=[*kept, *words[i:]], torchrun=tuple(passed))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plan_launch(
    args: argparse.Namespace,
    *,
    free_port: Callable[[], int] = _free_port,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Build the ``torch.distributed.run`` arguments for parsed ``fshard launch`` args (pure).

    Flags win over the config file, which wins over the defaults (one machine, one process,
    127.0.0.1, a free port). Several machines need an address for machine 0 (a flag or
    ``main_process_ip``); on one machine the file's ``main_process_ip`` is not used (as in
    ``accelerate launch``), only its ``main_process_port``. torchrun's own options
    (``args.torchrun_options``, taken out of the command line by ``main``) follow fshard's, in
    the order given, before SCRIPT. Raises ``LaunchError`` naming the flag or key for an
    impossible layout. Without ``--config_file``, a ``$FSHARD_CONFIG_FILE`` in ``environ`` (default: this
    process's environment; left over from an earlier launch or an export) is removed for the
    script, so that ``fshard.from_config(model)`` never applies a file this launch was not given.

    Example:
        >>> from fshard.cli import build_parser, plan_launch
        >>> args = build_parser().parse_args(["launch", "--nproc", "2", "train.py"])
        >>> plan_launch(args, free_port=lambda: 12345).torchrun_args[:4]
        ('--nnodes', '1', '--nproc-per-node', '2')
    """
    from fshard._config import CONFIG_ENV, LaunchConfig, load_config

    env: dict[str, str] = {}
    unset: tuple[str, ...] = ()
    layout = LaunchConfig()
    if args.config_file is not None:
        config_path = os.path.abspath(args.config_file)
        layout = load_config(config_path).launch
        env[CONFIG_ENV] = config_path
    elif CONFIG_ENV in (os.environ if environ is None else environ):
        unset = (CONFIG_ENV,)

    nnodes = args.nnodes if args.nnodes is not None else layout.num_machines or 1
    if nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {nnodes}")
    if args.nproc is not None:
        nproc = args.nproc
        if nproc < 1:
            raise LaunchError(f"--nproc must be >= 1, got {nproc}")
    elif layout.num_processes is not None:
        if layout.num_processes % nnodes:
            raise LaunchError(
                f"num_processes {layout.num_processes} (the total over all machines) does not "
                f"divide evenly over {nnodes} machine(s); fix the config or pass --nproc (per machine)"
            )
        nproc = layout.num_processes // nnodes
    else:
        nproc = 1
    node_rank = args.node_rank if args.node_rank is not None else layout.machine_rank or 0
    if not 0 <= node_rank < nnodes:
        given = "--node-rank" if args.node_rank is not None else f"machine_rank in {args.config_file!r}"
        raise LaunchError(
            f"{given} must be in 0..{nnodes - 1} for {nnodes} machine(s), got {node_rank}; "
            "pass --node-rank (this machine's rank) or --nnodes to match"
        )
    # The file's main_process_ip only matters on several machines, as in accelerate launch
    # (prepare_multi_gpu_env): a file written for a cluster and run with num_machines: 1 or
    # --nnodes 1 must not send the rendezvous to a machine that is not part of the job.
    addr = args.master_addr or (layout.main_process_ip if nnodes > 1 else None)
    if not addr:
        if nnodes > 1:
            # 127.0.0.1 would have every machine wait on its own loopback until the rendezvous
            # times out. An explicit loopback address stays allowed (several "nodes" on one host).
            if args.nnodes is not None:
                needs = f"--nnodes {nnodes} needs --master-addr (or main_process_ip in the config)"
            else:
                needs = (
                    f"num_machines: {nnodes} in {args.config_file!r} needs main_process_ip in "
                    "the config (or --master-addr)"
                )
            raise LaunchError(f"{needs}: the address of machine 0, which every machine can reach")
        addr = "127.0.0.1"
    port = args.master_port or layout.main_process_port
    if port is None:
        port = free_port() if nnodes == 1 else _MULTI_NODE_PORT
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {port}")
    backend = args.rdzv_backend or layout.rdzv_backend or _DEFAULT_RDZV
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    passed: tuple[TorchrunOption, ...] = tuple(args.torchrun_options)
    passed_dests = {option.dest for option in passed}
    if args.module and "no_python" in passed_dests:
        raise LaunchError("-m runs SCRIPT as a Python module and --no-python as a program; pass one of them")

    torchrun = [
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc),
        "--max-restarts", str(args.max_restarts),
        "--rdzv-backend", backend,
    ]  # fmt: skip
    if backend == "static":
        torchrun += ["--node-rank", str(node_rank), "--master-addr", addr, "--master-port", str(port)]
    else:
        torchrun += ["--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", args.rdzv_id]
    if _is_loopback(addr) and "local_addr" not in passed_dests:
        # Workers reach rank 0 at this address instead of the machine's FQDN, which need not
        # resolve on an isolated host. A --local-addr given to fshard launch is passed instead.
        torchrun += ["--local-addr", addr]
    torchrun += [word for option in passed for word in option.words]
    if args.module:
        torchrun.append("--module")
    torchrun += [args.script, *args.script_args]
    if layout.gpu_ids is not None and layout.gpu_ids != "all":
        env["CUDA_VISIBLE_DEVICES"] = layout.gpu_ids
    return LaunchPlan(torchrun_args=tuple(torchrun), env=env, unset=unset)


def root_failure(failures: dict[int, tuple[int, float]]) -> tuple[int, int]:
    """The (rank, exit code) to report among failed ranks: rank -> (exit code, timestamp).

    When one rank fails, its peers usually fail too (a gloo/NCCL "connection closed" error,
    exit code 1) or are stopped by torchrun (SIGTERM), often within the same second, which is
    all the resolution torchrun records. So the most telling failure wins: an explicit exit
    code (2 and up) or a fatal signal other than SIGTERM, then a plain 1, then SIGTERM; the
    earliest (then the lowest rank) among equals.

    Example:
        >>> from fshard.cli import root_failure
        >>> root_failure({0: (1, 10.0), 1: (3, 10.0)})
        (1, 3)
    """
    sigterm = -15

    def rank_key(rank: int) -> tuple[int, float, int]:
        code, timestamp = failures[rank]
        telling = 2 if code == sigterm else 1 if code == 1 else 0
        return telling, timestamp, rank

    first = min(failures, key=rank_key)
    return first, failures[first][0]


def _exit_status(exitcode: int) -> int:
    """A worker's exit code as a process exit status (signals as 128 + signal number)."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if exitcode > 0 else 1


def _run_launch(args: argparse.Namespace) -> int:
    no_python = any(option.dest == "no_python" for option in args.torchrun_options)
    if no_python and not args.dry_run and shutil.which(args.script) is None:
        _error(f"launch: program {args.script!r} not found (--no-python runs SCRIPT as a program)")
        return 2
    if not (args.module or no_python or args.dry_run) and not Path(args.script).is_file():
        _error(f"launch: script {args.script!r} does not exist (use -m to run a module)")
        return 2
    try:
        plan = plan_launch(args)
    except (LaunchError, ValueError, OSError) as exc:  # OSError: the config file is missing, ...
        _error(f"launch: {exc}")
        return 2
    if args.dry_run:
        print(plan.command())
        return 0
    print(f"fshard launch: {plan.command()}", file=sys.stderr, flush=True)

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun_run

    for name in plan.unset:
        os.environ.pop(name, None)
    os.environ.update(plan.env)
    try:
        torchrun_args = torchrun_parse_args(list(plan.torchrun_args))
        torchrun_run(torchrun_args)
    except ChildFailedError as exc:
        rank, exitcode = root_failure({r: (f.exitcode, f.timestamp) for r, f in exc.failures.items()})
        print(f"fshard launch: {args.script} failed on rank {rank} with exit code {exitcode}", file=sys.stderr)
        return _exit_status(exitcode)
    except SignalException as exc:
        # SIGTERM / SIGINT / SIGHUP / SIGQUIT while the workers ran: torchrun's agent has passed
        # the signal on to them and waited for them to stop before raising this. Exit as a
        # process ended by that signal reports itself to the shell, without a traceback.
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


# ------------------------------------------------------------------------------- consolidate


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
        _error(f"consolidate: {str(output)!r} is a directory; give the path of the file to write")
        return 2
    if output.exists() and not args.force:
        _error(f"consolidate: {str(output)!r} exists; pass --force to overwrite it")
        return 2
    from safetensors import SafetensorError

    from fshard.checkpoint import CheckpointError, consolidate_to

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _error(f"consolidate: cannot write {str(output)!r}: {type(exc).__name__}: {exc}")
        return 2
    try:
        # A checkpoint dir briefly missing after a crash mid-save is recovered by consolidate.
        # One tensor at a time: [Note: streamed consolidate].
        done = consolidate_to(args.checkpoint, output, optimizer=args.optimizer)
    except CheckpointError as exc:
        _error(f"consolidate: {exc}{_newest_inside_hint(args.checkpoint)}")
        return 2
    except TypeError as exc:  # a dtype safetensors has no code for
        _error(
            f"consolidate: {exc}; write a torch.save file instead: fshard consolidate CKPT "
            f"{output.with_suffix('.pt').name}"
        )
        return 2
    except (OSError, SafetensorError, KeyError, ValueError, RuntimeError) as exc:
        _error(f"consolidate: cannot write {str(output)!r}: {type(exc).__name__}: {exc}")
        return 2
    _chmod_like_a_new_file(output)
    print(f"wrote {done.tensors} tensors ({done.nbytes / 2**20:.1f} MiB) to {output}")
    return 0


# ---------------------------------------------------------------------------------- estimate

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
        )
    except (ValueError, TypeError) as exc:
        _error(f"estimate: error: {exc}")
        return 2
    print(result)
    if args.json:
        write_json(result, args.json)
    return 0


# ------------------------------------------------------------------------------------- main


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps its sub-parsers only there
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(f"fshard internal error: no {name!r} sub-command")


def _accelerate_hint(word: str) -> str | None:
    """How to say the `accelerate launch` flag ``word`` to ``fshard launch`` (``None``: not one)."""
    flag = word.split("=", 1)[0].replace("-", "_")
    flag = "--" + flag.lstrip("_")
    if flag in _ACCELERATE_FLAGS:
        return _ACCELERATE_FLAGS[flag]
    if flag.startswith("--fsdp_"):
        return f"{flag}: {_IN_THE_FILE}, under fsdp_config ({flag[2:]}: ...)"
    return None


def _torchrun_hint(word: str, torchrun: argparse.ArgumentParser) -> str | None:
    """For an abbreviation of torchrun options (``--log-d``): their full spellings (``None``: not one)."""
    name = word.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    matches = [option for option in _option_actions(torchrun) if option.startswith(name)]
    if not matches:
        return None
    return f"{name}: torchrun's options pass through spelled in full ({', '.join(matches)})"


def _parse_launch(parser: argparse.ArgumentParser, words: Sequence[str], at: int) -> argparse.Namespace:
    """Parse the command line ``words`` whose command, ``words[at]``, is ``launch``.

    torchrun's own options before SCRIPT are taken out first (``_split_launch_words``) and end
    up in ``args.torchrun_options``. Errors exit with launch's usage, as argparse's do.
    """
    from torch.distributed.run import get_args_parser

    launch = _subparser(parser, "launch")
    torchrun = get_args_parser()  # the installed torch's options, whatever its version
    try:
        split = _split_launch_words(words[at + 1 :], launch, torchrun)
    except LaunchError as exc:
        launch.error(str(exc))
    args, unknown = parser.parse_known_args([*words[: at + 1], *split.fshard])
    if unknown:
        # Only words before SCRIPT can be unknown (the rest belong to the script), so these
        # are launcher flags, often `accelerate launch` ones: answer with launch's usage.
        options = [word for word in unknown if word.startswith("-")]
        hints = [_accelerate_hint(word) or _torchrun_hint(word, torchrun) for word in options]
        launch.error(
            f"unrecognized arguments: {' '.join(unknown)}"
            + "".join(f"\n  hint: {hint}" for hint in dict.fromkeys(h for h in hints if h))
        )
    args.torchrun_options = split.torchrun
    return args


def _error(message: str) -> None:
    print(f"fshard {message}", file=sys.stderr)


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
        args = _parse_launch(parser, words, words.index(command))
    else:
        args = parser.parse_args(words)
    if args.command == "launch":
        return _run_launch(args)
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
