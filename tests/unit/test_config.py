"""Accelerate-style configs: parsing, aliases and every error (pure: no process group)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import yaml
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import fshard
from fshard._config import AutoWrapPolicy, LaunchConfig, StateDictType
from fshard._wrap import ByClass, BySize
from tests.accelerate_samples import GUIDE, NOTES, sample

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)


class BertEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(), BertLayer()])


class ToyBert(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["BertLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(10, 4)
        self.encoder = BertEncoder()


# --------------------------------------------------------------------- the two samples


def test_guide_sample() -> None:
    cfg = fshard.load_config(yaml.safe_load(GUIDE))
    assert cfg.sharding_strategy is fshard.ShardingStrategy.FULL_SHARD
    assert cfg.offload_params is True and cfg.offload_policy == fshard.CPUOffload()
    assert cfg.auto_wrap_policy is AutoWrapPolicy.TRANSFORMER_BASED_WRAP
    assert cfg.transformer_layer_cls_to_wrap == ("BertLayer",)
    assert cfg.backward_prefetch is fshard.BackwardPrefetch.BACKWARD_PRE
    assert cfg.forward_prefetch is False
    assert cfg.state_dict_type == "SHARDED_STATE_DICT"
    assert cfg.sync_module_states and cfg.cpu_ram_efficient_loading and cfg.syncs_module_states
    assert cfg.use_orig_params is True
    assert cfg.mixed_precision == "bf16"
    assert cfg.mp_policy == fshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert cfg.launch == LaunchConfig(
        num_processes=2, num_machines=1, machine_rank=0, rdzv_backend="static", use_cpu=False
    )


def test_notes_sample() -> None:
    cfg = fshard.load_config(yaml.safe_load(NOTES))
    assert cfg.sharding_strategy is fshard.ShardingStrategy.FULL_SHARD
    assert cfg.offload_params is False and cfg.offload_policy is None
    assert cfg.transformer_layer_cls_to_wrap == ("BertLayer",)
    assert cfg.mixed_precision == "bf16"


def test_examples_config_is_the_guide_sample() -> None:
    example = yaml.safe_load((REPO / "examples" / "accelerate_config.yaml").read_text())
    assert example == yaml.safe_load(GUIDE)


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the source documents (../shared/seeds) are not here")
def test_samples_match_the_source_documents() -> None:
    guide = (SEEDS / "hf-fsdp-guide.en.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", guide, flags=re.S)
    assert yaml.safe_load(GUIDE) in [yaml.safe_load(b) for b in blocks]
    notes = (SEEDS / "fsdp-pytorch-accelerate-notes.zh.txt").read_text(encoding="utf-8")
    flat = {line.split(":")[0].strip() for line in notes.splitlines() if re.match(r"^[a-z_0-9]+:", line)}
    ours = yaml.safe_load(NOTES)
    assert flat == set(ours) | set(ours["fsdp_config"])  # same keys, indentation restored
    assert "fsdp_sharding_strategy: FULL_SHARD" in notes and "fsdp_offload_params: false" in notes


def test_sample_units() -> None:
    for name in ("guide", "notes"):
        cfg = fshard.load_config(sample(name))
        model = ToyBert()
        policy = cfg.wrap_policy(model)
        assert isinstance(policy, ByClass) and policy.classes == (BertLayer,)
        assert fshard.select_modules(model, policy) == ["encoder.layer.0", "encoder.layer.1"]


def test_yaml_path_and_block_only(tmp_path: Path) -> None:
    whole = tmp_path / "accelerate.yaml"
    whole.write_text(GUIDE)
    block = tmp_path / "fsdp.yaml"
    block.write_text(yaml.safe_dump(yaml.safe_load(GUIDE)["fsdp_config"]))
    from_file = fshard.load_config(whole)
    assert from_file.source == str(whole)
    assert from_file.offload_params and from_file.launch.num_processes == 2
    from_block = fshard.load_config(str(block))
    assert from_block.offload_params and from_block.launch == LaunchConfig()
    assert from_block.mixed_precision == "no"  # the block alone has no mixed_precision


def test_config_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(NOTES)
    monkeypatch.setenv("FSHARD_CONFIG_FILE", str(path))
    assert fshard.load_config().source == str(path)
    monkeypatch.delenv("FSHARD_CONFIG_FILE")
    with pytest.raises(ValueError, match=r"no FSDP config given.*fshard launch --config_file.*FSHARD_CONFIG_FILE"):
        fshard.load_config()
    with pytest.raises(ValueError, match="no FSDP config given"):
        fshard.from_config(ToyBert())


def test_an_fsdp_config_passes_through() -> None:
    cfg = fshard.FSDPConfig(sharding_strategy="SHARD_GRAD_OP", mixed_precision="fp16")
    assert fshard.load_config(cfg) is cfg
    assert cfg.sharding_strategy is fshard.ShardingStrategy.SHARD_GRAD_OP
    assert cfg.mp_policy == fshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)


# ------------------------------------------------------------------------ values and aliases


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (3, "NO_SHARD"), (4, "HYBRID_SHARD"),
        (5, "HYBRID_SHARD_ZERO2"), ("1", "FULL_SHARD"), ("FULL_SHARD", "FULL_SHARD"),
        ("hybrid_shard", "HYBRID_SHARD"), ("SHARD_GRAD_OP", "SHARD_GRAD_OP"),
    ],
)  # fmt: skip
def test_strategy_by_name_or_number(value: Any, expected: str) -> None:
    assert fshard.load_config({"fsdp_sharding_strategy": value}).sharding_strategy.name == expected


def test_torch_fsdp1_strategies_are_accepted_by_name() -> None:
    """The migration guide's FSDP1 row: torch's enum names number 5 ``_HYBRID_SHARD_ZERO2``,
    which was an unknown name (and the enum itself a TypeError)."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    from fshard._strategy import parse_strategy

    for theirs in TorchStrategy:
        ours = parse_strategy(theirs, "strategy_kwargs")
        assert ours.value == theirs.value and ours.name == theirs.name.lstrip("_")
        assert parse_strategy(theirs.name, "strategy_kwargs") is ours


