"""Forwards of the copy that can be compared: outputs captured, state kept, randomness replayed.

The loss-free probes (``batch_order_dependent``, ``forward_not_reproducible``) compare two
forwards of the same copy. Three things would make two correct forwards differ, and each is
taken out here:

- **state** the forward writes (batch-norm running statistics, a counter, a cached tensor):
  :class:`State` snapshots every buffer and every non-parameter tensor, number, string or
  generator in a module's ``__dict__``, and restores it before each forward;
- **randomness**: :class:`Draws` (a ``TorchFunctionMode``) makes the dropout family the
  identity (``dropout_p`` 0 for attention kernels, whose masks are drawn inside the kernel),
  records every other random draw of the first forward (``torch.randn_like`` of a VAE,
  a drop-path's ``bernoulli_``, Gumbel noise) and replays it in the next, permuted along the
  batch axis when the draw has one: each sample gets the noise it got before, wherever it
  sits. A forward that draws elsewhere (a C++ kernel, another process) shows as two replayed
  forwards under different seeds that disagree;
- **the outputs**: a forward hook on the root module records what the model returned
  (``loss_fn`` may reduce it at once); :func:`per_sample` lists its floating tensors with the
  batch's leading dimension.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gradwatch.probes._sandbox import CannotJudge, LossFn, evaluate

__all__ = ["Draws", "Forward", "State", "differ", "per_sample", "run_forward"]

_IDENTITY = {
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.dropout,
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
}
_NO_DROPOUT = {F.scaled_dot_product_attention, F.multi_head_attention_forward}
_FACTORIES = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.bernoulli,
    torch.multinomial,
    torch.normal,
    torch.poisson,
    torch.randperm,
    Tensor.bernoulli,
    Tensor.multinomial,
}
_IN_PLACE = {
    Tensor.bernoulli_,
    Tensor.uniform_,
    Tensor.normal_,
    Tensor.exponential_,
    Tensor.random_,
    Tensor.geometric_,
    Tensor.cauchy_,
    Tensor.log_normal_,
}


def _without_dropout(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with ``dropout_p`` 0 (``scaled_dot_product_attention`` is a builtin without a
    signature to bind: its ``dropout_p`` is the fifth positional argument)."""
    if "dropout_p" in kwargs:
        return args, {**kwargs, "dropout_p": 0.0}
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        at = 4 if func is F.scaled_dot_product_attention else None
        if at is not None and len(args) > at:
            args = (*args[:at], 0.0, *args[at + 1 :])
        return args, kwargs
    if "dropout_p" in bound.arguments:
        bound.arguments["dropout_p"] = 0.0
    return bound.args, bound.kwargs


class Draws(TorchFunctionMode):
    """Dropout off; every other random draw recorded, or replayed (permuted by ``perm``).

    Raises (on exit of a replay, through :meth:`check`):
        CannotJudge: the replayed forward drew other random numbers than the recorded one.
    """

    def __init__(
        self, n: int, replay: Optional[list[Tensor]] = None, perm: Optional[Tensor] = None
    ) -> None:
        super().__init__()
        self.n, self.replay, self.perm = n, replay, perm
        self.drawn: list[Tensor] = []
        self.unaligned = 0  # draws without the batch axis first: not permutable
        self.indices = False  # the draw being replayed is a permutation of the batch
        self.mismatch = ""

    def _value(self, fresh: Tensor) -> Tensor:
        k = len(self.drawn)
        if self.replay is None:
            self.drawn.append(fresh.detach().clone())
            return fresh
        if k >= len(self.replay) or self.replay[k].shape != fresh.shape:
            self.mismatch = self.mismatch or f"draw {k} of shape {tuple(fresh.shape)}"
            self.drawn.append(fresh)
            return fresh
        value = self.replay[k]
        self.drawn.append(value)
        batched = value.dim() > 0 and value.shape[0] == self.n
        if self.perm is not None and batched:
            perm = self.perm.to(value.device)
            value = value[perm]
            if self.indices:  # a randperm of the batch (mixup's partner): indices follow too
                value = perm.argsort()[value]
        return value

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _IDENTITY:
            return args[0] if args else kwargs["input"]
        if func in _NO_DROPOUT:
            args, kwargs = _without_dropout(func, args, kwargs)
        out = func(*args, **kwargs)
        self.indices = func is torch.randperm
        if func in _FACTORIES and isinstance(out, Tensor):
            if not (out.dim() > 0 and out.shape[0] == self.n) and out.numel() > 1:
                self.unaligned += 1
            return self._value(out).to(out.dtype)
        if func in _IN_PLACE and isinstance(out, Tensor):
            if not (out.dim() > 0 and out.shape[0] == self.n) and out.numel() > 1:
                self.unaligned += 1
            value = self._value(out)
            if value is not out:
                with torch.no_grad():
                    out.copy_(value)
            return out
        return out


_KEPT = (Tensor, int, float, bool, str, type(None))


