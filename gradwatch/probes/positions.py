"""Independences inside one sample that the model or its batch declare, along its positions.

``sample_dependence`` reads two declarations besides the batch axis, on the same leaves (the
batch's floating inputs and the embedding outputs) and the same graph:

- **causal**: an attention module with ``is_causal = True`` (Hugging Face's decoder
  attention), a module class named ``Causal...`` or ``...ForCausal...`` (minGPT's
  ``CausalSelfAttention``, ``LlamaForCausalLM``), or the config's ``causal: true``. Position
  ``t``'s output must not reach an input after ``t``. Not judged for an encoder-decoder
  (``config.is_encoder_decoder``) or a model that declares both (its encoder's positions
  are all visible to its decoder), nor when the config says ``causal: false``.
- **padding**: a batch mapping with an ``attention_mask`` of 0/1 (``(batch, positions)``)
  for a model whose ``forward`` takes ``attention_mask``. The output at the kept positions
  (the whole sample's, when the output has no position axis, as a pooled one) must not
  reach the inputs at the zeroed ones.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "Leak",
    "NotJudged",
    "causal_leak",
    "declared_causal",
    "declared_padding",
    "names_mask",
    "padding_leak",
    "weighted_grads",
]

SEED = 4099
_CAUSAL_NAME = re.compile(r"(^|For)Causal")


class NotJudged(Exception):
    """A declared independence this model's output or inputs give no way to judge (said in
    the probe's record, never passed over)."""


@dataclass
class Leak:
    """A declared independence inside one sample that one backward found broken."""

    kind: str  # "causal" | "padding"
    sample: int
    declared_by: str
    position: Optional[int] = None  # the output position (causal); None: every kept one
    reached: list[int] = field(default_factory=list)  # input positions it must not reach
    share: float = 0.0
    inputs: list[str] = field(default_factory=list)


def declared_causal(model: nn.Module, override: Optional[bool]) -> Optional[str]:
    """What declares the model causal, or ``None`` when nothing does (or it is not judged)."""
    if override is not None:
        return "the config (checks.sample_dependence.causal)" if override else None
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        return None
    causal: Optional[str] = None
    for name, module in model.named_modules():
        flag = getattr(module, "is_causal", None)
        if flag is False:
            return None  # a bidirectional encoder beside it (or alone): positions all visible
        if causal is None and (flag is True or _CAUSAL_NAME.search(type(module).__name__)):
            how = ".is_causal" if flag is True else " (its class name)"
            causal = f"{type(module).__name__}{how} at {name or 'the root'}"
    return causal


def declared_padding(model: nn.Module, batch: Any, n: int) -> Optional[Tensor]:
    """The batch's ``attention_mask`` as bools ``(n, positions)``, kept = True, when it zeroes
    some position of some sample and the model's ``forward`` takes it; else ``None``."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != n:
        return None
    if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
        return None  # an additive float mask, or weights: no 0/1 declaration to read
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    takes = "attention_mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    kept = mask.detach().bool().cpu()
    return kept if takes and bool((~kept).any()) else None


def names_mask(model: nn.Module) -> bool:
    """Whether the model's ``forward`` names ``attention_mask`` (FNet's takes only ``**kwargs``:
    no mask can be given to it)."""
    try:
        return "attention_mask" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True


def _positional(leaves: list[tuple[str, Tensor]], length: int) -> list[tuple[str, Tensor]]:
    return [(p, t) for p, t in leaves if t.dim() >= 2 and t.shape[1] == length]


def weighted_grads(
    target: Tensor, leaves: list[tuple[str, Tensor]], seed: int = SEED
) -> list[Optional[Tensor]]:
    """The gradient on each leaf of ``target`` under a seeded random weighting (the graph is
    kept: the same forward serves every backward of the probe)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(target.shape, generator=gen).to(target.device, target.dtype)
    return list(
        torch.autograd.grad(
            (target * weight).sum(), [t for _, t in leaves], allow_unused=True, retain_graph=True
        )
    )


def _split(
    leaves: list[tuple[str, Tensor]],
    grads: list[Optional[Tensor]],
    sample: int,
    allowed: Tensor,
) -> tuple[float, float, list[int], list[str]]:
    """Per position of ``sample``: the norm on allowed positions, on forbidden ones, which
    forbidden positions were reached, and through which inputs."""
    own, other, reached, names = 0.0, 0.0, set(), []
    for (path, _), g in zip(leaves, grads):
        if g is None:
            continue
        per = g[sample].detach().double().abs().reshape(g.shape[1], -1)
        keep = allowed.to(per.device)
        own = max(own, float(per[keep].norm()))
        rest = float(per[~keep].norm())
        if rest > 0:
            names.append(path)
            other = max(other, rest)
            hit = (per.max(dim=1).values > 0) & ~keep
            reached |= {int(j) for j in torch.nonzero(hit).flatten().tolist()}
    share = other / own if own > 0 else (float("inf") if other > 0 else 0.0)
    return own, share, sorted(reached), names


def causal_leak(
    out: Tensor,
    leaves: list[tuple[str, Tensor]],
    sample: int,
    kept: Optional[Tensor],
    *,
    declared_by: str,
    min_share: float,
) -> Optional[Leak]:
    """One backward from the middle position's output of ``sample``: any later input reached.

    Raises:
        NotJudged: the output has no position axis, or no leaf shares its positions.

    A position the batch's mask zeroes is not chosen: Hugging Face lets a fully masked
    query row attend everywhere (scaled_dot_product_attention needs one key)."""
    if out.dim() < 3 or out.shape[1] < 2:
        raise NotJudged(f"the per-sample output {tuple(out.shape)} has no position axis")
    length = out.shape[1]
    seq = _positional(leaves, length)
    keep_row = kept[sample] if kept is not None and kept.shape[1] == length else None
    starts = [t for t in range(length - 1) if keep_row is None or bool(keep_row[t])]
    if not seq:
        raise NotJudged(f"no input or embedding output has the output's {length} positions")
    if not starts:
        raise NotJudged(f"sample {sample} keeps no position before its last")
    t = starts[len(starts) // 2]
    allowed = torch.arange(length) <= t
    _, share, reached, names = _split(seq, weighted_grads(out[sample, t], seq), sample, allowed)
    if not reached or share <= min_share:
        return None
    return Leak("causal", sample, declared_by, t, reached, share, names)


def padding_leak(
    out: Tensor, leaves: list[tuple[str, Tensor]], kept: Tensor, *, min_share: float
) -> Optional[Leak]:
    """One backward from the kept positions' outputs of a padded sample: any padded input
    reached.

    Raises:
        NotJudged: no leaf has the mask's positions, or no sample is partly padded.
    """
    length = kept.shape[1]
    seq = _positional(leaves, length)
    rows = [s for s in range(kept.shape[0]) if bool(kept[s].any()) and not bool(kept[s].all())]
    if not seq:
        raise NotJudged(f"no input or embedding output has the mask's {length} positions")
    if not rows:
        raise NotJudged("no sample keeps some positions and pads others")
    sample = rows[len(rows) // 2]
    row = kept[sample]
    positional = out.dim() >= 2 and out.shape[1] == length
    target = out[sample][row.to(out.device)] if positional else out[sample]
    _, share, reached, names = _split(seq, weighted_grads(target, seq), sample, row)
    if not reached or share <= min_share:
        return None
    return Leak("padding", sample, "the batch's attention_mask", None, reached, share, names)
