"""Dropout run as in training inside an eval-mode forward of the watched model.

During the first ``forwards`` eval-mode forwards of the watched model (a forward pre-hook on
it, whenever they come: validation at an epoch's end, a sampling helper), the functional
dropouts (``torch.nn.functional.dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``,
``feature_alpha_dropout``) are wrapped for the length of that forward. A call with
``training=True`` and ``p > 0`` from the ``forward`` of a module that is itself in eval mode
is a *site*: the module ignored ``self.training`` (``F.dropout(x, 0.1)``: its default is
``training=True``). ``nn.Dropout`` passes its own mode, so a dropout module switched back to
train mode on purpose (Monte-Carlo dropout) is not a site. Nothing is wrapped outside those
forwards; a function imported by name before watching (``from torch.nn.functional import
dropout``) is not seen.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.model.locations import call_site

__all__ = ["FUNCTIONS", "DropoutSite", "EvalDropoutWatch"]

FUNCTIONS = (
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
)
_ALPHA = frozenset({"alpha_dropout", "feature_alpha_dropout"})  # default training=False


@dataclass(frozen=True)
class DropoutSite:
    """A dropout that ran as in training inside an eval-mode module's forward."""

    module: str  # the module whose forward called it ("" the model)
    cls: str
    params: list[str]  # that module's parameter names (what ``ignore`` matches)
    function: str  # e.g. "dropout"
    p: float
    called_at: Optional[str]  # file:line of the call


class EvalDropoutWatch:
    """One watcher's view of the functional dropouts in its model's eval forwards."""

    def __init__(
        self,
        model: nn.Module,
        found: Callable[[DropoutSite], None],
        on_error: Callable[[str, BaseException], None],
        *,
        forwards: int,
    ) -> None:
        self._names = {id(m): (n, m) for n, m in model.named_modules()}
        self._model = weakref.ref(model)
        self._found = found
        self._on_error = on_error
        self.left = forwards
        self._saved: dict[str, Any] = {}
        self._seen: set[tuple[str, str]] = set()
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training or self.left <= 0 or self._saved:
            return
        self.left -= 1
        F = torch.nn.functional
        for name in FUNCTIONS:
            original = getattr(F, name)
            self._saved[name] = original
            setattr(F, name, self._wrap(name, original))

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self._restore()
        if self.left <= 0:
            self.remove()

    def _restore(self) -> None:
        F = torch.nn.functional
        for name, original in self._saved.items():
            setattr(F, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        default = name not in _ALPHA

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                training = args[2] if len(args) > 2 else kwargs.get("training", default)
                if training and p > 0:
                    self._site(name, float(p), sys._getframe(1))
            except Exception as exc:  # never the user's forward
                self._on_error("eval dropout", exc)
            return original(*args, **kwargs)

        return wrapper

    def _site(self, name: str, p: float, frame: Any) -> None:
        caller = frame.f_locals.get("self")
        entry = self._names.get(id(caller)) if isinstance(caller, nn.Module) else None
        if entry is None or entry[1] is not caller or caller.training:
            return  # outside the watched model, or a module in train mode on purpose
        where, mod = entry
        if (where, name) in self._seen:
            return
        self._seen.add((where, name))
        params = _params_near(self._names, where)
        self._found(DropoutSite(where, type(mod).__name__, params, name, p, call_site()))

    def remove(self) -> None:
        self._restore()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._names = {}  # (name, module) pairs: the watched model must not outlive the watch


def _params_near(names: dict[int, tuple[str, nn.Module]], where: str) -> list[str]:
    """The parameter names of module ``where``, else of its nearest ancestor that has some
    (a parameter-free dropout wrapper is silenced by its parent's names)."""
    by_name = {n: m for n, m in names.values()}
    path = where
    while True:
        mod = by_name.get(path)
        if mod is not None:
            out = [f"{path}.{n}" if path else n for n, _ in mod.named_parameters()]
            if out or not path:
                return out
        path = path.rsplit(".", 1)[0] if "." in path else ""
