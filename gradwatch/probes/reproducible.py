"""The ``forward_not_reproducible`` probe: does a forward read what an earlier one left?

On a copy of the model, the same batch runs twice with every global generator seeded alike
(and any ``torch.Generator`` a module holds set back to its state). The second forward must
give the first's outputs: nothing the forward reads may carry over from an earlier call. The
state each forward changed is every buffer and plain attribute of every module
(:class:`~gradwatch.probes._replay.State`); when the outputs differ, each changed entry is
put back alone (within the time budget) to find those the output reads.

Batch-norm running statistics (and ``num_batches_tracked``) change at every train-mode
forward, but the output there reads the batch's own statistics: they are not blamed (in eval
mode the forward reads them but does not write them). State a forward re-estimates
by design and reads, quantisation-aware training's observers (their running ranges) and
spectral norm's power-iteration vectors (``weight_u``, ``_u``), is set back before the second
forward (``details.reset``), so the rest is still judged. State carried on purpose, a
recurrent state fed back for truncated BPTT, a key/value cache or a Transformer-XL memory,
is declared (the config's ``stateful`` or ``allow``) or recognised by its name (``cache``,
``mems``, ``memory``, a MoCo ``queue``, a memory ``bank``): the probe then reports that the
property was not judged (only when the outputs differ, unless ``stateful: true``).

What it cannot judge: state that the same batch sets back to the same value on every call
(a mask cached from the first batch and reused, stale for the next, different batch); state
outside the model's modules (a global, a closure in ``loss_fn``) beyond saying that no
module attribute changed; non-determinism below ``rtol`` (GPU atomics).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradwatch.probes._copies import own_bytes, shared_copy
from gradwatch.probes._replay import Draws, State, differ, run_forward
from gradwatch.probes._sandbox import Budget, LossFn, batch_size

__all__ = ["ReproResult", "reproducibility"]

SEED = 8191
_ON_PURPOSE = re.compile(r"(cache|mems|memory|past_key|queue|bank)", re.IGNORECASE)
_STATS = ("running_mean", "running_var", "num_batches_tracked")
_OBSERVERS = re.compile(r"Observer|FakeQuant|SpectralNorm", re.IGNORECASE)
_POWER_ITERATION = ("weight_u", "weight_v", "_u", "_v")


@dataclass
class ReproResult:
    """What the second forward changed, and which state it read."""

    batch: int = 0
    output: Optional[str] = None  # the output that changed between the two forwards
    change: float = 0.0
    samples: list[int] = field(default_factory=list)
    state: list[str] = field(default_factory=list)  # every entry the first forward changed
    read: list[str] = field(default_factory=list)  # those shown to change the output
    reset: list[str] = field(default_factory=list)  # re-estimated by design: set back
    declared: str = ""  # what declared or showed the state to be carried on purpose
    memory_bytes: int = 0

    @property
    def differs(self) -> bool:
        return self.output is not None


def _norm_stats(model: nn.Module) -> set[str]:
    """The running statistics of batch norms: written in train mode, read only in eval."""
    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, _BatchNorm):
            names |= {f"{name}.{s}" if name else s for s in _STATS}
    return names


def _on_purpose(names: list[str], stateful: Optional[bool], allow: list[str]) -> str:
    if stateful:
        return "the config (checks.forward_not_reproducible.stateful)"
    allowed = [k for k in names if any(fnmatch.fnmatch(k, pat) for pat in allow)]
    if names and len(allowed) == len(names):
        return f"the config's allow ({', '.join(allowed[:4])})"
    if stateful is None:
        named = [k for k in names if _ON_PURPOSE.search(k.rsplit(".", 1)[-1])]
        if names and len(named) == len(names):
            return f"its name ({', '.join(named[:4])}: a cache or memory kept on purpose)"
    return ""


def reproducibility(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    rtol: float,
    budget: Budget,
    stateful: Optional[bool] = None,
    allow: Optional[list[str]] = None,
) -> ReproResult:
    """Two forwards of one copy on one batch, seeded alike: what changed, and what it read.

    Raises:
        CannotJudge: no per-sample output, or ``loss_fn`` failed.
    """
    n = batch_size(batch) or 1
    copy = shared_copy(model)
    result = ReproResult(batch=n, memory_bytes=own_bytes(copy))
    start = State(copy)
    first = run_forward(copy, batch, loss_fn, n, SEED, Draws(n, replay=[]))
    after = State(copy).saved
    ignored = _norm_stats(copy) if copy.training else set()
    changed = [k for k in start.changed(after) if k not in ignored]
    for name in [k for k in changed if isinstance(_attr(copy, k), torch.Generator)]:
        _set(copy, name, start.saved.get(name))  # a module's own generator: seeded alike
        changed.remove(name)
    kinds = _owners(copy, changed)
    result.reset = [k for k in changed if _recomputed(k, kinds)]
    for name in result.reset:  # re-estimated at every call by design: both forwards alike
        _set(copy, name, start.saved.get(name))
    result.state = [k for k in changed if k not in result.reset]
    second = run_forward(copy, batch, loss_fn, n, SEED, Draws(n, replay=[]))
    for (path, a), (_, b) in zip(first.outputs, second.outputs):
        change, samples = differ(a, b, rtol)
        if len(samples):
            result.output, result.change, result.samples = path, change, samples.tolist()
            break
    if len(first.outputs) != len(second.outputs):
        result.output = "output (another set of tensors)"
    if stateful:
        result.declared = _on_purpose(result.state, stateful, [])
    elif result.differs:
        result.declared = _on_purpose(result.state, stateful, list(allow or []))
        if not result.declared:
            result.read = _read(copy, batch, loss_fn, n, start, after, result, rtol, budget)
            if result.read:
                result.declared = _on_purpose(result.read, stateful, list(allow or []))
    return result


def _recomputed(name: str, kinds: dict[str, str]) -> bool:
    """State a forward re-estimates on purpose and reads: quantisation observers' running
    ranges, spectral norm's power-iteration vectors."""
    leaf = name.rpartition(".")[2]
    return bool(_OBSERVERS.search(kinds.get(name, ""))) or leaf in _POWER_ITERATION


