"""``Probe``: a model, a batch and a loss, bundled so that CI can run a few watched steps.

``gradwatch check path/to/file.py:build`` imports ``build``, calls it, and gets a
:class:`Probe`; :func:`gradwatch.testing.assert_no_ghosts` builds one from its arguments.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import gradwatch
    >>> model = nn.Linear(4, 1)
    >>> probe = gradwatch.Probe(
    ...     model=model,
    ...     batch=(torch.randn(8, 4), torch.randn(8, 1)),
    ...     loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    ... )
    >>> probe.run(steps=2).failed
    False
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from gradwatch._severity import at_least
from gradwatch.config import GradWatchConfig
from gradwatch.core.watcher import watch
from gradwatch.errors import ConfigError, GradWatchError
from gradwatch.report import Curvature, Finding, Report

__all__ = [
    "LOSS_NOT_DECREASING",
    "Probe",
    "ProbeError",
    "add_finding",
    "loss_not_decreasing",
    "resolve_config",
]

LOSS_NOT_DECREASING = "loss_not_decreasing"

ConfigArg = Union[GradWatchConfig, dict[str, Any], str, Path, None]
LossFn = Callable[[nn.Module, Any], torch.Tensor]

# Containers that are one batch (``(x, y)``, ``[x, y]`` as the default collate makes,
# ``{"input_ids": ...}``), never a sequence of batches.
_ONE_BATCH = (torch.Tensor, tuple, list, Mapping, str, bytes)


class ProbeError(ConfigError):
    """The probe's own code failed (``loss_fn``, ``backward``, the optimizer) or a field is wrong.

    The message is one line naming the phase and step; the original exception is chained.
    """


@dataclass
class Probe:
    """What ``gradwatch check`` runs: a model, its data, its loss, optionally its optimizer.

    Attributes:
        model: the module to train.
        batch: one batch (a tensor, tuple, list or dict, passed to ``loss_fn`` as is) or a
            source of batches (a ``DataLoader``, a generator, any other iterable). Batches are
            drawn in order and cycled when the source runs out. To give a list of batches,
            pass ``iter(batches)``: a list is one batch.
        loss_fn: ``loss_fn(model, batch) -> Tensor``, a scalar loss.
        optimizer: the optimizer to step; ``None`` means
            ``torch.optim.SGD(trainable parameters, lr=1e-2)``.
        config: a :class:`~gradwatch.GradWatchConfig`, a dict or a path; ``None`` for defaults.

    Example:
        >>> def build() -> gradwatch.Probe:  # doctest: +SKIP
        ...     model = MyNet()
        ...     return gradwatch.Probe(model, (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    """

    model: nn.Module
    batch: Any
    loss_fn: LossFn
    optimizer: Optional[torch.optim.Optimizer] = None
    config: ConfigArg = None
    _cache: list[Any] = field(default_factory=list, init=False, repr=False)
    _source: Optional[Iterator[Any]] = field(default=None, init=False, repr=False)
    _own_optimizer: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ProbeError(
                f"Probe.model must be a torch.nn.Module, not {type(self.model).__name__}"
            )
        if not callable(self.loss_fn):
            raise ProbeError(
                f"Probe.loss_fn must be callable as loss_fn(model, batch), "
                f"not {type(self.loss_fn).__name__}"
            )
        if self.batch is None:
            raise ProbeError("Probe.batch is None: give one batch or an iterable of batches")
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if not params:
                raise ProbeError(
                    f"Probe.model ({type(self.model).__name__}) has no trainable parameters"
                )
            self.optimizer = torch.optim.SGD(params, lr=1e-2)
            self._own_optimizer = False  # the probes then use their own default, not this
        elif not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ProbeError(
                f"Probe.optimizer must be a torch.optim.Optimizer or None, "
                f"not {type(self.optimizer).__name__}"
            )

    # -- data ------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """Batches forever: the one batch repeated, or the source's batches, cycled."""
        if isinstance(self.batch, _ONE_BATCH) or not isinstance(self.batch, Iterable):
            return itertools.repeat(self.batch)
        return self._cycled()

    def _cycled(self) -> Iterator[Any]:
        yield from self._cache
        if self._source is None:
            self._source = iter(self.batch)
        for b in self._source:
            self._cache.append(b)
            yield b
        if not self._cache:
            raise ProbeError("Probe.batch is an empty iterable: it yielded no batch")
        while True:
            yield from self._cache

    def first_batch(self) -> Any:
        """The first batch (what ``--overfit`` trains on)."""
        return next(self.batches())

    # -- running ---------------------------------------------------------------------------

    def step(self, batch: Any, step: int) -> float:
        """One ordinary training step (zero_grad, loss, backward, step); returns the loss.

        Raises:
            ProbeError: when ``loss_fn``, ``backward`` or the optimizer fails, or the loss
                is not a scalar tensor.
        """
        opt = self.optimizer
        assert opt is not None
        opt.zero_grad()
        loss = _call(f"loss_fn failed at step {step}", self.loss_fn, self.model, batch)
        if not isinstance(loss, torch.Tensor):
            raise ProbeError(f"loss_fn returned {type(loss).__name__}, not a scalar torch.Tensor")
        if loss.numel() != 1:
            raise ProbeError(
                f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar"
            )
        if not loss.requires_grad:
            raise ProbeError(
                "loss_fn returned a tensor that does not require grad (computed under "
                "torch.no_grad, or detached from the model)"
            )
        _call(f"loss.backward() failed at step {step}", loss.backward)
        _call(f"optimizer.step() failed at step {step}", opt.step)
        return float(loss.detach())

    def run(self, steps: int = 3, *, config: ConfigArg = None) -> Report:
        """Run ``steps`` training steps under :func:`gradwatch.watch` and return the report.

        Args:
            steps: optimizer steps to run.
            config: overrides ``self.config`` when given (see :func:`resolve_config`).

        Raises:
            ProbeError: the probe's own code failed (the message names phase and step).
            ConfigError: a bad config.
        """
        if steps < 1:
            raise ProbeError(f"steps must be at least 1, got {steps}")
        cfg = GradWatchConfig.coerce(config if config is not None else self.config)
        self.model.train()
        with watch(self.model, self.optimizer, config=cfg) as watcher:
            try:
                for k, batch in zip(range(steps), self.batches()):
                    self.step(batch, k)
            except ConfigError:
                raise
            except GradWatchError:
                # fail_fast stopped the loop at a finding: the report holds it.
                pass
        return watcher.report()

    def probes(self, config: ConfigArg = None) -> Report:
        """Run the probes (:func:`gradwatch.probe`) on copies of the model, on the first batch,
        with the user's optimizer (``None`` when the Probe made its default one)."""
        from gradwatch.probes import probe

        cfg = GradWatchConfig.coerce(config if config is not None else self.config)
        opt = self.optimizer if self._own_optimizer else None
        return probe(self.model, self.first_batch(), self.loss_fn, opt, config=cfg)

    def curvature(self, *, samples: int = 16, seed: int = 0) -> Curvature:
        """Per-layer curvature of the loss on the first batch (:func:`gradwatch.sensitivity`).

        Raises:
            SensitivityError: one line when the loss or model does not support double
                backward (it is a :class:`~gradwatch.ConfigError`).
        """
        from gradwatch.vectors.sensitivity import sensitivity

        return sensitivity(self.model, self.first_batch(), self.loss_fn, samples=samples, seed=seed)

    def overfit(self, steps: int = 30) -> list[float]:
        """Train on the first batch only for ``steps`` steps; the loss before each update.

        A healthy model and optimizer drive the loss of one repeated batch down; see
        :func:`loss_not_decreasing`.
        """
        batch = self.first_batch()
        self.model.train()
        return [self.step(batch, k) for k in range(steps)]


def _call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except (GradWatchError, ProbeError):
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ProbeError(f"{what}: {type(exc).__name__}" + (f": {text}" if text else "")) from exc
    except SystemExit as exc:  # sys.exit(0) in a loss_fn is a bug, never a finished run
        raise ProbeError(f"{what}: it called sys.exit({exc.code!r})") from exc


def loss_not_decreasing(losses: list[float], *, ratio: float = 0.9) -> Optional[Finding]:
    """A ``loss_not_decreasing`` warning when overfitting one batch did not lower the loss.

    It fires when the last loss is not finite, or is above ``ratio`` of the first (for a
    positive first loss; in general when it fell by less than ``1 - ratio`` of ``|first|``).

    Example:
        >>> loss_not_decreasing([1.0, 0.5, 0.2]) is None
        True
        >>> loss_not_decreasing([1.0, 0.99, 0.98]).check
        'loss_not_decreasing'
    """
    if len(losses) < 2:
        return None
    first, last = losses[0], losses[-1]
    if math.isfinite(first) and math.isfinite(last):
        if first == 0.0 or last <= first - (1.0 - ratio) * abs(first):
            return None
    return Finding(
        check=LOSS_NOT_DECREASING,
        severity="warning",
        message=f"overfitting one batch for {len(losses)} steps took the loss from {first:.4g} "
        f"to {last:.4g} (needs {last:.4g} <= {ratio:g} x {first:.4g}).",
        hint="A model that cannot fit a single batch has a bug: check the learning rate, "
        "that the loss uses the model's output, detached tensors, frozen or ghost layers, "
        "and the labels.",
        first_step=0,
        last_step=len(losses) - 1,
        count=1,
        details={"initial_loss": first, "final_loss": last, "ratio": ratio, "steps": len(losses)},
    )


def add_finding(report: Report, finding: Finding) -> Report:
    """Append ``finding`` to ``report`` and recompute ``failed`` (in place; returns it)."""
    report.findings.append(finding)
    report.failed = any(at_least(f.severity, report.fail_on) for f in report.findings)
    return report


def resolve_config(
    config: ConfigArg,
    *,
    ignore: Iterable[str] = (),
    fail_on: Optional[str] = None,
    every_n_steps: Optional[int] = 1,
    warn: Optional[bool] = None,
    select: Optional[Iterable[str]] = None,
    ignore_checks: Iterable[str] = (),
) -> GradWatchConfig:
    """The config a CI run uses: ``config`` plus extra ``ignore`` patterns and ``fail_on``.

    ``every_n_steps`` and ``warn`` replace the config's values only when the config did not
    set them (CI runs a handful of steps, so statistics are taken on every one; where the
    report is the output, one warning per finding is noise).

    ``select`` (check ids) replaces the config's ``enabled`` flags: exactly those checks run,
    even one the config turns off; ``ignore_checks`` turns checks off on top of the config or
    the selection (an id in both is off). Their thresholds and severities stay the config's.
    Ids that are no config entry (gradwatch's own checks, always on) change nothing.

    Example:
        >>> resolve_config({"ignore": ["a.*"]}, ignore=["b.*"], fail_on="warning").ignore
        ['a.*', 'b.*']
        >>> ids = ["ghost_param", "stale_param"]
        >>> cfg = resolve_config(None, select=ids, ignore_checks=ids[1:])
        >>> [k for k in type(cfg.checks).model_fields if cfg.check(k).enabled]
        ['ghost_param']
    """
    cfg = GradWatchConfig.coerce(config)
    update: dict[str, Any] = {}
    switches = _switches(cfg, None if select is None else set(select), set(ignore_checks))
    if switches:
        checks = cfg.checks.model_dump(exclude_unset=True)
        for check_id, on in switches.items():
            checks[check_id] = {**checks.get(check_id, {}), "enabled": on}
        update["checks"] = checks
    extra = [p for p in ignore if p not in cfg.ignore]
    if extra:
        update["ignore"] = [*cfg.ignore, *extra]
    if fail_on is not None:
        update["fail_on"] = fail_on
    if every_n_steps is not None and "every_n_steps" not in cfg.model_fields_set:
        update["every_n_steps"] = every_n_steps
    if warn is not None and "warn" not in cfg.model_fields_set:
        update["warn"] = warn
    if not update:
        return cfg
    data = cfg.model_dump(exclude_unset=True)
    data.update(update)
    return GradWatchConfig.coerce(data)


def _switches(
    cfg: GradWatchConfig, select: Optional[set[str]], ignore: set[str]
) -> dict[str, bool]:
    """The ``enabled`` flags that ``select`` and ``ignore`` change in ``cfg``."""
    if select is None and not ignore:
        return {}
    out = {}
    for check_id in type(cfg.checks).model_fields:
        on = (select is None or check_id in select) and check_id not in ignore
        if select is not None or not on:  # a bare --ignore-check leaves the others as set
            if cfg.check(check_id).enabled != on:
                out[check_id] = on
    return out
