"""What the watched model's forward pass does: when it ran, what ran inside it, where NaN starts.

A few forward hooks on the model's entry points (the root module, and its direct children
until the root is seen running in grad mode: a Lightning ``training_step`` often calls
``self.model(x)`` rather than ``self(x)``) give:

- *run stamps*: the event number of the last outermost forward, with and without grad mode
  (``loss_disconnected`` needs "the model ran in this window", long after the per-layer
  forward hooks were trimmed);
- *unregistered modules*: during the first ``scan_steps`` optimizer steps a global module
  forward hook is on only while the model's forward runs; every module called in between
  that is not registered in the model and owns parameters requiring grad gets a one-shot
  post-accumulate hook on those parameters. Those that receive a gradient are
  ``unregistered_param`` findings (frozen or no-grad ones never are);
- *NaN probe* (:class:`~gradwatch.capture.forward.nan_probe.NanProbe`, its base class): during the
  first steps, then again after a non-finite gradient, device-side finiteness flags per
  module, read with the next step's single host transfer.

Nothing here syncs with the device: flags stay 0-dim tensors until the step's gather.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.forward.nan_probe import NanProbe, _not_eager, _Owned
from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.spans import count_after
from gradwatch.model.locations import call_site

__all__ = ["BUILT_IN_FORWARD", "ForwardScout", "container_paths"]

BUILT_IN_FORWARD = " built inside forward"
"""In the name of a module that did not outlive the forward that called it (``nn.Linear(d,
d)(h)`` in ``forward``): ``<Linear built inside forward at net.py:25>``."""

OnError = Callable[[str, BaseException], None]

_MODULE_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping, not user state
_MAX_DEPTH = 4  # nesting of plain containers walked to name an unregistered module
_MAX_BATCHES = 256  # batch starts remembered (windows longer than that are not capped)


def _walk(value: Any, path: str, out: dict[int, str], depth: int) -> None:
    if isinstance(value, nn.Module):
        if id(value) not in out:
            for sub_name, sub in value.named_modules():
                out.setdefault(id(sub), f"{path}.{sub_name}" if sub_name else path)
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            _walk(v, f"{path}[{k}]", out, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{path}[{k!r}]", out, depth + 1)


def container_paths(model: nn.Module) -> dict[int, str]:
    """``id(module) -> attribute path`` of modules kept in plain containers of ``model``.

    Example: a ``self.blocks = [nn.Linear(4, 4)]`` attribute of a submodule ``enc`` gives
    ``enc.blocks[0]``. Registered submodules are not listed (their names are known).
    """
    out: dict[int, str] = {}
    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if attr in _MODULE_ATTRS or not isinstance(value, (list, tuple, dict)):
                continue
            _walk(value, f"{name}.{attr}" if name else attr, out, 0)
    registered = {id(m) for m in model.modules()}
    return {k: v for k, v in out.items() if k not in registered}


@dataclass
class _Called:
    """An unregistered module called in the model's forward, as seen when it ran."""

    module: weakref.ref[nn.Module]
    cls: str
    params: list[tuple[str, weakref.ref[nn.Parameter]]]
    site: Optional[str]  # the line that called it
    built: bool = False  # gone once the forward returned: built inside it


