"""The ``batch_order_dependent`` probe: does a sample's result depend on where it sits?

On a copy of the model, the batch and a permutation of it (a seeded derangement: every sample
moves) run through the same weights with the same RNG state (:mod:`._replay`: dropout off,
every other random draw replayed and permuted with its sample; the state a forward writes
restored before each). Every per-sample output of the permuted run must be the original's,
permuted alike, and ``loss_fn``'s value (a mean or a sum over samples) unchanged. A forward
hook on every module fingerprints its per-sample outputs (two fixed weighted sums per
sample), so the first module whose output moved names where the order got in.

Train-mode batch norm needs no exception: its statistics are sums over the batch, the same in
any order (up to rounding, which the tolerance allows). Batch norm over *parts* of the batch
(ghost batch norm, TabNet's virtual batches, a forward run in chunks) gives each sample the
statistics of the part it lands in, by design: when the order stops mattering once those
norms use their running statistics, the move is said as not judged. Experts of limited
capacity (Switch, GShard: a module with ``expert_capacity`` or ``capacity_factor``) drop
tokens by their place in the batch by design: a move there is said as not judged. A forward
that draws random numbers the replay cannot align with the samples is judged with the copy in
eval mode, and says so.

What it cannot judge: a dependence on the position that the derangement leaves in place (a
bug that depends only on the batch size, or on a sample's neighbours' content and not
their order); a loss that reduces over samples in another way than a mean or sum (it is
compared only when ``compare_loss``); randomness the replay cannot see (drawn inside a C++
kernel or from a generator the forward does not call through torch), which forces eval mode
and so misses a train-mode-only order dependence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradwatch.probes._axes import TimeMajor
from gradwatch.probes._copies import own_bytes, shared_copy
from gradwatch.probes._graph import declared_graph
from gradwatch.probes._replay import Draws, Forward, State, differ, run_forward
from gradwatch.probes._sandbox import Budget, CannotJudge, LossFn, _map, batch_size

__all__ = ["OrderResult", "order_dependence"]

SEED = 31337


@dataclass
class OrderResult:
    """What the permuted forward changed."""

    batch: int = 0
    permutation: list[int] = field(default_factory=list)
    output: Optional[str] = None  # the output that moved (its path in what the model returned)
    samples: list[int] = field(default_factory=list)  # the samples whose output moved
    change: float = 0.0  # the largest change, relative to the output's scale
    loss: Optional[tuple[float, float]] = None  # (original, permuted) when only the loss moved
    module: Optional[str] = None  # the first module whose per-sample output moved
    last_same: Optional[str] = None  # the last module before it whose output did not
    mode: str = "train"  # "eval" when randomness forced the copy into eval mode
    memory_bytes: int = 0

    @property
    def moved(self) -> bool:
        return self.output is not None or self.loss is not None


def derangement(n: int, seed: int = SEED) -> Tensor:
    """A seeded permutation of ``range(n)`` that moves every index (n >= 2)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    fixed = perm == torch.arange(n)
    while bool(fixed.any()):  # rotate the fixed points among themselves (or with a neighbour)
        idx = torch.nonzero(fixed).flatten()
        if len(idx) == 1:
            j = int(idx[0])
            k = (j + 1) % n
            perm[j], perm[k] = perm[k].clone(), perm[j].clone()
        else:
            perm[idx] = perm[idx.roll(1)]
        fixed = perm == torch.arange(n)
    return perm


def permute_batch(batch: Any, perm: Tensor, n: int) -> Any:
    """Every tensor of the batch with ``n`` samples first, in the order ``perm``."""
    return _map(batch, lambda t: t[perm.to(t.device)] if t.dim() > 0 and t.shape[0] == n else t)


class _Prints:
    """Per-sample fingerprints of every module's output, in the order the forward ran them."""

    def __init__(self, model: nn.Module, n: int) -> None:
        self.n = n
        self.rows: list[tuple[str, Tensor, Tensor]] = []
        self.calls: dict[str, int] = {}
        self.handles = [
            mod.register_forward_hook(self._hook(name or "(the model)"))
            for name, mod in model.named_modules()
        ]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if not (isinstance(out, Tensor) and out.is_floating_point()):
                return
            if out.dim() == 0 or out.shape[0] != self.n or out.numel() == 0:
                return
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            flat = out.detach().reshape(self.n, -1).double()
            w = torch.cos(torch.arange(flat.shape[1], device=flat.device, dtype=flat.dtype))
            prints = torch.stack([flat.sum(1), (flat * w).sum(1)], dim=1)
            label = name if k == 0 else f"{name} (call {k + 1})"
            self.rows.append((label, prints, flat.abs().sum(1)))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _first_moved(
    first: _Prints, second: _Prints, perm: Tensor, rtol: float
) -> tuple[Optional[str], Optional[str]]:
    """The first module (in forward order) whose per-sample output moved, and the last
    module before it that did not."""
    by_label = {label: (p, s) for label, p, s in second.rows}
    last_same = None
    for label, prints, scale in first.rows:
        if label not in by_label:
            continue
        other, _ = by_label[label]
        want = prints[perm.to(prints.device)]
        tol = max(rtol, 1e3 * torch.finfo(torch.float32).eps)
        bound = tol * (scale[perm.to(scale.device)].unsqueeze(1) + 1e-30)
        if other.shape != want.shape or bool(((want - other).abs() > bound).any()):
            return label, last_same
        last_same = label
    return None, last_same


