"""``double_backward`` evidence: one loss graph backpropagated twice into one step.

``loss.backward(retain_graph=True)`` followed by a second ``backward()`` of the same loss
adds the very same gradient twice. Autograd names no graph root, so the evidence is the
gradient itself, on one small parameter per optimizer (the *probe*): a tensor hook queues two
device numbers per backward pass (its incoming gradient's sum and norm), with the stamp of
the model's latest forward. At the step, passes of one forward whose numbers are equal bit
for bit (and non-zero) are the same root again; two different losses over one graph give
different gradients. The comparison is one device op, read with the step's transfer.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.hooks import release_pre_hooks
from gradwatch.capture.grads.window import Track

__all__ = ["BackwardProbe"]

LIMIT = 32  # backward passes remembered per window


class BackwardProbe:
    """Per optimizer, the probe's per-backward fingerprints of the current window."""

    def __init__(self, forward_stamp: Callable[[], int]) -> None:
        self._stamp = forward_stamp
        self._seen: dict[Optional[int], list[tuple[tuple[int, int], torch.Tensor]]] = {}
        self._probes: dict[Optional[int], weakref.ref[torch.Tensor]] = {}
        self._handles: list[RemovableHandle] = []

    def install(self, track: Track) -> None:
        """A probe on ``track``'s smallest trainable parameter (once per optimizer)."""
        k = track.index
        probe = self._probes.get(k)
        if k is None or (probe is not None and probe() is not None):
            return
        params = [  # a lazy parameter has no size yet: probed once materialised (a re-sync)
            p for p in track.params if p.requires_grad and not is_lazy(p) and p.numel() > 0
        ]
        if not params:
            return
        p = min(params, key=lambda t: t.numel())
        self._probes[k] = weakref.ref(p)
        self._handles.append(p.register_hook(self._hook(k, self._probes[k])))

    def _hook(
        self, k: Optional[int], pref: weakref.ref[torch.Tensor]
    ) -> Callable[[torch.Tensor], None]:
        wself = weakref.ref(self)
        resets = [0]

        def fingerprint(grad: torch.Tensor) -> None:
            me, p = wself(), pref()
            if me is None or p is None or grad.is_sparse:
                return
            if p.grad is None:
                resets[0] += 1  # reset since the last pass: what came before was dropped
            seen = me._seen.setdefault(k, [])
            if len(seen) < LIMIT:
                g = grad.detach()
                # A pass repeats another only within one forward and one accumulation.
                seen.append(
                    ((me._stamp(), resets[0]), torch.stack((g.sum(), torch.linalg.vector_norm(g))))
                )

        torch.utils.hooks.unserializable_hook(fingerprint)
        return fingerprint

    def flags(self, k: Optional[int]) -> list[torch.Tensor]:
        """``[n]``: how many of the window's backward passes repeated an earlier one of the
        same forward (a 1-element device tensor), or ``[]`` when none could."""
        seen = self._seen.pop(k, None)
        if not seen or len(seen) < 2:
            return []
        groups: dict[tuple[int, int], int] = {}
        keys = [groups.setdefault(s, len(groups)) for s, _ in seen]
        if len(groups) == len(keys):
            return []  # a forward (or a reset) before each backward: different graphs
        c = torch.stack([v.float() for _, v in seen])  # (n, 2)
        same = torch.tensor(keys, device=c.device)
        eq = (c[:, None, :] == c[None, :, :]).all(-1) & (same[:, None] == same[None, :])
        eq &= (c[:, 1] > 0)[None, :]
        return [torch.triu(eq, diagonal=1).any(0).sum().reshape(1).float()]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for ref in self._probes.values():
            release_pre_hooks(ref())
        self._handles.clear()
        self._seen.clear()
        self._probes.clear()