@pytest.mark.parametrize(
    ("raf", "strategy", "expected"),
    [(True, None, "FULL_SHARD"), (False, None, "SHARD_GRAD_OP"), ("HYBRID_SHARD", None, "HYBRID_SHARD"),
     (True, 4, "HYBRID_SHARD"), (False, 5, "HYBRID_SHARD_ZERO2"), (False, 3, "NO_SHARD"),
     ("true", None, "FULL_SHARD"), ("False", None, "SHARD_GRAD_OP"), ("2", None, "SHARD_GRAD_OP")],
)  # fmt: skip
def test_fsdp2_style_reshard_after_forward(raf: Any, strategy: Any, expected: str) -> None:
    data: dict[str, Any] = {"fsdp_reshard_after_forward": raf}
    if strategy is not None:
        data["fsdp_sharding_strategy"] = strategy
    assert fshard.load_config(data).sharding_strategy.name == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None), (False, None), (None, None)],
)
def test_mixed_precision_mapping(value: Any, expected: torch.dtype | None) -> None:
    cfg = fshard.load_config({"distributed_type": "FSDP", "mixed_precision": value})
    if expected is None:
        assert cfg.mp_policy is None
    else:
        # accelerate's FSDP bf16/fp16: compute and gradient reduction in the low dtype.
        assert cfg.mp_policy == fshard.MixedPrecision(param_dtype=expected, reduce_dtype=expected)


def test_yaml_bare_no_is_no_mixed_precision() -> None:
    data = yaml.safe_load("distributed_type: FSDP\nmixed_precision: no\n")
    assert data["mixed_precision"] is False  # YAML 1.1 reads `no` as a boolean
    assert fshard.load_config(data).mixed_precision == "no"


def test_legacy_fp16_key() -> None:
    assert fshard.load_config({"distributed_type": "FSDP", "fp16": True}).mixed_precision == "fp16"


def test_guide_spellings_of_size_based_wrap() -> None:
    # The guide says `fsdp_wrap_policy: SIZED_BASED_WRAP` and `min_num_param`.
    for data in (
        {"fsdp_wrap_policy": "SIZED_BASED_WRAP", "min_num_param": 1000},
        {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000},
        {"auto_wrap_policy": "size_based_wrap", "min_num_params": "1e3"},
        {"fsdp_min_num_params": 1000},  # the policy follows from the key
    ):
        cfg = fshard.load_config(data)
        assert cfg.auto_wrap_policy is AutoWrapPolicy.SIZE_BASED_WRAP, data
        assert cfg.wrap_policy(ToyBert()) == BySize(min_num_params=1000), data


def test_wrap_policy_defaults_and_class_lists() -> None:
    assert fshard.load_config({}).wrap_policy(ToyBert()) is None  # NO_WRAP: the root only
    assert fshard.load_config({"fsdp_auto_wrap_policy": "NO_WRAP"}).auto_wrap_policy == "NO_WRAP"
    listed = fshard.load_config({"fsdp_transformer_layer_cls_to_wrap": ["BertLayer", "Embedding"]})
    assert listed.transformer_layer_cls_to_wrap == ("BertLayer", "Embedding")
    commas = fshard.load_config({"fsdp_transformer_layer_cls_to_wrap": "BertLayer, Embedding"})
    assert commas.transformer_layer_cls_to_wrap == ("BertLayer", "Embedding")
    units = fshard.select_modules(ToyBert(), commas.wrap_policy(ToyBert()))
    assert units == ["embeddings", "encoder.layer.0", "encoder.layer.1"]


