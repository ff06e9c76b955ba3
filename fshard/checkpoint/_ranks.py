"""Every rank raises if one failed: checkpoints are collective, and a rank left alone would
wait in the next collective.
"""

from __future__ import annotations

import torch.distributed as dist

from fshard import _collectives
from fshard.checkpoint._manifest import CheckpointError


def require_dist(where: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where} is collective: initialise the process group first (torchrun, "
            "torch.distributed.init_process_group); use fshard.checkpoint.consolidate to read a "
            "checkpoint in one process"
        )


def raise_if_any_rank_failed(
    error: str | None, where: str, label: str, error_type: type[Exception] = CheckpointError
) -> None:
    """Every rank raises if one did, so no rank is left waiting in the next collective."""
    errors = _collectives.all_gather_objects_by_rank(error, None, label=label)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if len(set(failed.values())) == 1:
        raise error_type(f"{where}: {next(iter(failed.values()))} (on rank(s) {sorted(failed)})")
    if failed:
        body = "\n".join(f"  rank {r}: {e}" for r, e in failed.items())
        raise error_type(f"{where} failed on rank(s) {sorted(failed)}:\n{body}")
