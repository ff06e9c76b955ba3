"""transformers models on fshard: HF's own FSDP-aware code paths see a sharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.testing import RankPool, mesh_for

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (make test installs it)"
)


def _is_fsdp_managed(module: torch.nn.Module) -> bool:
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:  # older transformers
        from transformers.integrations.fsdp import is_fsdp_managed_module
    return bool(is_fsdp_managed_module(module))


class _StopAfter(transformers.StoppingCriteria):
    """Stops this rank's generation after ``new`` tokens (ranks finish at different steps)."""

    def __init__(self, prompt_len: int, new: int) -> None:
        self.stop_at = prompt_len + new

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.stop_at, dtype=torch.bool)


def _generate_then_train_worker():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    fshard.auto_shard(model, policy=fshard.by_class(GPT2Block), mesh=mesh_for((2,)))
    managed = _is_fsdp_managed(model)
    prompt = torch.tensor([[1, 2, 3]])
    criteria = transformers.StoppingCriteriaList([_StopAfter(3, 1 + 2 * dist.get_rank())])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, stopping_criteria=criteria, pad_token_id=0)
    # Training goes on with every rank's collectives paired.
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).loss.backward()
    return managed, out.shape[1]


def test_generate_with_ranks_finishing_at_different_steps():
    """HF's generate keeps every rank stepping until all are done (synced_gpus) for models it
    sees as FSDP-managed; without that, a rank that stops early leaves the others' all-gathers
    unpaired."""
    pool = RankPool(2, timeout=120, pg_timeout=20)
    try:
        results = pool.run(_generate_then_train_worker)
    finally:
        pool.close()
    assert [managed for managed, _ in results] == [True, True]
    assert [length for _, length in results] == [3 + 1, 3 + 3]


def _encoder_decoder_generate_worker(stacks_are_units: bool):
    import copy

    from transformers.models.t5.modeling_t5 import T5Block, T5Stack

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    reference = copy.deepcopy(model)
    classes = (T5Block, T5Stack) if stacks_are_units else (T5Block,)
    fshard.auto_shard(model, policy=fshard.by_class(*classes), mesh=mesh_for((2,)))
    ids = torch.randint(1, 32, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    same = []
    for _ in range(2):  # the second after an inference forward freed the root
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            expected = reference.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            encoded = model.get_encoder()(input_ids=ids).last_hidden_state
            want = reference.get_encoder()(input_ids=ids).last_hidden_state
        same.append(torch.equal(out, expected) and torch.allclose(encoded, want, atol=1e-5))
    return all(same)


@pytest.mark.parametrize("stacks_are_units", [False, True])
def test_encoder_decoder_generate_with_one_unit_per_block(stacks_are_units):
    """T5's generate runs ``model.get_encoder()(...)`` first, outside the model's forward; the
    root unit's shared embedding and final norms are gathered for it, also when the encoder
    stack is a unit of its own (which reads the root's tied embedding)."""
    pool = RankPool(2, timeout=120, pg_timeout=20)
    try:
        assert pool.run(_encoder_decoder_generate_worker, stacks_are_units) == [True, True]
    finally:
        pool.close()


def _checkpointed_with_cache_worker():
    import copy
    import logging

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    settings = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    fshard.from_config(model, {**settings, "fsdp_activation_checkpointing": True})
    fshard.from_config(reference, settings)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # padding, as a tokenizer gives
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fshard").addHandler(handler)
    try:
        losses = []
        for _ in range(2):  # the model's default, use_cache=True, passes a cache to every block
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
    finally:
        logging.getLogger("fshard").removeHandler(handler)
    expected = reference(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 2 * q.grad, msg=lambda m, name=name: f"{name}: {m}")  # (two backwards)
    warned = [r for r in records if "GPT2Block is checkpointed" in r]
    return [loss.item() for loss in losses], expected.item(), len(warned)


def test_activation_checkpointing_trains_with_the_default_kv_cache():
    """Transformers decoders build a KV cache in training unless told use_cache=False; a block
    checkpointed by fsdp_activation_checkpointing drops it (as HF's own checkpointing does), one
    warning per block class, instead of appending to it again in the recompute (a shape error
    with padding)."""
    pool = RankPool(2, timeout=120, pg_timeout=20)
    try:
        results = pool.run(_checkpointed_with_cache_worker)
    finally:
        pool.close()
    for losses, expected, warned in results:
        assert losses == pytest.approx([expected, expected], rel=1e-6) and warned == 1


def _save_pretrained_worker(path: str):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)  # tied lm_head / wte; 97 rows: uneven shards
    fshard.auto_shard(model, policy=fshard.by_class(GPT2Block), mesh=mesh_for((2,)))
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    full = fshard.full_state_dict(model)  # every rank calls it; rank 0 gets the tensors
    model.save_pretrained(path, is_main_process=dist.get_rank() == 0, state_dict=dict(full))
    dist.barrier()
    return {k: v.clone() for k, v in full.items()}


def test_save_pretrained_with_the_full_state_dict_on_every_rank(tmp_path):
    """The accelerate recipe from the checkpoints guide: every rank calls ``save_pretrained``
    with ``is_main_process`` and the state dict from ``fshard.full_state_dict``; the files load
    with ``from_pretrained`` into the trained weights (tied head included)."""
    pool = RankPool(2, timeout=120, pg_timeout=20)
    try:
        full = pool.run(_save_pretrained_worker, str(tmp_path / "out"))[0]
    finally:
        pool.close()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").state_dict()
    assert set(loaded) == set(full)
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key