def _pair(
    copy: nn.Module, batch: Any, loss_fn: LossFn, n: int, perm: Tensor, state: State
) -> tuple[Forward, Forward, Forward]:
    """The original forward, its replay under another seed, the permuted one."""
    state.restore()
    orig = run_forward(copy, batch, loss_fn, n, SEED, Draws(n))
    state.restore()
    again = run_forward(copy, batch, loss_fn, n, SEED + 1, Draws(n, orig.draws.drawn))
    state.restore()
    moved = run_forward(
        copy, permute_batch(batch, perm, n), loss_fn, n, SEED, Draws(n, orig.draws.drawn, perm)
    )
    state.restore()
    return orig, again, moved


def _fingerprinted(
    copy: nn.Module, batch: Any, loss_fn: LossFn, n: int, perm: Tensor, state: State
) -> tuple[_Prints, _Prints]:
    """The original and the permuted forward again, every module's output fingerprinted:
    run only once an output moved, so a model whose outputs permute pays for none."""
    state.restore()
    first = _Prints(copy, n)
    try:
        orig = run_forward(copy, batch, loss_fn, n, SEED, Draws(n))
    finally:
        first.remove()
    state.restore()
    second = _Prints(copy, n)
    try:
        permuted = permute_batch(batch, perm, n)
        run_forward(copy, permuted, loss_fn, n, SEED, Draws(n, orig.draws.drawn, perm))
    finally:
        second.remove()
    state.restore()
    return first, second


def _stable(orig: Forward, again: Forward, rtol: float) -> bool:
    if again.draws.mismatch or orig.draws.unaligned:
        return False
    return all(
        len(differ(a, b, rtol)[1]) == 0 for (_, a), (_, b) in zip(orig.outputs, again.outputs)
    )


def order_dependence(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, rtol: float, budget: Budget
) -> OrderResult:
    """Run the batch and a derangement of it through a copy; what moved, and where.

    Raises:
        CannotJudge: fewer than two samples, no per-sample output, a forward that is not
            reproducible even in eval mode, or a permuted batch the model refuses.
    """
    n = batch_size(batch)
    if n is None or n < 2:
        raise CannotJudge("one_sample", "the batch has no leading dimension of two or more samples")
    graph = declared_graph(batch, n, model)
    if graph is not None:  # the samples are a graph's nodes: their order is in the edges
        raise CannotJudge(
            "graph_batch",
            f"{graph[0]} declares a graph over the batch's {n} samples: permuting the "
            "nodes without their edges changes the outputs by design",
        )
    copy = shared_copy(model)
    perm = derangement(n)
    result = OrderResult(batch=n, permutation=perm.tolist(), memory_bytes=own_bytes(copy))
    state = State(copy)
    orig, again, moved = _pair(copy, batch, loss_fn, n, perm, state)
    if not _stable(orig, again, rtol):
        if budget.left() <= 0:
            raise CannotJudge("budget", "the forward is random beyond what the replay aligns")
        copy.eval()  # the forward draws what the replay cannot align: judged in eval mode
        result.mode = "eval"
        orig, again, moved = _pair(copy, batch, loss_fn, n, perm, state)
        if not _stable(orig, again, rtol):
            raise CannotJudge(
                "not_reproducible",
                "two forwards with the same weights, batch and replayed random draws differ, "
                "even in eval mode (see forward_not_reproducible)",
            )
    if len(moved.outputs) != len(orig.outputs):
        raise CannotJudge("forward_changed", "the permuted batch gave another set of outputs")
    _what_moved(orig, moved, perm, rtol, result)
    if result.moved:
        first, second = _fingerprinted(copy, batch, loss_fn, n, perm, state)
        result.module, result.last_same = _first_moved(first, second, perm, rtol)
        _time_major(copy, batch, loss_fn, n, state, dict(orig.outputs).get(result.output or ""))
        parts = _norms_over_parts(copy, batch, loss_fn, n, perm, state, rtol)
        if parts:
            raise CannotJudge("coupled_on_purpose", parts, partial=result)
        capped = _capacity_routing(copy)
        if capped:  # tokens past an expert's capacity are dropped by their place in the batch
            raise CannotJudge(
                "coupled_on_purpose",
                f"the outputs moved with the batch order, but {capped} routes tokens to "
                "experts of limited capacity, which drops tokens by their place in the batch "
                "by design: not judged",
                partial=result,
            )
    return result


