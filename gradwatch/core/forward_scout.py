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
- *NaN probe* (during the first steps, then again after a non-finite gradient): per-module device-side
  finiteness flags of inputs, outputs and own parameters, and of the gradient that reaches
  the model's output, read with the next step's single host transfer.

Nothing here syncs with the device: flags stay 0-dim tensors until the step's gather.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.core.evidence import Tracker
from gradwatch.core.hooks import _INERT_REDUCE
from gradwatch.core.stats import foreach_norms

__all__ = ["ForwardScout", "container_paths"]

OnError = Callable[[str, BaseException], None]
Flag = Any  # a 0-dim bool tensor, or True when there was nothing to check

_MODULE_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping, not user state
_MAX_RECORDS = 4096  # forward calls kept per armed window (bounded memory)
_MAX_DEPTH = 4  # nesting of plain containers walked to name an unregistered module


class _Owned:
    """A module hook that acts only for the module it was put on, and never travels.

    Modules keep hooks in their ``__dict__``: ``copy.deepcopy`` (``AveragedModel``, EMA copies)
    would carry a plain closure along and pickling (``torch.save(model)``) would fail on it.
    A copy gets an inert hook; a pickle gets a standard-library no-op.
    """

    __slots__ = ("__weakref__", "fn", "owner")

    def __init__(self, fn: Callable[..., Any], module: nn.Module) -> None:
        self.fn = fn
        self.owner = weakref.ref(module)

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        if module is self.owner():
            return self.fn(module, *rest)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT_REDUCE


class _Inert:
    """What a copy of a watched module holds instead of a scout hook: leaves at its first call."""

    def __call__(self, module: nn.Module, *args: Any) -> None:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if h is self]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT_REDUCE


