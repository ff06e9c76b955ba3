"""The ``fshard`` command line: help, argument parsing and the torchrun command (no processes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fshard._launch import (
    LaunchError,
    TorchrunOption,
    exit_status,
    parse_launch,
    plan_launch,
    root_failure,
)
from fshard.cli import _COMMANDS, _newest_inside_hint, build_parser, main
from tests.accelerate_samples import GUIDE, sample


def _plan(argv: list[str], port: int = 4321, environ: dict[str, str] | None = None) -> Any:
    args = parse_launch(build_parser(), ["launch", *argv], 0)
    if environ is None:
        return plan_launch(args, free_port=lambda: port)
    return plan_launch(args, free_port=lambda: port, environ=environ)


def _flags(args: tuple[str, ...]) -> dict[str, str]:
    """torchrun's ``--flag value`` pairs before the script."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("--"):
        if args[i] == "--module":
            out["--module"] = ""
            i += 1
            continue
        out[args[i]] = args[i + 1]
        i += 2
    return out


# ---------------------------------------------------------------------------------- help


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fshard" in out
    for text in ("launch", "consolidate", "bench", "fshard launch --config_file", "fshard COMMAND --help"):
        assert text in out
    assert "fshard estimate" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "commands:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("command", "texts"),
    [
        ("launch", ["--config_file", "--nproc", "--nnodes", "--node-rank", "--master-addr",
                    "--master-port", "--rdzv-backend", "--dry-run", "FSHARD_CONFIG_FILE",
                    "num_processes", "exit status", "examples:", "torchrun's other launcher options",
                    "--log-dir logs --tee 3 train.py"]),
        ("consolidate", ["CKPT", "OUT", ".safetensors", "--force", "example:"]),
        ("bench", ["--impl", "--model", "--batch-fn", "--by-class", "--min-params", "--config_file",
                   "--nproc", "--mesh", "--device", "--mp", "--steps", "--warmup", "--json",
                   "--plot", "examples:", "(inputs, target)"]),
    ],
)  # fmt: skip
def test_subcommand_help(command: str, texts: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in texts:
        assert text in out, text


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Every command the top-level help lists parses its own --help (none is a placeholder)."""
    assert _COMMANDS == ("launch", "consolidate", "bench", "estimate")
    for name in _COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: fshard {name}" in capsys.readouterr().out


def test_launch_without_a_script_names_only_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("fshard launch: error: the following arguments are required: SCRIPT")
    assert build_parser().parse_args(["launch", "t.py"]).script_args == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import fshard

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"fshard {fshard.__version__}"


# --------------------------------------------------------------------------------- parsing


def test_script_arguments_pass_through_unchanged() -> None:
    args = build_parser().parse_args(["launch", "--nproc", "2", "train.py", "--nproc", "7", "--config_file", "x"])
    assert args.nproc == 2 and args.config_file is None
    assert args.script == "train.py" and args.script_args == ["--nproc", "7", "--config_file", "x"]


def test_accelerate_and_torchrun_spellings() -> None:
    args = build_parser().parse_args(
        ["launch", "--config-file", "c.yaml", "--nproc-per-node", "3", "--num_machines", "2",
         "--machine_rank", "1", "--main_process_ip", "h", "--main_process_port", "9", "s.py"]
    )  # fmt: skip
    assert (args.config_file, args.nproc, args.nnodes, args.node_rank) == ("c.yaml", 3, 2, 1)
    assert (args.master_addr, args.master_port) == ("h", 9)


def test_consolidate_arguments() -> None:
    args = build_parser().parse_args(["consolidate", "ckpt/step_1", "out.safetensors"])
    assert (args.checkpoint, args.output, args.force) == ("ckpt/step_1", "out.safetensors", False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["consolidate", "only_one"])


# ------------------------------------------------------------------------------ the plan


def test_defaults_one_local_process() -> None:
    plan = _plan(["train.py"])
    assert plan.torchrun_args == (
        "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:4321", "--rdzv-id", "fshard", "--local-addr", "127.0.0.1",
        "train.py",
    )  # fmt: skip
    assert plan.env == {}


def test_config_file_sets_the_layout_and_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text(GUIDE)
    plan = _plan(["--config_file", str(config), "train.py", "--lr", "1"])
    flags = _flags(plan.torchrun_args)
    assert flags["--nproc-per-node"] == "2" and flags["--nnodes"] == "1"
    assert flags["--rdzv-backend"] == "static"  # the file's rdzv_backend
    assert (flags["--node-rank"], flags["--master-addr"], flags["--master-port"]) == ("0", "127.0.0.1", "4321")
    assert plan.torchrun_args[-3:] == ("train.py", "--lr", "1")
    assert plan.env == {"FSHARD_CONFIG_FILE": str(config.resolve())}


def test_num_processes_is_the_total_over_machines(tmp_path: Path) -> None:
    config = tmp_path / "multi.yaml"
    config.write_text(yaml.safe_dump(sample(
        "guide", num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1",
        main_process_port=29555, gpu_ids="0,1,2,3",
    )))  # fmt: skip
    plan = _plan(["--config_file", str(config), "train.py"])
    flags = _flags(plan.torchrun_args)
    assert (flags["--nnodes"], flags["--nproc-per-node"], flags["--node-rank"]) == ("2", "4", "1")
    assert (flags["--master-addr"], flags["--master-port"]) == ("10.0.0.1", "29555")
    assert "--local-addr" not in flags  # a real network address: torchrun finds the local one
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # Flags override the file.
    flags = _flags(_plan(["--config_file", str(config), "--nproc", "3", "--nnodes", "3",
                          "--node-rank", "2", "--master-port", "1234", "--rdzv-backend", "c10d",
                          "train.py"]).torchrun_args)  # fmt: skip
    assert (flags["--nnodes"], flags["--nproc-per-node"]) == ("3", "3")
    assert flags["--rdzv-endpoint"] == "10.0.0.1:1234" and "--node-rank" not in flags


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_one_machine_ignores_the_files_main_process_ip(backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # accelerate launch uses main_process_ip only when num_machines > 1: a cluster file run on
    # one machine (num_machines: 1, or --nnodes 1 over a file with 2) keeps the rendezvous on
    # this machine, at the file's port.
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(sample("guide", num_machines=1, main_process_ip="10.1.2.3",
                                         main_process_port=29555, rdzv_backend=backend)))  # fmt: skip
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(sample("guide", num_processes=4, num_machines=2, main_process_ip="10.1.2.3",
                                         main_process_port=29555, rdzv_backend=backend)))  # fmt: skip
    for argv in (["--config_file", str(one)], ["--config_file", str(two), "--nnodes", "1", "--nproc", "2"]):
        plan = _plan([*argv, "t.py"])
        assert "10.1.2.3" not in plan.command(), argv
        flags = _flags(plan.torchrun_args)
        assert flags["--nnodes"] == "1" and flags["--local-addr"] == "127.0.0.1"
        if backend == "static":
            assert (flags["--master-addr"], flags["--master-port"]) == ("127.0.0.1", "29555")
        else:
            assert flags["--rdzv-endpoint"] == "127.0.0.1:29555"
        assert main(["launch", "--dry-run", *argv, "t.py"]) == 0
        assert "10.1.2.3" not in capsys.readouterr().out
    # On two machines it is the address of machine 0; an explicit flag is always used.
    assert "10.1.2.3" in _plan(["--config_file", str(two), "t.py"]).command()
    assert "10.9.9.9" in _plan(["--config_file", str(one), "--master-addr", "10.9.9.9", "t.py"]).command()


def test_several_machines_without_a_port_use_29500() -> None:
    flags = _flags(_plan(["--nnodes", "2", "--master-addr", "10.1.1.1", "t.py"], port=1).torchrun_args)
    assert flags["--rdzv-endpoint"] == "10.1.1.1:29500"


@pytest.mark.parametrize(
    ("argv", "config", "message"),
    [
        (["--nnodes", "2"], None, "--nnodes 2 needs --master-addr (or main_process_ip in the config): "
         "the address of machine 0, which every machine can reach"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1"], None,
         "--nnodes 2 needs --master-addr"),
        ([], {"num_machines": 2, "num_processes": 2, "main_process_ip": None},
         "num_machines: 2 in '{config}' needs main_process_ip in the config (or --master-addr): "
         "the address of machine 0"),
        (["--nnodes", "2"], {"num_machines": 1}, "--nnodes 2 needs --master-addr (or main_process_ip in the config)"),
    ],
    ids=["flag", "flag-static", "config", "flag-over-config"],
)  # fmt: skip
def test_several_machines_need_the_address_of_machine_0(
    argv: list[str], config: dict[str, Any] | None, message: str, tmp_path: Path
) -> None:
    # Defaulting to 127.0.0.1 would have each machine wait on its own loopback until timeout.
    if config is not None:
        path = tmp_path / "multi.yaml"
        path.write_text(yaml.safe_dump(sample("guide", **config)))
        argv = ["--config_file", str(path), *argv]
        message = message.format(config=path)
    with pytest.raises(LaunchError, match=re.escape(message)):
        _plan([*argv, "t.py"])


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_several_nodes_on_an_explicit_loopback_address(host: str, tmp_path: Path) -> None:
    # Several "nodes" on one host (tests/test_launch.py does this): allowed when asked for.
    flags = _flags(_plan(["--nnodes", "2", "--master-addr", host, "t.py"]).torchrun_args)
    assert flags["--rdzv-endpoint"] == f"{host}:29500" and flags["--local-addr"] == host
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(sample("guide", num_machines=2, main_process_ip=host)))
    flags = _flags(_plan(["--config_file", str(config), "t.py"]).torchrun_args)
    assert (flags["--nnodes"], flags["--master-addr"]) == ("2", host)


def test_module_flag() -> None:
    plan = _plan(["-m", "pkg.train", "--x"])
    assert plan.torchrun_args[-3:] == ("--module", "pkg.train", "--x")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2", "t.py"], "--node-rank must be in 0..1 for 2 machine(s), got 2"),
        (["--nproc", "0", "t.py"], "--nproc must be >= 1, got 0"),
        (["--nnodes", "0", "t.py"], "--nnodes must be >= 1, got 0"),
        (["--master-port", "70000", "t.py"], "--master-port must be in 1..65535, got 70000"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_impossible_layouts(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        _plan(argv)


def test_a_bad_node_rank_from_the_file_names_machine_rank(tmp_path: Path) -> None:
    # machine_rank 1 fits the file's 2 machines, but --nnodes 1 overrides them.
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(sample("guide", num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1")))
    message = f"machine_rank in {str(config)!r} must be in 0..0 for 1 machine(s), got 1; pass --node-rank"
    with pytest.raises(LaunchError, match=re.escape(message)):
        _plan(["--config_file", str(config), "--nnodes", "1", "t.py"])


def test_a_stale_config_file_variable_does_not_reach_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = {"FSHARD_CONFIG_FILE": "/old/run/accelerate.yaml"}
    plan = _plan(["t.py"], environ=stale)
    assert plan.unset == ("FSHARD_CONFIG_FILE",) and plan.env == {}
    assert plan.command().startswith("env -u FSHARD_CONFIG_FILE python -m torch.distributed.run ")
    assert _plan(["t.py"], environ={}).unset == ()
    # With --config_file, the given file replaces it.
    config = tmp_path / "c.yaml"
    config.write_text(GUIDE)
    plan = _plan(["--config_file", str(config), "t.py"], environ=stale)
    assert plan.unset == () and plan.env == {"FSHARD_CONFIG_FILE": str(config.resolve())}
    # What main() prints for --dry-run reads this process's environment.
    monkeypatch.setenv("FSHARD_CONFIG_FILE", "/old/run/accelerate.yaml")
    assert main(["launch", "--dry-run", "t.py"]) == 0
    assert capsys.readouterr().out.startswith("env -u FSHARD_CONFIG_FILE python -m torch.distributed.run")


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--num_processes", "2"], "--num_processes is accelerate's total over all machines: fshard launch takes --nproc N per machine (and --nnodes M"),
        (["--num-processes=2"], "--num_processes is accelerate's total over all machines"),
        (["--mixed_precision", "bf16"], "--mixed_precision: put it in the --config_file YAML"),
        (["--use_fsdp"], "--use_fsdp: fshard launch always runs FSDP, so leave it out; the FSDP options go in the --config_file YAML"),
        (["--fsdp_sharding_strategy", "1"], "--fsdp_sharding_strategy: put it in the --config_file YAML (an `accelerate config` file) instead, under fsdp_config"),
        (["--multi_gpu"], "--multi_gpu is not needed: --nproc N starts N processes"),
        (["--num_cpu_threads_per_process", "4"], "--num_cpu_threads_per_process: set OMP_NUM_THREADS in the environment"),
    ],
)  # fmt: skip
def test_accelerate_launch_flags_get_the_launch_usage_and_a_hint(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", *argv, "train.py", "--lr", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fshard launch ")
    assert f"fshard launch: error: unrecognized arguments: {argv[0]}" in err
    assert f"\n  hint: {hint}" in err


def test_an_unknown_launch_flag_gets_the_launch_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--bogus", "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fshard launch ") and "unrecognized arguments: --bogus" in err
    assert "hint" not in err
    # After the script, the same words are the script's.
    assert build_parser().parse_args(["launch", "t.py", "--num_processes", "2"]).script_args == ["--num_processes", "2"]


# ------------------------------------------------------------ torchrun's options pass through


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The words of the torchrun command that ``fshard launch --dry-run ARGV`` prints."""
    assert main(["launch", "--dry-run", *argv]) == 0
    words = capsys.readouterr().out.split()
    assert words[:3] == ["python", "-m", "torch.distributed.run"]
    return words[3:]


def test_torchrun_value_option_passes_through_before_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    words = _dry_run(["--nproc", "2", "--log-dir", "logs", "train.py", "--lr", "1"], capsys)
    assert words[-5:] == ["--log-dir", "logs", "train.py", "--lr", "1"]
    # fshard's own flags are unchanged; torchrun's follow them.
    assert words[:4] == ["--nnodes", "1", "--nproc-per-node", "2"]
    assert words.count("--log-dir") == 1


def test_torchrun_option_equals_form_and_underscore_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    words = _dry_run(["--log_dir=/tmp/x y", "--redirects=3", "train.py"], capsys)
    assert words[-4:] == ["'--log_dir=/tmp/x", "y'", "--redirects=3", "train.py"]  # shlex-quoted
    args = parse_launch(build_parser(), ["launch", "--log_dir=/tmp/x y", "-t3", "train.py"], 0)
    assert args.torchrun_options == (
        TorchrunOption("log_dir", ("--log_dir=/tmp/x y",)), TorchrunOption("tee", ("-t3",))
    )
    assert args.script == "train.py" and args.script_args == []


def test_torchrun_store_true_option_takes_no_value(capsys: pytest.CaptureFixture[str]) -> None:
    # --run-path takes no value, so the next word is SCRIPT.
    words = _dry_run(["--run-path", "train.py", "--x"], capsys)
    assert words[-3:] == ["--run-path", "train.py", "--x"]
    args = parse_launch(build_parser(), ["launch", "--no-python", "--nproc", "2", "bash", "-c", "true"], 0)
    assert args.torchrun_options == (TorchrunOption("no_python", ("--no-python",)),)
    assert (args.nproc, args.script, args.script_args) == (2, "bash", ["-c", "true"])


def test_torchrun_options_keep_their_order_among_fshard_flags(capsys: pytest.CaptureFixture[str]) -> None:
    words = _dry_run(["--tee", "3", "--nproc", "2", "--role", "trainer", "-m", "--monitor-interval", "0.5",
                      "--start-method=fork", "pkg.train", "--steps", "3"], capsys)  # fmt: skip
    start = words.index("--tee")
    assert words[start:] == ["--tee", "3", "--role", "trainer", "--monitor-interval", "0.5",
                             "--start-method=fork", "--module", "pkg.train", "--steps", "3"]  # fmt: skip
    assert words[words.index("--nproc-per-node") + 1] == "2"


def test_a_torchrun_option_after_the_script_is_the_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    words = _dry_run(["--tee", "1", "train.py", "--tee", "3", "--log-dir", "d"], capsys)
    assert words.count("--tee") == 2 and words[-6:] == ["1", "train.py", "--tee", "3", "--log-dir", "d"]
    args = parse_launch(build_parser(), ["launch", "train.py", "--tee", "3", "--standalone"], 0)
    assert args.torchrun_options == () and args.script_args == ["--tee", "3", "--standalone"]
    # After `--`, too: the next word is SCRIPT.
    args = parse_launch(build_parser(), ["launch", "--", "train.py", "--tee", "3"], 0)
    assert (args.script, args.script_args, args.torchrun_options) == ("train.py", ["--tee", "3"], ())


def test_a_torchrun_value_is_not_taken_for_the_script() -> None:
    # `--tee 3 train.py`: 3 is --tee's value; it was taken for SCRIPT.
    args = parse_launch(build_parser(), ["launch", "--tee", "3", "train.py", "--lr", "1"], 0)
    assert (args.script, args.script_args) == ("train.py", ["--lr", "1"])
    assert args.torchrun_options == (TorchrunOption("tee", ("--tee", "3")),)
    # An abbreviated fshard flag keeps its value too (fshard's parser expands it).
    args = parse_launch(build_parser(), ["launch", "--nnode", "1", "--tee", "3", "train.py"], 0)
    assert (args.nnodes, args.script, len(args.torchrun_options)) == (1, "train.py", 1)


def test_a_local_addr_replaces_fshards() -> None:
    plan = _plan(["--local-addr", "10.0.0.5", "t.py"])
    assert plan.torchrun_args.count("--local-addr") == 1
    assert _flags(plan.torchrun_args)["--local-addr"] == "10.0.0.5"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv-endpoint", "h:1"], "argument --rdzv-endpoint: fshard launch sets it from --master-addr "
         "and --master-port; pass --master-addr HOST --master-port PORT instead"),
        (["--rdzv_endpoint=h:1"], "argument --rdzv_endpoint: fshard launch sets it from --master-addr"),
        (["--standalone"], "argument --standalone: fshard launch sets the rendezvous itself, and on one "
         "machine it already is a local one (127.0.0.1 at a free port); leave --standalone out"),
        (["--no-python=1"], "argument --no-python: ignored explicit argument '1'"),
        (["--log-dir", "--tee", "3"], "argument --log-dir: expected one argument"),
    ],
)  # fmt: skip
def test_torchrun_options_that_fshard_sets_or_that_are_malformed_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--dry-run", *argv, "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fshard launch ") and f"fshard launch: error: {message}" in err
    # A missing value at the end of the command line, too.
    with pytest.raises(SystemExit):
        main(["launch", "--tee"])
    assert "argument --tee: expected one argument" in capsys.readouterr().err


