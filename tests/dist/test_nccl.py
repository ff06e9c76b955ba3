"""The equivalence properties on CUDA with NCCL, one rank per GPU (skipped without GPUs).

Device handling is generic, so these run the same code path as the gloo tests; only the pool's
backend differs. With one GPU this runs world size 1 over NCCL: that checks devices, streams,
pinned-memory offload, mixed precision, the grad scaler and checkpoints on CUDA, though a mesh
of one rank moves nothing over the network (the gloo suite covers the collectives' contents).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given

import fshard
from fshard.testing import RankPool, assert_equivalent_to_ddp, mesh_for
from fshard.testing.models import (
    MLPSpec,
    TransformerSpec,
    build_model,
    compute_loss,
    make_batch,
    shard_model,
)
from tests.dist.test_equivalence import cases, run_case

GPT = TransformerSpec(vocab=37, dim=12, heads=3, layers=2, seq=7)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = torch.distributed.is_available() and torch.distributed.is_nccl_available()

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        GPUS == 0 or not NCCL,
        reason=f"needs CUDA GPUs with NCCL (this machine: {GPUS} GPU(s), NCCL "
        f"{'available' if NCCL else 'not available'})",
    ),
]


@pytest.fixture(scope="module")
def nccl_pool():
    pool = RankPool(min(GPUS, 4), backend="nccl")
    pool.start()
    yield pool
    pool.close()


def _to_cuda_model(spec):
    return build_model(spec, device="cuda")


def _cuda_batch(spec, step, rank):
    return make_batch(spec, step, rank, device="cuda")


@pytest.mark.parametrize(
    "spec",
    [TransformerSpec(vocab=37, dim=12, heads=3, layers=2, seq=7), MLPSpec(widths=(7, 5, 3), scalar_param=True)],
    ids=["gpt", "mlp"],
)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_nccl_training_equals_ddp(nccl_pool, spec, reshard_after_forward):
    world = nccl_pool.world_size
    for mesh_shape in {(world,), (1, world), (world, 1)}:
        assert_equivalent_to_ddp(
            functools.partial(_to_cuda_model, spec),
            batch_fn=functools.partial(_cuda_batch, spec),
            loss_fn=functools.partial(compute_loss, spec),
            shard_fn=functools.partial(shard_model, spec, reshard_after_forward=reshard_after_forward),
            world_size=world,
            mesh_shape=mesh_shape,
            steps=3,
            grad_accum=2,
            pool=nccl_pool,
        )


@given(case=cases(world_sizes=(max(1, min(GPUS, 4)),)))
def test_nccl_property_training_equals_ddp(nccl_pool, case):
    """The core property of tests/dist/test_equivalence.py, drawn the same way (models, meshes,
    resharding, optimizers, steps, accumulation), on the GPUs over NCCL."""
    run_case(case, device="cuda", pool=nccl_pool)


# ------------------------------------------------------------- the knobs, on the accelerator


def _train(spec, model, steps=3, scaler=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = compute_loss(spec, model, _cuda_batch(spec, step, torch.distributed.get_rank()))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        fshard.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return opt, losses


def _knobs_worker(spec, knob):
    mesh = mesh_for((torch.distributed.get_world_size(),))
    runs = {}
    for offload in (False, True):
        kwargs = {"offload_policy": fshard.CPUOffload(pin_memory=True)} if offload else {}
        if knob in ("bf16", "fp16"):
            dtype = torch.bfloat16 if knob == "bf16" else torch.float16
            kwargs["mp_policy"] = fshard.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
        model = shard_model(spec, _to_cuda_model(spec), mesh, **kwargs)
        scaler = fshard.ShardedGradScaler() if knob == "fp16" else None
        _, losses = _train(spec, model, scaler=scaler)
        state = fshard.full_state_dict(model, rank0_only=False)
        runs[offload] = (losses, {k: v.cpu() for k, v in state.items()})
        if offload:
            p = next(model.parameters())
            assert p.to_local().device.type == "cpu" and p.full_tensor().device.type == "cpu"
            # Pinned host shards: their copies to the GPU before each gather are asynchronous.
            assert all(q.to_local().is_pinned() for q in model.parameters() if q.to_local().numel())
    (plain_losses, plain), (off_losses, off) = runs[False], runs[True]
    assert all(math.isfinite(x) for x in plain_losses), plain_losses
    # Offload steps AdamW on the CPU instead of the GPU: the same math, rounded by other kernels.
    tol = 1e-5 if knob == "fp32" else 2e-2
    torch.testing.assert_close(torch.tensor(off_losses), torch.tensor(plain_losses), rtol=tol, atol=tol)
    for key in plain:
        torch.testing.assert_close(off[key], plain[key], rtol=tol, atol=tol, msg=key)
    return True


@pytest.mark.parametrize("knob", ["fp32", "bf16", "fp16"])
def test_nccl_mixed_precision_offload_and_scaler(nccl_pool, knob):
    """bf16 / fp16 (with ShardedGradScaler) and CPU offload with pinned memory train on the GPU,
    and offloading changes the numbers by rounding only."""
    assert all(nccl_pool.run(_knobs_worker, GPT, knob))


def _cpu_built_worker(spec):
    mesh = mesh_for((torch.distributed.get_world_size(),))
    on_gpu = shard_model(spec, _to_cuda_model(spec), mesh)
    on_cpu = build_model(spec)  # built on the CPU: fully_shard copies its rows to the GPU
    on_cpu.register_buffer("scale", torch.ones(()))  # a buffer moves too
    shard_model(spec, on_cpu, mesh)
    assert all(p.to_local().is_cuda for p in on_cpu.parameters())
    assert all(b.is_cuda for b in on_cpu.buffers())
    _, a = _train(spec, on_gpu)
    _, b = _train(spec, on_cpu)
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)
    return True


def test_nccl_model_built_on_the_cpu(nccl_pool):
    assert all(nccl_pool.run(_cpu_built_worker, GPT))


def _checkpoint_worker(spec, directory, fused):
    mesh = mesh_for((torch.distributed.get_world_size(),))
    offload = {"offload_policy": fshard.CPUOffload()}
    model = shard_model(spec, _to_cuda_model(spec), mesh, **offload)
    opt, _ = _train(spec, model, steps=2)
    path = f"{directory}/ckpt-{fused}"
    extra = {"rng": torch.cuda.get_rng_state(), "on_gpu": torch.arange(3, device="cuda")}
    fshard.checkpoint.save(path, model, opt, extra=extra)
    # Load into a model on another mesh shape, not offloaded (the sharded state is gathered
    # from CPU shards over the GPU mesh), with a fused or plain AdamW.
    other = shard_model(spec, _to_cuda_model(spec), mesh_for((1, torch.distributed.get_world_size())))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, fused=fused)
    back = fshard.checkpoint.load(path, other, other_opt)
    assert back["on_gpu"].device == torch.device("cuda", torch.cuda.current_device())
    for state in other_opt.state.values():
        # torch keeps step on the CPU unless the optimizer is fused or capturable.
        assert state["step"].device.type == ("cuda" if fused else "cpu"), state["step"].device
        assert state["exp_avg"].is_cuda
    sd = fshard.state_dict(model)
    target = shard_model(spec, _to_cuda_model(spec), mesh_for((1, torch.distributed.get_world_size())))
    fshard.load_state_dict(target, sd)  # DTensors with CPU locals on a CUDA mesh
    for (name, p), q in zip(target.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor().cpu(), q.full_tensor().cpu(), rtol=0, atol=0, msg=name)
    return True


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_nccl_checkpoint_devices(nccl_pool, tmp_path_factory, fused):
    directory = str(tmp_path_factory.mktemp("nccl-ckpt"))
    assert all(nccl_pool.run(_checkpoint_worker, GPT, directory, fused))


def _gpu_module_on_a_cpu_mesh():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)).cuda()
    fshard.fully_shard(model[1], mesh=mesh_for((1,), device_type="cpu"))


def test_a_module_on_the_gpu_with_a_cpu_mesh_is_an_error_naming_the_parameter():
    """End to end through fully_shard (CPU-only machines have no second device type): a
    parameter on a device other than the mesh's is named, with what to do."""
    from fshard.testing import RanksFailed, get_pool

    with pytest.raises(RanksFailed) as info:
        get_pool(1).run(_gpu_module_on_a_cpu_mesh)
    message = str(info.value.errors[0])
    assert "parameter 'weight' is on cuda:0, but the mesh computes on cpu" in message, message
    assert "module.to('cpu')" in message, message


def _accelerate_worker(spec, offload):
    # The accelerate flow: the model is built on the CPU (rank 0 only, the others on meta, with
    # cpu_ram_efficient_loading), then from_config shards it onto the GPUs.
    if torch.distributed.get_rank() == 0:
        model = build_model(spec)
    else:
        with torch.device("meta"):
            model = build_model(spec)
    config = {
        "mixed_precision": "bf16",
        "fsdp_config": {
            "fsdp_sharding_strategy": "FULL_SHARD",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Block",
            "fsdp_offload_params": offload,
            "fsdp_sync_module_states": True,
            "fsdp_cpu_ram_efficient_loading": True,
        },
    }
    fshard.from_config(model, config)
    expected = "cpu" if offload else "cuda"
    assert all(p.to_local().device.type == expected for p in model.parameters())
    _, losses = _train(spec, model)
    assert all(math.isfinite(x) for x in losses), losses
    return True


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "offload"])
def test_nccl_from_config_with_a_model_built_on_the_cpu(nccl_pool, offload):
    assert all(nccl_pool.run(_accelerate_worker, GPT, offload))
