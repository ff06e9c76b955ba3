"""DCP checkpoints move between fshard and torch's own FSDP2, both ways."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import fshard
import fshard.checkpoint
from fshard.testing import get_pool, mesh_for
from tests.dist import _sd_common as C


def _fsdp2_model(mesh_shape, seed):
    model = C.build(seed=seed)
    mesh = mesh_for(mesh_shape)
    for block in model.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(model, mesh=mesh)
    return model


def _fsdp2_full(model):
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in model.state_dict().items()
    }


def _fshard_to_fsdp2_task(path, mesh_shape):
    source = C.build_sharded(mesh_shape)
    C.train(source, C.make_optim(source), range(1))  # weights differ from any fresh init
    want = C.full_params(source)
    dcp.save(fshard.state_dict(source), checkpoint_id=path + "/plain")
    fshard.checkpoint.save(path + "/fshard", source)

    target = _fsdp2_model(mesh_shape, seed=31)
    sd = target.state_dict()
    dcp.load(sd, checkpoint_id=path + "/plain")
    target.load_state_dict(sd)
    C.assert_same_tensors(_fsdp2_full(target), want, what="FSDP2 from fshard's DCP checkpoint")

    target = _fsdp2_model(mesh_shape, seed=32)
    sd = {"model": target.state_dict()}
    dcp.load(sd, checkpoint_id=path + "/fshard")  # fshard.checkpoint's own directory
    target.load_state_dict(sd["model"])
    C.assert_same_tensors(_fsdp2_full(target), want, what="FSDP2 from fshard.checkpoint")
    # And the in-memory way: an FSDP2 state dict loads straight into fshard.
    third = C.build_sharded(mesh_shape, seed=33)
    fshard.load_state_dict(third, target.state_dict())
    C.assert_same_tensors(C.full_params(third), want, what="fshard from FSDP2's DTensors")
    return True


def _fsdp2_to_fshard_task(path, save_mesh, load_mesh):
    source = _fsdp2_model(save_mesh, seed=3)
    opt = C.make_optim(source)
    rank, world = dist.get_rank(), dist.get_world_size()
    C.loss_of(source, C.rank_batch(0, rank, world)).backward()
    opt.step()
    want = _fsdp2_full(source)
    dcp.save(source.state_dict(), checkpoint_id=path)

    target = C.build_sharded(load_mesh, seed=34)
    sd = fshard.state_dict(target)
    dcp.load(sd, checkpoint_id=path)
    fshard.load_state_dict(target, sd)
    C.assert_same_tensors(C.full_params(target), want, what="fshard from FSDP2's DCP checkpoint")
    return True


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_fshard_checkpoint_loads_into_fsdp2(tmp_path, mesh_shape):
    assert all(get_pool(4).run(_fshard_to_fsdp2_task, str(tmp_path), mesh_shape))


@pytest.mark.parametrize(("save_mesh", "load_mesh"), [((4,), (4,)), ((2, 2), (4,))])
def test_fsdp2_checkpoint_loads_into_fshard(tmp_path, save_mesh, load_mesh):
    assert all(get_pool(4).run(_fsdp2_to_fshard_task, str(tmp_path / "ckpt"), save_mesh, load_mesh))


def _optimizer_both_ways_task(path: str) -> bool:
    """Model and AdamW state saved by FSDP2 resume in fshard, and the reverse; each resumed
    run's next step equals the one the saving run takes."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    source = _fsdp2_model((4,), seed=3)
    source_opt = C.make_optim(source)
    C.train(source, source_opt, range(2))
    dcp.save({"model": source.state_dict(), "optim": get_optimizer_state_dict(source, source_opt)},
             checkpoint_id=path + "/fsdp2")  # fmt: skip
    C.train(source, source_opt, range(2, 3))
    want = _fsdp2_full(source)

    target = C.build_sharded((2, 2), seed=34)
    target_opt = C.make_optim(target)
    template = {"model": fshard.state_dict(target), "optim": fshard.optim_state_dict(target, target_opt)}
    template["optim"].pop("optimizer_class")  # fshard's own key, which FSDP2 does not write
    dcp.load(template, checkpoint_id=path + "/fsdp2")
    fshard.load_state_dict(target, template["model"])
    fshard.load_optim_state_dict(target, target_opt, template["optim"])
    C.train(target, target_opt, range(2, 3))
    C.assert_same_tensors(C.full_params(target), want, what="fshard resumed from FSDP2", exact=False)  # other mesh: other sum order

    # The reverse: fshard's checkpoint into FSDP2 (its template asks for no optimizer_class).
    dcp.save({"model": fshard.state_dict(target), "optim": fshard.optim_state_dict(target, target_opt)},
             checkpoint_id=path + "/fshard")  # fmt: skip
    C.train(target, target_opt, range(3, 4))
    want = C.full_params(target)
    back = _fsdp2_model((4,), seed=35)
    back_opt = C.make_optim(back)
    C.train(back, back_opt, range(1))  # (FSDP2's optimizer template needs state to exist)
    sd = {"model": back.state_dict(), "optim": get_optimizer_state_dict(back, back_opt)}
    dcp.load(sd, checkpoint_id=path + "/fshard")
    back.load_state_dict(sd["model"])
    set_optimizer_state_dict(back, back_opt, sd["optim"])
    C.train(back, back_opt, range(3, 4))
    C.assert_same_tensors(_fsdp2_full(back), want, what="FSDP2 resumed from fshard", exact=False)
    return True


