"""Train a small GPT-style model with fshard, next to DDP, on synthetic tokens.

Run it on 4 CPU ranks (this is what `make demo` does):

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh 4 --steps 20

`--mesh 4` shards over 4 ranks (FULL_SHARD); `--mesh 2x2` is hybrid sharding (HSDP): replicate
over 2 groups, shard over 2 ranks in each. Every step prints fshard's loss and, with `--ddp`
(the default), the loss of a DistributedDataParallel replica trained on the same data; at the end
each rank's bytes of parameters + gradients + optimizer state are printed next to DDP's.

The model gets one fshard unit per transformer block plus the root (embeddings, final norm and
the head tied to the embedding), and trains with a plain torch.optim.AdamW.

Checkpoints and resuming after a crash: with `--checkpoint-dir D --checkpoint-every K` every rank
saves a sharded checkpoint (`fshard.checkpoint.save`, atomic) to `D/step-NNNNNN` every K steps and
after the last one, and a run started again resumes from the newest complete checkpoint in D. Under
`torchrun --max-restarts 1`, `--crash-at-step S --crash-rank R` makes rank R kill itself at the
start of step S on the first attempt only; torchrun restarts every rank, training resumes, and the
final parameters are bit-identical to an uninterrupted run:

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_gpt.py --no-ddp \
        --steps 8 --checkpoint-dir /tmp/ckpt --checkpoint-every 2 --crash-at-step 5 --crash-rank 1
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fshard
import fshard.checkpoint

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional (pip install fshard[examples])
    tqdm = None


# ------------------------------------------------------------------------------------ the model


@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: belongs to the root unit
        for module in self.modules():  # GPT-2 style init: small weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------------------------- the data


def synthetic_batch(cfg: GPTConfig, batch: int, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences from a fixed random bigram table: learnable, different on every rank."""
    table = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=table)
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=gen)
    choice = torch.randint(0, 4, (batch, cfg.seq), generator=gen)
    for t in range(cfg.seq):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------- the training


def parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like 4 or 2x2, got {text!r}") from None
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh must be N (1D) or RxS (2D), got {text!r}")
    return shape


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``minimum``, else a usage error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (``fshard.memory_stats``
    counts them for any model: a sharded parameter counts its local shard)."""
    stats = fshard.memory_stats(model, optimizer)
    return {"params": stats.param_bytes, "grads": stats.grad_bytes, "optim": stats.optim_bytes}


def init_process_group(backend: str) -> None:
    """``dist.init_process_group`` that also works after a torchrun restart.

    torchrun (torch 2.13) keeps one TCPStore for every restart attempt and gives the workers no
    per-attempt prefix, so a restarted worker can read the address a killed worker published and
    hang or fail in gloo's connect. Prefixing the store with the attempt number keeps them apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world)


