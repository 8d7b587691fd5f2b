"""The house: imports run one way, from the faces down to a pure layout core, and never in a cycle.

Every ``import`` and ``from ... import`` of ``src/reshard`` is read with ``ast``, including the lazy
ones inside functions (a lazy import hides a cycle from Python, not from the design). Each module
belongs to a layer (``docs/architecture.md`` explains them); an edge may only point to the same
layer or a lower one, and the graph of modules may hold no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.oracle import ROOT

SRC = ROOT / "src"

# Lowest first. A module belongs to the first layer one of whose prefixes it equals or lies under.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "reshard",
        "reshard.errors",
        "reshard.arguments",
        "reshard.dtypes",
        "reshard.text",
        "reshard.statenames",
        "reshard.interrupts",
        "reshard.lazy",
        "reshard.readahead",
    ),
    ("reshard.layout", "reshard.naming"),
    ("reshard.formats",),
    ("reshard.plan",),
    ("reshard.sources",),
    ("reshard.execute",),
    (
        "reshard.lock",
        "reshard.manifest",
        "reshard.resume",
        "reshard.destination",
        "reshard.ops",
        "reshard.api",
        "reshard.auto",
        "reshard.strategy_wait",
    ),
    (
        "reshard.mindspore",
        "reshard.transform_ckpt",
        "reshard.cli",
        "reshard.inspection",
        "reshard.picture",
        "reshard.verify",
        "reshard.demo",
        "reshard.synthetic",
        "reshard.__main__",
        "reshard.entry",
    ),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest matching prefix wins
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "reshard" and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and to docs/architecture.md")
    return best[1]


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The reshard modules ``path`` imports (``from reshard import api`` names the module ``reshard.api``)."""
    module = module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "reshard")
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            if target.split(".")[0] != "reshard":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(SRC.joinpath("reshard").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): {m for m in imports_of(p, modules) if m in modules or m == "reshard"} for p in paths}


def test_every_import_points_down() -> None:
    upward = []
    for module, targets in import_graph().items():
        for target in sorted(targets):
            if target == "reshard" and module != "reshard":
                continue  # the package itself: only __version__ and the error base class
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target == "reshard":
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("reshard.layout", ("google.protobuf", "reshard.formats", "numpy")),
    ],
)
def test_the_layout_core_loads_alone(module: str, forbidden: tuple[str, ...]) -> None:
    """``import reshard.layout`` loads neither protobuf nor any reader: the slice algebra is pure."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith({forbidden!r})))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"import {module} loaded: {proc.stdout.strip()}"


def test_layers_cover_every_module() -> None:
    for module in import_graph():
        layer_of(module)
