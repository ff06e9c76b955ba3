"""fshard.hf: from_pretrained (weights on rank 0, meta elsewhere), save_pretrained, and the
Trainer's refusal of a job transformers does not run distributed; on 2 ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from fshard.testing import RankPool

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (make test installs it)"
)
pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")

WORLD = 2


@pytest.fixture(scope="module")
def pool():
    """One pool for the tests below (the memory test starts its own: a fresh process)."""
    ranks = RankPool(WORLD, timeout=180)
    yield ranks
    ranks.close()


def _llama_config(**overrides):
    values = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def _save_plain(path: str, **overrides) -> None:
    """A random-weight Llama saved by rank 0 (the other ranks wait for it)."""
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(_llama_config(**overrides)).save_pretrained(path)
    dist.barrier()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def _round_trip_worker(root: str, config_file: dict | None) -> dict:
    import fshard.hf

    src, out = os.path.join(root, "src"), os.path.join(root, "out")
    _save_plain(src)
    kwargs = {"config_file": config_file} if config_file is not None else {}
    model = fshard.hf.from_pretrained(transformers.AutoModelForCausalLM, src, **kwargs)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        logits = model(_ids()).logits
    # Train one step so that the saved weights are not the loaded ones.
    model.train()
    ids = torch.randint(
        0, 128, (2, 12), generator=torch.Generator().manual_seed(10 + dist.get_rank())
    )
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    model.eval()
    with torch.no_grad():
        trained = model(_ids()).logits
    fshard.hf.save_pretrained(model, out, max_shard_size="20KB")
    result = {
        "tied": tied,
        "units": [u.fqn for u in fshard.units(model)],
        "meta": any(p.is_meta for p in model.parameters()),
        "inv_freq": model.model.rotary_emb.inv_freq.clone(),
        "logits": logits,
        "trained": trained,
    }
    if dist.get_rank() == 0:
        plain = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            result["plain_logits"] = plain(_ids()).logits
            result["back_logits"] = back(_ids()).logits
        result["back_tied"] = back.lm_head.weight is back.model.embed_tokens.weight
        result["files"] = sorted(os.listdir(out))
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        result["index_keys"] = sorted(index["weight_map"])
        result["total_parameters"] = index["metadata"]["total_parameters"]
        result["plain_numel"] = plain.num_parameters()
        result["plain_keys"] = sorted(plain.state_dict())
        result["plain_inv_freq"] = plain.model.rotary_emb.inv_freq
    return result


@pytest.mark.parametrize(
    "config_file", [None, {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}]
)
def test_from_pretrained_then_save_pretrained_round_trip(pool, tmp_path, config_file) -> None:
    results = pool.run(_round_trip_worker, str(tmp_path), config_file)
    r0 = results[0]
    for r in results:
        assert r["tied"] and not r["meta"]
        assert r["units"] == ["", "model.layers.0", "model.layers.1"]
        # The sharded model computes what the plain model from the same directory computes.
        torch.testing.assert_close(r["logits"], r0["plain_logits"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r["inv_freq"], r0["plain_inv_freq"], rtol=0, atol=0)
    # What save_pretrained wrote loads into a plain model that computes the trained logits.
    torch.testing.assert_close(r0["back_logits"], r0["trained"], rtol=0, atol=1e-6)
    assert r0["back_tied"]
    assert "config.json" in r0["files"] and "generation_config.json" in r0["files"]
    shards = [f for f in r0["files"] if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f.startswith("model-0000") for f in shards), r0["files"]
    assert "model.safetensors.index.json" in r0["files"]
    # Tied weights once: the index holds the embedding and not lm_head, as transformers writes.
    assert "lm_head.weight" not in r0["index_keys"]
    assert r0["index_keys"] == [k for k in r0["plain_keys"] if k != "lm_head.weight"]
    assert r0["total_parameters"] == r0["plain_numel"]


def _one_rank_save_worker(root: str) -> tuple[str | None, bool]:
    import fshard.hf

    src, out = os.path.join(root, "src"), os.path.join(root, "out")
    _save_plain(src)
    model = fshard.hf.from_pretrained(transformers.LlamaForCausalLM, src)
    error = None
    if dist.get_rank() == 0:  # the usual mistake: rank 0 alone saves
        try:
            model.save_pretrained(out)
        except RuntimeError as exc:
            error = str(exc)
    dist.barrier()
    # Training goes on: no rank was left in a collective.
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    return error, os.path.exists(out)


def test_save_pretrained_on_one_rank_is_an_fshard_error_and_writes_nothing(pool, tmp_path) -> None:
    results = pool.run(_one_rank_save_worker, str(tmp_path))
    (error, written), (other, _) = results
    assert error is not None and other is None
    assert "fshard.hf.save_pretrained(model, path) on every rank" in error, error
    assert "LlamaForCausalLM.save_pretrained cannot save a model sharded by fshard" in error
    assert not written  # not even config.json


def _not_distributed_worker(root: str) -> str:
    import fshard.hf

    # The pool's ranks are not started by torchrun: transformers sees no LOCAL_RANK and runs
    # NOT_PARALLEL, every rank on all the data.
    args = transformers.TrainingArguments(output_dir=root, use_cpu=True, report_to=[])
    model = transformers.LlamaForCausalLM(_llama_config())
    with pytest.raises(ValueError) as info:
        fshard.hf.Trainer(model=model, args=args)
    return str(info.value)


def test_the_trainer_refuses_a_job_that_transformers_does_not_run_distributed(pool, tmp_path) -> None:
    for message in pool.run(_not_distributed_worker, str(tmp_path)):
        assert "the job has 2 ranks but TrainingArguments run NOT_PARALLEL" in message, message
        assert "start the script with fshard launch or torchrun" in message, message


def _peak_rss_growth(fn) -> tuple[int, object]:
    """Bytes the process's resident set grew to at its peak while ``fn()`` ran (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the current resident size

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(key))
        return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    out = fn()
    return status("VmHWM:") - before, out


