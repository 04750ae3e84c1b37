"""Helpers for a project's own tests: one-line assertions over a few watched training steps.

Example:
    >>> from gradwatch.testing import assert_no_ghosts
    >>> def test_every_layer_trains():  # doctest: +SKIP
    ...     assert_no_ghosts(MyNet(), (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from gradwatch.checks.ghost import GhostParam
from gradwatch.cli.probe import ConfigArg, LossFn, Probe, resolve_config
from gradwatch.render.junit import finding_text
from gradwatch.report import Report

__all__ = ["assert_no_ghosts"]


def assert_no_ghosts(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    steps: int = 2,
    config: ConfigArg = None,
    ignore: Iterable[str] = (),
) -> Report:
    """Run ``steps`` training steps and fail when a trainable parameter got no gradient.

    Args:
        model: the module under test.
        batch: one batch, or an iterable of batches (as :class:`~gradwatch.Probe` takes).
        loss_fn: ``loss_fn(model, batch) -> Tensor``.
        optimizer: stepped each step; ``None`` means ``SGD(trainable parameters, lr=1e-2)``.
        steps: training steps to run (two tell a permanent ghost from a first-step effect).
        config: a config, dict or path (its ``ignore`` allowlist applies).
        ignore: more fnmatch patterns over parameter names that may stay without gradient.

    Returns:
        The :class:`~gradwatch.Report`, for further assertions.

    Raises:
        AssertionError: listing each ghost layer: parameter names, cause and hint.
        gradwatch.cli.probe.ProbeError: when ``loss_fn``, ``backward`` or the optimizer fails.

    Example:
        >>> assert_no_ghosts(model, (x, y), loss_fn, ignore=["aux_head.*"])  # doctest: +SKIP
    """
    probe = Probe(model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer)
    report = probe.run(steps, config=resolve_config(config, ignore=ignore, warn=False))
    ghosts = report.by_check(GhostParam.id)
    if ghosts:
        names = sum(len(f.params) for f in ghosts)
        body = "\n".join("- " + finding_text(f).replace("\n", "\n  ") for f in ghosts)
        raise AssertionError(
            f"{names} trainable parameter(s) in {len(ghosts)} layer(s) got no gradient "
            f"in {report.steps} step(s):\n{body}"
        )
    return report
