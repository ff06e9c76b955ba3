"""``fshard launch``: the plan of a ``torch.distributed.run`` command from fshard's flags, an
accelerate config file and torchrun's own options, and running it (the parser lives in cli)."""


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

__all__ = ["LaunchPlan", "LaunchError", "plan_launch", "run_launch", "parse_launch"]

LAUNCH_DESCRIPTION = """\
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


LAUNCH_EPILOG = """\
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


RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


DEFAULT_RDZV = "c10d"


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


MULTI_NODE_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    """What ``fshard launch`` runs: torchrun's arguments, the extra environment, and the
    variables removed from the environment (``unset``)."""

    torchrun_args: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ()
    # For several machines: whom the launch waits for at the rendezvous, and for how long
    # (printed before torchrun starts, which says nothing while it waits).
    waiting: str = ""

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
        >>> from fshard._launch import _split_launch_words, subparser
        >>> from fshard.cli import build_parser
        >>> split = _split_launch_words(["--nproc", "2", "--tee", "3", "train.py", "--tee", "1"],
        ...                             subparser(build_parser(), "launch"), get_args_parser())
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
        >>> from fshard._launch import plan_launch
        >>> from fshard.cli import build_parser
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
        port = free_port() if nnodes == 1 else MULTI_NODE_PORT
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port must be in 1..65535, got {port}")
    backend = args.rdzv_backend or layout.rdzv_backend or DEFAULT_RDZV
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
    waiting = ""
    if nnodes > 1:
        waiting = _rendezvous_wait(backend, nnodes, nproc, node_rank, f"{addr}:{port}", args.rdzv_id, passed)
    return LaunchPlan(torchrun_args=tuple(torchrun), env=env, unset=unset, waiting=waiting)


_RDZV_TIMEOUT_S = 600  # torchrun's default for both c10d's join_timeout and static's timeout


def _rendezvous_wait(
    backend: str,
    nnodes: int,
    nproc: int,
    node_rank: int,
    endpoint: str,
    rdzv_id: str,
    passed: tuple[TorchrunOption, ...],
) -> str:
    """The line a launch over ``nnodes`` machines prints before it waits for the others."""
    key = "timeout" if backend == "static" else "join_timeout"
    timeout: str | int = _RDZV_TIMEOUT_S
    for option in passed:
        if option.dest == "rdzv_conf":
            conf = option.words[-1].split("=", 1)[1] if len(option.words) == 1 else option.words[-1]
            for item in conf.split(","):
                name, _, value = item.partition("=")
                if name.strip() == key:
                    timeout = value.strip()
    give_up = f"gives up after {timeout} s if they do not come ({key} in --rdzv-conf sets it)"
    if backend == "static":
        return (
            f"fshard launch: machine {node_rank} of {nnodes} ({nproc} process(es) each) waiting "
            f"for the others at the static rendezvous {endpoint} (hosted by machine 0, every "
            f"machine with its own --node-rank); {give_up}"
        )
    return (
        f"fshard launch: waiting for {nnodes} machines ({nproc} process(es) each, this one "
        f"included) to join the {backend} rendezvous {endpoint} (id {rdzv_id!r}; the same "
        f"command on each machine, in any order); {give_up}"
    )


def root_failure(failures: dict[int, tuple[int, float]]) -> tuple[int, int]:
    """The (rank, exit code) to report among failed ranks: rank -> (exit code, timestamp).

    When one rank fails, its peers usually fail too (a gloo/NCCL "connection closed" error,
    exit code 1) or are stopped by torchrun (SIGTERM), often within the same second, which is
    all the resolution torchrun records. So the most telling failure wins: an explicit exit
    code (2 and up) or a fatal signal other than SIGTERM, then a plain 1, then SIGTERM; the
    earliest (then the lowest rank) among equals.

    Example:
        >>> from fshard._launch import root_failure
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


def exit_status(exitcode: int) -> int:
    """A worker's exit code as a process exit status (signals as 128 + signal number)."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if exitcode > 0 else 1


