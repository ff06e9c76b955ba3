"""fshard's warnings point at the user's line, not at fshard's or torch's files."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import fshard._errors
from fshard._errors import warn_user


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return caught


def test_a_direct_call_points_at_the_caller():
    caught = _record(lambda: warn_user("fshard: direct"))
    assert [(w.filename, w.category) for w in caught] == [(__file__, UserWarning)]


_LIBRARY = """
from fshard._errors import warn_user

def pre_hook(module, args):
    warn_user("fshard: from a module hook", RuntimeWarning)

def grad_hook(grad):
    warn_user("fshard: from backward")
"""


def test_torch_frames_between_fshard_and_the_user_are_skipped(tmp_path, monkeypatch):
    """Hooks of a library (a file under a directory counted as fshard's) run by torch's
    ``Module.__call__`` and by autograd's engine (via ``Tensor.backward``) warn at the user's
    line that called torch."""
    (tmp_path / "fake_fshard_hooks.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fshard._errors, "_NOT_USER_DIRS", (*fshard._errors._NOT_USER_DIRS, f"{tmp_path}/"))
    import fake_fshard_hooks

    module = nn.Linear(2, 2)
    module.register_forward_pre_hook(fake_fshard_hooks.pre_hook)
    x = torch.ones(1, 2, requires_grad=True)
    x.register_hook(fake_fshard_hooks.grad_hook)

    def call():
        module(x).sum().backward()

    caught = _record(call)
    line = call.__code__.co_firstlineno + 1
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)] * 2
    assert [w.category for w in caught] == [RuntimeWarning, UserWarning]
