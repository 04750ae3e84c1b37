"""Per-layer curvature of a loss from Hessian-vector products (``gradwatch.sensitivity``).

For every layer (a module that directly owns trainable parameters) this estimates two
numbers of ``H_ll``, the layer's diagonal block of the Hessian of the loss:

* the trace, by Hutchinson's estimator ``tr(H_ll) = E[v^T H_ll v]`` with Rademacher
  vectors ``v`` on that layer's parameters only, reported with its standard error. The
  variance is ``2 (||H_ll||_F^2 - sum_i (H_ll)_ii^2)``: it depends on this layer alone,
  so a layer whose curvature is 100x larger elsewhere in the model does not swamp it
  (a single model-wide probe would add every cross-block term to every layer's noise);
* the eigenvalue of largest magnitude, by power iteration on ``H_ll``.

Each Hessian-vector product differentiates the gradient once more ("double backward",
Pearlmutter's trick), so it costs about one extra backward pass; the gradient graph is
built once and reused. The parameters' ``.grad`` fields are not touched. The model is
used in the mode it is in (a dropout mask is drawn once, with the graph).

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> batch = (torch.randn(16, 4), torch.randn(16, 1))
    >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> [c.name for c in sensitivity(model, batch, loss_fn, samples=8).layers]
    ['0', '2']
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from gradwatch.errors import ConfigError
from gradwatch.model.index import ROOT
from gradwatch.results import Curvature, LayerCurvature
from gradwatch.vectors._layout import Patterns, _matches, _patterns

__all__ = ["SensitivityError", "layer_groups", "sensitivity"]

LossFn = Callable[[nn.Module, Any], Tensor]


class SensitivityError(ConfigError):
    """The loss or the model cannot give Hessian-vector products (one line naming why)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def layer_groups(model: nn.Module) -> list[tuple[str, list[str], list[Tensor]]]:
    """``(layer, parameter names, parameters)`` for every module that directly owns
    trainable parameters, in ``named_modules()`` order; a tied parameter belongs to its
    first owner.

    Example:
        >>> [g[0] for g in layer_groups(torch.nn.Sequential(torch.nn.Linear(2, 2)))]
        ['0']
    """
    seen: set[int] = set()
    groups: list[tuple[str, list[str], list[Tensor]]] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        names, params = [], []
        for pname, p in mod._parameters.items():
            if p is None or not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(f"{mod_name}.{pname}" if mod_name else pname)
            params.append(p)
        if params:
            groups.append((mod_name or ROOT, names, params))
    return groups


class _Block:
    """Hessian-vector products restricted to one layer's diagonal block."""

    def __init__(self, name: str, params: list[Tensor], grads: Sequence[Optional[Tensor]]):
        self.name = name
        self.params = params
        # A gradient that does not require grad does not depend on any parameter: its
        # rows of the Hessian are zero (a loss linear in that parameter).
        self.live = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self.count = 0

    def hvp(self, v: list[Tensor]) -> list[Tensor]:
        self.count += 1
        out = [torch.zeros_like(p) for p in self.params]
        if not self.live:
            return out
        dot = torch.stack([(g * v[i]).sum() for i, g in self.live]).sum()
        try:
            hv = torch.autograd.grad(dot, self.params, retain_graph=True, allow_unused=True)
        except RuntimeError as exc:
            raise SensitivityError(
                f"sensitivity needs double backward (Hessian-vector products), but "
                f"differentiating the gradient of layer {self.name!r} failed: {_first_line(exc)}"
            ) from None
        return [o if h is None else h.detach() for o, h in zip(out, hv)]


