"""The third round's architecture rules (issue 28), checked on the source, not hoped for.

Every import counts here, function-local and ``TYPE_CHECKING`` ones included (the layers
themselves are an import-linter contract in pyproject.toml, run by ``.ci/test``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from gradwatch.checks.registry import ALL_CHECKS, SELF_CHECKS

PKG = Path(__file__).resolve().parents[2] / "gradwatch"
MAX_FUNCTION_LINES = 100
MAX_CORE_MODULES = 12
# Adapters over the core: they use its public names only.
INTEGRATIONS = (
    "lightning",
    "transformers",
    "cli",
    "sinks",
    "adapter.py",
    "pytest_plugin.py",
    "testing.py",
)
# Receivers whose private attributes a module may touch: its own object, and the watcher's
# weak self-references inside hook closures (``me = wself()``).
OWN = {"self", "cls", "me", "mcs"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _all_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every gradwatch import anywhere in the file (functions and TYPE_CHECKING included)."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name in known:
                parts = name.split(".")
                deps.update(".".join(parts[:k]) for k in range(2, len(parts) + 1))
    return deps


def test_no_import_circle_counting_function_local_imports() -> None:
    known = _modules()
    graph = {
        m: {d for d in _all_imports(p, known) if not m.startswith(d + ".") and d != m}
        for m, p in known.items()
    }
    graph["gradwatch"] = set()  # the root package only re-exports, lazily (PEP 562)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                walk(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not circles, "\n".join(circles)


def test_no_function_over_100_lines() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {size} lines")
    assert not long, long


def test_core_holds_about_a_dozen_modules() -> None:
    modules = [p.name for p in (PKG / "core").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_CORE_MODULES, sorted(modules)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_no_check_id_string_outside_checks() -> None:
    ids = {cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS]}
    found = []
    for name, path in _modules().items():
        if name.startswith("gradwatch.checks"):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and (node.value in ids or any(node.value.startswith(f"{i}'") for i in ids))
            ):
                found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, found


def _integration_files() -> list[Path]:
    out = []
    for part in INTEGRATIONS:
        target = PKG / part
        out.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return out


def test_integrations_use_only_public_names_of_gradwatch_objects() -> None:
    """An adapter touches no private attribute of an object it does not own."""
    found = []
    for path in _integration_files():
        tree = ast.parse(path.read_text())
        modules = {  # ``os._exit`` is a module's function, not an object's private state
            (a.asname or a.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for a in node.names
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and (base.id in OWN or base.id in modules):
                continue
            found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} .{attr}")
    assert not found, found


def test_every_check_module_is_registered_once() -> None:
    classes = [*ALL_CHECKS, *SELF_CHECKS]
    assert len({c.id for c in classes}) == len(classes)
    modules = {c.__module__ for c in classes}
    helpers = {"base", "views", "registry", "docs", "explain", "__init__"}
    files = {
        f"gradwatch.checks.{p.stem}"
        for p in (PKG / "checks").glob("*.py")
        if p.stem not in helpers and not p.stem.startswith("_")
    }
    assert files <= modules, sorted(files - modules)
