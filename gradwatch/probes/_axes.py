"""Which axis of the batch holds the samples: a model can declare it is time-major.

``nn.RNN``/``nn.LSTM``/``nn.GRU`` and ``nn.MultiheadAttention`` (so every ``nn.Transformer*``
layer) default to ``batch_first=False``: their input is ``(time, batch, ...)``. When such a
module reads the batch's leading dim as its time axis and the model's output keeps the
module's batch axis as its dim 1 (pytorch/examples word_language_model, the nn.Transformer LM
tutorial), the batch is time-major end to end: the leading dim holds time steps, which depend
on each other by design. A ``batch_first=False`` LSTM fed ``(batch, seq, d)`` by mistake and
read as ``out[:, -1]`` drops that axis, and stays judged.

A learned position table read whole (``self.pos(torch.arange(T))``, nanoGPT's ``wpe``) gives a
``(T, d)`` output shared by every sample: its rows are positions, even when T equals the batch
size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["TimeMajor", "position_table", "storages_of"]

_DECLARING = (nn.RNNBase, nn.MultiheadAttention)


class TimeMajor:
    """Pre-hooks on the ``batch_first=False`` modules of ``model``: the ones fed a 3-d input
    whose leading dim is the batch's ``n``, with the length of their batch axis."""

    def __init__(self, model: nn.Module, n: int) -> None:
        self.n = n
        self.seen: list[tuple[str, int]] = []
        self.handles = [
            mod.register_forward_pre_hook(self._hook(name))
            for name, mod in model.named_modules()
            if isinstance(mod, _DECLARING) and getattr(mod, "batch_first", True) is False
        ]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            x = args[0] if args else None
            if isinstance(x, Tensor) and x.dim() == 3 and x.shape[0] == self.n:
                self.seen.append((name, int(x.shape[1])))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def reason(self, out: Any) -> Optional[str]:
        """Why the leading dim is not the samples' (``out``: the model's per-sample output,
        whose dim 1 must be the module's batch axis), or None."""
        if not isinstance(out, Tensor) or out.dim() < 2:
            return None
        for name, b in self.seen:
            if b >= 2 and int(out.shape[1]) == b:
                return (
                    f"'{name}' (batch_first=False) reads the batch's leading dim ({self.n}) "
                    f"as time and its batch axis ({b}) is the output's dim 1: the model is "
                    "time-major, so the leading dim holds time steps, not samples, and "
                    "independence across it is not judged"
                )
        return None


def storages_of(batch: Any) -> set[int]:
    """The storages of the batch's (strided) tensors: ids that are views of them are its."""
    if isinstance(batch, Tensor):
        strided = batch.layout == torch.strided
        return {batch.untyped_storage().data_ptr()} if strided else set()
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return {p for v in batch for p in storages_of(v)}
    return set()


def position_table(ids: Any, storages: set[int]) -> bool:
    """Ids made in the forward as ``arange(T)``, not (views of) the batch's: a position
    table read whole, shared by every sample."""
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point():
        return False
    if ids.layout != torch.strided or ids.untyped_storage().data_ptr() in storages:
        return False
    return bool(torch.equal(ids.cpu(), torch.arange(len(ids))))


def pairwise(out: Tensor, leaves: list[tuple[str, Tensor]], n: int, sample: int) -> Optional[str]:
    """An ``(n, n)`` output whose entry ``[i, j]`` reads samples i and j only (CLIP's
    image-text logits, HF CLIPModel's ``logits_per_image``): both its axes are samples, and
    every row reading every sample is the design. Why, or None (a softmax over the batch
    that happens to give n columns reaches all the samples from one entry)."""
    if out.dim() != 2 or int(out.shape[1]) != n:
        return None
    other = (sample + 1) % n
    grads = torch.autograd.grad(
        out[sample, other], [leaf for _, leaf in leaves], retain_graph=True, allow_unused=True
    )
    reached: set[int] = set()
    for g in grads:
        if g is not None:
            per = g.detach().reshape(n, -1).abs().amax(dim=1)
            reached |= {int(j) for j in torch.nonzero(per > 0).flatten().tolist()}
    if other not in reached or not reached <= {sample, other}:
        return None
    return (
        f"the output is pairwise ({n} x {n}: entry [{sample}, {other}] reads samples "
        f"{sample} and {other} only, as CLIP's image-text logits): every row reads every "
        "sample by design, so independence across the batch is not judged"
    )