def test_transformer_wrap_falls_back_to_no_split_modules() -> None:
    cfg = fshard.load_config({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    assert fshard.select_modules(ToyBert(), cfg.wrap_policy(ToyBert())) == ["encoder.layer.0", "encoder.layer.1"]
    with pytest.raises(ValueError, match=r"no fsdp_transformer_layer_cls_to_wrap is given and Sequential has no _no_split_modules"):
        cfg.wrap_policy(nn.Sequential(nn.Linear(2, 2)))


def test_a_bad_no_split_modules_name_is_blamed_on_no_split_modules() -> None:
    class WithVision(ToyBert):
        _no_split_modules: ClassVar[list[str]] = ["BertLayer", "VisionLayer"]

    cfg = fshard.load_config({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    with pytest.raises(ValueError) as info:
        cfg.wrap_policy(WithVision())
    message = str(info.value)
    assert message.startswith(
        "WithVision._no_split_modules (used because fsdp_transformer_layer_cls_to_wrap is not "
        "set; set it to name the blocks): by_class: no module of class 'VisionLayer' in WithVision"
    ), message


def test_unknown_layer_class_names_the_class_and_lists_the_models() -> None:
    cfg = fshard.load_config({"fsdp_transformer_layer_cls_to_wrap": "BertLayer,GPT2Block"})
    with pytest.raises(
        ValueError,
        match=r"fsdp_transformer_layer_cls_to_wrap: by_class: no module of class 'GPT2Block' in ToyBert; "
        r"its module classes are: BertEncoder, BertLayer, Embedding, Linear, ModuleList, ToyBert",
    ):
        cfg.wrap_policy(ToyBert())


@pytest.mark.parametrize(
    ("value", "expected"),
    [("FULL_STATE_DICT", "FULL_STATE_DICT"), ("SHARDED_STATE_DICT", "SHARDED_STATE_DICT"),
     ("LOCAL_STATE_DICT", "SHARDED_STATE_DICT"), ("sharded_state_dict", "SHARDED_STATE_DICT")],
)  # fmt: skip
def test_state_dict_type(value: str, expected: str) -> None:
    cfg = fshard.load_config({"fsdp_state_dict_type": value})
    assert cfg.state_dict_type == expected and isinstance(cfg.state_dict_type, StateDictType)


def test_defaults_follow_accelerate() -> None:
    cfg = fshard.load_config({})
    assert cfg.sharding_strategy is fshard.ShardingStrategy.FULL_SHARD
    assert cfg.state_dict_type == "FULL_STATE_DICT"
    assert cfg.min_num_params == 100_000_000
    assert (cfg.backward_prefetch, cfg.forward_prefetch) == (None, None)  # fshard's defaults stay
    assert not cfg.syncs_module_states


@pytest.mark.parametrize("version", [2, "2"])
def test_fsdp_version_2_saves_sharded_by_default_like_accelerate(version: Any) -> None:
    # accelerate's FSDP2 plugin: state_dict_type defaults to SHARDED_STATE_DICT (FSDP1: FULL).
    whole = {"distributed_type": "FSDP", "num_machines": 1, "num_processes": 2, "fsdp_config": {"fsdp_version": version}}
    assert fshard.load_config(whole).state_dict_type is StateDictType.SHARDED_STATE_DICT
    assert fshard.load_config({"fsdp_version": version, "fsdp_reshard_after_forward": True}).state_dict_type == "SHARDED_STATE_DICT"
    assert fshard.load_config({"fsdp_version": 1}).state_dict_type is StateDictType.FULL_STATE_DICT
    explicit = {"fsdp_version": version, "fsdp_state_dict_type": "FULL_STATE_DICT"}
    assert fshard.load_config(explicit).state_dict_type is StateDictType.FULL_STATE_DICT


def test_aliases_with_equal_values_are_fine() -> None:
    cfg = fshard.load_config(
        {"fsdp_backward_prefetch": "BACKWARD_POST", "fsdp_backward_prefetch_policy": "BACKWARD_POST"}
    )
    assert cfg.backward_prefetch is fshard.BackwardPrefetch.BACKWARD_POST


@pytest.mark.parametrize("key", ["fsdp_backward_prefetch", "fsdp_backward_prefetch_policy"])
def test_null_backward_prefetch_is_no_prefetch_as_in_fsdp1(key: str, tmp_path: Path) -> None:
    # FSDP1's FullyShardedDataParallel(backward_prefetch=None) and accelerate's plugin read
    # None as "no prefetch"; a YAML file may write it as null.
    path = tmp_path / "fsdp.yaml"
    path.write_text(f"distributed_type: FSDP\nfsdp_config:\n  {key}: null\n")
    assert fshard.load_config(path).backward_prefetch is fshard.BackwardPrefetch.NO_PREFETCH
    assert fshard.load_config({key: None}).backward_prefetch is fshard.BackwardPrefetch.NO_PREFETCH


def test_booleans_as_strings_and_other_sections() -> None:
    cfg = fshard.load_config(
        {
            "distributed_type": "FSDP",
            "deepspeed_config": {},
            "dynamo_config": {"dynamo_backend": "NO"},
            "gpu_ids": "0,1",
            "main_process_ip": "10.0.0.1",
            "main_process_port": 29501,
            "num_processes": -1,
            "fsdp_config": {"fsdp_offload_params": "true", "fsdp_use_orig_params": "false", "fsdp_version": 2},
        }
    )
    assert cfg.offload_params is True and cfg.use_orig_params is False
    assert cfg.launch == LaunchConfig(gpu_ids="0,1", main_process_ip="10.0.0.1", main_process_port=29501)


# -------------------------------------------------------------------------------- errors


def _error(data: Any) -> str:
    with pytest.raises(ValueError) as info:
        fshard.load_config(data)
    return str(info.value)


BAD_BLOCK_VALUES = [
    ("fsdp_sharding_strategy", 6, r"fsdp_sharding_strategy: unknown sharding strategy 6; valid: FULL_SHARD \(1\), SHARD_GRAD_OP \(2\), NO_SHARD \(3\), HYBRID_SHARD \(4\), HYBRID_SHARD_ZERO2 \(5\)"),
    ("fsdp_sharding_strategy", "ZERO3", r"unknown sharding strategy 'ZERO3'; valid: FULL_SHARD \(1\)"),
    ("fsdp_offload_params", "maybe", r"fsdp_offload_params: 'maybe' is not valid; expected true or false"),
    ("fsdp_auto_wrap_policy", "LAYER_WRAP", r"fsdp_auto_wrap_policy: 'LAYER_WRAP' is not valid; expected one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
    ("fsdp_wrap_policy", 3, r"fsdp_wrap_policy: 3 is not valid; expected one of TRANSFORMER_BASED_WRAP"),
    ("fsdp_transformer_layer_cls_to_wrap", 5, r"fsdp_transformer_layer_cls_to_wrap: 5 is not valid; expected a class name"),
    ("fsdp_min_num_params", -5, r"fsdp_min_num_params: -5 is not valid; expected an integer >= 0"),
    ("min_num_param", "many", r"min_num_param: 'many' is not valid; expected an integer >= 0"),
    ("fsdp_backward_prefetch_policy", "BACKWARD_LATER", r"fsdp_backward_prefetch_policy: 'BACKWARD_LATER' is not valid; expected one of BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH"),
    ("fsdp_forward_prefetch", 2, r"fsdp_forward_prefetch: 2 is not valid; expected true or false"),
    ("fsdp_state_dict_type", "FULL", r"fsdp_state_dict_type: 'FULL' is not valid; expected one of FULL_STATE_DICT, SHARDED_STATE_DICT, LOCAL_STATE_DICT"),
    ("fsdp_sync_module_states", "sometimes", r"fsdp_sync_module_states: 'sometimes' is not valid; expected true or false"),
    ("fsdp_cpu_ram_efficient_loading", [], r"fsdp_cpu_ram_efficient_loading: \[\] is not valid; expected true or false"),
    ("fsdp_use_orig_params", None, r"fsdp_use_orig_params: None is not valid; expected true or false"),
    ("mixed_precision", "fp32", r"mixed_precision: 'fp32' is not valid; expected one of no, fp16, bf16"),
    ("mixed_precision", "fp8", r"mixed_precision: 'fp8' is not supported by fshard; expected one of no, fp16, bf16"),
    ("fsdp_activation_checkpointing", "often", r"fsdp_activation_checkpointing: 'often' is not valid; expected true or false"),
    ("fsdp_version", 3, r"fsdp_version: 3 is not valid; expected an integer >= 1 and <= 2"),
    ("fsdp_reshard_after_forward", "sometimes", r"fsdp_reshard_after_forward: 'sometimes' is not valid; expected true, false or a sharding strategy"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value", "message"), BAD_BLOCK_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_BLOCK_VALUES])
def test_every_bad_value_is_named(key: str, value: Any, message: str) -> None:
    assert re.search(message, _error({key: value}))
    # ... in the whole-file form too, under fsdp_config.
    whole = sample("guide")
    if key == "mixed_precision":
        whole[key] = value
    else:
        whole["fsdp_config"][key] = value
    assert re.search(message, _error(whole))


def test_activation_checkpointing_needs_a_wrap_policy() -> None:
    cfg = fshard.load_config({"fsdp_activation_checkpointing": True, "fsdp_transformer_layer_cls_to_wrap": "BertLayer"})
    assert cfg.activation_checkpointing and cfg.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert not fshard.load_config({}).activation_checkpointing
    message = _error({"fsdp_activation_checkpointing": True})
    assert "fsdp_activation_checkpointing: true checkpoints the blocks the wrap policy selects" in message
    assert "NO_WRAP" in message and "SIZE_BASED_WRAP" in message


def test_unknown_block_key_suggests_and_lists_the_valid_ones() -> None:
    message = _error({"fsdp_ofload_params": True})
    assert "unknown key 'fsdp_ofload_params' in the fsdp_config block (did you mean 'fsdp_offload_params'?)" in message
    valid = message.split("valid keys: ")[1].split(", ")
    for key in ("fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_auto_wrap_policy",
                "fsdp_transformer_layer_cls_to_wrap", "min_num_params", "fsdp_backward_prefetch_policy",
                "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
                "fsdp_sync_module_states", "fsdp_use_orig_params", "mixed_precision"):  # fmt: skip
        assert key in valid, key


@pytest.mark.parametrize("key", ["FSDP_OFFLOAD_PARAMS", "fsdp-offload-params", "Fsdp_Offload_Params "])
def test_unknown_key_suggestions_ignore_case_and_dashes(key: str) -> None:
    assert f"unknown key {key!r} in the fsdp_config block (did you mean 'fsdp_offload_params'?)" in _error({key: True})


def test_trainer_keys_without_an_equivalent_are_known(caplog: pytest.LogCaptureFixture) -> None:
    # A TrainingArguments fsdp_config (json) loads; switched-on options say why they do nothing.
    data = {"transformer_layer_cls_to_wrap": ["BertLayer"], "backward_prefetch": "backward_pre",
            "forward_prefetch": False, "limit_all_gathers": True, "use_orig_params": True,
            "sync_module_states": True, "activation_checkpointing": False, "xla": False,
            "xla_fsdp_grad_ckpt": False, "xla_fsdp_settings": {}, "fsdp_xla_fsdp_v2": "false"}  # fmt: skip
    with caplog.at_level("WARNING", logger="fshard"):
        cfg = fshard.load_config(data)
    assert cfg.transformer_layer_cls_to_wrap == ("BertLayer",) and cfg.sync_module_states
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "limit_all_gathers is ignored: FSDP1's rate limit on all-gathers in flight has no fshard "
        "equivalent (fshard prefetches one unit ahead by default; see fshard.set_prefetch)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="fshard"):
        fshard.load_config({"distributed_type": "FSDP", "fsdp_config": {"fsdp_xla": True}})
    assert [r.getMessage() for r in caplog.records] == [
        "fsdp_xla is ignored: fshard does not run on PyTorch/XLA (TPU); it shards with "
        "torch.distributed on CPU or GPU"
    ]


def test_unknown_key_inside_fsdp_config_of_a_whole_file() -> None:
    data = sample("notes")
    data["fsdp_config"]["fsdp_grad_ckpt"] = True
    assert "unknown key 'fsdp_grad_ckpt' in fsdp_config" in _error(data)


def test_unknown_top_level_key_lists_accelerates_keys() -> None:
    message = _error(sample("guide", num_gpus=2))
    assert "unknown key 'num_gpus' in the accelerate config" in message
    valid = message.split("valid keys: ")[1].split(", ")
    for key in ("compute_environment", "debug", "distributed_type", "downcast_bf16", "machine_rank",
                "main_training_function", "mixed_precision", "num_machines", "num_processes",
                "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
                "use_cpu", "main_process_ip", "main_process_port", "gpu_ids", "enable_cpu_affinity",
                "dynamo_config", "fsdp_config"):  # fmt: skip
        assert key in valid, key


def test_fsdp_key_at_the_top_of_a_whole_file_says_where_it_belongs() -> None:
    message = _error(sample("guide", fsdp_offload_params=True))
    assert "unknown key 'fsdp_offload_params' in the accelerate config ('fsdp_offload_params' belongs under fsdp_config)" in message


def test_top_level_key_in_a_block_says_to_pass_the_whole_file() -> None:
    message = _error({"fsdp_sharding_strategy": 1, "num_processes": 2})
    assert "unknown key 'num_processes' in the fsdp_config block ('num_processes' is a top-level key" in message


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("distributed_type", "DEEPSPEED", "distributed_type: 'DEEPSPEED' is not supported; fshard runs FSDP configs"),
        ("distributed_type", "MULTI_GPU", "distributed_type: 'MULTI_GPU' is not supported"),
        ("compute_environment", "AMAZON_SAGEMAKER", "compute_environment: 'AMAZON_SAGEMAKER' is not valid; expected LOCAL_MACHINE"),
        ("num_machines", 0, "num_machines: 0 is not valid; expected an integer >= 1"),
        ("machine_rank", 3, "machine_rank 3 must be < num_machines 1"),
        ("main_process_port", 70000, "main_process_port: 70000 is not valid; expected an integer >= 1 and <= 65535"),
        ("rdzv_backend", "zookeeper", "rdzv_backend: 'zookeeper' is not valid; expected one of static, c10d, etcd, etcd-v2"),
        ("use_cpu", "gpu", "use_cpu: 'gpu' is not valid; expected true or false"),
        ("mixed_precision", "int8", "mixed_precision: 'int8' is not valid; expected one of no, fp16, bf16"),
        ("fsdp_config", ["fsdp_offload_params"], "fsdp_config: ['fsdp_offload_params'] is not valid; expected a mapping"),
    ],
)  # fmt: skip
def test_bad_top_level_values(key: str, value: Any, message: str) -> None:
    assert message in _error(sample("guide", **{key: value}))


def test_conflicting_spellings() -> None:
    message = _error({"fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_backward_prefetch_policy": "BACKWARD_POST"})
    assert "fsdp_backward_prefetch (BACKWARD_PRE) and fsdp_backward_prefetch_policy (BACKWARD_POST) set the same option to different values" in message
    message = _error({"fsdp_reshard_after_forward": False, "fsdp_sharding_strategy": "FULL_SHARD"})
    assert "fsdp_reshard_after_forward (False) contradicts fsdp_sharding_strategy (FULL_SHARD)" in message
    data = sample("guide")
    data["fsdp_config"]["mixed_precision"] = "fp16"
    assert "mixed_precision is 'bf16' at the top level but 'fp16' in fsdp_config" in _error(data)
    message = _error({"fsdp_transformer_layer_cls_to_wrap": "BertLayer", "fsdp_min_num_params": 10})
    assert "are both set but fsdp_auto_wrap_policy is not" in message


def test_all_problems_are_reported_at_once() -> None:
    message = _error({"fsdp_sharding_strategy": 9, "fsdp_offload_params": "x", "bogus": 1})
    assert message.startswith("FSDP config dict: 3 problems:")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"FSDP config file '.*missing.yaml' does not exist"):
        fshard.load_config(tmp_path / "missing.yaml")
    with pytest.raises(IsADirectoryError, match=r"FSDP config file '.*' is a directory, not a file; pass the path of the YAML file"):
        fshard.load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("fsdp_config: [unclosed\n")
    with pytest.raises(ValueError, match=r"FSDP config '.*bad.yaml' is not valid YAML"):
        fshard.load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"must hold a mapping .* got a list"):
        fshard.load_config(listy)
    typo = tmp_path / "typo.yaml"
    typo.write_text("fsdp_shardingstrategy: 1\n")
    with pytest.raises(ValueError, match=r"FSDP config '.*typo.yaml': unknown key 'fsdp_shardingstrategy'"):
        fshard.load_config(typo)
    with pytest.raises(TypeError, match="load_config expects a dict, a YAML path or an FSDPConfig, got int"):
        fshard.load_config(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        # Last-wins would apply strategy 2 and drop the offload of the first block.
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 1\n  fsdp_offload_params: true\n"
         "  fsdp_sharding_strategy: 2\nfsdp_config:\n  fsdp_offload_params: false\n", "fsdp_config", (2, 6)),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 2\n  fsdp_sharding_strategy: 1\n",
         "fsdp_sharding_strategy", (3, 4)),
        ("fsdp_offload_params: true\nmixed_precision: bf16\nmixed_precision: 'no'\n", "mixed_precision", (2, 3)),
    ],
    ids=["top_level", "inside_fsdp_config", "block_only"],
)  # fmt: skip
def test_a_key_given_twice_in_a_yaml_file_is_an_error(tmp_path: Path, text: str, key: str, lines: tuple[int, int]) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    message = re.escape(f"FSDP config {str(path)!r} gives key {key!r} twice in one mapping (lines {lines[0]} and {lines[1]}); keep one")
    with pytest.raises(ValueError, match=message):
        fshard.load_config(path)


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    # An explicit key next to a merge (<<) is an override, not a duplicate.
    path = tmp_path / "merge.yaml"
    path.write_text(
        "base: &base\n  fsdp_offload_params: true\n  fsdp_sharding_strategy: 1\n"
        "distributed_type: FSDP\nfsdp_config:\n  <<: *base\n  fsdp_sharding_strategy: 2\n"
    )
    message = _error(path)  # `base` is not an accelerate key; the merge itself parsed
    assert "unknown key 'base'" in message and "twice" not in message