def _compiling() -> bool:
    """Inside a torch.compile trace: the scout stays out (its hooks are eager-only evidence)."""
    return bool(torch.compiler.is_compiling())


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Floating tensors directly in ``obj`` (a tensor, or one level of tuple/list/dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (tuple, list)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return []
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _all_finite(ts: list[torch.Tensor]) -> Flag:
    """One 0-dim bool tensor on the device (no sync), or ``True`` for nothing to check."""
    ts = [t for t in ts if not t.is_sparse and t.numel() > 0]
    if not ts:
        return True
    flags = [torch.isfinite(t.detach()).all() for t in ts]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


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


class ForwardScout:
    """Forward-pass evidence of one watched model (see the module docstring)."""

    def __init__(self, tracker: Tracker, on_error: OnError, scan_steps: int) -> None:
        self.tracker = tracker
        self._on_error = on_error
        self.scan_steps = scan_steps
        self.ran_grad = 0  # event number of the last outermost forward in grad mode
        self.ran_nograd = 0
        self._model: Optional[weakref.ref[nn.Module]] = None
        self._known: Callable[[torch.Tensor], bool] = lambda p: False
        self._depth = 0
        self._entry: list[RemovableHandle] = []
        self._children: list[RemovableHandle] = []
        self._global: Optional[RemovableHandle] = None
        self.scanning = scan_steps > 0
        self._registered: set[int] = set()
        self._new: dict[int, weakref.ref[nn.Module]] = {}
        self._judged: set[int] = set()  # modules whose parameters were looked at
        # unregistered parameters waiting for a gradient: id -> (param, module, name in module)
        self._waiting: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[nn.Module], str]] = {}
        self._grad_hooks: dict[int, RemovableHandle] = {}
        self._got: set[int] = set()
        # NaN probe
        self.armed = False
        self.armed_steps = 0
        self.arm_limit = 0
        self._probe: list[RemovableHandle] = []
        self._records: list[tuple[str, Flag, Flag, str]] = []
        self._out_flags: dict[int, tuple[weakref.ref[torch.Tensor], Flag]] = {}
        self._plist: list[torch.Tensor] = []  # every module's own weights, in module order
        self._prange: dict[str, tuple[int, int]] = {}  # module -> its slice of _plist
        self._pvec: Optional[torch.Tensor] = None  # this window's per-weight finiteness
        self._n_flags = 0
        self._flag_pos: dict[int, int] = {}  # id(flag) -> its place in pending_flags()
        self._out_grad: list[torch.Tensor] = []

    # -- installing ------------------------------------------------------------------------

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
            if me is not None and not _compiling():
                me._enter()

        def post(module: nn.Module, args: Any, output: Any) -> None:
            me = wself()
            if me is not None and not _compiling():
                me._leave(output)

        def pre_root(module: nn.Module, args: Any) -> None:
            me = wself()
            if me is not None and not _compiling():
                if me._children and torch.is_grad_enabled():
                    # The training forward enters through the root: the children's hooks
                    # (there for a training_step that calls self.model(x)) only cost.
                    for h in me._children:
                        h.remove()
                    me._children.clear()
                me._enter()

        self._entry.append(model.register_forward_pre_hook(_Owned(pre_root, model)))
        self._entry.append(model.register_forward_hook(_Owned(post, model), always_call=True))
        for mod in model.children():
            self._children.append(mod.register_forward_pre_hook(_Owned(pre, mod)))
            self._children.append(mod.register_forward_hook(_Owned(post, mod), always_call=True))

    def _enter(self) -> None:
        try:
            if self._depth == 0:
                self._out_flags.clear()  # output identities are per forward
                seq = self.tracker.now()
                if torch.is_grad_enabled():
                    self.ran_grad = seq
                else:
                    self.ran_nograd = seq
                if self.scanning and self._global is None:
                    self._global = nn.modules.module.register_module_forward_hook(self._seen())
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

    def _seen(self) -> Callable[..., None]:
        wself = weakref.ref(self)

        def seen(module: nn.Module, args: Any, output: Any) -> None:
            me = wself()
            if me is None:
                return
            key = id(module)
            # The common case (a registered module) costs one set lookup.
            if key in me._registered or key in me._judged or not module._parameters:
                return
            me._new[key] = weakref.ref(module)

        return seen

    def _adopt(self) -> None:
        """Judge the modules that ran in the forward without being registered in the model."""
        new, self._new = self._new, {}
        model = self._model() if self._model is not None else None
        if model is None:
            return
        self._registered = {id(m) for m in model.modules()}  # the model may have grown
        wself = weakref.ref(self)
        for key, mref in new.items():
            mod = mref()
            if mod is None or key in self._registered:
                continue
            self._judged.add(key)
            for pname, p in mod._parameters.items():
                if p is None or not p.requires_grad or self._known(p) or id(p) in self._waiting:
                    continue
                pid = id(p)

                def got(_: torch.Tensor, pid: int = pid) -> None:
                    me = wself()
                    if me is not None:
                        me._got.add(pid)

                self._waiting[pid] = (weakref.ref(p), mref, pname)
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
            entry = self._waiting.pop(pid, None)
            handle = self._grad_hooks.pop(pid, None)
            if handle is not None:
                handle.remove()
            if entry is None:
                continue
            _, mref, pname = entry
            mod = mref()
            cls = type(mod).__name__ if mod is not None else "Module"
            where = paths.get(id(mod)) if mod is not None else None
            out.append((f"{where}.{pname}" if where else f"<{cls} outside the model>.{pname}", cls))
        return out

    def after_step(self, steps: int) -> None:
        """Stop scanning for unregistered modules after ``scan_steps`` optimizer steps."""
        if self.scanning and steps >= self.scan_steps:
            self.scanning = False

    # -- NaN probe -------------------------------------------------------------------------

    def arm(self, limit: int) -> None:
        """Finiteness flags on every module of the model for up to ``limit`` steps."""
        model = self._model() if self._model is not None else None
        if model is None or self.armed or limit <= 0:
            return
        self.armed, self.armed_steps, self.arm_limit = True, 0, limit
        self._records.clear()
        self._out_grad.clear()
        self._out_flags.clear()
        self._pvec = None
        self._plist, self._prange = [], {}
        for name, mod in model.named_modules():
            own = [
                p
                for p in mod._parameters.values()
                if p is not None
                and p.is_floating_point()
                and not isinstance(p, nn.parameter.UninitializedParameter)
            ]
            start = len(self._plist)
            self._plist.extend(own)
            self._prange[name or "(root)"] = (start, len(self._plist))
        wself = weakref.ref(self)
        for name, mod in model.named_modules():

            def flag(m: nn.Module, args: Any, output: Any, name: str = name or "(root)") -> None:
                me = wself()
                if me is None or len(me._records) >= _MAX_RECORDS or _compiling():
                    return
                try:
                    # no_grad: a flag must not enter the autograd graph (a weight norm would be
                    # saved for backward, and non-reentrant checkpointing counts saved tensors).
                    with torch.no_grad():
                        me._record(m, name, args, output)
                except Exception as exc:
                    me._on_error("NaN probe", exc)

            self._probe.append(mod.register_forward_hook(_Owned(flag, mod)))

    def _record(self, m: nn.Module, name: str, args: Any, output: Any) -> None:
        """One module call's (inputs, output, own weights) finiteness, as device flags.

        An input that is an earlier module's output reuses that output's flag (no kernel:
        in a chain every input is one), and a module's weights are checked once per window.
        """
        seen = self._out_flags
        ins = _tensors(args)
        reused = [seen.get(id(t)) for t in ins]
        if ins and all(r is not None and r[0]() is t for r, t in zip(reused, ins)):
            flags = [r[1] for r in reused]  # type: ignore[index]
            in_ok: Flag = flags[0] if len(flags) == 1 else torch.stack(flags).all()
        else:
            in_ok = _all_finite(ins)
        outs = _tensors(output)
        out_ok = _all_finite(outs)
        if len(outs) == 1 and isinstance(out_ok, torch.Tensor):
            seen[id(outs[0])] = (weakref.ref(outs[0]), out_ok)
        if self._pvec is None and self._plist:
            # Every module's weights at once, at the window's first forward: one batched norm
            # (NaN/Inf norm <=> a NaN/Inf weight) instead of a check per module call.
            try:
                self._pvec = torch.isfinite(torch.stack(foreach_norms(self._plist)))
            except RuntimeError:  # weights on several devices: judged without them
                self._plist = []
        self._records.append((name, in_ok, out_ok, name))

    def disarm(self) -> None:
        for h in self._probe:
            h.remove()
        self._probe.clear()
        self._plist, self._prange = [], {}
        self._records.clear()
        self._out_grad.clear()
        self._out_flags.clear()
        self._pvec = None
        self.armed = False

    def _watch_output_grad(self, output: Any) -> None:
        if len(self._out_grad) >= _MAX_RECORDS:
            return
        wself = weakref.ref(self)
        for t in _tensors(output):
            if t.requires_grad:

                def out_grad(g: torch.Tensor) -> None:
                    me = wself()
                    if me is not None:
                        me._out_grad.append(torch.isfinite(g.detach()).all())

                t.register_hook(out_grad)
                return

    def pending_flags(self) -> list[torch.Tensor]:
        """The armed window's device flags, in a fixed order (read with the step's transfer)."""
        if not self.armed:
            return []
        # A reused flag (an input that was an earlier output, weights checked once) is one
        # tensor: sent once.
        pos: dict[int, int] = {}
        flags: list[torch.Tensor] = []
        for rec in self._records:
            for f in rec[1:]:
                if isinstance(f, torch.Tensor) and id(f) not in pos:
                    pos[id(f)] = len(flags)
                    flags.append(f)
        self._flag_pos = pos
        flags += self._out_grad
        self._n_flags = len(flags)
        # One vector: converting hundreds of 0-dim flags one by one costs more than them.
        parts = [torch.stack(flags).to(torch.float32)] if flags else []
        if self._pvec is not None:
            parts.append(self._pvec.to(torch.float32))
        return [torch.cat(parts)] if parts else []

    def interpret(self, values: list[float]) -> Optional[dict[str, Any]]:
        """Where the window's NaN/Inf was born, from the values of :meth:`pending_flags`.

        Returns ``None`` when nothing in the window was checked, else a dict with ``phase``
        (``forward``: a module's finite inputs gave a non-finite output; ``loss``: every
        module output was finite but the gradient reaching the model's output was not;
        ``backward``: both were finite) and ``origin_module``; ``weights_nonfinite`` when a
        module's own parameters were already non-finite (an earlier update spread it).
        """
        if not self.armed or (not self._records and not self._out_grad):
            return None
        pos = self._flag_pos
        n_p = self._pvec.numel() if self._pvec is not None else 0
        if len(values) < self._n_flags + n_p:
            return None  # flags recorded after they were sent: judged with the next window
        pvals = values[self._n_flags : self._n_flags + n_p]

        def weights_ok(name: str) -> bool:
            a, b = self._prange.get(name, (0, 0))
            return all(bool(v) for v in pvals[a:b]) if b <= len(pvals) else True

        def ok(f: Flag) -> bool:
            k = pos.get(id(f)) if isinstance(f, torch.Tensor) else None
            return True if k is None else bool(values[k])

        decoded = [(name, ok(i), ok(o), weights_ok(p)) for name, i, o, p in self._records]
        out_grad_ok = all(bool(v) for v in values[len(pos) : len(pos) + len(self._out_grad)])
        self._records.clear()
        self._out_grad.clear()
        self._out_flags.clear()
        self._pvec = None
        # Hooks fire in completion order: an inner module (the normaliser) finishes before the
        # block that calls it, so the first candidate is the innermost.
        for name, in_ok, out_ok, p_ok in decoded:
            if in_ok and not out_ok and p_ok:
                return {"phase": "forward", "origin_module": name}
        if any(not p_ok for _, _, _, p_ok in decoded):
            return {"phase": None, "origin_module": None, "weights_nonfinite": True}
        if any(not out_ok for _, _, out_ok, _ in decoded):
            return {"phase": None, "origin_module": None}  # non-finite model input
        if not out_grad_ok:
            return {"phase": "loss", "origin_module": None}
        return {"phase": "backward", "origin_module": None}

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