def pick_device(choice: str) -> torch.device:
    """This rank's device for ``--device``: ``auto`` takes a GPU per local rank when the machine
    has one for each (NCCL needs a GPU per rank), else the CPU (gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if choice == "auto":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        choice = "cuda" if enough else "cpu"
    if choice == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(
                f"--device cuda: local rank {local_rank} has no GPU ({torch.cuda.device_count()} "
                "visible); start one process per GPU, or use --device cpu"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", type=parse_mesh, default=None, help="N or RxS (default: world size)")
    parser.add_argument("--steps", type=at_least(1), default=20, help="optimizer steps in all (at least 1)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", action=argparse.BooleanOptionalAction, default=True, help="train a DDP replica alongside for comparison")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here and resume from the newest")
    parser.add_argument("--checkpoint-every", type=at_least(0), default=0, help="save every K steps (0: only after the last step)")
    parser.add_argument("--crash-at-step", type=int, default=None, help="testing: a rank kills itself at the start of this step (first attempt only)")
    parser.add_argument("--crash-rank", type=int, default=0, help="testing: the rank that --crash-at-step kills")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU per rank if there are enough, else CPU ranks over gloo")
    args = parser.parse_args(argv)

    device = pick_device(args.device)
    init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = args.mesh or (world,)
    if math.prod(shape) != world:
        parser.error(f"--mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} ranks, but {world} were started")
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)

    cfg = GPTConfig(vocab=args.vocab, layers=args.layers, dim=args.dim)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fshard.fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    fshard.fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start_step = 0
    resume_from = fshard.checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    if resume_from is not None:
        extra = fshard.checkpoint.load(resume_from, model, optimizer)
        start_step = extra["step"]
        torch.set_rng_state(extra["rng"])
        if rank == 0:
            print(f"resuming from {resume_from} at step {start_step}")
        if args.ddp:  # the DDP replica is not checkpointed: comparing with it would mislead
            args.ddp = False
            if rank == 0:
                print("(DDP comparison off: the replica is not part of the checkpoint)")
        if start_step >= args.steps:
            if rank == 0:
                print(f"{resume_from} is already at step {start_step} of {args.steps}: nothing to do")
            dist.destroy_process_group()
            return 0

    ddp = ddp_optimizer = None
    if args.ddp:
        torch.manual_seed(args.seed)
        ddp = nn.parallel.DistributedDataParallel(GPT(cfg).to(device), device_ids=[device] if device.type == "cuda" else None)
        ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    n_params = sum(p.full_shape.numel() if fshard.is_sharded(p) else p.numel() for p in model.parameters())
    if rank == 0:
        print(f"GPT with {n_params / 1e6:.2f}M parameters, {cfg.layers} blocks, mesh {'x'.join(map(str, shape))} over {world} ranks ({device.type})")
    bar = tqdm(total=args.steps, initial=start_step, disable=rank != 0 or None, file=sys.stderr, desc="train") if tqdm else None
    start = time.perf_counter()
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    for step in range(start_step, args.steps):
        if step == args.crash_at_step and rank == args.crash_rank and first_attempt:
            print(f"rank {rank}: crashing at step {step} (--crash-at-step)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = synthetic_batch(cfg, args.batch, step, rank, device)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        if step == args.steps - 1:  # gradients and optimizer state both exist here
            fshard_bytes = state_bytes(model, optimizer)
        optimizer.zero_grad()
        line = f"step {step:3d}  loss {loss.item():.4f}"
        if ddp is not None and ddp_optimizer is not None:
            ddp_loss = F.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten())
            ddp_loss.backward()
            ddp_optimizer.step()
            if step == args.steps - 1:
                ddp_bytes = state_bytes(ddp.module, ddp_optimizer)
            ddp_optimizer.zero_grad()
            line += f"   ddp loss {ddp_loss.item():.4f}"
        if rank == 0:
            (bar.write if bar is not None else print)(line)
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or (args.checkpoint_every and done % args.checkpoint_every == 0)):
            path = os.path.join(args.checkpoint_dir, f"step-{done:06d}")
            fshard.checkpoint.save(path, model, optimizer, extra={"step": done, "rng": torch.get_rng_state()})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    report = {"fshard": fshard_bytes, "ddp": ddp_bytes if ddp is not None else None}
    reports: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(reports, report)
    if rank == 0:
        print(f"\n{args.steps - start_step} steps in {elapsed:.1f}s. Per-rank bytes after the last step (params + grads + AdamW state):")
        header = f"{'rank':>4}  {'fshard params':>13} {'grads':>10} {'optim':>10} {'total':>10}"
        if ddp is not None:
            header += f"   {'DDP total':>10}  {'fshard/DDP':>10}"
        print(header)
        for r, rep in enumerate(reports):
            f = rep["fshard"]
            total = f["params"] + f["grads"] + f["optim"]
            row = f"{r:>4}  {f['params']:>13,} {f['grads']:>10,} {f['optim']:>10,} {total:>10,}"
            if rep["ddp"] is not None:
                d = sum(rep["ddp"].values())
                row += f"   {d:>10,}  {total / d:>10.3f}"
            print(row)
    # Drop DDP's reducer (it holds a process group) before tearing the groups down: destroying
    # a gloo group from a Python destructor at interpreter exit can deadlock (a torch race).
    del ddp, ddp_optimizer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