def test_json_files_are_read_as_json(tmp_path: Path) -> None:
    # Tab indentation is valid JSON but not valid YAML 1.1 (PyYAML).
    block = tmp_path / "block.json"
    block.write_text('{\n\t"fsdp_transformer_layer_cls_to_wrap": [\n\t\t"BertLayer"\n\t],\n\t"fsdp_offload_params": true\n}')
    cfg = fshard.load_config(block)
    assert cfg.transformer_layer_cls_to_wrap == ("BertLayer",) and cfg.offload_params
    whole = tmp_path / "whole.JSON"
    whole.write_text('{\n\t"distributed_type": "FSDP",\n\t"num_processes": 2,\n\t"fsdp_config": {\n\t\t"fsdp_sharding_strategy": 2\n\t}\n}')
    cfg = fshard.load_config(whole)
    assert cfg.sharding_strategy.name == "SHARD_GRAD_OP" and cfg.launch.num_processes == 2
    dup = tmp_path / "dup.json"
    dup.write_text('{"fsdp_sharding_strategy": 1, "fsdp_sharding_strategy": 2}')
    with pytest.raises(ValueError, match=re.escape(f"FSDP config {str(dup)!r} gives key 'fsdp_sharding_strategy' twice in one object; keep one")):
        fshard.load_config(dup)
    bad = tmp_path / "bad.json"
    bad.write_text('{"fsdp_sharding_strategy": 1,}')
    with pytest.raises(ValueError, match=r"FSDP config '.*bad.json' is not valid JSON: "):
        fshard.load_config(bad)


