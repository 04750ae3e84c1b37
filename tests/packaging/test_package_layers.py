"""The package's shape (issue 20): no import circles, small modules, a core free of frameworks."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gradwatch"
MAX_MODULE_LINES = 420  # "a module past ~400 lines is a sign to split it"
MAX_CLASS_LINES = 250


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Module-level gradwatch imports (TYPE_CHECKING blocks included; lazy ones are not)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text()).body)
    deps = set()
    for name in found:
        if name not in known:
            continue
        deps.add(name)
        parts = name.split(".")
        # importing a submodule runs every parent package's __init__ first
        deps.update(".".join(parts[:k]) for k in range(2, len(parts)))
    return deps


def test_no_import_circles() -> None:
    known = _modules()
    graph = {
        m: {d for d in _imports(p, known) if not m.startswith(d + ".") and d != m}
        for m, p in known.items()
    }
    graph["gradwatch"] = set()  # the root only re-exports lazily (PEP 562)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                walk(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_core_and_checks_never_import_frameworks() -> None:
    known = _modules()
    banned = ("lightning", "pytorch_lightning", "transformers", "accelerate")
    for name, path in known.items():
        if not name.startswith(("gradwatch.core", "gradwatch.checks", "gradwatch.report")):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            assert not any(m.split(".")[0] in banned for m in mods), (name, mods)


def test_modules_and_classes_stay_small() -> None:
    big = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    big.append(f"{name}.{node.name}: class of {size} lines")
    assert not big, big