class ForwardScout(NanProbe):
    """Forward-pass evidence of one watched model (see the module docstring)."""

    def __init__(self, tracker: Tracker, on_error: OnError, scan_steps: int) -> None:
        NanProbe.__init__(self, on_error)
        self.tracker = tracker
        self.scan_steps = scan_steps
        self.ran_grad = 0  # event number of the last outermost forward in grad mode
        self.ran_nograd = 0
        self._known: Callable[[torch.Tensor], bool] = lambda p: False
        self._depth = 0
        self._entry: list[RemovableHandle] = []
        self._children: list[RemovableHandle] = []
        self._global: Optional[RemovableHandle] = None
        self.scanning = scan_steps > 0
        self._registered: set[int] = set()
        self._new: list[_Called] = []  # unregistered modules this forward called
        self._new_ids: dict[int, weakref.ref[nn.Module]] = {}
        # modules whose parameters were looked at (a weakref: a module built in each forward
        # is a new object that may get a dead one's id)
        self._judged: dict[int, weakref.ref[nn.Module]] = {}
        # unregistered parameters waiting for a gradient: id -> (param, module, its name)
        self._waiting: dict[int, tuple[weakref.ref[nn.Parameter], _Called, str]] = {}
        # Leaves requiring grad handed to the forward as they are (a PINN's collocation points)
        self._fed: dict[int, weakref.ref[torch.Tensor]] = {}
        self._grad_hooks: dict[int, RemovableHandle] = {}
        self._got: set[int] = set()
        self._reported: set[int] = set()  # unregistered parameters already returned
        # Called at each outermost forward in grad mode with the module it entered
        # (``capture/forward/modes.py``'s ModeWatch.seen), where a check needs the model's modes.
        self.on_outer: Optional[Callable[[nn.Module], None]] = None
        # Event numbers of the outermost grad-mode forwards that began a new batch: the
        # first after a backward pass completed (a model called twice per batch, as a
        # Siamese one is, is one batch; a backward repeated on one forward is one batch).
        self.batch_starts: deque[int] = deque(maxlen=_MAX_BATCHES)
        self.input_grad_starts: deque[int] = deque(maxlen=_MAX_BATCHES)  # inputs wanted grad
        # Samples the latest batch held (the leading dim of the forward's first tensor input).
        self.rows: Optional[int] = None
        self._ended_seen = -1

    # -- installing ------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """Whether its entry hooks are on a model (:meth:`install` ran)."""
        return self._model is not None

    def install(self, model: nn.Module, known: Callable[[torch.Tensor], bool]) -> None:
        """Hook the model's entry points (once). ``known(p)``: ``p`` is a watched parameter."""
        if self._model is not None:
            return
        self._model = weakref.ref(model)
        self._known = known
        self._registered = {id(m) for m in model.modules()}
        wself = weakref.ref(self)

        def pre(module: nn.Module, args: Any) -> None:
            me = wself()
            if me is not None and not _not_eager():
                me._enter(module)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            me = wself()
            if me is not None and not _not_eager():
                me._leave(output)

        def pre_root(module: nn.Module, args: Any) -> None:
            me = wself()
            if me is not None and not _not_eager():
                if me._children and torch.is_grad_enabled():
                    # The training forward enters through the root: the children's hooks
                    # (there for a training_step that calls self.model(x)) only cost.
                    for h in me._children:
                        h.remove()
                    me._children.clear()
                if me.scanning and len(me._fed) < 64:
                    _note_fed(me._fed, args)
                last = me.batch_starts[-1] if me.batch_starts else 0
                me._enter(module)
                if me.batch_starts and me.batch_starts[-1] != last:  # a new batch began
                    _new_batch(me, args)

        self._entry.append(model.register_forward_pre_hook(_Owned(pre_root, model)))
        self._entry.append(model.register_forward_hook(_Owned(post, model), always_call=True))
        for mod in model.children():
            self._children.append(mod.register_forward_pre_hook(_Owned(pre, mod)))
            self._children.append(mod.register_forward_hook(_Owned(post, mod), always_call=True))

    def _enter(self, module: nn.Module) -> None:
        try:
            if self._depth == 0:
                self._out_flags.clear()  # output identities are per forward
                seq = self.tracker.now()
                if torch.is_grad_enabled():
                    self.ran_grad = seq
                    if self.tracker.ended_at != self._ended_seen:
                        self._ended_seen = self.tracker.ended_at
                        self.batch_starts.append(seq)
                    if self.on_outer is not None:
                        self.on_outer(module)
                else:
                    self.ran_nograd = seq
                if self.scanning and self._global is None:
                    self._global = nn.modules.module.register_module_forward_hook(_seen(self))
            self._depth += 1
        except Exception as exc:
            self._on_error("forward scout", exc)

    def _leave(self, output: Any) -> None:
        try:
            self._depth = max(0, self._depth - 1)
            if self._depth:
                return
            if self._global is not None:
                self._global.remove()
                self._global = None
            if self._new:
                self._adopt()
            if self.armed:
                self._watch_output_grad(output)
        except Exception as exc:
            self._on_error("forward scout", exc)

    # -- unregistered modules --------------------------------------------------------------

    def _adopt(self) -> None:
        """Judge the modules that ran in the forward without being registered in the model."""
        new, self._new = self._new, []
        self._new_ids.clear()
        model = self._model() if self._model is not None else None
        if model is None:
            return
        self._registered = {id(m) for m in model.modules()}  # the model may have grown
        wself = weakref.ref(self)
        for called in new:
            mod = called.module()
            if mod is not None:
                if id(mod) in self._registered:
                    continue
                self._judged[id(mod)] = called.module
            else:  # it did not outlive the forward: built inside it
                called.built = True
            for pname, pref in called.params:
                p = pref()
                if p is None or self._known(p) or id(p) in self._waiting:
                    continue
                pid = id(p)

                def got(_: torch.Tensor, pid: int = pid) -> None:
                    me = wself()
                    if me is not None:
                        me._got.add(pid)

                self._waiting[pid] = (pref, called, pname)
                self._grad_hooks[pid] = p.register_post_accumulate_grad_hook(got)

    def take_unregistered(self) -> list[tuple[str, str]]:
        """``(parameter path, module class)`` of unregistered parameters that got a gradient.

        Each is returned once; its one-shot hook is removed.
        """
        if not self._got:
            return []
        got, self._got = self._got, set()
        model = self._model() if self._model is not None else None
        paths = container_paths(model) if model is not None else {}
        out: list[tuple[str, str]] = []
        for pid in [k for k in self._waiting if k in got]:
            self._reported.add(pid)
            entry = self._waiting.pop(pid, None)
            handle = self._grad_hooks.pop(pid, None)
            if handle is not None:
                handle.remove()
            if entry is None:
                continue
            _, called, pname = entry
            mod, cls = called.module(), called.cls
            where = paths.get(id(mod)) if mod is not None else None
            if where is None:
                at = f" at {called.site}" if called.site else ""
                where = (
                    f"<{cls}{BUILT_IN_FORWARD}{at}>"
                    if called.built
                    else f"<{cls} outside the model>"
                )
            out.append((f"{where}.{pname}", cls))
        return out

    def batches_since(self, start: int) -> Optional[int]:
        """Batches the watched model's training forwards began after event ``start`` (see
        ``batch_starts``); ``None`` while its entry hooks are not on (nothing counted)."""
        if not self.installed:
            return None
        return count_after(self.batch_starts, start)

    def fed(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a leaf requiring grad) was an argument of the model's forward."""
        ref = self._fed.get(id(t))
        return ref is not None and ref() is t

    def follows(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is an unregistered module's parameter this scout judges (waiting for
        its gradient, or reported): named by its container path, not as a loose leaf."""
        return id(p) in self._waiting or id(p) in self._reported

    def after_step(self, steps: int) -> None:
        """Stop scanning for unregistered modules after ``scan_steps`` optimizer steps."""
        if self.scanning and steps >= self.scan_steps:
            self.scanning = False

    # -- removal ---------------------------------------------------------------------------

    def remove_all(self) -> None:
        """Remove every hook (idempotent)."""
        if self._global is not None:
            self._global.remove()
            self._global = None
        for h in [*self._entry, *self._children, *self._grad_hooks.values()]:
            h.remove()
        self._entry.clear()
        self._children.clear()
        self._grad_hooks.clear()
        self._waiting.clear()
        self.disarm()


def _note_fed(fed: dict[int, weakref.ref[torch.Tensor]], args: Any) -> None:
    for a in args if isinstance(args, tuple) else ():
        if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is None:
            fed[id(a)] = weakref.ref(a)


def _new_batch(scout: ForwardScout, args: Any) -> None:
    """A new batch began: its samples, and whether its inputs' gradient is wanted (an
    attack's or a saliency map's forward: a tensor argument that requires grad)."""
    scout.rows = _rows(args)
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        scout.input_grad_starts.append(scout.batch_starts[-1])


def _rows(args: Any) -> Optional[int]:
    """The batch's samples: the leading dim of the forward's first tensor argument."""
    for a in args if isinstance(args, tuple) else ():
        if isinstance(a, torch.Tensor):
            return int(a.shape[0]) if a.dim() else 1
    return None


def _seen(scout: ForwardScout) -> Callable[..., None]:
    """The global forward hook of a scan: note each module run but not registered."""
    wself = weakref.ref(scout)

    def seen(module: nn.Module, args: Any, output: Any) -> None:
        me = wself()
        if me is None:
            return
        key = id(module)
        # The common case (a registered module) costs one set lookup.
        if key in me._registered or not module._parameters:
            return
        for ref in (me._new_ids.get(key), me._judged.get(key)):
            if ref is not None and ref() is module:
                return
        # Its parameters now, while they live: a layer built inside forward is gone by
        # the time the forward returns (only the graph keeps its parameters); and the
        # line that called it (read once per module object, during the scan only).
        params = [
            (n, weakref.ref(p))
            for n, p in module._parameters.items()
            if p is not None and p.requires_grad
        ]
        mref = weakref.ref(module)
        if not params:  # frozen: never this bug
            me._judged[key] = mref
            return
        me._new.append(_Called(mref, type(module).__name__, params, call_site()))
        me._new_ids[key] = mref

    return seen
