"""Docstrings: every public name shows an ``Example:``, and every example in ``fshard`` passes.

Pure: no process group. Examples that need one are marked ``# doctest: +SKIP`` in their
docstrings, so ``doctest`` runs the rest here (the same flags as ``pytest --doctest-modules``
would need: ``ELLIPSIS | NORMALIZE_WHITESPACE``).
"""

from __future__ import annotations

import doctest
import functools
import importlib
import importlib.util
import io
import pkgutil
import re
import types
import typing
from typing import NamedTuple

import pytest

import fshard

# Modules whose public names users read in the API docs; each must define ``__all__``.
PUBLIC_MODULES = [
    "fshard",
    "fshard.checkpoint",
    "fshard.transforms",
    "fshard.testing",
    "fshard.testing.strategies",
    "fshard.testing.models",
]
if importlib.util.find_spec("transformers") and importlib.util.find_spec("accelerate"):
    PUBLIC_MODULES.append("fshard.hf")  # the hf extra (make test installs it)

DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# An "Example:" (or "Examples:") section header on a line of its own.
_EXAMPLE_HEADER = re.compile(r"^[ \t]*Examples?:[ \t]*$", re.MULTILINE)


def _is_exempt(obj: object) -> bool:
    """Names that carry no docstring of their own: submodules (their public names are checked
    through ``PUBLIC_MODULES``) and type aliases (``Coord = tuple[int, ...]``,
    ``ModelSpec = MLPSpec | TransformerSpec``), whose ``__doc__`` is the origin type's."""
    if isinstance(obj, types.ModuleType):
        return True
    if isinstance(obj, type):
        return False  # a class, even a generic one, has its own docstring
    alias_types: tuple[type, ...] = (types.GenericAlias, types.UnionType)
    if hasattr(typing, "TypeAliasType"):  # `type X = ...` (Python 3.12+)
        alias_types += (typing.TypeAliasType,)
    return isinstance(obj, alias_types) or typing.get_origin(obj) is not None


def _public_names() -> list[tuple[str, str]]:
    pairs = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        assert hasattr(module, "__all__"), f"{module_name} has no __all__"
        pairs += [(module_name, name) for name in module.__all__]
    return pairs


def _package_modules() -> list[str]:
    names = [fshard.__name__]
    for info in pkgutil.walk_packages(fshard.__path__, prefix=f"{fshard.__name__}."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # `python -m fshard`: importing it runs the CLI and exits
        if info.name == "fshard.hf" and "fshard.hf" not in PUBLIC_MODULES:
            continue  # needs the hf extra
        names.append(info.name)
    return names


# ----------------------------------------------------------------------------- Example sections


def test_public_names_are_found() -> None:
    names = _public_names()
    assert ("fshard", "fully_shard") in names
    assert ("fshard.testing.models", "build_model") in names
    assert ("fshard.testing.strategies", "mesh_shapes") in names


def test_exemptions_are_by_kind() -> None:
    from fshard import transforms
    from fshard.testing import models

    assert _is_exempt(transforms.Coord)  # tuple[int, ...]
    assert _is_exempt(models.ModelSpec)  # MLPSpec | TransformerSpec
    assert _is_exempt(fshard.checkpoint)  # a submodule
    assert not _is_exempt(transforms.Layout)  # a class over a generic base
    assert not _is_exempt(fshard.fully_shard)


@pytest.mark.parametrize(("module_name", "name"), _public_names(), ids=lambda v: v)
def test_public_name_has_example(module_name: str, name: str) -> None:
    obj = getattr(importlib.import_module(module_name), name)
    if _is_exempt(obj):
        pytest.skip(f"{type(obj).__name__}: no docstring of its own")
    # `__doc__`, not `inspect.getdoc`: a class without a docstring would inherit its base's
    # (nn.Module's has an example of its own).
    doc = obj.__doc__ or ""
    header = _EXAMPLE_HEADER.search(doc)
    assert header is not None, f"{module_name}.{name}: docstring has no 'Example:' section"
    assert ">>>" in doc[header.end() :], f"{module_name}.{name}: 'Example:' has no '>>>' line"


# --------------------------------------------------------------------------------- doctests


class DoctestResult(NamedTuple):
    failed: int
    attempted: int  # examples that ran: doctest does not count +SKIP ones
    report: str


@functools.cache
def _run_doctests(module_name: str) -> DoctestResult:
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    out = io.StringIO()
    failed = attempted = 0
    for test in doctest.DocTestFinder().find(module, module_name):
        result = runner.run(test, out=out.write)
        failed += result.failed
        attempted += result.attempted
    return DoctestResult(failed, attempted, out.getvalue())


def test_package_modules_are_found() -> None:
    modules = _package_modules()
    assert {"fshard", "fshard._api", "fshard.testing.models", "fshard.transforms"} <= set(modules)
    assert "fshard.__main__" not in modules


@pytest.mark.parametrize("module_name", _package_modules())
def test_doctests_pass(module_name: str) -> None:
    result = _run_doctests(module_name)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed:\n{result.report}"


def test_doctests_really_run() -> None:
    attempted = {name: _run_doctests(name).attempted for name in _package_modules()}
    assert sum(attempted.values()) > 0, "every doctest example is skipped"
    # The pure modules show real input -> output, not only skipped examples.
    for name in ["fshard.transforms", "fshard.testing.models", "fshard.testing.strategies"]:
        assert attempted[name] > 0, f"{name}: every doctest example is skipped"