def test_optimizer_state_moves_between_fsdp2_and_fshard(tmp_path):
    """The documented recipe: fshard's template without its ``optimizer_class`` key reads an
    FSDP2 checkpoint's AdamW state (with it, DCP asks the checkpoint for that key)."""
    assert all(get_pool(4).run(_optimizer_both_ways_task, str(tmp_path), timeout=120))


# ------------------------------------------- torch.distributed.checkpoint.state_dict helpers


def _dcp_state_dict_api_task(mesh_shape):
    """``get_model_state_dict`` / ``set_model_state_dict``, which HF, accelerate and torchtitan
    call, work on an fshard model through ``model.state_dict()`` / ``load_state_dict()``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model = C.build_sharded(mesh_shape)
    sharded = get_model_state_dict(model)
    ours = fshard.state_dict(model)
    assert list(sharded) == list(ours)
    for key, value in ours.items():
        if isinstance(value, DTensor):
            assert isinstance(sharded[key], DTensor) and sharded[key].placements == value.placements, key
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    want = C.build().state_dict()
    if dist.get_rank() == 0:
        C.assert_same_tensors(full, want, what="full")
    other = C.build(seed=5).state_dict()
    set_model_state_dict(model, other, options=StateDictOptions(full_state_dict=True))
    C.assert_same_tensors(C.full_params(model), C.build(seed=5).state_dict(), what="set full")
    source = want if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, source, options=options)
    C.assert_same_tensors(C.full_params(model), C.build().state_dict(), what="broadcast")
    return True


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_torch_state_dict_helpers_work_on_fshard_models(mesh_shape):
    assert all(get_pool(4).run(_dcp_state_dict_api_task, mesh_shape))


# ------------------------------------------------ the DCP resume recipe, fresh optimizer


def _dcp_resume_task(path, save_mesh, load_mesh):
    """torchtitan's resume: a fresh job builds the state dicts as templates, ``dcp.load`` reads
    the checkpoint into them, then they are loaded. A fresh optimizer has no state to read
    into: the template must still have Adam's moments and step, or the resumed run starts
    them again without a word."""
    source = C.build_sharded(save_mesh)
    opt = C.make_optim(source)
    C.train(source, opt, range(2))
    dcp.save({"model": fshard.state_dict(source), "optim": fshard.optim_state_dict(source, opt)}, checkpoint_id=path)
    C.train(source, opt, range(2, 4))
    want = C.full_params(source)

    target = C.build_sharded(load_mesh, seed=35)
    fresh = C.make_optim(target)
    stepped = []
    fresh.register_step_post_hook(lambda *_: stepped.append(True))  # an EMA update, say
    before = C.full_params(target)
    template = {"model": fshard.state_dict(target), "optim": fshard.optim_state_dict(target, fresh)}
    # The template is made without touching the optimizer, its hooks or the params.
    assert not fresh.state and not stepped
    assert all(p.grad is None for p in target.parameters())
    C.assert_same_tensors(C.full_params(target), before, what="params after the template")
    exp_avg = template["optim"]["state"]["blocks.0.qkv.weight"]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and exp_avg.shape == target.blocks[0].qkv.weight.full_shape
    dcp.load(template, checkpoint_id=path)
    fshard.load_state_dict(target, template["model"])
    fshard.load_optim_state_dict(target, fresh, template["optim"])
    C.train(target, fresh, range(2, 4))
    # (on another mesh shape the gradient sums round differently)
    exact = save_mesh == load_mesh
    C.assert_same_tensors(C.full_params(target), want, exact=exact, what="resumed through dcp.load")
    return True


@pytest.mark.parametrize(("save_mesh", "load_mesh"), [((4,), (4,)), ((4,), (2, 2))], ids=str)
def test_dcp_resume_into_a_fresh_optimizer(tmp_path, save_mesh, load_mesh):
    assert all(get_pool(4).run(_dcp_resume_task, str(tmp_path / "ckpt"), save_mesh, load_mesh))


class _WithPooler(nn.Module):
    """A body the loss uses and a pooler it never does (BERT's under an MLM loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.pooler = nn.Linear(4, 4)
        self.use_pooler = False  # (a head that starts training later)
        # (float32: torch's Optimizer.load_state_dict casts NAdam's float32 mu_product to a
        # float64 param's dtype, so a resumed float64 run differs from an uninterrupted one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.body(x))
        return out + self.pooler(x) if self.use_pooler else out


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "rprop": lambda params: torch.optim.Rprop(params, lr=0.01),
    "nadam": lambda params: torch.optim.NAdam(params, lr=0.01),
    "asgd": lambda params: torch.optim.ASGD(params, lr=0.01),
}