def test_fshards_own_spellings_of_torchrun_options_stay_fshards() -> None:
    # torchrun's spellings of what fshard launch sets are fshard's aliases: passed once.
    plan = _plan(["--nproc_per_node", "3", "--max_restarts=2", "--rdzv_id", "job", "--module", "pkg"])
    flags = _flags(plan.torchrun_args)
    assert (flags["--nproc-per-node"], flags["--max-restarts"], flags["--rdzv-id"]) == ("3", "2", "job")
    assert plan.torchrun_args.count("--module") == 1 and plan.torchrun_args[-1] == "pkg"


def test_module_and_no_python_conflict() -> None:
    with pytest.raises(LaunchError, match=re.escape("-m runs SCRIPT as a Python module and --no-python as a program")):
        _plan(["-m", "--no-python", "pkg.train"])


def test_no_python_looks_for_a_program_not_a_script_file(capsys: pytest.CaptureFixture[str]) -> None:
    # With --no-python, SCRIPT is a program on $PATH (bash), not a file here; none is started.
    assert main(["launch", "--no-python", "fshard-no-such-program", "x"]) == 2
    err = capsys.readouterr().err
    assert "launch: program 'fshard-no-such-program' not found (--no-python runs SCRIPT as a program)" in err


def test_an_abbreviated_torchrun_option_is_unknown_with_its_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--log-d", "x", "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fshard launch: error: unrecognized arguments: --log-d" in err
    assert "\n  hint: --log-d: torchrun's options pass through spelled in full (--log-dir)" in err


