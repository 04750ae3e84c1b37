"""The package's shape (issue 20): no import circles, small modules, a core free of frameworks."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gradwatch"
MAX_MODULE_LINES = 420  # "a module past ~400 lines is a sign to split it"
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 100  # tests/packaging/test_architecture_rules.py's cap on a function
# A unit within 10 % of its cap has no room for the next fix: split it before it is needed.
ROOM = 0.9


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


def _sizes() -> Iterator[tuple[str, int, int]]:
    """``(unit, lines, cap)`` of every module, class and function, counted as the caps are."""
    for name, path in _modules().items():
        text = path.read_text()
        yield name, text.count("\n"), MAX_MODULE_LINES
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                cap = MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES
                yield f"{name}.{node.name} ({kind})", size, cap


def test_caps_keep_ten_percent_room() -> None:
    """No module, class or function is within 10 % of its cap (420, 250 and 100 lines)."""
    tight = [
        f"{unit}: {size} > {int(ROOM * cap)}" for unit, size, cap in _sizes() if size > ROOM * cap
    ]
    assert not tight, tight


def test_core_keeps_ten_percent_room_under_its_module_cap() -> None:
    """``core/`` holds at most 90 % of the dozen modules its architecture rule allows."""
    core = Path(__file__).resolve().parents[2] / "gradwatch" / "core"
    modules = sorted(p.name for p in core.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= int(ROOM * 12), modules