def _memory_worker(root: str) -> dict:
    import gc

    import fshard.hf

    src = os.path.join(root, "src")
    # ~21M parameters (84 MB in fp32); the tied embedding (8.4 MB) is the largest parameter.
    _save_plain(
        src, vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    # Warm up (imports, allocator) with a tiny load first.
    tiny = os.path.join(root, "tiny")
    _save_plain(tiny)
    fshard.hf.from_pretrained(transformers.LlamaForCausalLM, tiny)
    gc.collect()
    dist.barrier()
    grown, model = _peak_rss_growth(
        lambda: fshard.hf.from_pretrained(transformers.LlamaForCausalLM, src)
    )
    params = list(model.parameters())
    return {
        "peak": grown,
        "model_bytes": sum(p.full_shape.numel() * p.element_size() for p in params),
        "shard_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_bytes": max(p.full_shape.numel() * p.element_size() for p in params),
    }


@pytest.mark.slow
def test_ranks_other_than_0_stay_near_their_shards_while_loading(tmp_path) -> None:
    fresh = RankPool(WORLD, timeout=300)
    try:
        results = fresh.run(_memory_worker, str(tmp_path))
    finally:
        fresh.close()
    mb = 2**20
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: peak RSS growth {r['peak'] / mb:.1f} MiB; model {r['model_bytes'] / mb:.1f} MiB, "
            f"this rank's shards {r['shard_bytes'] / mb:.1f} MiB, largest parameter "
            f"{r['largest_bytes'] / mb:.1f} MiB"
        )
    r1 = results[1]
    # Shards plus one parameter in flight, with room for allocator slack: far from the model.
    assert r1["peak"] < r1["shard_bytes"] + r1["largest_bytes"] + 16 * mb, r1
    assert r1["peak"] < 0.8 * r1["model_bytes"], r1
    assert results[0]["peak"] > r1["model_bytes"] * 0.9  # rank 0 did read the whole model