@pytest.mark.parametrize("key", ["fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_sync_module_states",
                                 "fsdp_cpu_ram_efficient_loading", "fsdp_use_orig_params", "fsdp_activation_checkpointing"])  # fmt: skip
def test_booleans_as_yaml_integers_1_and_0(key: str) -> None:
    # accelerate's str_to_bool takes 1/0; other numbers stay errors.
    extra = {"fsdp_transformer_layer_cls_to_wrap": "BertLayer"}
    canon = key.removeprefix("fsdp_")
    assert getattr(fshard.load_config({key: 1, **extra}), canon) is True
    assert getattr(fshard.load_config(yaml.safe_load(f"{key}: 0")), canon) is False
    for bad in (2, -1, 1.0):
        assert f"{key}: {bad!r} is not valid; expected true or false" in _error({key: bad, **extra})
    assert fshard.load_config({"distributed_type": "FSDP", "use_cpu": 1}).launch.use_cpu is True


def test_reshard_after_forward_zero_says_to_write_false() -> None:
    message = _error({"fsdp_reshard_after_forward": 0})
    assert "fsdp_reshard_after_forward: 0 is not valid; expected true, false or a sharding strategy" in message
    assert "to keep the parameters gathered after forward, write false" in message
    assert fshard.load_config({"fsdp_reshard_after_forward": 1}).sharding_strategy.name == "FULL_SHARD"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_strategy": 9}, ValueError, "FSDPConfig.sharding_strategy: unknown sharding strategy 9"),
        ({"auto_wrap_policy": "WRAP_ALL"}, ValueError, "FSDPConfig.auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP"),
        ({"mixed_precision": "fp32"}, ValueError, "FSDPConfig.mixed_precision must be one of no, fp16, bf16, got 'fp32'"),
        ({"offload_params": 1}, TypeError, "FSDPConfig.offload_params must be a bool, got 1"),
        ({"transformer_layer_cls_to_wrap": "BertLayer"}, TypeError, "must be a tuple of class names, got 'BertLayer'"),
        ({"min_num_params": -1}, ValueError, "FSDPConfig.min_num_params must be an int >= 0, got -1"),
        ({"backward_prefetch": "SOON"}, ValueError, "FSDPConfig.backward_prefetch must be one of BACKWARD_PRE"),
        ({"replicate_size": 0}, ValueError, "FSDPConfig.replicate_size must be None or an int >= 1, got 0"),
        ({"replicate_size": 2}, ValueError, "FSDPConfig.replicate_size applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only, not FULL_SHARD"),
        ({"shard_size": "2"}, ValueError, "FSDPConfig.shard_size must be None or an int >= 1, got '2'"),
    ],
)  # fmt: skip
def test_fsdp_config_validates_direct_construction(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        fshard.FSDPConfig(**kwargs)


def test_configs_are_frozen() -> None:
    cfg = fshard.load_config({})
    with pytest.raises(AttributeError):
        cfg.offload_params = True  # type: ignore[misc]


def test_from_config_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"from_config expects an nn\.Module, got str"):
        fshard.from_config("model", {})  # type: ignore[type-var]
    # A bad config fails before any process group is needed.
    with pytest.raises(ValueError, match="unknown key 'fsdp_bogus'"):
        fshard.from_config(ToyBert(), {"fsdp_bogus": 1})
    with pytest.raises(ValueError, match="no module of class 'GPT2Block' in ToyBert"):
        fshard.from_config(ToyBert(), {"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fsdp_transformer_layer_cls_to_wrap": "ToyBert"},
         "TRANSFORMER_BASED_WRAP (classes ToyBert) selects no submodule of ToyBert (the root is never one, nor a module without parameters); name block classes"),
        ({"fsdp_transformer_layer_cls_to_wrap": "BertEncoder", "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"},
         "SIZE_BASED_WRAP (fsdp_min_num_params: 100000000) selects no submodule of ToyBert (the root is never one, nor a module without parameters); lower fsdp_min_num_params"),
    ],
)  # fmt: skip
def test_checkpointing_with_a_policy_that_selects_nothing_is_an_error(config: dict[str, Any], message: str) -> None:
    # Like NO_WRAP with checkpointing: the key would silently do nothing. Raised before any
    # process group is needed, with the model untouched.
    model = ToyBert()
    with pytest.raises(ValueError) as info:
        fshard.from_config(model, {**config, "fsdp_activation_checkpointing": True})
    assert str(info.value).startswith("fsdp_activation_checkpointing: true checkpoints the blocks the wrap policy selects, but ")
    assert message in str(info.value)
    assert str(info.value).endswith("or set fsdp_activation_checkpointing: false")


