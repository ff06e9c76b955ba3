"""The core property: fshard trains exactly like DDP.

Hypothesis draws the model (MLPs with corner cases, tiny transformers), the world size (1-4),
the mesh (1D or 2D), reshard_after_forward (a bool or an int), the optimizer, the number of steps and gradient
accumulation; every example runs on a persistent pool of gloo ranks next to real DDP.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from fshard.testing import assert_equivalent_to_ddp
from fshard.testing import strategies as fst
from fshard.testing.models import MLPSpec, ModelSpec, build_model, compute_loss, make_batch, shard_model

OPTIMIZERS = {
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
}


# The models avoid parameters whose gradient is exactly zero in theory (a key bias, a LayerNorm over
# fewer than three features): AdamW would turn their rounding noise into lr-sized updates.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-9, 1e-11)}


@st.composite
def cases(draw: st.DrawFn) -> dict:
    world_size = draw(st.integers(1, 4))
    optimizer = draw(st.sampled_from(sorted(OPTIMIZERS)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    spec: ModelSpec = draw(fst.model_specs(dtype=dtype))
    mesh_shape = draw(fst.mesh_shapes(world_size=world_size))
    shard = mesh_shape[-1]
    # A bool, or an int dividing the shard dimension (resharding to that many ranks).
    ints = [d for d in range(1, shard + 1) if shard % d == 0]
    return {
        "spec": spec,
        "world_size": world_size,
        "mesh_shape": mesh_shape,
        "reshard_after_forward": draw(st.one_of(st.booleans(), st.sampled_from(ints))),
        "optimizer": optimizer,
        "steps": draw(st.integers(1, 3)),
        "grad_accum": draw(st.integers(1, 2)),
        "reduce_scatter_accumulation": draw(st.booleans()),
        "optimizer_before_shard": draw(st.booleans()),
    }


def run_case(case: dict) -> None:
    spec = case["spec"]
    unused = isinstance(spec, MLPSpec) and spec.skip_layer is not None
    report = assert_equivalent_to_ddp(
        functools.partial(build_model, spec),
        batch_fn=functools.partial(make_batch, spec),
        loss_fn=functools.partial(compute_loss, spec),
        shard_fn=functools.partial(shard_model, spec, reshard_after_forward=case["reshard_after_forward"]),
        optim_fn=OPTIMIZERS[case["optimizer"]],
        world_size=case["world_size"],
        mesh_shape=case["mesh_shape"],
        steps=case["steps"],
        grad_accum=case["grad_accum"],
        reduce_scatter_accumulation=case["reduce_scatter_accumulation"],
        optimizer_before_shard=case["optimizer_before_shard"],
        ddp_kwargs={"find_unused_parameters": True} if unused else None,
        rtol=TOLERANCES[spec.dtype][0],
        atol=TOLERANCES[spec.dtype][1],
    )
    note(f"max parameter difference vs DDP: {report.max_param_diff:.3g}")


@given(case=cases())
def test_training_equals_ddp(case: dict) -> None:
    run_case(case)


class _Stacked(torch.nn.Module):
    """Blocks in an ``nn.ModuleList``, as most models keep them, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _stacked_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))


def test_the_defaults_take_a_module_list_and_keep_float64() -> None:
    """With no ``shard_fn``, the blocks of a child ``nn.ModuleList`` become units (sharding the
    list itself is refused: it has no forward), and a float64 model's default loss is float64."""
    report = assert_equivalent_to_ddp(_Stacked, batch_fn=_stacked_batch, world_size=2, steps=2, rtol=1e-9, atol=1e-11)
    want = _Stacked()(_stacked_batch(0, 0)).pow(2).mean().item()  # rank 0's first loss
    assert abs(report.losses[0][0] - want) <= 1e-15 * abs(want), (report.losses[0][0], want)