def _what_moved(
    orig: Forward, moved: Forward, perm: Tensor, rtol: float, into: Optional[OrderResult] = None
) -> OrderResult:
    """The first output that did not permute with the batch (its samples, its change), else
    a mean or sum loss that changed: written into ``into`` (a fresh record by default)."""
    result = into if into is not None else OrderResult()
    for (path, a), (_, b) in zip(orig.outputs, moved.outputs):
        change, samples = _compare(a, b, perm, rtol)
        if len(samples):
            result.output, result.samples, result.change = path, samples.tolist(), change
            return result
    if orig.loss is not None and moved.loss is not None:
        scale = max(abs(orig.loss), 1e-30)
        if abs(orig.loss - moved.loss) > max(rtol, 1e-4) * scale:
            result.loss = (orig.loss, moved.loss)
    return result


def _norms_over_parts(
    copy: nn.Module, batch: Any, loss_fn: LossFn, n: int, perm: Tensor, state: State, rtol: float
) -> str:
    """Why the move is by design when it comes from train-mode batch norms that normalise
    parts of the batch (a call with fewer than ``n`` samples) and the order stops mattering
    once they use their running statistics; ``""`` otherwise."""
    norms = {
        name: m
        for name, m in copy.named_modules()
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
    }
    if not norms:
        return ""
    fewest: dict[str, int] = {}

    def seen(name: str) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            x = args[0] if args else None
            if isinstance(x, Tensor) and x.dim() > 0:
                fewest[name] = min(fewest.get(name, n), int(x.shape[0]))

        return pre

    handles = [m.register_forward_pre_hook(seen(name)) for name, m in norms.items()]
    for m in norms.values():
        m.eval()
    try:
        orig, _, moved = _pair(copy, batch, loss_fn, n, perm, state)
    except Exception:  # the forward refuses running statistics: the move stands
        return ""
    finally:
        for h in handles:
            h.remove()
        for m in norms.values():
            m.train()
    parts = sorted(name for name, k in fewest.items() if k < n)
    # outputs only: whether the loss may move is the caller's (``compare_loss``)
    still = len(moved.outputs) != len(orig.outputs) or (
        _what_moved(orig, moved, perm, rtol).output is not None
    )
    if not parts or still:
        return ""
    return (
        f"the outputs moved with the batch order, but only through batch norm over parts of "
        f"the batch ({parts[0] or 'the model'} normalised {fewest[parts[0]]} of {n} samples "
        "at a time: ghost batch norm, or a forward run in chunks), which gives each sample "
        "the statistics of its part by design; with running statistics the order does not "
        "matter: not judged"
    )


def _time_major(
    copy: nn.Module, batch: Any, loss_fn: LossFn, n: int, state: State, out: Any
) -> None:
    """A model that declares the batch's leading dim its time axis (:mod:`._axes`): what moved
    is time steps, not samples, so the order is not judged."""
    axes = TimeMajor(copy, n)
    try:
        run_forward(copy, batch, loss_fn, n, SEED, Draws(n))
    finally:
        axes.remove()
        state.restore()
    why = axes.reason(out)
    if why:
        raise CannotJudge("time_major", why)


def _compare(a: Tensor, b: Tensor, perm: Tensor, rtol: float) -> tuple[float, Tensor]:
    """``a`` permuted against ``b``; a pairwise output (``(n, n)``, CLIP's image-text logits)
    has its columns permuted too."""
    p = perm.to(a.device)
    change, samples = differ(a[p], b, rtol)
    if len(samples) and a.dim() >= 2 and a.shape[1] == a.shape[0]:
        pairwise = differ(a[p][:, p], b, rtol)
        if not len(pairwise[1]):
            return pairwise
    return change, samples


def _capacity_routing(model: nn.Module) -> str:
    """A module that routes to experts of limited capacity (Switch, GShard), if any."""
    for name, mod in model.named_modules():
        for key in ("expert_capacity", "capacity_factor"):
            if getattr(mod, key, None) not in (None, 0, False):
                return f"{type(mod).__name__} at {name or 'the root'} ({key})"
    return ""
