"""The documented input domains of torch's losses, and the cheap reductions that read them.

Each rule maps one ``torch.nn.functional`` loss (the ``nn`` loss modules call these) to the
arguments it constrains: a :class:`Demand` names the argument, its domain and the 0-dim
reductions that tell whether the values lie in it. A reduction is computed on the detached
tensor (``aminmax``, a row sum, ``|x| - 1``), stays on the device and is read with the step's
one host transfer; nothing is copied to the host and nothing is kept of the data.

Domains (``Demand.domain``):

- ``unit``: every value in [0, 1] (BCE targets and inputs, probabilities);
- ``logprob``: every value <= 0 (``nll_loss``'s and ``kl_div``'s input, ``ctc_loss``'s);
- ``nonneg``: every value >= 0 (Poisson counts and rates, class and positive weights);
- ``pm1``: every value -1 or +1 (the margin losses' labels);
- ``dist``: each row along the class dim sums to one (an all-zero row, a masked position,
  is allowed): cross-entropy's probability targets;
- ``index``: class indices in [0, C), ``ignore_index`` aside.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["LOSS_RULES", "Demand", "demands", "reduce"]


@dataclass(frozen=True)
class Demand:
    """One argument of one loss call and the domain it must lie in."""

    role: str  # "target", "input", "var", ...: the argument's name in torch's signature
    domain: str  # see the module docstring
    extra: Optional[int] = None  # ``dist``: the class dim; ``index``: C (the class count)
    ignore: Optional[int] = None  # ``index``: the ignore_index
    tol: float = 0.0  # ``dist``: the rounding a row sum of this dtype and width may carry


def _t(b: dict[str, Any], name: str) -> Optional[torch.Tensor]:
    v = b.get(name)
    return v if isinstance(v, torch.Tensor) and v.numel() > 0 else None


def _class_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 2 else 0


_WEIGHTS = (Demand("weight", "nonneg"), Demand("pos_weight", "nonneg"))  # absent: skipped


def _bce(b: dict[str, Any]) -> list[Demand]:
    return [Demand("input", "unit"), Demand("target", "unit"), *_WEIGHTS]


def _bce_logits(b: dict[str, Any]) -> list[Demand]:
    return [Demand("target", "unit"), *_WEIGHTS]


def _nll(b: dict[str, Any]) -> list[Demand]:
    x = _t(b, "input")
    out = [Demand("input", "logprob"), *_WEIGHTS]
    if x is not None and x.dim() >= 1:
        out.append(Demand("target", "index", int(x.shape[_class_dim(x)]), b.get("ignore_index")))
    return out


def _cross_entropy(b: dict[str, Any]) -> list[Demand]:
    x, t = _t(b, "input"), _t(b, "target")
    if x is None or t is None or x.dim() < 1:
        return []
    weights = list(_WEIGHTS)
    if t.is_floating_point():  # class probabilities (soft targets, mixup, label smoothing)
        dim = _class_dim(x)
        width = int(t.shape[dim]) if t.dim() > dim else 1
        tol = max(1e-3, width * torch.finfo(t.dtype).eps)  # a bf16 row of 10: 0.08
        return [Demand("target", "unit"), Demand("target", "dist", dim, tol=tol), *weights]
    index = Demand("target", "index", int(x.shape[_class_dim(x)]), b.get("ignore_index"))
    return [index, *weights]


def _kl_div(b: dict[str, Any]) -> list[Demand]:
    target = Demand("target", "logprob" if b.get("log_target") else "unit")
    return [Demand("input", "logprob"), target]


def _poisson(b: dict[str, Any]) -> list[Demand]:
    out = [Demand("target", "nonneg")]
    if not b.get("log_input", True):
        out.append(Demand("input", "nonneg"))
    return out


def _margin(b: dict[str, Any]) -> list[Demand]:
    return [Demand("target", "pm1")]


def _multilabel_soft(b: dict[str, Any]) -> list[Demand]:
    return [Demand("target", "unit")]


def _ctc(b: dict[str, Any]) -> list[Demand]:
    return [Demand("log_probs", "logprob")]


#: The loss functions read, each with its rule. ``nn.BCELoss`` & co. call these.
LOSS_RULES: dict[Callable[..., Any], Callable[[dict[str, Any]], list[Demand]]] = {
    F.binary_cross_entropy: _bce,
    F.binary_cross_entropy_with_logits: _bce_logits,
    F.nll_loss: _nll,
    F.cross_entropy: _cross_entropy,
    F.kl_div: _kl_div,
    F.poisson_nll_loss: _poisson,
    F.hinge_embedding_loss: _margin,
    F.soft_margin_loss: _margin,
    F.margin_ranking_loss: _margin,
    F.cosine_embedding_loss: _margin,
    F.multilabel_soft_margin_loss: _multilabel_soft,
    F.ctc_loss: _ctc,
}
_SIGNATURES: dict[Callable[..., Any], inspect.Signature] = {}


def demands(
    func: Callable[..., Any], args: Any, kwargs: Any
) -> tuple[dict[str, Any], list[Demand]]:
    """The call's arguments by name (defaults filled in) and what its loss demands of them."""
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = _SIGNATURES[func] = inspect.signature(func)
    bound = sig.bind(*args, **(kwargs or {}))
    bound.apply_defaults()
    b = dict(bound.arguments)
    return b, LOSS_RULES[func](b)


def reduce(d: Demand, x: torch.Tensor) -> list[torch.Tensor]:
    """The 0-dim float reductions that tell whether ``x`` lies in ``d``'s domain.

    ``unit``: (min, max); ``logprob``: (max,); ``nonneg``: (min,); ``pm1``: (the largest
    ``||x| - 1|``,); ``dist``: (the largest distance of a row sum from 1, rows summing to 0
    aside,); ``index``: (min, max) of the indices that are not ``ignore_index``.
    """
    x = x.detach()
    if d.domain == "unit":
        lo, hi = torch.aminmax(x)
        return [lo.float(), hi.float()]
    if d.domain == "logprob":
        return [x.amax().float()]
    if d.domain == "nonneg":
        return [x.amin().float()]
    if d.domain == "pm1":
        return [(x.abs() - 1).abs().amax().float()]
    if d.domain == "dist":
        s = x.sum(dim=d.extra or 0, dtype=torch.float32)
        return [torch.minimum((s - 1).abs(), s.abs()).amax()]
    if d.domain == "index":
        if d.ignore is not None:
            x = x.masked_fill(x == d.ignore, 0)
        lo, hi = torch.aminmax(x)
        return [lo.float(), hi.float()]
    raise ValueError(f"unknown domain {d.domain!r}")
