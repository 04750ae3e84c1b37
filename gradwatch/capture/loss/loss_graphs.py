"""The loss's graph on scan steps: described at each ``backward()``, with the modules that
produced its nodes, and whether earlier steps' graphs are still alive.

- *Described* (:mod:`gradwatch.capture.loss.graph_walk`): during the first ``scan_steps`` optimizer
  windows, each ``Tensor.backward`` root's graph is walked once (at most ``max_nodes`` nodes).
- *Module outputs*: during the same windows, one global module forward hook notes which
  module of the watched model produced which ``grad_fn`` (and in which mode), so a node is
  named by its module and the loss's own ops are told from the model's. The grad_fns are
  kept only until the next backward or the window's end (ids are only valid while they live).
- *Retained*: each described root gets a token in its node's ``metadata`` (a dict autograd
  frees with the node); a weak reference to the token says whether that step's graph is
  still alive later, as ``running_loss += loss`` keeps every one of them.

Off the scan windows nothing is installed or walked. Under torch.compile no module hook is
added (a hook is a dynamo guard) and a compiled region is one opaque node of the graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.capture.loss.graph_walk import GraphDesc, Mark, describe
from gradwatch.capture.loss.loose import BackwardRoots
from gradwatch.capture.loss.term_shares import TermShares
from gradwatch.model.hook_args import post_args
from gradwatch.model.locations import call_site

__all__ = ["MAX_GRAPH_NODES", "LossGraphs"]

MAX_GRAPH_NODES = 20_000  # nodes described per backward, at most
_MAX_MARKS = 4096  # module outputs noted per backward, at most
_MAX_GRAPHS = 8  # described graphs kept per window (gradient accumulation), at most
_MAX_TOKENS = 64  # earlier graphs followed for liveness, at most
_SETTINGS_OF = frozenset(
    {
        "SoftmaxBackward0",
        "LogSoftmaxBackward0",
        "NllLossBackward0",
        "NllLoss2DBackward0",
        "BinaryCrossEntropyWithLogitsBackward0",
        "BinaryCrossEntropyBackward0",
        "MseLossBackward0",
        "MulBackward0",
        "MulBackward1",
        "DivBackward0",
        "DivBackward1",
        "NativeDropoutBackward0",
    }
)


class _Token:
    """Planted in a root node's ``metadata``: alive exactly as long as that node."""

    __slots__ = ("__weakref__", "window")

    def __init__(self, window: int) -> None:
        self.window = window


