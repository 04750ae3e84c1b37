"""PyTorch Lightning integration: one callback gives every gradwatch check.

Importing this package needs ``lightning`` or ``pytorch_lightning`` (``pip install
gradwatch[lightning]`` installs the latter). With both installed, the callback is a
``Callback`` of both, so either package's Trainer and LightningCLI accept it.
``import gradwatch`` itself never imports Lightning.

Example:
    >>> from gradwatch.lightning import GradWatchCallback
    >>> trainer = Trainer(callbacks=[GradWatchCallback(config={"fail_fast": True})])  # doctest: +SKIP
"""

from __future__ import annotations

from gradwatch.lightning.callback import (
    LIGHTNING_PACKAGE,
    LIGHTNING_PACKAGES,
    LIGHTNING_VERSION,
    REPORT_NAME,
    GradWatchCallback,
)

__all__ = [
    "LIGHTNING_PACKAGE",
    "LIGHTNING_PACKAGES",
    "LIGHTNING_VERSION",
    "REPORT_NAME",
    "GradWatchCallback",
]