def test_checkpointing_a_block_whose_forward_is_patched_fails_before_sharding() -> None:
    model = ToyBert()
    layer = model.encoder.layer[1]
    layer.forward = layer.forward  # type: ignore[method-assign]  # e.g. a hook library patched it
    with pytest.raises(ValueError, match=re.escape("fsdp_activation_checkpointing: the forward of 'encoder.layer.1' is already set on the instance")):
        fshard.from_config(model, {"fsdp_transformer_layer_cls_to_wrap": "BertLayer", "fsdp_activation_checkpointing": True})
    assert not any(fshard.is_sharded(p) for p in model.parameters())
    assert "forward" not in model.encoder.layer[0].__dict__


# Every spelling fshard accepts for an fsdp_config option (see [Note: accelerate key spellings]).
SPELLINGS = [
    *(f"{prefix}{name}" for prefix in ("fsdp_", "") for name in (
        "sharding_strategy", "reshard_after_forward", "offload_params", "auto_wrap_policy",
        "wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "min_num_param",
        "backward_prefetch", "backward_prefetch_policy", "forward_prefetch", "state_dict_type",
        "sync_module_states", "cpu_ram_efficient_loading", "use_orig_params",
        "activation_checkpointing", "version")),
    "mixed_precision",
]  # fmt: skip
# Values no option accepts.
GARBAGE = st.one_of(
    st.integers(max_value=-1),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
)