def _pooler_run(
    optimizer: str, path: str, save_at: int, steps: int, pooler_from: int | None = None
) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps; with ``path``, a fresh run first resumes from the DCP
    checkpoint saved after ``save_at`` steps (``save_at`` < 0: this run saves it). With
    ``pooler_from``, the pooler trains from that step on, and a scheduler halves the learning
    rate every step."""
    model = _WithPooler()
    fshard.fully_shard(model.body, mesh=mesh_for((2,)))
    fshard.fully_shard(model, mesh=mesh_for((2,)))
    opt = OPTIMIZERS[optimizer](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if pooler_from is not None else None
    start = 0
    if save_at >= 0:  # resume: the template of a fresh job, then dcp.load
        template = {"model": fshard.state_dict(model), "optim": fshard.optim_state_dict(model, opt)}
        dcp.load(template, checkpoint_id=path)
        fshard.load_state_dict(model, template["model"])
        fshard.load_optim_state_dict(model, opt, template["optim"])
        if scheduler is not None:
            scheduler.last_epoch = save_at  # (its state dict would say so)
        start = save_at
    for step in range(start, steps):
        if save_at < 0 and step == -save_at - 1:
            dcp.save({"model": fshard.state_dict(model), "optim": fshard.optim_state_dict(model, opt)}, checkpoint_id=path)
        model.use_pooler = pooler_from is not None and step >= pooler_from
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return fshard.full_state_dict(model, rank0_only=False)


def _resume_task(optimizer: str, path: str, save_at: int, pooler_from: int | None = None) -> bool:
    steps = 3 if pooler_from is None else 4
    want = _pooler_run(optimizer, path, -(save_at + 1), steps, pooler_from)  # saves before step ``save_at``
    got = _pooler_run(optimizer, path, save_at, steps, pooler_from)
    C.assert_same_tensors(got, want, what=f"{optimizer} resumed at step {save_at}")
    return True


@pytest.mark.parametrize("save_at", [0, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_dcp_resume_with_an_unused_parameter_and_from_before_the_first_step(tmp_path, optimizer, save_at):
    """A parameter that never gets a gradient has state in the checkpoint too (the fresh
    template asks for it: dcp.load raised "Missing key"), and a checkpoint saved before the
    first step resumes exactly as a fresh run (the template's one-step state was saved as
    real state: Rprop's step size clamped from lr 0, NAdam's mu_product, ASGD's eta)."""
    assert all(get_pool(2).run(_resume_task, optimizer, str(tmp_path / "ckpt"), save_at))


@pytest.mark.parametrize("save_at", [0, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_dcp_resume_of_a_parameter_that_starts_training_after_the_learning_rate_changed(
    tmp_path, optimizer, save_at
):
    """A parameter without state at the save (the pooler trains from step 3 on, after the
    resume) starts as in a fresh run: from the learning rate of its first step, which the
    scheduler changed since the save (ASGD's eta, Rprop's step size), not from the one of
    the save that its placeholder entry was made with."""
    assert all(get_pool(2).run(_resume_task, optimizer, str(tmp_path / "ckpt"), save_at, 3))