def test_num_processes_must_divide_over_machines(tmp_path: Path) -> None:
    config = tmp_path / "odd.yaml"
    config.write_text(yaml.safe_dump(sample("guide", num_processes=3, num_machines=2)))
    with pytest.raises(LaunchError, match=r"num_processes 3 \(the total over all machines\) does not divide evenly over 2"):
        _plan(["--config_file", str(config), "t.py"])


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ({1: (3, 5.0)}, (1, 3)),
        ({0: (1, 5.0), 1: (3, 5.0)}, (1, 3)),  # rank 0 only lost its peer
        ({0: (-15, 5.0), 1: (1, 5.0)}, (1, 1)),  # rank 0 was stopped by torchrun
        ({0: (1, 5.0), 1: (-9, 5.0)}, (1, -9)),  # killed (e.g. out of memory)
        ({0: (1, 6.0), 1: (1, 5.0)}, (1, 1)),  # the earlier one
        ({0: (2, 5.0), 1: (3, 5.0)}, (0, 2)),  # a tie: the lower rank
    ],
)
def test_root_failure(failures: dict[int, tuple[int, float]], expected: tuple[int, int]) -> None:
    assert root_failure(failures) == expected


def test_exit_status_of_signals() -> None:
    assert (exit_status(3), exit_status(-9), exit_status(-15)) == (3, 137, 143)


