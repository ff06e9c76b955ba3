"""One rank of a small job for the hang-check tests, started by tests/dist/test_hang_check.py.

Run from the repository root: ``python -m tests.dist._hang_child CASE STORE RANK WORLD``. Each
rank prints one JSON line: ``{"rank", "error" (its type name or null), "message", "seconds"}``,
where ``seconds`` is the time from the mistake to the error. Cases:

- ``dead``: rank 1 exits (``os._exit(7)``) after one step; rank 0 goes on to the next step.
- ``stopped``: rank 1 returns after one step (a rank that stopped early); rank 0 goes on.
- ``skipped``: rank 1 skips the second step's forward and backward and exits normally.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import fshard
from fshard.testing import mesh_for


def main(case: str, store: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fshard.fully_shard(model[0], mesh=mesh_for((world,)))
    fshard.fully_shard(model, mesh=mesh_for((world,)))
    model(torch.randn(2, 5)).sum().backward()
    start = time.monotonic()
    out = {"rank": rank, "error": None, "message": "", "seconds": 0.0}
    try:
        if rank == 1:
            if case == "dead":
                os._exit(7)
            print(json.dumps(out), flush=True)  # stopped / skipped: this rank is done
            return
        model(torch.randn(2, 5)).sum().backward()  # rank 0 waits for a peer that is gone
    except Exception as exc:  # the survivor's error is what the test checks
        out.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
        out["is_collective_error"] = isinstance(exc, fshard.CollectiveError)
    print(json.dumps(out), flush=True)
    os._exit(0)  # (the process group's peer is gone: no clean teardown to wait for)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
