"""The ``gradient_mismatch`` probe: autograd against central finite differences, per layer.

On a float64 copy of the model whose parameters read the user's weights (a float64 copy of
the weights, then the model's own dtype, when its forward fails there: ``_FORMS``), one
autograd evaluation gives the gradient of every layer; per layer, a random unit direction
``v`` of its parameters gives autograd's directional derivative ``g . v`` and the central
difference ``(L(t + h v) - L(t - h v)) / 2h``. Every evaluation seeds the global generators
alike (dropout draws the same mask) and restores the buffers (running statistics, EMA
codebooks), and visible stop-gradients are held at their recorded values
(:mod:`gradwatch.probes._stopgrad`), so both sides differentiate the same function. A
difference is taken first at ``h / FINER`` where rounding allows (float64: fewer ReLU kinks
crossed), then at ``h``; a disagreement is confirmed at step ``2h``: rounding noise changes
with the step, a wrong derivative does not. When not every layer fits in the time budget,
every layer is first compared at once along one random direction (a wrong derivative
anywhere shows there), then the layers are sampled, spread over the forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from gradwatch.probes._copies import probe_copy, widened_bytes
from gradwatch.probes._direction import Direction, Draw, Reduced, Uses, bases, joint, reduce_grads
from gradwatch.probes._sandbox import Budget, CannotJudge, LossFn, batch_size, evaluate, param_bytes
from gradwatch.probes._stopgrad import (
    ReplayMismatch,
    StopGradients,
    custom_functions,
    straight_through_params,
)
from gradwatch.probes._surgery import declare
from gradwatch.probes._wide import KeepWide
from gradwatch.results import ProbeLayer
from gradwatch.vectors.sensitivity import layer_groups

__all__ = ["GradientResult", "gradient_agreement"]

SEED = 20190425  # the date of the Recipe: any fixed seed, the same for every evaluation
#: How far from the point, relative to the weights' size, a mismatch is looked for again (at
#: least ten finite-difference steps: a thousand in float64).
NUDGE = 1e-2
#: The copies tried in turn: float64 read from the user's weights, a float64 copy of them (an
#: op the widened parameters do not run), the model's own dtype (a forward that is not
#: float64: ``loss_fn`` builds float32 tensors).
_FORMS = ("widened", "float64", "native")
#: Where the loss's rounding allows it (float64), the difference is taken first at
#: ``h / FINER``, then at ``h`` if it disagrees there: a ReLU network's loss is piecewise
#: linear, and a step a hundred times shorter crosses a hundred times fewer kinks (ResNet-18's
#: layout, every layer along one direction: 5.9e-3 from autograd at 1e-5 of the weights, 2e-8
#: at 1e-7). A wrong derivative disagrees at every step.
FINER = 100.0
_RETRY = {"widened": {"loss_failed", "not_differentiable"}, "float64": {"loss_failed"}}


@dataclass
class GradientResult:
    """What the probe measured: per layer rows, and what was left out and why."""

    layers: list[ProbeLayer] = field(default_factory=list)
    dtype: str = "float64"
    form: str = "widened"  # the copy: float64 read from the user's weights (see _FORMS)
    total_layers: int = 0
    sampled: bool = False
    memory_bytes: int = 0
    samples: Optional[int] = None  # of the batch, spread over it
    custom_functions: list[str] = field(default_factory=list)
    straight_through: list[str] = field(default_factory=list)
    surgery: dict[str, float] = field(default_factory=dict)  # Function -> c, its backward c*g
    masked: dict[str, Any] = field(default_factory=dict)  # embedding rows left out, and why
    joint: Optional[ProbeLayer] = None  # every layer along one direction, when sampled

    def mismatched(self) -> list[ProbeLayer]:
        return [row for row in self.layers if row.status == "mismatch"]


class _Evaluator:
    """Evaluations of the copy's loss: seeded, buffers restored, stop-gradients replayed."""

    def __init__(
        self, model: nn.Module, batch: Any, loss_fn: LossFn, mode: StopGradients, wide: bool
    ) -> None:
        self.model, self.batch, self.loss_fn, self.mode = model, batch, loss_fn, mode
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.wide = wide
        self.loss, self.value = torch.zeros(()), 0.0  # the recorded evaluation's
        self.reads: Optional[list[Tensor]] = None  # parameters whose reads are told apart
        self.uses: Optional[Uses] = None  # the recorded evaluation's reads of them

    def _evaluate(self) -> Tensor:
        """One seeded evaluation; in float64 the forward's own new tensors are float64 too
        (``torch.full(..., -inf)`` for a mask, ``torch.randn`` noise): a float32 mask in a
        float64 ``nn.MultiheadAttention`` has a wrong backward in torch 2.13 (CPU). Its casts
        down stay float64 (:class:`KeepWide`)."""
        if not self.wide:
            return evaluate(self.model, self.batch, self.loss_fn, SEED)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            with KeepWide():
                return evaluate(self.model, self.batch, self.loss_fn, SEED)
        finally:
            torch.set_default_dtype(before)

    def _restore(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                if b.shape != saved.shape:  # sized by the forward (a per-channel observer's
                    b.resize_(saved.shape)  # min/max start empty): its shape is state too
                b.copy_(saved)

    def recorded(self) -> Tensor:
        self._restore()
        self.uses = Uses(self.reads) if self.reads is not None else None
        with self.uses or contextlib.nullcontext(), self.mode.start(replay=False):
            self.loss = self._evaluate()
        self.value = float(self.loss.detach())
        return self.loss

    def replayed(self) -> float:
        self._restore()
        try:  # with grad on, as recorded: what requires grad decides what is held constant
            with self.mode.start(replay=True):
                loss = self._evaluate()
            return float(loss.detach())
        except ReplayMismatch as exc:
            raise CannotJudge("forward_changed", f"the forward took another path: {exc}") from exc


def _judge(row: ProbeLayer, noise: float, rtol: float) -> str:
    err = abs(row.numeric - row.autograd)
    scale = max(abs(row.numeric), abs(row.autograd))
    if err <= rtol * scale or err <= 1e-9:
        return "agree"
    return "mismatch" if err > 10.0 * noise else "inconclusive"


def _error(row: ProbeLayer) -> float:
    return abs(row.numeric - row.autograd) / max(abs(row.numeric), abs(row.autograd), 1e-30)


def _rounding(loss: Tensor, value: float, h: float) -> float:
    """The least error rounding leaves in a central difference of step ``h``: the loss is
    known to a few ulps, so a change below that reads as 0 at ``h`` and ``2h`` alike (a
    float32 loss of 10 moves by 1e-6 at the least)."""
    eps = torch.finfo(loss.dtype).eps if loss.is_floating_point() else 0.0
    return 2.0 * eps * abs(value) / h


def _precision(dtype: str, rtol: float) -> tuple[float, float]:
    """The relative step and the tolerance a loss computed at ``dtype`` allows."""
    if dtype == "float64":
        return 1e-5, rtol
    if dtype == "autocast":
        return 3e-2, max(rtol, 0.25)
    return 3e-3, max(rtol, 5e-2)


def _central(ev: _Evaluator, layer: Direction, h: float) -> float:
    layer.shift(h)
    up = ev.replayed()
    layer.shift(-h)
    down = ev.replayed()
    layer.shift(0.0)
    return (up - down) / (2.0 * h)


def _spread(n: int, k: int) -> list[int]:
    """``k`` indices of ``range(n)`` spread evenly, first and last included."""
    if k >= n:
        return list(range(n))
    if k <= 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _base(ev: _Evaluator, params: list[Tensor]) -> tuple[Tensor, Draw, Reduced]:
    """The recorded evaluation, and autograd's gradient reduced along the draw as it is
    made (never held: :func:`reduce_grads`)."""
    loss = ev.recorded()
    if not loss.requires_grad:
        raise CannotJudge("not_differentiable", "the loss does not require grad")
    if not torch.isfinite(loss):
        raise CannotJudge("nonfinite_loss", "the loss is not finite on the copy")
    draw = Draw(params, SEED, ev.mode.masks)
    try:
        reduced = reduce_grads(loss, draw, ev.uses)
    except RuntimeError as exc:
        raise CannotJudge("not_differentiable", f"autograd failed: {exc}") from exc
    return loss, draw, reduced


def gradient_agreement(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, rtol: float, budget: Budget, max_samples: int
) -> GradientResult:
    """Compare autograd with finite differences on every layer that the budget allows.

    In float64 when the model and ``loss_fn`` run in it, else in the model's own dtype
    (``loss_fn`` builds float32 tensors: ``torch.randn(n, 2)`` for a GAN's noise).

    Raises:
        CannotJudge: the copy cannot be evaluated reproducibly or differentiated.
    """
    for form in _FORMS[:-1]:
        try:
            return _agreement(model, batch, loss_fn, rtol, budget, max_samples, form=form)
        except CannotJudge as exc:
            if exc.reason not in _RETRY[form]:
                raise
    return _agreement(model, batch, loss_fn, rtol, budget, max_samples, form=_FORMS[-1])


def _agreement(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    rtol: float,
    budget: Budget,
    max_samples: int,
    *,
    form: str,
) -> GradientResult:
    copy, small = probe_copy(model, batch, max_samples, form)
    dtype = "native" if form == "native" else "float64"
    groups = layer_groups(copy)
    if not groups:
        raise CannotJudge("no_parameters", "the model has no trainable parameters")
    owner = {id(p): k for k, g in enumerate(groups) for p in g[2]}
    mode = StopGradients(owner)
    ev = _Evaluator(copy, small, loss_fn, mode, wide=dtype == "float64")
    result = GradientResult(dtype=dtype, form=form, total_layers=len(groups))
    result.memory_bytes = widened_bytes(copy) if form == "widened" else param_bytes(copy)
    result.samples = batch_size(small)
    t0 = budget.elapsed()
    params = list(_params_of(groups))
    ev.reads = params if form == "widened" else None  # each read's gradient alone
    loss, draw, reduced = _base(ev, params)
    if form == "widened":  # the largest gradient as the reduction took it
        result.memory_bytes = widened_bytes(copy, reduced.largest)
    if mode.autocast:  # the forward ran in bf16/fp16: compared at that precision
        result.dtype = "autocast"
    elif loss.dtype != torch.float64:  # a loss upcast to float32 (HF's .float()) limits all
        result.dtype = str(loss.dtype).removeprefix("torch.")
    result.custom_functions = custom_functions(loss)
    ste_ids, result.straight_through = straight_through_params(loss)
    declared, cut = declare(loss, params)
    result.surgery = declared.surgery
    ste_ids |= declared.explained_ids
    result.masked = mode.masks.described({id(p): n for g in groups for n, p in zip(g[1], g[2])})
    value = float(loss.detach())
    again = ev.replayed()
    if abs(again - value) > 1e-9 * max(1.0, abs(value)):
        raise CannotJudge(
            "not_reproducible",
            f"the loss changed between two evaluations with the same weights and seed "
            f"({value:.10g}, then {again:.10g}): loss_fn or the model keeps state",
        )
    per_eval = max((budget.elapsed() - t0) / 2.0, 1e-4)
    order = [k for k in dict.fromkeys(mode.first_use)]
    order += [k for k in range(len(groups)) if k not in order]
    fits = int(max(budget.left(), 0.0) / (2.0 * per_eval))
    h_rel, tol = _precision(result.dtype, rtol)
    base = bases(copy, model, params)
    blocks, start = [], 0
    for g in groups:
        blocks.append(list(range(start, start + len(g[2]))))
        start += len(g[2])
    if fits < len(order) and not ste_ids:  # sampled: first every layer along one direction
        fits -= 1
        whole = joint(draw, blocks, reduced, base, [n for g in groups for n in g[1]])
        result.joint = _compare(ev, whole, reduced, h_rel, tol, explained=False)
    chosen = [order[i] for i in _spread(len(order), max(fits, 1))]
    result.sampled = len(chosen) < len(order)
    for k in chosen:
        if budget.left() <= 0 and (result.layers or result.joint is not None):
            result.sampled = True
            break
        name, names, own = groups[k]
        layer = Direction(name, names, draw, blocks[k], base)
        explained = any(id(p) in ste_ids for p in own)
        row = _compare(ev, layer, reduced, h_rel, tol, explained=explained)
        behind = [
            f
            for f in declared.candidates
            if any(f in declared.upstream_of.get(id(p), ()) for p in own)
        ]
        if row.status != "agree" and not explained:
            ste = [f for f in behind if _cut_agrees(row, layer, cut(f), tol)]
            if ste:  # the Function's forward is locally constant: a straight-through estimator
                row.status = "explained"
                result.straight_through = sorted({*result.straight_through, *ste})
        result.layers.append(row)
    return result


def _cut_agrees(row: ProbeLayer, layer: Direction, cut: Any, tol: float) -> bool:
    """Whether the finite difference equals autograd's derivative with the unexplained custom
    Functions' paths cut: their forward is locally constant (straight-through)."""
    if cut is None:
        return False
    auto = layer.directional_of(cut)
    cut_row = ProbeLayer(name=row.name, params=row.params, autograd=auto, numeric=row.numeric)
    return _judge(cut_row, 0.0, tol) == "agree"


def _params_of(groups: list[Any]) -> Any:
    return (p for g in groups for p in g[2])


def _compare(
    ev: _Evaluator,
    layer: Direction,
    reduced: Reduced,
    h_rel: float,
    tol: float,
    *,
    explained: bool,
    nearby: bool = True,
) -> ProbeLayer:
    """One layer's (or every layer's) directional derivative, autograd against numeric. A
    mismatch is looked for again at a point nearby (:func:`_nearby`) unless ``nearby`` is
    off."""
    h = h_rel * layer.scale
    floor = _rounding(ev.loss, ev.value, h)
    auto = layer.directional(reduced)
    # the shorter step first where rounding allows it (float64), then the step itself
    steps = (
        [h / FINER, h] if _rounding(ev.loss, ev.value, h / FINER) < 0.1 * tol * abs(auto) else [h]
    )
    row = ProbeLayer(
        name=layer.name, params=layer.names, autograd=auto, numeric=_central(ev, layer, steps[0])
    )
    row.error = _error(row)
    if explained:
        row.status = "explained"
    else:
        row.status = _judge(row, 0.0, tol)
        if row.status != "agree" and len(steps) > 1:  # noise at the shorter step: at h
            row.numeric = _central(ev, layer, h)
            row.status, row.error = _judge(row, 0.0, tol), _error(row)
        if row.status != "agree":  # confirm at 2h: noise moves, a wrong derivative stays
            again2 = _central(ev, layer, 2.0 * h)
            row.status = _judge(row, max(abs(again2 - row.numeric), floor), tol)
        if row.status == "mismatch" and nearby and _nearby(ev, layer, h_rel, tol) != "mismatch":
            row.status = "inconclusive"  # not differentiable at this point: no evidence
    return row


def _nearby(ev: _Evaluator, layer: Direction, h_rel: float, tol: float) -> str:
    """The comparison along the same direction at a point :data:`NUDGE` of the weights'
    size away (at least ten finite-difference steps). A wrong derivative is wrong on a whole
    neighbourhood; a loss that is not differentiable at this very point (a ReLU input at
    exactly 0, a max over exact ties, a weight projected onto a bound), whose autograd
    derivative is a one-sided one, is not there. The copy and its recorded evaluation come
    back to the point afterwards."""
    draw = layer.draw
    other = Draw(draw.params, SEED + 1, ev.mode.masks)
    nudge = Direction("(nudge)", [], other, layer.indices, layer.base)
    layer.offset = (nudge, max(NUDGE, 10.0 * h_rel) * layer.scale)
    try:
        layer.shift(0.0)
        reduced = reduce_grads(ev.recorded(), draw, ev.uses)
        status = _compare(ev, layer, reduced, h_rel, tol, explained=False, nearby=False).status
    except (CannotJudge, RuntimeError):  # another path, or no loss there: not confirmed
        status = "mismatch"
    finally:
        layer.offset = None
        layer.shift(0.0)
        ev.recorded()
    return status
