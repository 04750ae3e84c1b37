"""PyTorch Lightning integration: one callback gives every gradwatch check.

Importing this package needs ``pytorch_lightning`` (or ``lightning``): ``pip install
gradwatch[lightning]``. ``import gradwatch`` itself never imports Lightning.

Example:
    >>> from gradwatch.lightning import GradWatchCallback
    >>> trainer = Trainer(callbacks=[GradWatchCallback(config={"fail_fast": True})])  # doctest: +SKIP
"""

from __future__ import annotations

from gradwatch.lightning.callback import (
    LIGHTNING_PACKAGE,
    LIGHTNING_VERSION,
    REPORT_NAME,
    GradWatchCallback,
)

__all__ = ["LIGHTNING_PACKAGE", "LIGHTNING_VERSION", "REPORT_NAME", "GradWatchCallback"]
