"""torch's documented gradient masks of an embedding, as rows left out of the comparison.

``F.embedding`` and ``F.embedding_bag`` document a gradient that is not the derivative of
their forward on some rows: the ``padding_idx`` row gets none (though an ``nn.Embedding``
sums or feeds it like any other row), ``scale_grad_by_freq`` divides a row's gradient by
how often the batch looks it up (``embedding_bag``'s kernel scales every looked-up row, so
all of them are left out there), and ``max_norm`` renormalises the looked-up rows in place
(a row at the norm bound is projected back by every finite-difference step). Autograd's
derivative is torch's documented one only off those rows, so the finite differences are
taken along a direction that leaves them out; the probe's record names them.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["EMBEDDINGS", "EmbeddingMasks"]

EMBEDDINGS = {"embedding", "embedding_bag"}
_MARGIN = 1e-3  # a row within 0.1 % of max_norm is at the bound (torch divides by norm + 1e-7)


def _bound(func: Callable[..., Any], args: Any, kwargs: Any) -> dict[str, Any]:
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    bound.apply_defaults()
    return dict(bound.arguments)


class EmbeddingMasks:
    """Rows of the trainable embedding weights whose documented gradient is not the
    derivative, per parameter id, each with why (recorded in the autograd evaluation)."""

    def __init__(self, params: dict[int, int]) -> None:
        self._params = params
        self.rows: dict[int, set[int]] = {}
        self.why: dict[int, set[str]] = {}

    def note(self, func: Any, args: Any, kwargs: Any) -> None:
        """Called before an embedding op of the recorded evaluation runs."""
        if func is not F.embedding and func is not F.embedding_bag:
            return
        a = _bound(func, args, kwargs)
        weight, ids = a.get("weight"), a.get("input")
        if not isinstance(weight, Tensor) or id(weight) not in self._params:
            return
        if not isinstance(ids, Tensor) or weight.dim() != 2:
            return
        n = weight.shape[0]
        pad = a.get("padding_idx")
        if pad is not None and -n <= int(pad) < n:
            self._add(weight, {int(pad) % n}, "padding_idx")
        flat = ids.detach().reshape(-1).long()
        if a.get("scale_grad_by_freq") and flat.numel():
            seen, counts = torch.unique(flat, return_counts=True)
            if func is F.embedding_bag:  # its CPU kernel scales even rows seen once
                counts = counts + 1
            self._add(weight, set(seen[counts > 1].tolist()), "scale_grad_by_freq")
        max_norm = a.get("max_norm")
        if max_norm is not None and flat.numel():
            looked = torch.unique(flat)
            norms = weight.detach()[looked].norm(p=float(a.get("norm_type") or 2.0), dim=1)
            at_bound = looked[norms >= float(max_norm) * (1.0 - _MARGIN)]
            self._add(weight, set(at_bound.tolist()), "max_norm")

    def _add(self, weight: Tensor, rows: set[int], why: str) -> None:
        if rows:
            self.rows.setdefault(id(weight), set()).update(rows)
            self.why.setdefault(id(weight), set()).add(why)

    def apply(self, params: list[Tensor], v: list[Tensor]) -> list[Tensor]:
        """``v`` with the masked rows zeroed (not renormalised)."""
        out = []
        for p, d in zip(params, v):
            rows = self.rows.get(id(p))
            if rows:
                d = d.clone()
                d[sorted(rows)] = 0.0
            out.append(d)
        return out

    def described(self, names: dict[int, str]) -> dict[str, dict[str, Any]]:
        """For the record: each masked parameter's name, row count and reasons."""
        return {
            names.get(k, "?"): {"rows": len(rows), "why": sorted(self.why.get(k, ()))}
            for k, rows in self.rows.items()
        }