@given(key=st.sampled_from(SPELLINGS), value=GARBAGE, whole=st.booleans())
def test_any_bad_value_of_any_spelling_names_that_key(key: str, value: Any, whole: bool) -> None:
    data: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": {key: value}} if whole else {key: value}
    with pytest.raises(ValueError) as info:
        fshard.load_config(data)
    assert f"{key}: " in str(info.value) or f"{key} " in str(info.value)


@given(key=st.from_regex(r"\A[a-z][a-z_]{0,20}\Z"), whole=st.booleans())
def test_any_unknown_key_is_named(key: str, whole: bool) -> None:
    known = set(SPELLINGS) | {"fsdp_config", "distributed_type"}
    no_equivalent = ("limit_all_gathers", "xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2")
    known |= {f"{prefix}{name}" for prefix in ("", "fsdp_") for name in no_equivalent}
    assume(key not in known)
    data: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": {key: 1}} if whole else {key: 1}
    with pytest.raises(ValueError, match=re.escape(f"unknown key {key!r}")):
        fshard.load_config(data)


def test_transformers_fsdp_config_json_reads_as_the_trainer_reads_it(tmp_path: Path) -> None:
    # TrainingArguments(fsdp_config="fsdp_config.json"): cpu_offload, a class-based wrap by
    # default (the model's _no_split_modules), and min_num_params 0 meaning "not set".
    def load(block: dict) -> Any:
        path = tmp_path / "fsdp_config.json"
        path.write_text(json.dumps(block))
        return fshard.load_config(path)

    cfg = load({"version": 2, "cpu_offload": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    assert cfg.offload_params and cfg.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    cfg = load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "min_num_params": 0})
    assert cfg.auto_wrap_policy is AutoWrapPolicy.TRANSFORMER_BASED_WRAP
    for block in ({"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}, {"activation_checkpointing": True}):
        cfg = load(block)
        assert cfg.auto_wrap_policy is AutoWrapPolicy.TRANSFORMER_BASED_WRAP, block
    cfg = load({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 0})  # accelerate's default size
    assert cfg.auto_wrap_policy is AutoWrapPolicy.SIZE_BASED_WRAP and cfg.min_num_params == 100_000_000
    # The dict the Trainer normalised (it adds the xla keys) reads the same way...
    assert fshard.load_config({"sharding_strategy": 1, "xla": False}).auto_wrap_policy.value == "TRANSFORMER_BASED_WRAP"
    # ...while an accelerate block keeps accelerate's default, NO_WRAP.
    assert fshard.load_config({"fsdp_sharding_strategy": 1}).auto_wrap_policy is AutoWrapPolicy.NO_WRAP
    assert fshard.load_config({"fsdp_min_num_params": 0, "fsdp_transformer_layer_cls_to_wrap": "X"}).auto_wrap_policy.value == "TRANSFORMER_BASED_WRAP"


def test_transformers_fsdp_config_gets_the_trainers_fsdp1_defaults(tmp_path: Path) -> None:
    # TrainingArguments._process_fsdp_args (transformers 5.x): with "version": 1 it passes
    # sync_module_states (default "true"), forward_prefetch ("false"), backward_prefetch
    # ("NO_PREFETCH") and use_orig_params ("true"); the version defaults to 2, which passes
    # none of them; state_dict_type is always passed, FULL_STATE_DICT unless given.
    def load(block: dict) -> Any:
        path = tmp_path / "fsdp_config.json"
        path.write_text(json.dumps(block))
        return fshard.load_config(path)

    v1 = load({"version": 1, "transformer_layer_cls_to_wrap": ["Layer"]})
    assert v1.sync_module_states and v1.syncs_module_states
    assert (v1.forward_prefetch, v1.backward_prefetch) == (False, fshard.BackwardPrefetch.NO_PREFETCH)
    assert v1.use_orig_params and v1.state_dict_type is StateDictType.FULL_STATE_DICT
    # The dict the Trainer normalised (the xla keys mark it) reads the same way.
    assert fshard.load_config({"version": "1", "xla": False}).sync_module_states
    # What the file says wins.
    given = load({"fsdp_version": 1, "sync_module_states": "false", "backward_prefetch": "backward_pre",
                  "forward_prefetch": True})  # fmt: skip
    assert not given.sync_module_states
    assert (given.forward_prefetch, given.backward_prefetch) == (True, fshard.BackwardPrefetch.BACKWARD_PRE)
    # Version 2 (the Trainer's default): no FSDP1 options, and FULL_STATE_DICT, not FSDP2's SHARDED.
    for block in ({"transformer_layer_cls_to_wrap": ["Layer"]}, {"version": 2, "cpu_offload": True}):
        v2 = load(block)
        assert not v2.syncs_module_states, block
        assert (v2.forward_prefetch, v2.backward_prefetch) == (None, None), block
        assert v2.state_dict_type is StateDictType.FULL_STATE_DICT, block
    # An accelerate file is not a Trainer config: accelerate's defaults.
    accelerate_v1 = fshard.load_config({"fsdp_version": 1, "fsdp_transformer_layer_cls_to_wrap": "Layer"})
    assert not accelerate_v1.syncs_module_states and accelerate_v1.backward_prefetch is None


# ------------------------------------------------------------ accelerate's parallelism_config


def _with_parallelism(sizes: dict[str, Any], num_processes: int | None = 4, **block: Any) -> dict[str, Any]:
    """A whole FSDP2 accelerate file with a parallelism_config section (keys without their prefix)."""
    data: dict[str, Any] = {
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_version": 2, **block},
        "parallelism_config": {f"parallelism_config_{k}": v for k, v in sizes.items()},
    }
    if num_processes is not None:
        data["num_processes"] = num_processes
    return data


@pytest.mark.parametrize(
    ("block", "strategy"),
    [({}, "HYBRID_SHARD"), ({"fsdp_reshard_after_forward": True}, "HYBRID_SHARD"),
     ({"fsdp_reshard_after_forward": False}, "HYBRID_SHARD_ZERO2"),
     ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}, "HYBRID_SHARD_ZERO2")],
)  # fmt: skip
def test_parallelism_config_dp_replicate_size_is_hybrid_sharding(block: dict[str, Any], strategy: str) -> None:
    # accelerate's HSDP (examples/torch_native_parallelism): dp_replicate_size replicas of
    # dp_shard_size-way sharding.
    sizes = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "cp_size": 1, "cp_comm_strategy": "allgather"}
    cfg = fshard.load_config(_with_parallelism(sizes, **block))
    assert cfg.sharding_strategy.name == strategy
    assert (cfg.replicate_size, cfg.shard_size) == (2, 2)
    # dp_shard_size 1 (accelerate's default): replicas of whole parameters.
    cfg = fshard.load_config(_with_parallelism({"dp_replicate_size": 2}, num_processes=2))
    assert cfg.sharding_strategy.name == "HYBRID_SHARD" and (cfg.replicate_size, cfg.shard_size) == (2, 1)