class State:
    """Every buffer and every plain attribute of every module of ``model``: saved, restored,
    compared. Parameters are not state (the probes never step them); a ``torch.Generator``
    attribute is saved as its state."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved = self.read()

    def read(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, mod in self.model.named_modules():
            prefix = f"{name}." if name else ""
            for key, buf in mod._buffers.items():
                if buf is not None:
                    out[prefix + key] = buf.detach().clone()
            for key, value in vars(mod).items():
                if key.startswith("_") or key == "training":
                    continue
                if isinstance(value, torch.Generator):
                    out[prefix + key] = value.get_state()
                elif isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                    out[prefix + key] = value.detach().clone()
                elif isinstance(value, _KEPT):
                    out[prefix + key] = value
                elif _is_state(value):
                    out[prefix + key] = type(value)(v.detach().clone() for v in value)
        return out

    def restore(self) -> None:
        for name, mod in self.model.named_modules():
            prefix = f"{name}." if name else ""
            for key in list(mod._buffers):
                if prefix + key in self.saved and mod._buffers[key] is not None:
                    buf, saved = mod._buffers[key], self.saved[prefix + key]
                    with torch.no_grad():
                        if buf.shape != saved.shape:
                            buf.resize_(saved.shape)
                        buf.copy_(saved)
            for key in [k for k in vars(mod) if not k.startswith("_") and k != "training"]:
                value = vars(mod)[key]
                full = prefix + key
                if isinstance(value, torch.Generator) and full in self.saved:
                    value.set_state(self.saved[full])
                elif full in self.saved:
                    setattr(mod, key, _fresh(self.saved[full]))
                elif _is_state(value):
                    del vars(mod)[key]  # created by a forward: absent, as before it

    def changed(self, after: dict[str, Any]) -> list[str]:
        """The names whose value differs between the saved state and ``after``."""
        names = sorted(set(self.saved) | set(after))
        return [k for k in names if not _same(self.saved.get(k), after.get(k))]


def _is_state(value: Any) -> bool:
    if isinstance(value, Tensor):
        return not isinstance(value, nn.Parameter)
    return isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value)


def _fresh(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value):
        return type(value)(v.clone() for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
            return False
        if a.layout != torch.strided:  # torch.equal has no sparse kernel (a GCN's adjacency)
            a, b = a.to_dense(), b.to_dense()
        return bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return a is b


def per_sample(out: Any, n: int, path: str = "output") -> list[tuple[str, Tensor]]:
    """Every floating tensor of a forward's output whose leading dimension is the batch's."""
    if isinstance(out, Tensor):
        ok = out.is_floating_point() and out.dim() > 0 and out.shape[0] == n
        return [(path, out.detach())] if ok else []
    found: list[tuple[str, Tensor]] = []
    if isinstance(out, Mapping):
        for k, v in out.items():
            found += per_sample(v, n, f"{path}[{k!r}]")
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            found += per_sample(v, n, f"{path}[{i}]")
    return found


@dataclass
class Forward:
    """One forward of the copy: its per-sample outputs, its loss, and what it drew."""

    outputs: list[tuple[str, Tensor]]
    loss: Optional[float]
    draws: Draws


def run_forward(
    model: nn.Module, batch: Any, loss_fn: LossFn, n: int, seed: int, draws: Draws
) -> Forward:
    """``loss_fn(model, batch)`` under ``draws`` with every generator seeded, grad off.

    Raises:
        CannotJudge: ``loss_fn`` failed, or the model returned no per-sample output.
    """
    seen: list[Any] = []
    handle = model.register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        with torch.no_grad(), draws:
            loss = evaluate(model, batch, loss_fn, seed)
    finally:
        handle.remove()
    outputs = per_sample(seen[0], n) if seen else []
    if not outputs:
        raise CannotJudge(
            "no_per_sample_output",
            f"the model returned no floating tensor with the batch's {n} samples first",
        )
    value = float(loss.detach().double()) if loss.is_floating_point() else None
    return Forward(outputs, value, draws)


def differ(a: Tensor, b: Tensor, rtol: float) -> tuple[float, Tensor]:
    """The largest difference relative to ``a``'s scale, and the samples beyond ``rtol``
    of it (a floor of a thousand times the dtype's epsilon: reordered sums round apart)."""
    if a.shape != b.shape:
        return float("inf"), torch.arange(a.shape[0])
    if a.dtype == b.dtype and torch.equal(a, b):  # the common case, at a read of each
        return 0.0, torch.zeros(0, dtype=torch.long, device=a.device)
    x, y = a.double(), b.double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    same_nonfinite = (~finite) & ((x == y) | (torch.isnan(x) & torch.isnan(y)))
    scale = float(x[finite].abs().max()) if bool(finite.any()) else 0.0
    tol = max(rtol, 1000 * torch.finfo(a.dtype).eps) * max(scale, 1e-30)
    gap = torch.where(finite, (x - y).abs(), torch.where(same_nonfinite, 0.0, float("inf")))
    per = gap.reshape(a.shape[0], -1).amax(dim=1) if gap.numel() else gap.new_zeros(a.shape[0])
    rel = float(per.max()) / max(scale, 1e-30) if per.numel() else 0.0
    return rel, torch.nonzero(per > tol).flatten()
