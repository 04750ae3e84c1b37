"""What every probe shares: a copy of the model, the global RNG kept, batches, and a budget.

A probe never touches the user's weights, optimizer state, RNG state or data: it works on a
deep copy (:func:`fresh_copy`; the loss-free probes' copies read the user's weights without
writing them: :mod:`gradwatch.probes._copies`) inside :func:`rng_kept`, which restores the
global generators of torch (CPU and every initialised CUDA device), ``random`` and NumPy on
the way out.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "Budget",
    "CannotJudge",
    "LossFn",
    "cast_batch",
    "evaluate",
    "fresh_copy",
    "param_bytes",
    "rng_kept",
    "seeded",
    "slice_batch",
    "spread",
]

LossFn = Callable[[nn.Module, Any], Tensor]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class CannotJudge(Exception):
    """The probe cannot judge this model or loss: its ``reason`` (a slug) and a sentence."""

    def __init__(self, reason: str, message: str, partial: Any = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.partial = partial  # what the probe measured before it stopped, if anything


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Restore the global RNG state (torch, CUDA, ``random``, NumPy) however the block ends."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)


def seeded(seed: int) -> None:
    """Fix every global generator, so that one evaluation draws what the last one drew."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (2**32))


def _is_ours(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or type(hook).__module__
    return isinstance(owner, str) and owner.startswith("gradwatch.")


def _keep_param_attributes(model: nn.Module, memo: dict[int, Any]) -> None:
    """Give each copied parameter the Python attributes of its original.

    ``Parameter.__deepcopy__`` drops them (``Tensor.__deepcopy__`` keeps them), but libraries
    keep per-parameter state there that their hooks read in the forward: opacus's
    ``_forward_counter`` and ``grad_sample``. Copied through the same ``memo``, so a value
    that refers to the model refers to the copy.
    """
    for p in model.parameters():
        twin = memo.get(id(p))
        if twin is None or twin is p:
            continue
        for key, value in vars(p).items():
            if key not in vars(twin):
                setattr(twin, key, copy.deepcopy(value, memo))


def fresh_copy(model: nn.Module, memo: Optional[dict[int, Any]] = None) -> nn.Module:
    """A deep copy of ``model`` without gradwatch's own hooks (a watcher's, if one watches);
    ``memo``'s entries stand for their originals (``copy.deepcopy``'s memo).

    Raises:
        CannotJudge: the model cannot be deep-copied.
    """
    memo = {} if memo is None else memo
    try:
        clone = copy.deepcopy(model, memo)
        _keep_param_attributes(model, memo)
    except Exception as exc:
        raise CannotJudge(
            "not_copyable", f"the model cannot be deep-copied ({type(exc).__name__}: {exc})"
        ) from exc
    for mod in clone.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(mod, attr, None)
            if isinstance(hooks, dict):
                for key in [k for k, h in hooks.items() if _is_ours(h)]:
                    del hooks[key]
    for p in clone.parameters():
        p.grad = None
    return clone


def param_bytes(model: nn.Module, itemsize: Optional[int] = None) -> int:
    """Bytes of the model's parameters (at ``itemsize`` bytes per element when given)."""
    return sum(p.numel() * (itemsize or p.element_size()) for p in model.parameters())


def _map(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        out = {k: _map(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(out)  # type: ignore[call-arg]  # a BatchEncoding, OrderedDict
        except Exception:
            return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def tensors(batch: Any) -> list[Tensor]:
    """Every tensor of a batch (a tensor, tuple, list, dict, nested)."""
    found: list[Tensor] = []
    _map(batch, lambda t: found.append(t))
    return found


def batch_size(batch: Any) -> Optional[int]:
    """The leading dimension every tensor of the batch shares, if they share one."""
    sizes = {t.shape[0] for t in tensors(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def spread(n: int, k: int) -> list[int]:
    """``k`` indices of ``range(n)`` spread evenly, first and last included."""
    if k >= n:
        return list(range(n))
    if k <= 1:
        return [n // 2]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def slice_batch(batch: Any, n: int) -> Any:
    """``n`` samples spread over a batch whose tensors share their leading dimension (first
    and last included): a defect in one sample of the middle is not left out."""
    size = batch_size(batch)
    if size is None or size <= n:
        return batch
    index = torch.tensor(spread(size, n))
    return _map(batch, lambda t: t[index.to(t.device)] if t.dim() > 0 else t)


def cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating tensors in ``dtype`` (integer ids, masks of bools kept)."""
    return _map(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)


def evaluate(model: nn.Module, batch: Any, loss_fn: LossFn, seed: int) -> Tensor:
    """The loss of ``model`` on ``batch`` with every generator seeded: one evaluation.

    Raises:
        CannotJudge: ``loss_fn`` failed or did not return a scalar tensor.
    """
    seeded(seed)
    try:
        loss = loss_fn(model, batch)
    except Exception as exc:
        raise CannotJudge(
            "loss_failed", f"loss_fn failed on the copy ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise CannotJudge("not_scalar", "loss_fn did not return a scalar tensor")
    return loss.reshape(())


@dataclass
class Budget:
    """A probe's time budget: ``left()`` seconds remain."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()