def test_dry_run_prints_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(GUIDE)
    assert main(["launch", "--dry-run", "--config_file", str(config), "train.py", "--name", "a b"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"FSHARD_CONFIG_FILE={config.resolve()} python -m torch.distributed.run --nnodes 1 --nproc-per-node 2")
    assert out.endswith("train.py --name 'a b'")


def test_launch_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "script" in capsys.readouterr().err
    script = tmp_path / "s.py"
    script.write_text("")
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\n")
    assert main(["launch", "--config_file", str(bad), str(script)]) == 2
    assert "distributed_type: 'DEEPSPEED' is not supported" in capsys.readouterr().err
    assert main(["launch", "--config_file", str(tmp_path / "none.yaml"), str(script)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["launch", "--config_file", str(tmp_path), str(script)]) == 2
    assert f"FSDP config file {str(tmp_path)!r} is a directory, not a file" in capsys.readouterr().err


def test_consolidate_refuses_missing_checkpoint_and_existing_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "consolidate: no checkpoint at" in err and "nope" in err
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"")
    assert main(["consolidate", str(tmp_path), str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err


def _fake_checkpoint(path: Path, created: float) -> None:
    """A directory that fshard.checkpoint takes for a complete checkpoint (a manifest only)."""
    import fshard.checkpoint as ckpt
    from fshard.checkpoint._manifest import manifest_bytes

    path.mkdir()
    body = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "created": created}
    (path / ckpt.MANIFEST).write_bytes(manifest_bytes(body))


def test_consolidate_of_a_run_root_suggests_its_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What examples/train_gpt.py --checkpoint-dir leaves: step-NNNNNN/ checkpoints, the last one
    # half-written by a crash.
    root = tmp_path / "run"
    root.mkdir()
    _fake_checkpoint(root / "step-000003", created=3.0)
    _fake_checkpoint(root / "step-000006", created=6.0)
    (root / "step-000009").mkdir()
    assert _newest_inside_hint(str(root)) == (
        f"; did you mean {root / 'step-000006'} (the newest complete checkpoint there)?"
    )
    # No hint for a checkpoint that is one (or was meant to be), nor for a directory without any.
    assert _newest_inside_hint(str(root / "step-000009")) == ""
    assert _newest_inside_hint(str(root / "step-000006")) == ""
    assert _newest_inside_hint(str(tmp_path / "missing")) == ""
    assert main(["consolidate", str(root), str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{root} is not a complete fshard checkpoint: fshard.json is missing" in err
    assert err.rstrip().endswith(f"did you mean {root / 'step-000006'} (the newest complete checkpoint there)?")


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_consolidate_output_mode_follows_the_umask(
    umask: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # safetensors creates its file 0600; the consolidated model should read like any new file.
    import os

    import torch

    import fshard.checkpoint

    def fake(path: object, out: object, *, optimizer: bool) -> fshard.checkpoint.Consolidated:
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, str(out))  # safetensors' own writer makes it 0600
        return fshard.checkpoint.Consolidated(str(out), 1, 8)

    monkeypatch.setattr(fshard.checkpoint, "consolidate_to", fake)
    out = tmp_path / "model.safetensors"
    previous = os.umask(umask)
    try:
        assert main(["consolidate", str(tmp_path), str(out)]) == 0
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    capsys.readouterr()


def test_consolidate_passes_its_arguments_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # consolidate_to itself (streaming, .pt, dtypes) is tested with fshard.checkpoint; here only
    # the command around it.
    import fshard.checkpoint

    calls: list[tuple[str, str, bool]] = []

    def fake(path: object, out: object, *, optimizer: bool) -> fshard.checkpoint.Consolidated:
        calls.append((str(path), str(out), optimizer))
        Path(str(out)).write_bytes(b"x")
        return fshard.checkpoint.Consolidated(str(out), 3, 3 * 2**20)

    monkeypatch.setattr(fshard.checkpoint, "consolidate_to", fake)
    out = tmp_path / "sub" / "model.safetensors"
    assert main(["consolidate", str(tmp_path), str(out)]) == 0
    assert calls == [(str(tmp_path), str(out), False)]
    assert "wrote 3 tensors (3.0 MiB)" in capsys.readouterr().out
    assert main(["consolidate", "--optimizer", "--force", str(tmp_path), str(out)]) == 0
    assert calls[-1] == (str(tmp_path), str(out), True)
    capsys.readouterr()


def test_python_dash_m_fshard() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fshard", "launch", "--dry-run", "--nproc", "2", "t.py"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--nproc-per-node 2" in result.stdout


def test_several_machines_say_whom_they_wait_for_and_for_how_long() -> None:
    # torchrun waits silently at the rendezvous (up to 600 s by default): say so first.
    plan = _plan(["--nnodes", "2", "--nproc", "8", "--master-addr", "10.0.0.1", "--master-port", "29500", "train.py"])
    assert plan.waiting == (
        "fshard launch: waiting for 2 machines (8 process(es) each, this one included) to join the "
        "c10d rendezvous 10.0.0.1:29500 (id 'fshard'; the same command on each machine, in any order); "
        "gives up after 600 s if they do not come (join_timeout in --rdzv-conf sets it)"
    )  # fmt: skip
    static = _plan(["--rdzv-backend", "static", "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1",
                    "--rdzv-conf", "timeout=120,x=1", "train.py"])  # fmt: skip
    assert static.waiting.startswith("fshard launch: machine 2 of 3 (1 process(es) each) waiting for the others at "
                                     "the static rendezvous 10.0.0.1:29500")  # fmt: skip
    assert static.waiting.endswith("gives up after 120 s if they do not come (timeout in --rdzv-conf sets it)")
    assert _plan(["--nproc", "2", "train.py"]).waiting == ""
