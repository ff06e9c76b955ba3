"""``fshard bench``'s flags, and the ``BenchSpec`` they become (what every rank runs).

The parser is built here and nowhere else: ``fshard/cli.py`` adds it as the ``bench``
sub-command. ``spec_from_args`` checks every flag and raises ``BenchUsageError`` listing all
the problems at once; the spec travels to the ranks as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IMPLS",
    "BenchSpec",
    "BenchUsageError",
    "add_arguments",
    "add_bench_parser",
    "parse_mesh",
    "spec_from_args",
]

IMPLS = ("fshard", "ddp", "fsdp2")


class BenchUsageError(ValueError):
    """Flags of ``fshard bench`` that do not fit together."""


@dataclass(frozen=True)
class BenchSpec:
    """What to run on every rank. ``model``/``batch_fn`` are ``pkg.module:name`` or None (the
    built-in GPT and its batches); ``by_class``/``min_params``/``config_file`` pick the units
    (none of them: one unit per block, see ``_workload.default_units``)."""

    impls: tuple[str, ...] = IMPLS
    model: str | None = None
    batch_fn: str | None = None
    layers: int = 4
    dim: int = 128
    heads: int = 4
    seq: int = 64
    vocab: int = 128
    batch: int = 8
    by_class: tuple[str, ...] = ()
    min_params: int | None = None
    config_file: str | None = None
    reshard_after_forward: bool = True
    coalesce: int | None = None  # fshard.set_coalescing's max_bytes (None: fshard's default)
    nproc: int = 2
    mesh: tuple[int, ...] = (2,)
    device: str = "cpu"
    mp: str | None = None
    steps: int = 10
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        data: dict[str, Any] = json.loads(text)
        for name in ("impls", "by_class", "mesh"):
            data[name] = tuple(data[name])
        return cls(**data)


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"4"`` -> ``(4,)``, ``"2x2"`` -> ``(2, 2)`` (replicate x shard).

    Example:
        >>> from fshard._bench._spec import parse_mesh
        >>> parse_mesh("2x3")
        (2, 3)
    """
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like 4 or 2x2, got {text!r}") from None
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh must be N (1D) or RxS (2D), got {text!r}")
    return shape


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fshard bench``'s flags (see ``fshard bench --help``)."""
    work = parser.add_argument_group("workload (default: the built-in GPT)")
    work.add_argument(
        "--model", metavar="MOD:FACTORY",
        help="your model: FACTORY() in module MOD (importable from the current directory) "
        "returns the nn.Module; called once per implementation after the same seed",
    )
    work.add_argument(
        "--batch-fn", "--batch_fn", metavar="MOD:FN",
        help="FN(step, rank, device) returns the batch: (inputs, target) or a dict of "
        "keyword arguments (see the contract below); needed with --model",
    )
    for flag, default, text in (
        ("--layers", 4, "GPT blocks"), ("--dim", 128, "GPT width"), ("--heads", 4, "GPT heads"),
        ("--seq", 64, "GPT sequence length"), ("--vocab", 128, "GPT vocabulary"),
        ("--batch", 8, "GPT sequences per rank per step"),
    ):  # fmt: skip
        work.add_argument(flag, type=_positive, default=default, metavar="N", help=f"{text} (default: {default})")
    wrap = parser.add_argument_group("units (the same for fshard and FSDP2; default: one per block + root)")
    wrap.add_argument(
        "--by-class", "--by_class", metavar="NAME", action="append", default=[],
        help="a unit per submodule of this class name (repeatable)",
    )
    wrap.add_argument(
        "--min-params", "--min_params", type=_positive, metavar="N",
        help="a unit per submodule with at least N parameters not in a smaller unit",
    )
    wrap.add_argument(
        "--config_file", "--config-file", metavar="FILE",
        help="an accelerate config (YAML): its wrap policy, sharding strategy (reshard after "
        "forward or not) and mixed precision",
    )
    wrap.add_argument(
        "--no-reshard", action="store_true",
        help="keep units gathered from forward to backward (ZeRO-2, SHARD_GRAD_OP)",
    )
    wrap.add_argument(
        "--coalesce", type=_non_negative, metavar="BYTES",
        help="fshard only: adjacent small units share collectives up to BYTES "
        "(fshard.set_coalescing; default 1 MiB, 0: a collective per unit, as FSDP2)",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--impl", default=",".join(IMPLS), metavar="LIST",
        help=f"comma-separated implementations, from {','.join(IMPLS)} (default: all)",
    )
    run.add_argument("--nproc", type=_positive, metavar="N", help="ranks to start (default: the mesh's size, else 2)")
    run.add_argument("--mesh", type=parse_mesh, metavar="N|RxS", help="N (shard over N) or RxS (replicate R x shard S); default: --nproc")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    run.add_argument("--mp", choices=("bf16",), help="bf16 compute, fp32 shards and gradient reduction (DDP: autocast)")
    run.add_argument("--steps", type=_positive, default=10, metavar="N", help="measured steps per implementation (default: 10)")
    run.add_argument("--warmup", type=_non_negative, default=2, metavar="N", help="untimed steps first (default: 2)")
    run.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    run.add_argument("--seed", type=int, default=0, help="model seed, the same for every implementation")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write every figure to FILE (schema: see the docs)")
    out.add_argument("--plot", metavar="FILE.png", help="plot step time and memory per rank (needs fshard[plot])")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    """The spec of parsed flags; ``BenchUsageError`` lists every problem."""
    problems: list[str] = []
    impls = tuple(dict.fromkeys(i.strip() for i in args.impl.split(",") if i.strip()))
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        problems.append(f"--impl: unknown {', '.join(unknown) or '(empty)'}; choose from {','.join(IMPLS)}")
    if args.batch_fn and not args.model:
        problems.append("--batch-fn makes the batches of --model; give --model MOD:FACTORY too")
    if args.model and not args.batch_fn:
        problems.append("--model needs --batch-fn MOD:FN: the batches for your model")
    for flag, value in (("--model", args.model), ("--batch-fn", args.batch_fn)):
        if value and (value.count(":") != 1 or not all(value.split(":"))):
            problems.append(f"{flag} must look like pkg.module:name, got {value!r}")
    policies = [f for f, v in (("--by-class", args.by_class), ("--min-params", args.min_params), ("--config_file", args.config_file)) if v]
    if len(policies) > 1:
        problems.append(f"{' and '.join(policies)}: give one way to pick the units")
    if args.config_file and args.no_reshard:
        problems.append("--no-reshard and --config_file: the file's sharding strategy says whether units reshard")
    if args.dim % args.heads:
        problems.append(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    mesh = args.mesh or ((args.nproc,) if args.nproc else (2,))
    nproc = args.nproc or math.prod(mesh)
    if math.prod(mesh) != nproc:
        problems.append(f"--mesh {'x'.join(map(str, mesh))} has {math.prod(mesh)} ranks, but --nproc is {nproc}")
    if problems:
        raise BenchUsageError("; ".join(problems))
    return BenchSpec(
        impls=impls, model=args.model, batch_fn=args.batch_fn, layers=args.layers, dim=args.dim,
        heads=args.heads, seq=args.seq, vocab=args.vocab, batch=args.batch,
        by_class=tuple(args.by_class), min_params=args.min_params, config_file=args.config_file,
        reshard_after_forward=not args.no_reshard, coalesce=args.coalesce, nproc=nproc, mesh=tuple(mesh),
        device=args.device, mp=args.mp, steps=args.steps, warmup=args.warmup, lr=args.lr,
        seed=args.seed,
    )  # fmt: skip


DESCRIPTION = """\
Run a training step under fshard, DDP and torch's FSDP2 on N ranks of this machine (started
through torch.distributed.run, rendezvous at 127.0.0.1), interleaved step by step, and report
per implementation: step time (median, p25-p75, forward/backward/optimizer, ratio to DDP),
persistent bytes per rank (params, grads, AdamW state) beside the ZeRO theory, the peak of live
tensor bytes in a step, and the collectives of a step (calls and bytes per type) beside the
theory. The workload is the built-in GPT (size flags) or your model (--model, --batch-fn).

--batch-fn MOD:FN: FN(step, rank, device) returns (inputs, target), and the loss is
cross_entropy (integer target) or mse_loss (float target) of model(inputs); or it returns a
dict, the model is called as model(**batch) and returns the loss (or an object with .loss).
"""

EPILOG = """\
examples:
  fshard bench --nproc 2
  fshard bench --nproc 4 --mesh 2x2 --layers 8 --dim 384 --json out.json --plot out.png
  fshard bench --nproc 2 --model mypkg.models:build --batch-fn mypkg.models:make_batch \\
      --by-class Block --impl fshard,fsdp2
"""


def add_bench_parser(commands: Any, formatter_class: type[argparse.HelpFormatter]) -> None:
    """Register ``bench`` on ``fshard``'s sub-command parsers."""
    bench = commands.add_parser(
        "bench",
        help="time a training step and count memory and traffic: fshard next to DDP and FSDP2",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=formatter_class,
    )
    add_arguments(bench)
