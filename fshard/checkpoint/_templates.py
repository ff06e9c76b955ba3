"""Empty tensors, laid out like this run's shards, to read saved optimizer state into (fshard's
checkpoints and plain DCP directories alike).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fshard._errors import ProblemList
from fshard._param import ParamSlot
from fshard._state_dict._common import model_entries, param_names
from fshard._state_dict._optim_checks import STRICT_HINT
from fshard._unit._module_state_dict import as_dtensor


def optim_template(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    desc: Mapping[str, Any],
    where: str,
    *,
    strict: bool,
) -> dict[str, dict[str, Any]]:
    """Empty tensors to load the saved optimizer state into, laid out like this run's params.

    With ``strict=False`` the state of parameters the optimizer does not hold is left out (not
    read); otherwise it is an error.
    """
    names = param_names(model_entries(model, where))
    by_name: dict[str, tuple[ParamSlot | None, torch.Tensor]] = {}
    on_device_step: set[str] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in names:
                name, slot = names[id(p)]
                by_name[name] = (slot, p)
                if group.get("capturable") or group.get("fused"):
                    on_device_step.add(name)
    problems = ProblemList(where)
    out: dict[str, dict[str, Any]] = {}
    for name, entries in desc["state"].items():
        if name not in by_name:
            if strict:
                problems.add(
                    f"the checkpoint has optimizer state for {name!r}, which the optimizer does "
                    "not hold"
                )
            continue
        slot, param = by_name[name]
        per: dict[str, Any] = {}
        for key, d in entries.items():
            if d["kind"] == "object":
                per[key] = None
                continue
            dtype = getattr(torch, d["dtype"])
            shape = tuple(d["shape"])
            if key == "step" and name not in on_device_step:
                # As torch's optimizers keep it: on the CPU unless capturable or fused (a step
                # on the GPU costs two host syncs per parameter and step). Also the step of a
                # 0-d parameter, shaped like it and so saved as its (replicated) shard.
                per[key] = torch.empty(shape, dtype=dtype, device="cpu")
            elif d["kind"] == "sharded" and slot is not None:
                if shape != tuple(slot.layout.full_shape):
                    problems.add(
                        f"optimizer state {name!r}[{key!r}]: shape mismatch, the checkpoint has "
                        f"{list(shape)} but the parameter has {list(slot.layout.full_shape)}"
                    )
                    continue
                local = torch.empty(slot.layout.local_shape, dtype=dtype, device=param.device)
                per[key] = as_dtensor(slot, local)
            else:
                per[key] = torch.empty(shape, dtype=dtype, device=param.device)
        out[name] = per
    problems.raise_if_any(ValueError, hint=STRICT_HINT if strict else "")
    return out
