"""What the demo-model benchmarks share: the model and mesh flags, the process group and mesh
set-up, and small measuring helpers. The model and data come from ``examples/train_gpt.py``
itself, so the benchmarks measure what users run."""

from __future__ import annotations

import argparse
import gc
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPTConfig, parse_mesh, pick_device

MiB = 1 << 20


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--mesh``, the demo GPT's sizes (train_gpt.py's defaults), ``--device``, ``--batch``,
    ``--lr`` and ``--seed``."""
    parser.add_argument(
        "--mesh", type=parse_mesh, default=None, help="N or RxS (default: world size)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128, help="as train_gpt.py's demo")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: a GPU per rank if there are enough, else CPU ranks over gloo",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)


class Setup(NamedTuple):
    device: torch.device
    rank: int
    world: int
    mesh: DeviceMesh
    shape: tuple[int, ...]
    cfg: GPTConfig


def set_up(args: argparse.Namespace) -> Setup | None:
    """Start the process group (NCCL on GPUs, else gloo) and the mesh of ``--mesh``; None (after
    saying why on rank 0) when the mesh does not fit the ranks started."""
    device = pick_device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = args.mesh or (world,)
    if math.prod(shape) != world:
        if rank == 0:
            print(
                f"--mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} ranks, but {world} were started",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return None
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    cfg = GPTConfig(
        vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers
    )
    return Setup(device, rank, world, mesh, tuple(shape), cfg)


@contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector off, so that it does not run inside a timed region."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def mib(n: float) -> str:
    return f"{n / MiB:.2f}"


def parse_with_variants(
    parser: argparse.ArgumentParser, argv: list[str] | None, variants: tuple[str, ...]
) -> argparse.Namespace:
    """Add ``--variants`` (a comma-separated subset of ``variants``) and ``--json``, then parse;
    ``args.variants`` is the list asked for, in order, each once."""
    parser.add_argument(
        "--variants",
        default=",".join(variants),
        help=f"comma separated subset of {','.join(variants)}",
    )
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="also write the figures here (rank 0)"
    )
    args = parser.parse_args(argv)
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    unknown = [v for v in args.variants if v not in variants]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(variants)}")
    return args


def print_columns(columns: list[tuple[str, str]], rows: list[list[str]]) -> None:
    """A plain-text table: ``columns`` are (title, alignment: "<" or ">"), ``rows`` the cells."""
    widths = [
        max(len(title), *(len(row[i]) for row in rows)) for i, (title, _) in enumerate(columns)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            f"{cell:{align}{width}}"
            for cell, (_, align), width in zip(cells, columns, widths, strict=True)
        ).rstrip()

    print()
    print(line([title for title, _ in columns]))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    print()
