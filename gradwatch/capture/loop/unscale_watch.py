"""``clipped_while_scaled`` evidence: did gradients change between backward and unscaling?

``GradScaler`` has no hooks. Its ``step()`` unscales through ``self.unscale_(optimizer)``
(unless the user already called ``scaler.unscale_(optimizer)``), so one attribute set on the
scaler *instance* (never on the class) sees every unscale, explicit or implicit; leaving the
watcher deletes it again. At that moment each gradient that arrived in the window is compared
with what its last accumulation left (identity and version counter, kept by the
post-accumulate hook anyway): a clip, normalisation or noise in between bumped the version or
replaced the tensor. Nothing is copied and nothing syncs.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

__all__ = ["UnscaleWatch"]


class UnscaleWatch:
    """Calls ``on_unscale(optimizer)`` just before the scaler unscales an optimizer's grads."""

    def __init__(self, scaler: Any, on_unscale: Callable[[Any], None]) -> None:
        self._scaler: Optional[weakref.ref[Any]] = None
        self._installed = False
        real = getattr(type(scaler), "unscale_", None) if scaler is not None else None
        if real is None or "unscale_" in getattr(scaler, "__dict__", {"unscale_": None}):
            return  # not a GradScaler, or already wrapped by someone else: leave it alone
        callback = on_unscale

        def unscale_(optimizer: Any) -> Any:
            callback(optimizer)  # guarded by the caller: a fault never stops the unscale
            return real(scaler, optimizer)

        scaler.unscale_ = unscale_
        self._scaler = weakref.ref(scaler)
        self._installed = True

    def remove(self) -> None:
        """Give the scaler its own method back (idempotent)."""
        scaler = self._scaler() if self._scaler is not None else None
        if self._installed and scaler is not None:
            scaler.__dict__.pop("unscale_", None)
        self._installed = False
