"""Device choices that must also be right on machines this suite does not run on (GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fshard import _collectives
from fshard._mesh import default_device_type


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("cpu:gloo", "cpu"), ("ucc", "cuda")],
)
def test_default_device_follows_the_process_group_backend(monkeypatch, backend, expected):
    """On a GPU machine, a gloo group computes on the CPU (a CUDA mesh over gloo fails)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert default_device_type() == expected


def test_default_device_without_cuda_or_process_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device_type() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert default_device_type() == "cuda"


def test_dtypes_backends_cannot_move_travel_as_bytes():
    for dtype in (torch.int16, torch.uint16, torch.float8_e4m3fn):
        t = torch.zeros(2, 3).to(dtype)
        wire = _collectives._as_wire(t)
        assert wire.dtype == torch.uint8 and wire.numel() == t.numel() * t.element_size()
        wire.fill_(1)  # a view: what a collective writes lands in the tensor itself
        assert torch.equal(t.view(torch.uint8), torch.ones(2, 3 * t.element_size(), dtype=torch.uint8))
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        t = torch.zeros(4, dtype=dtype)
        assert _collectives._as_wire(t) is t
