"""Dropout run as in training inside an eval-mode forward of the watched model.

During the first ``forwards`` eval-mode forwards of the watched model (a forward pre-hook on
it, whenever they come: validation at an epoch's end, a sampling helper), a
``TorchFunctionMode`` sees the functional dropouts (``torch.nn.functional.dropout``,
``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``) for the length of that
forward: they dispatch to an active mode themselves, so a name bound before watching
(``from torch.nn.functional import dropout``) is seen as ``F.dropout`` is. A call with
``training=True`` and ``p > 0`` from the ``forward`` of a module that is itself in eval mode
is a *site*: the module ignored ``self.training`` (``F.dropout(x, 0.1)``: its default is
``training=True``). ``nn.Dropout`` passes its own mode, so a dropout module switched back to
train mode on purpose (Monte-Carlo dropout) is not a site. No mode is active outside those
forwards.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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
        self._mode: Optional[_DropoutMode] = None
        self._seen: set[tuple[str, str]] = set()
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training or self.left <= 0 or self._mode is not None:
            return
        self.left -= 1
        self._mode = _DropoutMode(self)
        self._mode.__enter__()

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self._restore()
        if self.left <= 0:
            self.remove()

    def _restore(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def seen_call(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        """A functional dropout ran inside the eval forward: a site when it dropped."""
        try:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            default = name not in _ALPHA
            training = args[2] if len(args) > 2 else kwargs.get("training", default)
            if training and p > 0:
                frame = _caller(func)
                if frame is not None:
                    self._site(name, float(p), frame)
        except Exception as exc:  # never the user's forward
            self._on_error("eval dropout", exc)

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


class _DropoutMode(TorchFunctionMode):
    """Active during one eval forward: tells its watch of each functional dropout call."""

    def __init__(self, watch: EvalDropoutWatch) -> None:
        super().__init__()
        self._watch = watch
        F = torch.nn.functional
        self._names = {getattr(F, name): name for name in FUNCTIONS}

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        name = self._names.get(func)
        if name is not None:
            self._watch.seen_call(func, name, args, kwargs)
        return func(*args, **kwargs)


def _caller(func: Any) -> Any:
    """The frame that called ``func`` (the functional dropout whose dispatch is running)."""
    code = getattr(func, "__code__", None)
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame.f_back if frame is not None else None


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