def test_parallelism_config_without_replication_is_plain_sharding() -> None:
    cfg = fshard.load_config(_with_parallelism({"dp_replicate_size": 1, "dp_shard_size": 4}))
    assert cfg.sharding_strategy.name == "FULL_SHARD" and (cfg.replicate_size, cfg.shard_size) == (None, 4)
    cfg = fshard.load_config(_with_parallelism({"dp_shard_size": 4}, fsdp_reshard_after_forward=False))
    assert cfg.sharding_strategy.name == "SHARD_GRAD_OP"
    # All sizes 1 asks for nothing: the other keys decide.
    cfg = fshard.load_config(_with_parallelism(dict.fromkeys(("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"), 1)))
    assert cfg.sharding_strategy.name == "FULL_SHARD" and (cfg.replicate_size, cfg.shard_size) == (None, None)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, "parallelism_config_tp_size: 2 asks for tensor parallelism, which fshard does not do (it shards data parallel only); set parallelism_config_tp_size: 1 and give those ranks to parallelism_config_dp_shard_size"),
        ({"dp_shard_size": 1, "cp_size": 4}, "parallelism_config_cp_size: 4 asks for context parallelism, which fshard does not do"),
        ({"dp_shard_size": 2, "sp_size": 2}, "parallelism_config_sp_size: 2 asks for sequence parallelism"),
        ({"dp_replicate_size": 0}, "parallelism_config_dp_replicate_size: 0 is not valid; expected an integer >= 1"),
        ({"dp_shard_size": "many"}, "parallelism_config_dp_shard_size: 'many' is not valid; expected an integer >= 1"),
        ({"dp_replicate_size": 2, "dp_shard_size": 4}, "parallelism_config: parallelism_config_dp_replicate_size 2 x parallelism_config_dp_shard_size 4 is 8 processes, but num_processes is 4; make the product equal num_processes"),
        ({"dp_replicas": 2}, "unknown key 'parallelism_config_dp_replicas' in parallelism_config (did you mean 'parallelism_config_dp_replicate_size'?); valid keys: parallelism_config_cp_backend"),
    ],
    ids=["tp", "cp", "sp", "zero", "not-a-number", "product", "unknown-key"],
)  # fmt: skip
def test_parallelism_config_errors_name_the_key(sizes: dict[str, Any], message: str) -> None:
    assert message in _error(_with_parallelism(sizes))


def test_parallelism_config_conflicting_with_the_sharding_strategy_names_both() -> None:
    message = _error(_with_parallelism({"dp_replicate_size": 2, "dp_shard_size": 2}, fsdp_sharding_strategy="FULL_SHARD"))
    assert ("fsdp_sharding_strategy is FULL_SHARD, but parallelism_config_dp_replicate_size: 2 asks for 2 replicas "
            "of 2-way sharding (hybrid sharding); set fsdp_sharding_strategy to HYBRID_SHARD or HYBRID_SHARD_ZERO2 "
            "(or leave it out), or parallelism_config_dp_replicate_size: 1") in message  # fmt: skip
    message = _error(_with_parallelism({"dp_shard_size": 4}, fsdp_reshard_after_forward="HYBRID_SHARD"))
    assert ("fsdp_reshard_after_forward is HYBRID_SHARD, but parallelism_config_dp_replicate_size: 1 with "
            "parallelism_config_dp_shard_size: 4 asks for plain sharding over 4 ranks") in message  # fmt: skip
    assert "parallelism_config: [2] is not valid; expected a mapping" in _error({"distributed_type": "FSDP", "parallelism_config": [2]})
