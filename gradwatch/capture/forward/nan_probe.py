"""The NaN probe: where a NaN/Inf is born, from device-side finiteness flags of the forward.

Armed during the first steps and again after a non-finite gradient: a forward hook on every
module records, as 0-dim bool tensors (no sync), whether its inputs and output were finite;
every module's own weights are checked by one batched norm per window; a tensor hook on the
model's output records whether the gradient reaching it was finite. The step's gather sends
the flags with its one host transfer; :meth:`NanProbe.interpret` names the first module whose
finite inputs gave a non-finite output (hooks complete innermost first).

:class:`_Owned` hooks act only for their own module and never travel with a copy or pickle.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.stamps import _INERT_REDUCE
from gradwatch.measure.stats import foreach_norms
from gradwatch.model.engines import clean_name, local
from gradwatch.model.hook_args import pre_kwargs

__all__ = ["NanProbe"]

OnError = Callable[[str, BaseException], None]
Flag = Any  # a 0-dim bool tensor, or True when there was nothing to check

_MAX_RECORDS = 4096  # forward calls kept per armed window (bounded memory)


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


_func_level: Callable[[], Optional[int]] = getattr(
    torch._C._functorch, "maybe_current_level", lambda: None
)


def _not_eager() -> bool:
    """Inside a torch.compile trace or a torch.func transform: the scout stays out.

    Its hooks are eager-only evidence. Under ``vmap``/``grad``/``jacrev`` (per-sample
    gradients, ``functional_call`` in a transform) a flag made from the module's tensors is a
    wrapped tensor that must not leave the transform, and the forward is not one whose
    gradients reach ``.grad`` through autograd.
    """
    return bool(torch.compiler.is_compiling()) or _func_level() is not None


def _dense_float(t: Any) -> bool:
    """A floating tensor ``isfinite`` can read: strided and not nested.

    ``nn.TransformerEncoder`` under ``no_grad`` with a padding mask hands nested tensors
    between its layers; sparse ones come from embeddings. Neither supports the check.
    """
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and not t.is_nested
        and t.is_floating_point()
    )


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Dense floating tensors directly in ``obj`` (a tensor, or one level of tuple/list/dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if _dense_float(obj) else []
    if isinstance(obj, (tuple, list)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return []
    return [t for t in items if _dense_float(t)]


def _all_finite(ts: list[torch.Tensor]) -> Flag:
    """One 0-dim bool tensor on the device (no sync), or ``True`` for nothing to check."""
    ts = [t for t in ts if t.numel() > 0]
    if not ts:
        return True
    flags = [torch.isfinite(t.detach()).all() for t in ts]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def _weights_by_subtree(model: nn.Module) -> tuple[list[torch.Tensor], dict[str, tuple[int, int]]]:
    """Every module's own floating weights in module order, and each module's slice of them
    that covers its whole subtree: a block whose inputs were finite but a child's weights
    were not did not make the NaN itself.

    ``named_modules`` lists a subtree right after its root (pre-order), so a module's
    descendants' weights follow its own in one contiguous slice.
    """
    plist: list[torch.Tensor] = []
    prange: dict[str, tuple[int, int]] = {}
    open_: list[tuple[str, int]] = []  # modules whose subtree is still being listed

    def close_until(name: str) -> None:
        while open_ and not (open_[-1][0] == "" or name.startswith(open_[-1][0] + ".")):
            done, start = open_.pop()
            prange[clean_name(done) or "(root)"] = (start, len(plist))

    for name, mod in model.named_modules():
        close_until(name)
        open_.append((name, len(plist)))
        plist.extend(
            p
            for p in mod._parameters.values()
            if p is not None
            and p.is_floating_point()
            and not isinstance(p, nn.parameter.UninitializedParameter)
        )
    while open_:  # the last subtrees, the root's included, end with the list
        done, start = open_.pop()
        prange[clean_name(done) or "(root)"] = (start, len(plist))
    return plist, prange


class NanProbe:
    """Per-module finiteness flags while armed (a base of the forward scout)."""

    def __init__(self, on_error: OnError) -> None:
        self._on_error = on_error
        self._model: Optional[weakref.ref[nn.Module]] = None
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
        # The model's own inputs, per argument (``args[0]``, ``pixel_values``): a NaN/Inf
        # that arrives with the data (``phase: input``).
        self._inputs: list[tuple[str, Flag]] = []

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
        self._plist, self._prange = _weights_by_subtree(model)
        wself = weakref.ref(self)
        for name, mod in model.named_modules():

            def flag(
                m: nn.Module, args: Any, output: Any, name: str = clean_name(name) or "(root)"
            ) -> None:
                me = wself()
                if me is None or len(me._records) >= _MAX_RECORDS or _not_eager():
                    return
                try:
                    # no_grad: a flag must not enter the autograd graph (a weight norm would be
                    # saved for backward, and non-reentrant checkpointing counts saved tensors).
                    with torch.no_grad():
                        me._record(m, name, args, output)
                except Exception as exc:
                    me._on_error("NaN probe", exc)

            self._probe.append(mod.register_forward_hook(_Owned(flag, mod)))

        def inputs(m: nn.Module, args: Any, *rest: Any) -> None:
            me = wself()
            if me is None or len(me._inputs) >= _MAX_RECORDS or _not_eager():
                return
            try:
                with torch.no_grad():
                    me._record_inputs(args, pre_kwargs(rest))
            except Exception as exc:
                me._on_error("NaN probe", exc)

        self._probe.append(model.register_forward_pre_hook(_Owned(inputs, model), with_kwargs=True))

    def _record_inputs(self, args: Any, kwargs: Any) -> None:
        """The finiteness of each floating argument of the model's own forward (no sync)."""
        named = [(f"args[{k}]", a) for k, a in enumerate(args)] + list(kwargs.items())
        for name, value in named:
            ts = _tensors(value)
            if ts:
                self._inputs.append((name, _all_finite(ts)))

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
        self._inputs.clear()
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
        for rec in [*self._records, *self._inputs]:
            for f in rec[1:]:
                if isinstance(f, torch.Tensor) and id(f) not in pos:
                    pos[id(f)] = len(flags)
                    flags.append(f)
        self._flag_pos = pos
        flags += self._out_grad
        self._n_flags = len(flags)
        # One vector: converting hundreds of 0-dim flags one by one costs more than them.
        # Sharded (FSDP2) weights give DTensor flags: this rank's shard's flag is read.
        parts = [torch.stack([local(f) for f in flags]).to(torch.float32)] if flags else []
        if self._pvec is not None:
            parts.append(local(self._pvec).to(torch.float32))
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
        bad_input = next((name for name, f in self._inputs if not ok(f)), None)
        self._records.clear()
        self._out_grad.clear()
        self._out_flags.clear()
        self._inputs.clear()
        self._pvec = None
        if bad_input is not None:  # it came with the data: the first module it reached
            first = next((name for name, in_ok, _, _ in decoded if not in_ok), None)
            return {"phase": "input", "origin_module": first, "input": bad_input}
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
