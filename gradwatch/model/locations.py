"""Where in the user's code a flagged layer was created, and which line called it.

Two locations go into a finding's ``details`` as ``"path/to/file.py:LINE"`` (relative to the
current directory when the file is inside it):

- ``defined_at``: the ``self.aux_head = ...`` line of the parent module's class (its
  ``__init__`` first, then its other methods, along the MRO), read once per class with
  :mod:`inspect` and :mod:`ast`. A layer inside a container (``nn.Sequential``,
  ``nn.ModuleList``, ``nn.ModuleDict``) or a torch module points at the line that created
  the nearest user-defined ancestor attribute (``self.blocks = nn.ModuleList(...)``).
- ``called_at``: for ``disconnected``/``no_grad`` ghosts and forward-pass NaN origins, the
  line that called the module, captured from the stack once, by that module's forward hook,
  after the finding asked for it. No stack is walked on ordinary steps.

Everything here is best effort: a class without source (defined in a REPL, compiled) gives
no location, never an error.

Example:
    >>> defined_at(my_model, "encoder.aux_head")  # doctest: +SKIP
    'models/net.py:42'
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
import textwrap
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.model.named import SEP, NamedModels

__all__ = ["Locations", "call_site", "declares", "defined_at", "where"]

_SKIP = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # gradwatch itself
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_REGISTER = {"add_module", "register_module", "register_parameter"}
_ROOT = "(root)"


def where(filename: str, line: int) -> str:
    """``file:line``, the file relative to the current directory when it lies inside it."""
    path = os.path.abspath(filename)
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under us
        cwd = ""
    if cwd and path.startswith(cwd.rstrip(os.sep) + os.sep):
        path = os.path.relpath(path, cwd)
    return f"{path}:{line}"


def call_site() -> Optional[str]:
    """The first frame on the stack outside gradwatch and torch, as ``file:line``.

    Called from a forward hook, this is the line that called the module (``self.pooler(h)``
    in the parent's ``forward``); a module called by ``nn.Sequential`` resolves to the line
    that called the ``Sequential``.
    """
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP) and not name.startswith("<"):
            return where(name, frame.f_lineno)
        frame = frame.f_back
    return None


def _parse(func: Callable[..., Any]) -> tuple[Optional[ast.AST], int, str]:
    """The AST of ``func``'s source, the file line of its first line, and its file name."""
    lines, start = inspect.getsourcelines(func)
    source = "".join(lines)
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        # A multi-line string less indented than the body defeats dedent: nest it instead.
        tree = ast.parse("if True:\n" + source)
        start -= 1
    return tree, start, func.__code__.co_filename


@functools.lru_cache(maxsize=512)
def _assignments(func: Callable[..., Any]) -> tuple[dict[str, int], str]:
    """``{attribute: file line}`` of ``self.<attribute> = ...`` (and ``add_module``) in ``func``."""
    try:
        tree, start, filename = _parse(func)
    except (OSError, TypeError, SyntaxError, ValueError):
        return {}, ""
    args = func.__code__.co_varnames[: max(func.__code__.co_argcount, 1)]
    me = args[0] if args else "self"
    found: dict[str, int] = {}

    def note(attr: str, node: ast.AST) -> None:
        found.setdefault(attr, start + getattr(node, "lineno", 1) - 1)

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    for node in ast.walk(tree):  # type: ignore[arg-type]
        for target in targets(node):
            elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            for t in elts:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == me
                ):
                    note(t.attr, node)
        if isinstance(node, ast.Call) and node.args:
            fn, first = node.func, node.args[0]
            # self.add_module("name", m) / setattr(self, "name", m)
            if (
                isinstance(fn, ast.Attribute)
                and fn.attr in _REGISTER
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                note(first.value, node)
            elif (
                isinstance(fn, ast.Name)
                and fn.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                note(node.args[1].value, node)
    return found, filename


def _user_class(cls: type) -> bool:
    return cls is not nn.Module and not cls.__module__.startswith("torch.")


def _attribute_line(parent: nn.Module, attr: str) -> Optional[str]:
    """Where ``parent``'s class assigns ``self.<attr>``: ``__init__`` first, then other methods."""
    for cls in type(parent).__mro__:
        if not _user_class(cls) or cls is object:
            continue
        methods = [v for k, v in vars(cls).items() if inspect.isfunction(v)]
        methods.sort(key=lambda f: f.__name__ != "__init__")
        for func in methods:
            lines, filename = _assignments(func)
            if attr in lines:
                return where(filename, lines[attr])
    return None


def declares(parent: nn.Module, attr: str) -> bool:
    """Whether ``parent``'s own class assigns ``self.<attr>`` (or ``add_module``s it): a
    child its code made, not one set on the instance from outside."""
    return _attribute_line(parent, attr) is not None


def _class_line(module: nn.Module) -> Optional[str]:
    cls = type(module)
    try:
        _, line = inspect.getsourcelines(cls)
        filename = inspect.getsourcefile(cls)
    except (OSError, TypeError):
        return None
    return where(filename, line) if filename else None


def defined_at(root: nn.Module, layer: str) -> Optional[str]:
    """Where the module ``layer`` of ``root`` was created, as ``file:line`` (best effort).

    Args:
        root: the watched model.
        layer: a module name as in ``root.named_modules()`` (``"(root)"`` for ``root``).

    Example:
        >>> defined_at(model, "aux_head")  # doctest: +SKIP
        'examples/ci_ghost.py:24'
    """
    if isinstance(root, NamedModels):  # a named model's layer: "G:main.0", its root "G"
        head, _, layer = layer.partition(SEP)
        named = root._modules.get(head + SEP)
        if named is None:
            return None
        root = named
    if layer in ("", _ROOT):
        return _class_line(root) if _user_class(type(root)) else None
    parts = layer.split(".")
    chain: list[nn.Module] = [root]
    for part in parts:
        child = chain[-1]._modules.get(part)
        if child is None:
            return None
        chain.append(child)
    # From the layer upwards: the first parent whose own class assigned the child.
    for k in range(len(parts) - 1, -1, -1):
        parent = chain[k]
        if isinstance(parent, _CONTAINERS) or not _user_class(type(parent)):
            continue
        found = _attribute_line(parent, parts[k])
        if found is not None:
            return found
    return None


class Locations:
    """Adds ``defined_at``/``called_at`` to one watcher's findings (a fault goes to ``on_error``)."""

    def __init__(
        self,
        model: nn.Module,
        called_at: dict[str, str],
        want_call: set[str],
        call_target: Callable[[Any], Optional[str]],
        on_error: Optional[Callable[[str, BaseException], None]] = None,
    ) -> None:
        self._model = weakref.ref(model)
        self._on_error = on_error  # the run's fault funnel: a fault here is still seen
        # which module's calling line a finding wants: its check says (checks/*.call_site)
        self._call_target = call_target
        # the forward hooks' evidence (core.evidence.Tracker): lines seen, layers asked for
        self._called_at = called_at
        self._want_call = want_call
        self._defined: dict[str, Optional[str]] = {}

    def annotate(self, finding: Any) -> None:
        """Fill in the locations known for ``finding``; ask for a call site when it needs one."""
        try:
            self._annotate(finding)
        except Exception as exc:  # a location must never cost a finding, nor hide a fault
            if self._on_error is not None:
                self._on_error("finding locations", exc)

    def _annotate(self, finding: Any) -> None:
        details, module = finding.details, finding.module
        if module and "defined_at" not in details:
            if module not in self._defined:
                model = self._model()
                self._defined[module] = defined_at(model, module) if model is not None else None
            found = self._defined[module]
            if found is not None:
                details["defined_at"] = found
        target = self._call_target(finding)
        if target is not None and "called_at" not in details:
            site = self._called_at.get(target)
            if site is not None:
                details["called_at"] = site
            else:
                self._want_call.add(target)
