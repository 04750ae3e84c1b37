"""The ``sample_dependence`` probe: does one sample's output depend on another's input?

On a copy of the model, the batch's floating inputs (and the outputs of embedding layers,
for token ids) become leaves that require grad; one backward from a random weighting of one
sample's output (the model's first output with the batch's leading dimension) gives the
gradient on every input. The middle sample's first; then the halves of the batch by each bit
of the sample index and their complements (2 log2 n backwards): any two samples fall apart in
one of them, so a dependence between any two samples is seen wherever they sit, and the one
sample of that half whose output shows it is named. Independent samples give exactly zero on the others: any gradient
there, beyond ``min_share`` of the sample's own, is a dependence. When the model trains batch
norms, the backward is run again with them in eval mode: a dependence that vanishes is batch
norm's, reported as ``info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradwatch.probes._axes import TimeMajor, pairwise, position_table, storages_of
from gradwatch.probes._copies import own_bytes, shared_copy
from gradwatch.probes._graph import (
    declared_graph,
    hops_needed,
    layers_with_parameters,
    nodes_of_edge_batch,
)
from gradwatch.probes._sandbox import (
    Budget,
    CannotJudge,
    LossFn,
    batch_size,
    evaluate,
)
from gradwatch.probes.positions import (
    Leak,
    NotJudged,
    causal_leak,
    declared_causal,
    declared_padding,
    names_mask,
    padding_leak,
    weighted_grads,
)

__all__ = ["SampleResult", "samples_reached"]

SEED = 1729


@dataclass
class SampleResult:
    """What the backward from one sample's output reached."""

    sample: int = 0
    batch: int = 0
    others: list[int] = field(default_factory=list)
    share: float = 0.0
    inputs: list[str] = field(default_factory=list)
    cause: Optional[str] = None  # "batch_norm" when eval-mode batch norms remove it
    memory_bytes: int = 0
    leaks: list[Leak] = field(default_factory=list)  # declared independences inside a sample
    declared: dict[str, str] = field(default_factory=dict)  # what declared them
    not_judged: dict[str, str] = field(default_factory=dict)  # declared, but why not judged
    mask_passed: bool = False  # the batch's mask reached the model's call, or it takes none

    @property
    def dependent(self) -> bool:
        return bool(self.others)


def _leafify(batch: Any, n: int, path: str, leaves: list[tuple[str, Tensor]]) -> Any:
    if isinstance(batch, Tensor):
        strided = batch.layout == torch.strided  # a sparse adjacency is the graph, not data
        if strided and batch.is_floating_point() and batch.dim() > 0 and batch.shape[0] == n:
            leaf = batch.detach().clone().requires_grad_(True)
            leaves.append((path, leaf))
            return leaf
        return batch
    if isinstance(batch, Mapping):
        out = {k: _leafify(v, n, f"{path}[{k!r}]", leaves) for k, v in batch.items()}
        try:
            return type(batch)(out)  # type: ignore[call-arg]
        except Exception:
            return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(
            *(_leafify(v, n, f"{path}.{f}", leaves) for f, v in zip(batch._fields, batch))
        )
    if isinstance(batch, (list, tuple)):
        return type(batch)(_leafify(v, n, f"{path}[{i}]", leaves) for i, v in enumerate(batch))
    return batch


def _first_output(out: Any, n: int) -> Optional[Tensor]:
    if isinstance(out, Tensor):
        ok = out.is_floating_point() and out.dim() > 0 and out.shape[0] == n and out.requires_grad
        return out if ok else None
    values: Any = out.values() if isinstance(out, Mapping) else out
    if isinstance(values, (list, tuple)) or isinstance(out, Mapping):
        for v in values:
            found = _first_output(v, n)
            if found is not None:
                return found
    return None


