"""Hugging Face ``transformers.Trainer`` integration: every gradwatch check, as one callback.

Importing this package needs ``transformers`` (``pip install gradwatch[hf]``, which also
installs ``accelerate``). ``import gradwatch`` itself never imports it.

Example:
    >>> from gradwatch.transformers import GradWatchCallback
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[GradWatchCallback()])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

from gradwatch.transformers.callback import REPORT_NAME, GradWatchCallback

__all__ = ["REPORT_NAME", "GradWatchCallback"]