class LossGraphs(BackwardRoots):
    """One watcher's listener that describes the loss's graph on scan windows.

    It rides on :class:`~gradwatch.capture.loss.loose.BackwardRoots`'s one wrapper of
    ``Tensor.backward`` (its loss flags and loose-leaf walk are off here: ``root`` is its own).
    """

    def __init__(
        self,
        model: nn.Module,
        on_error: Callable[[str, BaseException], None],
        *,
        scan_steps: int,
        observe_modules: bool,
        terms: bool = False,
    ) -> None:
        super().__init__(lambda p: True, on_error, loss=False, scan_steps=scan_steps)
        self._names = {id(m): (n, m) for n, m in model.named_modules()}
        self._model_cls = type(model).__name__
        self._time_major = any(getattr(m, "batch_first", True) is False for m in model.modules())
        self._observe = observe_modules
        self._hook: Optional[Any] = None
        self._marks: dict[int, Mark] = {}
        self._alive_fns: list[Any] = []  # the marked grad_fns, alive until the next walk
        self.graphs: list[GraphDesc] = []  # this window's
        self._tokens: list[weakref.ref[_Token]] = []
        self._batch: Optional[int] = None  # the model's input's first dim, latest forward
        self._batch_from: Optional[str] = None  # the module it was read at ("": the model)
        self.described = 0  # nodes described so far (for benchmarks)
        self.shares = TermShares() if terms else None  # per-term attribution
        if self.scanning:
            self._arm()

    # -- module outputs --------------------------------------------------------------------

    def _arm(self) -> None:
        if self._observe and self._hook is None:
            self._hook = nn.modules.module.register_module_forward_hook(
                self._seen, with_kwargs=True
            )

    def _disarm(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            # torch keeps a removed with_kwargs global hook's id in this dict (its handle is
            # not told of it): left there, every later torch.compile'd call in the process
            # warns of global hooks, and module calls keep the global-hook path.
            nn.modules.module._global_forward_hooks_with_kwargs.pop(self._hook.id, None)
            self._hook = None
        self._marks.clear()
        self._alive_fns.clear()

    def _seen(self, module: nn.Module, args: Any, *rest: Any) -> None:
        try:
            kwargs, out = post_args(rest)
            entry = self._names.get(id(module))
            if entry is None or entry[1] is not module or len(self._marks) >= _MAX_MARKS:
                return
            name, _ = entry
            if "." not in name and (name == "" or self._batch_from != ""):
                self._note_batch(name, args, kwargs)
            mark: Optional[Mark] = None
            for t in _tensors(out):
                fn = t.grad_fn
                if fn is None or id(fn) in self._marks:
                    continue
                if mark is None:
                    owns = next(module.parameters(), None) is not None
                    mark = Mark(name, type(module).__name__, module.training, owns)
                self._marks[id(fn)] = mark
                self._alive_fns.append(fn)
        except Exception as exc:  # never the user's forward
            self._on_error("module outputs", exc)

    def _note_batch(self, name: str, args: Any, kwargs: Any) -> None:
        for v in [*args, *(kwargs or {}).values()]:
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                self._batch, self._batch_from = int(v.shape[0]), name
                return

    # -- the backward ----------------------------------------------------------------------

    def root(self, t: torch.Tensor) -> None:
        """``t.backward()`` is about to run: describe its graph (scan windows only)."""
        try:
            if not self.scanning or t.grad_fn is None or len(self.graphs) >= _MAX_GRAPHS:
                return
            fn = t.grad_fn
            keep: Optional[list[Any]] = [] if self.shares is not None else None
            desc = describe(
                fn,
                self._marks,
                max_nodes=MAX_GRAPH_NODES,
                window=self.window,
                settings_of=_SETTINGS_OF,
                keep=keep,
            )
            if self.shares is not None and keep is not None:
                self.shares.attach(desc, keep)
                keep.clear()
            desc.marked = self._observe
            desc.batch = self._batch
            desc.model = self._model_cls
            desc.time_major = self._time_major
            desc.backward_at = call_site()
            self.described += len(desc.nodes)
            self.graphs.append(desc)
            self._marks.clear()
            self._alive_fns.clear()
            self._plant(fn)
        except Exception as exc:  # never the user's backward
            self._on_error("loss graph", exc)

    def _plant(self, fn: Any) -> None:
        meta = getattr(fn, "metadata", None)
        if not isinstance(meta, dict) or len(self._tokens) >= _MAX_TOKENS:
            return
        token = _Token(self.window)
        meta["gradwatch_step"] = token
        self._tokens.append(weakref.ref(token))

    def retained(self) -> list[int]:
        """The windows before this one whose described graphs are still alive."""
        live = [t for t in (ref() for ref in self._tokens) if t is not None]
        self._tokens = [weakref.ref(t) for t in live]
        return [t.window for t in live if t.window < self.window]

    def take(self) -> list[GraphDesc]:
        """This window's described graphs (each once)."""
        out, self.graphs = self.graphs, []
        return out

    def window_closed(self) -> None:
        self.window += 1
        self.graphs = []
        if self.scanning:
            self._marks.clear()
            self._alive_fns.clear()
        else:
            self._disarm()

    def remove(self) -> None:
        self._disarm()
        self._tokens.clear()
        self._names.clear()  # (name, module) pairs: the watched model must not outlive the watch
        self.graphs = []
        super().remove()


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output, one level deep (a tuple, a dict, a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        values: Any = out.values()
    elif isinstance(out, (tuple, list)):
        values = out
    else:
        return []
    return [v for v in values if isinstance(v, torch.Tensor)][:8]
