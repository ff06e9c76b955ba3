"""fshard.checkpoint's streamed safetensors writer: files the safetensors library reads back."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fshard.checkpoint._safetensors import StreamWriter, TensorSpec, unstorable


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(7, 5, generator=gen),
        "half": torch.randn(3, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "odd": torch.arange(3, dtype=torch.int8),
        "c": torch.tensor([1 + 2j], dtype=torch.complex64),
    }


def test_a_streamed_file_reads_back_with_safetensors(tmp_path):
    tensors = _tensors()
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    path = tmp_path / "out.safetensors"
    with StreamWriter(path, specs, {"format": "pt"}) as writer:
        for key, value in tensors.items():
            writer.write(key, value)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_out_of_order_or_missing_tensors_are_errors_and_leave_no_file(tmp_path):
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (3,))]
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match=r"expected 'a' torch.float32 \[2\] next, got 'b'"):
        with StreamWriter(path, specs) as writer:
            writer.write("b", torch.zeros(3))
    assert not path.exists()
    with pytest.raises(ValueError, match=r"1 tensor\(s\) never written, from 'b'"):
        with StreamWriter(path, specs) as writer:
            writer.write("a", torch.zeros(2))
    assert unstorable([TensorSpec("w", torch.complex128, (1,))]) == {"complex128": ["w"]}
