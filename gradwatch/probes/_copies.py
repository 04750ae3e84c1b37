"""The copies of the model that the probes run on, made to read the user's weights.

:func:`widened_copy` is ``gradient_mismatch``'s float64 copy (:mod:`._widened`), and
:func:`probe_copy` chooses it or a copy that holds its own weights (float64, or the model's
dtype). :func:`shared_copy` is the copy the forward probes run on, in the model's own dtype:
its parameters read the user's tensors, so a probe holds no second copy of the weights (issue
49's memory budget). An op that writes into one of them gives it values of its own first, and
a step that fails on a shared copy (``weight.tolist()`` is refused to a tensor subclass) is run
again on a plain copy (:class:`Sharing`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from gradwatch.probes._sandbox import CannotJudge, cast_batch, fresh_copy, slice_batch
from gradwatch.probes._widened import BLOCK, Root, Widened

__all__ = [
    "Sharing",
    "own_bytes",
    "probe_copy",
    "shared_copy",
    "widened_bytes",
    "widened_copy",
    "widened_need",
]


def _widenable(p: Tensor) -> bool:
    return type(p) in (Tensor, nn.Parameter) and p.is_floating_point() and p.layout == torch.strided


def widened_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in float64 whose plain floating parameters are :class:`Widened`
    over the user's own (the others, and the buffers, widened as usual).

    Raises:
        CannotJudge: the model cannot be deep-copied.
    """
    return _reading(model, torch.float64).double()


class Sharing:
    """Whether :func:`shared_copy` shares the user's weights (``enabled``), and whether it
    did since the block began (``made``): a probe whose step failed on a shared copy is run
    again on a copy of its own (:func:`gradwatch.probes._attempt`)."""

    enabled = True
    made = False

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._saved = (Sharing.enabled, Sharing.made)

    def __enter__(self) -> Sharing:
        self._saved = (Sharing.enabled, Sharing.made)
        Sharing.enabled, Sharing.made = self._enabled, False
        return self

    def __exit__(self, *exc: Any) -> None:
        self.made = Sharing.made
        Sharing.enabled, Sharing.made = self._saved


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in its own dtype whose plain floating parameters read the user's
    own (:class:`Widened` of the same dtype: no copy of the weights; an op that writes one
    gives it values of its own first), for the probes that run forwards, and backwards to
    their inputs. A plain copy inside ``Sharing(False)``.

    Raises:
        CannotJudge: the model cannot be deep-copied.
    """
    if not Sharing.enabled:
        return fresh_copy(model)
    Sharing.made = True
    return _reading(model, None)


def _reading(model: nn.Module, dtype: Optional[torch.dtype]) -> nn.Module:
    """``fresh_copy(model)`` whose plain floating parameters are :class:`Widened` over the
    user's own, of ``dtype`` (each its own where ``None``)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if _widenable(p) and id(p) not in memo:
            root = Root(p, dtype or p.dtype)
            memo[id(p)] = nn.Parameter(Widened(root), requires_grad=p.requires_grad)
    return fresh_copy(model, memo)


def probe_copy(model: nn.Module, batch: Any, max_samples: int, form: str) -> tuple[nn.Module, Any]:
    """``gradient_mismatch``'s copy and its samples of ``batch``: ``widened`` (float64 read
    from the user's weights), ``float64`` (a float64 copy of the weights), or ``native``
    (the model's own dtype); the batch's floats cast to match.

    Raises:
        CannotJudge: the model cannot be copied (``not_copyable``), or not in float64
            (``loss_failed``: the next form is tried).
    """
    small = slice_batch(batch, max_samples)
    if form == "native":
        return fresh_copy(model), small
    try:
        copy = widened_copy(model) if form == "widened" else fresh_copy(model).double()
    except CannotJudge:
        raise
    except Exception as exc:
        raise CannotJudge("loss_failed", f"the copy is not float64 ({exc})") from exc
    return copy, cast_batch(small, torch.float64)


def own_bytes(copy: nn.Module) -> int:
    """Bytes a copy holds of its own: its buffers and the parameters that do not read the
    user's (:func:`shared_copy`)."""
    held = [p for p in copy.parameters() if not isinstance(p, Widened)]
    return sum(t.numel() * t.element_size() for t in (*held, *copy.buffers()))


def widened_bytes(model: nn.Module, grad: Optional[int] = None) -> int:
    """What a widened copy holds at most beside the activations: its buffers and the
    parameters that are not :class:`Widened`, in float64, and its largest parameter's
    gradient (``grad`` bytes where the reduction measured it: a large matrix's gradient is
    a block of rows' where it is read by rows) and read (a block of rows, for a matrix:
    :data:`BLOCK`)."""
    return _held(model, lambda p: not isinstance(p, Widened), grad)


def widened_need(model: nn.Module) -> int:
    """:func:`widened_bytes` of the widened copy ``model`` would have."""
    return _held(model, lambda p: not _widenable(p))


def _held(model: nn.Module, kept: Callable[[Tensor], bool], grad: Optional[int] = None) -> int:
    params = list(model.parameters())
    held = sum(8 * t.numel() for t in model.buffers())
    held += sum(8 * p.numel() for p in params if kept(p))
    if not params:
        return held
    largest = max(params, key=lambda p: p.numel())
    read = min(largest.numel(), BLOCK) if largest.dim() == 2 else largest.numel()
    return held + 8 * read + (8 * largest.numel() if grad is None else grad)