class _Capture:
    """Hooks on the copy: the root's outputs, embedding outputs made leaves."""

    def __init__(
        self, model: nn.Module, n: int, leaves: list[tuple[str, Tensor]], batch: Any = None
    ) -> None:
        self.n, self.leaves = n, leaves
        self.storages = storages_of(batch)
        self.outputs: list[Any] = []  # the root's, else its children's (a GAN's G and D)
        self.children: list[Any] = []
        self.time_major = TimeMajor(model, n)
        self.mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        self.mask_passed = False  # the batch's mask reached the root's call
        self.handles = [model.register_forward_hook(self._root, with_kwargs=True)]
        for child in model.children():
            self.handles.append(child.register_forward_hook(self._child))
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                self.handles.append(mod.register_forward_hook(self._embedding(name)))

    def _root(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.outputs.append(output)
        if self.mask is not None:
            self.mask_passed |= any(t is self.mask for t in [*args, *kwargs.values()])

    def _child(self, module: nn.Module, args: Any, output: Any) -> None:
        self.children.append(output)

    def _embedding(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if args and position_table(args[0], self.storages):
                return None
            if isinstance(output, Tensor) and output.dim() > 0 and output.shape[0] == self.n:
                leaf = output.detach().requires_grad_(True)
                self.leaves.append((f"output of {name or 'embedding'}", leaf))
                return leaf
            return None

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.time_major.remove()


def _forward(
    model: nn.Module, batch: Any, loss_fn: LossFn, n: int, seen: Optional[dict[str, str]] = None
) -> tuple[Tensor, list[tuple[str, Tensor]]]:
    """One evaluation of the copy: its per-sample output and the leaves it reads (and into
    ``seen``, why the leading dim is time, where the model says so: :mod:`._axes`)."""
    leaves: list[tuple[str, Tensor]] = []
    leafy = _leafify(batch, n, "batch", leaves)
    capture = _Capture(model, n, leaves, batch)
    try:
        with torch.enable_grad():
            evaluate(model, leafy, loss_fn, SEED)
    finally:
        capture.remove()
    time_major = capture.time_major
    found = (_first_output(x, n) for x in capture.outputs or capture.children)
    out = next((o for o in found if o is not None), None)
    if out is None:
        raise CannotJudge(
            "no_per_sample_output",
            f"the model returned no floating tensor that requires grad with the batch's "
            f"{n} samples as its first dimension",
        )
    if not leaves:
        raise CannotJudge("no_inputs", "the batch has no floating input and the model no embedding")
    if seen is not None:
        seen["time_major"] = time_major.reason(out) or ""
        seen["mask_passed"] = "yes" if capture.mask_passed else ""
    return out, leaves


def _reach(
    out: Tensor, leaves: list[tuple[str, Tensor]], n: int, chosen: Tensor
) -> tuple[list[int], float, list[str]]:
    """The samples outside ``chosen`` (a mask) that the chosen samples' outputs reach, the
    share of gradient on them, and the inputs it came through."""
    index = torch.nonzero(chosen).flatten().to(out.device)
    grads = weighted_grads(out.index_select(0, index), leaves, SEED)
    own, others = 0.0, 0.0
    reached: set[int] = set()
    names = []
    for (path, _leaf), g in zip(leaves, grads):
        if g is None:
            continue
        flat = g.detach().double().reshape(n, -1).abs()
        per = flat.max(dim=1).values
        mask = ~chosen.to(per.device)
        own = max(own, float(flat[~mask].norm()))
        rest = float(flat[mask].norm()) if bool(mask.any()) else 0.0
        if rest > 0:
            names.append(path)
            others = max(others, rest)
            reached |= {int(j) for j in torch.nonzero(per * mask > 0).flatten().tolist()}
    share = others / own if own > 0 else (float("inf") if others > 0 else 0.0)
    return sorted(reached), share, names


def _one(n: int, sample: int) -> Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[sample] = True
    return mask


def _splits(n: int) -> list[Tensor]:
    """Halves of the batch by each bit of the sample index, and their complements: any two
    samples fall apart in one of them, so a dependence between any two is seen."""
    index = torch.arange(n)
    halves = [((index >> bit) & 1).bool() for bit in range(max(1, (n - 1).bit_length()))]
    return [m for h in halves for m in (h, ~h) if bool(m.any()) and not bool(m.all())]


def _search(
    out: Tensor,
    leaves: list[tuple[str, Tensor]],
    n: int,
    min_share: float,
    budget: Budget,
    result: SampleResult,
) -> tuple[list[int], float, list[str]]:
    """The middle sample's reach; then the bit halves of the batch (a dependence between any
    two samples, wherever they sit), and the one sample of a half that shows it."""
    found = _reach(out, leaves, n, _one(n, n // 2))
    if found[0] and found[1] > min_share:
        return found
    for half in _splits(n):
        if budget.left() <= 0:
            break
        try:
            split = _reach(out, leaves, n, half)
        except Exception:  # backward hooks that allow one backward per forward (opacus's)
            break
        if not split[0] or split[1] <= min_share:
            continue
        for sample in torch.nonzero(half).flatten().tolist():
            try:
                single = _reach(out, leaves, n, _one(n, sample))
            except Exception:
                break
            if single[0] and single[1] > min_share:
                result.sample = sample
                return single
            if budget.left() <= 0:
                break
        result.sample = int(torch.nonzero(half).flatten()[0])
        return split
    return found


def _within(
    copy: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    n: int,
    result: SampleResult,
    *,
    causal: Optional[bool],
    min_share: float,
) -> list[Leak]:
    """The declared independences inside a sample (:mod:`.positions`), judged with batch
    norms in eval mode (their coupling is the batch axis's, not a position's)."""
    by = declared_causal(copy, causal)
    kept = declared_padding(copy, batch, n)
    result.declared = {
        "causal": by or "not declared",
        "padding": "the batch's attention_mask" if kept is not None else "not declared",
    }
    if by is None and kept is None:
        return []
    for m in copy.modules():
        if isinstance(m, _BatchNorm):
            m.eval()
    seen: dict[str, str] = {}
    out, leaves = _forward(copy, batch, loss_fn, n, seen)
    result.mask_passed = bool(seen["mask_passed"]) or not names_mask(copy)
    rules: list[tuple[str, Callable[[], Optional[Leak]]]] = []
    if by is not None:
        rules.append(
            (
                "causal",
                lambda: causal_leak(
                    out, leaves, result.sample, kept, declared_by=by, min_share=min_share
                ),
            )
        )
    if kept is not None:
        rules.append(("padding", lambda: padding_leak(out, leaves, kept, min_share=min_share)))
    found = []
    for kind, judge in rules:
        try:
            found.append(judge())
        except NotJudged as exc:
            result.not_judged[kind] = str(exc)
    return [leak for leak in found if leak is not None]


def _along_graph(copy: nn.Module, batch: Any, n: int, sample: int, reached: list[int]) -> None:
    """A batch that declares a graph over its samples, and a dependence that follows its
    edges (within the model's layers' hops): the coupling is the design's, not judged."""
    graph = declared_graph(batch, n, copy)
    if graph is None:
        return
    path, adj = graph
    layers = layers_with_parameters(copy)
    k = hops_needed(adj, sample, reached, layers)
    if k is not None:
        edges = int(adj.sum()) - n
        raise CannotJudge(
            "graph_batch",
            f"{path} declares a graph over the batch's {n} samples ({edges} directed "
            f"edges besides self-loops) and sample {sample}'s output reaches only the "
            f"{len(reached)} sample(s) within {k} hop(s) of it ({layers} layers with "
            "parameters): a graph network couples its nodes by design, so independence "
            "across the batch is not judged",
        )


def samples_reached(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    min_share: float,
    budget: Budget,
    causal: Optional[bool] = None,
) -> SampleResult:
    """One backward from the middle sample's output of a copy, then from halves of the batch
    (by each bit of the sample index, while the budget lasts) until one reaches other
    samples; then the independences the model or batch declare inside a sample.

    Raises:
        CannotJudge: one sample only, no per-sample output, or no input to differentiate.
    """
    n = batch_size(batch) or nodes_of_edge_batch(batch)
    if n is None or n < 2:
        raise CannotJudge("one_sample", "the batch has no leading dimension of two or more samples")
    copy = shared_copy(model)
    result = SampleResult(sample=n // 2, batch=n, memory_bytes=own_bytes(copy))
    seen: dict[str, str] = {}  # why the batch's leading dim is not its samples, if it is not
    out, leaves = _forward(copy, batch, loss_fn, n, seen)
    others, share, names = _search(out, leaves, n, min_share, budget, result)
    if others and share > min_share:
        still, judged = others, (out, leaves)
        norms = [m for m in copy.modules() if isinstance(m, _BatchNorm) and m.training]
        if norms:  # over budget or not: without it, batch norm's coupling would read as a bug
            for m in norms:
                m.eval()
            del out, leaves, judged
            judged = _forward(copy, batch, loss_fn, n)
            still, still_share, _ = _reach(*judged, n, _one(n, result.sample))
            if not still or still_share <= min_share:
                result.cause = "batch_norm"
        if result.cause is None:
            seen["pairwise_output"] = pairwise(*judged, n, result.sample) or ""
            for reason, why in seen.items():
                if why:
                    raise CannotJudge(reason, why)
            _along_graph(copy, batch, n, result.sample, still)
        result.others, result.share, result.inputs = others, share, names
    result.leaks = _within(copy, batch, loss_fn, n, result, causal=causal, min_share=min_share)
    return result