def run_launch(args: argparse.Namespace) -> int:
    no_python = any(option.dest == "no_python" for option in args.torchrun_options)
    if no_python and not args.dry_run and shutil.which(args.script) is None:
        error(f"launch: program {args.script!r} not found (--no-python runs SCRIPT as a program)")
        return 2
    if not (args.module or no_python or args.dry_run) and not Path(args.script).is_file():
        error(f"launch: script {args.script!r} does not exist (use -m to run a module)")
        return 2
    try:
        plan = plan_launch(args)
    except (LaunchError, ValueError, OSError) as exc:  # OSError: the config file is missing, ...
        error(f"launch: {exc}")
        return 2
    if args.dry_run:
        print(plan.command())
        return 0
    print(f"fshard launch: {plan.command()}", file=sys.stderr, flush=True)
    if plan.waiting:
        print(plan.waiting, file=sys.stderr, flush=True)

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun_run

    for name in plan.unset:
        os.environ.pop(name, None)
    os.environ.update(plan.env)
    interrupted = _stop_workers_quietly_on_ctrl_c()
    try:
        torchrun_args = torchrun_parse_args(list(plan.torchrun_args))
        torchrun_run(torchrun_args)
    except RendezvousTimeoutError:
        print(
            "fshard launch: gave up waiting at the rendezvous: not every machine joined in time. "
            "Start the same command on each machine, check that they all reach the rendezvous "
            "address and port, or give them longer (--rdzv-conf join_timeout=SECONDS)",
            file=sys.stderr,
        )
        return 1
    except ChildFailedError as exc:
        if interrupted:
            return _say_interrupted()
        rank, exitcode = root_failure({r: (f.exitcode, f.timestamp) for r, f in exc.failures.items()})
        print(f"fshard launch: {args.script} failed on rank {rank} with exit code {exitcode}", file=sys.stderr)
        return exit_status(exitcode)
    except SignalException as exc:
        # SIGTERM / SIGINT / SIGHUP / SIGQUIT while the workers ran: torchrun's agent has passed
        # the signal on to them and waited for them to stop before raising this. Exit as a
        # process ended by that signal reports itself to the shell, without a traceback.
        if interrupted:
            return _say_interrupted()
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return _say_interrupted()
    return 0


def _stop_workers_quietly_on_ctrl_c() -> list[bool]:
    """Make Ctrl-C stop the workers with SIGTERM ([Note: Ctrl-C in fshard launch]); the
    returned list holds True once it happened."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing import api as elastic_api

    interrupted: list[bool] = []
    torchrun_handler = getattr(elastic_api, "_terminate_process_handler", None)
    if torchrun_handler is None:  # another torch: its own handling stays
        return interrupted

    def handler(signum: int, frame: Any) -> None:
        if signum != signal.SIGINT:
            torchrun_handler(signum, frame)
            return
        if not interrupted:
            interrupted.append(True)
            for name in list(logging.root.manager.loggerDict):
                if name.startswith("torch.distributed.elastic"):
                    logging.getLogger(name).setLevel(logging.ERROR)
        raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGTERM)

    elastic_api._terminate_process_handler = handler
    return interrupted


def _say_interrupted() -> int:
    print("fshard launch: interrupted (Ctrl-C); the workers on this machine were stopped", file=sys.stderr, flush=True)
    return 130


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


def parse_launch(parser: argparse.ArgumentParser, words: Sequence[str], at: int) -> argparse.Namespace:
    """Parse the command line ``words`` whose command, ``words[at]``, is ``launch``.

    torchrun's own options before SCRIPT are taken out first (``_split_launch_words``) and end
    up in ``args.torchrun_options``. Errors exit with launch's usage, as argparse's do.
    """
    from torch.distributed.run import get_args_parser

    launch = subparser(parser, "launch")
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

def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps its sub-parsers only there
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(f"fshard internal error: no {name!r} sub-command")

def error(message: str) -> None:
    print(f"fshard {message}", file=sys.stderr)
