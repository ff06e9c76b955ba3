"""The package's layers: imports only go down, and no module imports itself in a loop.

Every import inside ``fshard/`` counts (module level, inside functions, under TYPE_CHECKING):
each is a dependency a reader has to follow. The layer order is written once, in ``LAYERS``;
a module (or package) missing from it is an error, so a new room has to say where it stands.
See docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fshard"

# Lowest first. A module may import modules of its own layer or of a lower one. Names are
# relative to ``fshard`` (a package stands for all of its modules).
LAYERS: list[list[str]] = [
    ["_placement", "_options", "_errors", "_profiling", "_trees", "_checksum", "transforms"],
    ["_mesh", "_hang", "_collectives"],
    ["_param", "_bucket", "_amp", "_strategy", "_memtrack", "_replay"],
    ["_unit"],
    ["_runtime"],
    ["_api", "_controls", "_clip", "_introspect", "_materialize"],
    ["_state_dict"],
    ["_wrap", "checkpoint", "_config", "_estimate"],
    ["__init__", "__main__", "cli", "_launch", "testing", "hf", "_bench", "_model_source"],
]


def _room(module: str) -> str:
    """The entry of LAYERS that ``module`` (dotted, relative to fshard) belongs to."""
    return module.split(".")[0]


def _layer_of() -> dict[str, int]:
    return {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _relative(target: str) -> str:
    """``fshard.a.b`` -> ``a.b``; ``fshard`` -> ``__init__``."""
    return target.removeprefix("fshard").lstrip(".") or "__init__"


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The fshard modules ``path`` imports (``from fshard import _x`` names module ``_x``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join(["fshard", *base, *([node.module] if node.module else [])])
            else:
                stem = node.module or ""
            # ``from P import name``: the submodule P.name where there is one, else P itself.
            for alias in node.names:
                sub = f"{stem}.{alias.name}"
                targets.append(sub if _relative(sub) in known else stem)
        for target in targets:
            if target == "fshard" or target.startswith("fshard."):
                name = _relative(target)
                out.add(name if name in known else "__init__")
    out.discard(module)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules) | {"__init__"}
    return {name: _imports(path, name, known) for name, path in modules.items()}


def test_every_module_has_a_layer():
    layer = _layer_of()
    missing = sorted({_room(m) for m in _modules()} - set(layer))
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_no_import_goes_up_a_layer():
    layer = _layer_of()
    upward = [
        f"{m} (layer {layer[_room(m)]}) imports {t} (layer {layer[_room(t)]})"
        for m, targets in _graph().items()
        for t in sorted(targets)
        if _room(m) in layer and _room(t) in layer and layer[_room(t)] > layer[_room(m)]
    ]
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    circles = _cycles(_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_circle_finder_finds_circles(graph, expected):
    assert _cycles(graph) == expected


def test_imports_are_read_from_every_spelling(tmp_path):
    """``import fshard._x``, ``from fshard import _x``, ``from fshard._x import y`` and a
    relative import all name module ``_x``; other packages are ignored."""
    code = (
        "import fshard._a\nfrom fshard import _b\nfrom fshard._c import thing\n"
        "from . import _d\nfrom ._e import other\nimport torch\nimport fshard\n"
    )
    path = tmp_path / "_z.py"
    path.write_text(code)
    known = {"_a", "_b", "_c", "_d", "_e", "_z", "__init__"}
    assert _imports(path, "_z", known) == {"_a", "_b", "_c", "_d", "_e", "__init__"}