def _owners(model: nn.Module, names: list[str]) -> dict[str, str]:
    """The class name of the module that holds each state entry."""
    owners = {name: _owner(model, name)[0] for name in names}
    return {name: type(mod).__name__ if mod is not None else "" for name, mod in owners.items()}


def _read(
    copy: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    n: int,
    start: State,
    after: dict[str, Any],
    result: ReproResult,
    rtol: float,
    budget: Budget,
) -> list[str]:
    """The changed entries the output reads: each one alone at its post-forward value, the
    rest as before the first forward (a forward per entry, while the budget lasts)."""
    start.restore()
    base = run_forward(copy, batch, loss_fn, n, SEED, Draws(n, replay=[]))
    read = []
    for name in result.state:
        if budget.left() <= 0:
            break
        start.restore()
        try:
            _set(copy, name, after.get(name))
            out = run_forward(copy, batch, loss_fn, n, SEED, Draws(n, replay=[]))
        except Exception:  # one entry alone may be inconsistent with the rest: unknown
            continue
        if any(len(differ(a, b, rtol)[1]) for (_, a), (_, b) in zip(base.outputs, out.outputs)):
            read.append(name)
    start.restore()
    return read


def _owner(model: nn.Module, name: str) -> tuple[Optional[nn.Module], str]:
    """The module that holds a state entry (``None`` when it is gone), and the entry's key."""
    owner, _, key = name.rpartition(".")
    try:
        return (model.get_submodule(owner) if owner else model), key
    except AttributeError:
        return None, key


def _attr(model: nn.Module, name: str) -> Any:
    """The attribute a state entry names (``None`` when its module is gone)."""
    mod, key = _owner(model, name)
    return getattr(mod, key, None) if mod is not None else None


def _set(model: nn.Module, name: str, value: Any) -> None:
    owner, _, key = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    buf = mod._buffers.get(key)
    if buf is not None and value is not None:
        with torch.no_grad():
            if buf.shape != value.shape:
                buf.resize_(value.shape)
            buf.copy_(value)
    elif isinstance(getattr(mod, key, None), torch.Generator):
        getattr(mod, key).set_state(value)
    else:
        setattr(mod, key, value.clone() if hasattr(value, "clone") else value)