def _reaches_error(roots: Sequence[Optional[Tensor]]) -> bool:
    """Whether the graph behind ``roots`` holds a node that raises when differentiated.

    A ``@once_differentiable`` backward returns values computed without a graph, wrapped
    in an ``Error`` node: differentiating them again either raises or, when no parameter
    lies behind that node, silently gives zero. The walk catches the silent case.
    """
    stack: list[Any] = [t.grad_fn for t in roots if t is not None and t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ in ("Error", "DelayedError"):
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _wide(x: Tensor) -> Tensor:
    # float32 at least (bf16 sums lose the estimate); float64 is kept, never forced (MPS has none).
    return x if x.dtype == torch.float64 else x.float()


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    return torch.stack([(_wide(x) * _wide(y)).sum() for x, y in zip(a, b)]).sum()


def _rademacher(params: list[Tensor], gen: torch.Generator) -> list[Tensor]:
    # Drawn on the CPU so that a seed gives the same vectors on every device.
    return [
        (torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p.device, p.dtype) for p in params
    ]


def _hutchinson(block: _Block, samples: int, gen: torch.Generator) -> tuple[float, float]:
    values = []
    for _ in range(samples):
        v = _rademacher(block.params, gen)
        values.append(_dot(v, block.hvp(v)))
    t = torch.stack(values).cpu()  # one host transfer per layer
    mean = float(t.mean())
    stderr = float(t.std(unbiased=True)) / math.sqrt(samples)
    return mean, stderr


def _power(block: _Block, iters: int, tol: float, gen: torch.Generator) -> tuple[float, int]:
    v = [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in block.params]
    norm = float(_dot(v, v).sqrt())
    v = [x / norm for x in v]
    lam, used = 0.0, 0
    for used in range(1, iters + 1):
        hv = block.hvp(v)
        new = float(_dot(v, hv))  # Rayleigh quotient of the unit vector v
        size = float(_dot(hv, hv).sqrt())
        if size == 0.0 or not math.isfinite(size):
            return (0.0 if size == 0.0 else new), used
        v = [x / size for x in hv]
        if used > 1 and abs(new - lam) <= tol * abs(new):
            return new, used
        lam = new
    return lam, used


def _selected(
    model: nn.Module, samples: int, power_iters: int, layers: Patterns
) -> list[tuple[str, list[str], list[Tensor]]]:
    """Check the arguments and pick the layers to probe, before any loss is computed."""
    if not isinstance(samples, int) or samples < 2:
        raise SensitivityError(f"samples must be an int of at least 2, got {samples!r}")
    if not isinstance(power_iters, int) or power_iters < 1:
        raise SensitivityError(f"power_iters must be a positive int, got {power_iters!r}")
    try:
        wanted = _patterns("layers", layers)
    except ValueError as exc:
        raise SensitivityError(str(exc)) from None
    groups = layer_groups(model)
    if wanted is not None:
        groups = [g for g in groups if _matches([g[0]], wanted)]
    if not groups:
        what = (
            f"layers {list(wanted)} match no layer"
            if wanted
            else "the model has no trainable parameters"
        )
        raise SensitivityError(f"sensitivity: {what}")
    return groups


def _scalar_loss(model: nn.Module, batch: Any, loss_fn: LossFn) -> Tensor:
    """The loss, or one line saying why it cannot be differentiated twice."""
    try:
        loss = loss_fn(model, batch)
    except Exception as exc:
        raise SensitivityError(f"sensitivity: loss_fn failed: {_first_line(exc)}") from exc
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise SensitivityError(f"sensitivity: loss_fn must return a scalar tensor, got {got}")
    if not loss.requires_grad:
        raise SensitivityError(
            "sensitivity: the loss does not require grad (computed under torch.no_grad or detached)"
        )
    return loss


def _gradient_graph(
    loss: Tensor, groups: list[tuple[str, list[str], list[Tensor]]]
) -> tuple[tuple[Optional[Tensor], ...], list[int]]:
    """The gradient with its graph (built once, reused by every product) and each layer's start."""
    flat = [p for _, _, ps in groups for p in ps]
    try:
        grads = torch.autograd.grad(loss.reshape(()), flat, create_graph=True, allow_unused=True)
    except RuntimeError as exc:
        raise SensitivityError(
            f"sensitivity needs double backward, but the gradient with create_graph=True "
            f"failed: {_first_line(exc)}"
        ) from None
    starts = [0]
    for _, _, params in groups:
        starts.append(starts[-1] + len(params))
    if _reaches_error(grads):  # then name the first layer behind it
        culprit = next(
            g[0] for g, lo, hi in zip(groups, starts, starts[1:]) if _reaches_error(grads[lo:hi])
        )
        raise SensitivityError(
            f"sensitivity needs double backward (Hessian-vector products), but the gradient "
            f"of layer {culprit!r} passes through a backward marked @once_differentiable"
        )
    return grads, starts


def _layer_row(
    block: _Block, names: list[str], samples: int, power_iters: int, tol: float, seed: int
) -> LayerCurvature:
    """One layer's estimates, its probes seeded by its name so other layers do not shift them."""
    name, params = block.name, block.params
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
    trace, stderr = _hutchinson(block, samples, gen)
    top, used = _power(block, power_iters, tol, gen)
    numel = sum(p.numel() for p in params)
    return LayerCurvature(
        name=name,
        params=names,
        numel=numel,
        trace=trace,
        trace_stderr=stderr,
        trace_per_param=trace / numel if numel else 0.0,
        top_eigenvalue=top,
        power_iters=used,
    )


def sensitivity(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    samples: int = 32,
    power_iters: int = 20,
    tol: float = 1e-3,
    seed: int = 0,
    layers: Patterns = None,
) -> Curvature:
    """Per-layer curvature of ``loss_fn(model, batch)``: Hessian trace and top eigenvalue.

    Args:
        model: the model; its trainable parameters are grouped by owning module.
        batch: passed to ``loss_fn`` as is.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor`` (as in :class:`gradwatch.Probe`).
        samples: Rademacher probes per layer for the trace (at least 2: the standard
            error needs two).
        power_iters: at most this many products per layer for the top eigenvalue.
        tol: stop the power iteration when the eigenvalue moves by less than this
            fraction.
        seed: seeds the probes (per layer, so a layer's estimate does not depend on
            which other layers are included).
        layers: fnmatch patterns over layer names to restrict the work to.

    Returns:
        A :class:`~gradwatch.report.Curvature`, one row per layer in module order.

    Raises:
        SensitivityError: one line when the loss is not a differentiable scalar, a
            pattern selects nothing, or the graph does not support double backward.

    Example:
        >>> curv = gradwatch.sensitivity(model, (x, y), loss_fn, samples=16)  # doctest: +SKIP
        >>> print(curv.table())  # doctest: +SKIP
    """
    groups = _selected(model, samples, power_iters, layers)
    loss = _scalar_loss(model, batch, loss_fn)
    grads, starts = _gradient_graph(loss, groups)
    rows, hvps = [], 0
    for (name, names, params), lo, hi in zip(groups, starts, starts[1:]):
        block = _Block(name, params, grads[lo:hi])
        rows.append(_layer_row(block, names, samples, power_iters, tol, seed))
        hvps += block.count
    del grads  # frees the double-backward graph before returning
    return Curvature(loss=float(loss.detach()), samples=samples, seed=seed, hvps=hvps, layers=rows)
