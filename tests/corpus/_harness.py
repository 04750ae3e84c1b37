"""The clean corpus's harness (SPEC 8.1): run a correct program under ``watch()`` and the probes.

A program is a :class:`Program`: how to build it (fresh, seeded) and how its loop trains one
batch. :func:`run_program` trains it for a few steps under ``gradwatch.watch`` with the
default config (probes as the default runs them), then runs ``gradwatch.probe`` on its first
batch when the program gives a ``loss_fn``; :func:`assert_clean` fails listing every warning
or error either gave. A correct program must give none: the corpus is the list of designs
gradwatch must respect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

import gradwatch
from gradwatch import Finding, Report

#: ``step(models, optimizers, batch, step_index)``: the program's own training step, as its
#: loop is written (zero_grad, backward, step, clipping, scalers, schedulers, target nets).
Step = Callable[[Any, Any, Any, int], None]
#: ``loss_fn(model, batch) -> Tensor``, as for ``gradwatch.probe``; ``None``: no probe call.
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class Built:
    """One fresh instance of a program: what ``watch`` watches and what its loop needs."""

    models: Any  # a module, or a dict of named modules (a GAN: {"G": g, "D": d})
    optimizers: Any  # an optimizer, a sequence, a dict of named ones, or None
    batches: Sequence[Any]  # the batches of its loop, in order (a few steps' worth)
    step: Step
    loss_fn: Optional[LossFn] = None  # for gradwatch.probe on batches[0]
    probe_model: Optional[nn.Module] = None  # the module loss_fn takes (default: models)
    probe_optimizer: Optional[torch.optim.Optimizer] = None
    config: dict[str, Any] = field(default_factory=dict)  # a design's declared settings
    scaler: Any = None  # a GradScaler the loop uses, given to watch() as its docs say
    # More (models, optimizers) pairs, each under a watcher of its own, opened after the first
    # in this order: ``with watch(netD, optD), watch(netG, optG):``.
    watches: Sequence[tuple[Any, Any]] = ()


@dataclass(frozen=True)
class Program:
    """A correct training program of the corpus: its name, its family and how to build it."""

    name: str
    family: str
    build: Callable[[], Built]
    source: str = ""  # the paper or reference recipe it follows


def _config(extra: dict[str, Any]) -> gradwatch.GradWatchConfig:
    """The default config, with the preview checks at their own severity (``preview: true``):
    a preview check's false alarms are measured too, and listed as known until fixed."""
    return gradwatch.GradWatchConfig.coerce({"fail_on": "never", "preview": True, **extra})


def run_program(
    program: Program,
    *,
    seed: int = 0,
    config: Optional[dict[str, Any]] = None,
    probe: bool = True,
) -> list[Report]:
    """Train ``program`` under ``watch()``, then probe it: the reports, watch's first.

    ``config``: settings a runner adds over the design's own (``Built.config``), e.g. a
    slice of the corpus that leaves a costly probe to another pass. ``probe``: also run
    ``gradwatch.probe`` with the program's loss (the loss-free probes run inside ``watch()``
    either way).
    """
    torch.manual_seed(seed)
    built = program.build()
    cfg = _config({**built.config, **(config or {})})
    reports: list[Report] = []
    with ExitStack() as stack:
        watcher = stack.enter_context(
            gradwatch.watch(built.models, built.optimizers, config=cfg, scaler=built.scaler)
        )
        others = [stack.enter_context(gradwatch.watch(m, o, config=cfg)) for m, o in built.watches]
        for i, batch in enumerate(built.batches):
            built.step(built.models, built.optimizers, batch, i)
    reports.extend(w.report() for w in [watcher, *others])
    if probe and built.loss_fn is not None:
        model = built.probe_model if built.probe_model is not None else built.models
        reports.append(
            gradwatch.probe(
                model, built.batches[0], built.loss_fn, built.probe_optimizer, config=cfg
            )
        )
    return reports


def loud(reports: Iterable[Report]) -> list[Finding]:
    """The findings at warning or above: what a correct program must never get."""
    return [f for r in reports for f in r.findings if f.severity in ("warning", "error")]


def assert_clean(program: Program, reports: Iterable[Report]) -> None:
    """Fail naming each warning or error a correct program got, with its message."""
    bad = loud(reports)
    if bad:
        lines = [f"  {f.severity} {f.check}: {f.message} (params {f.params[:3]})" for f in bad]
        raise AssertionError(
            f"{program.name} ({program.family}) is correct, yet gradwatch said:\n"
            + "\n".join(lines)
        )


def known_false_alarms(path: Path) -> dict[str, set[str]]:
    """``program<TAB>check`` lines (``#`` comments): the false alarms a half of the corpus
    still finds (issue 50, open), so a new one fails and the list only shrinks."""
    out: dict[str, set[str]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                name, check = line.split("\t")[:2]
                out.setdefault(name, set()).add(check)
    return out


def assert_clean_but_known(program: Program, reports: Iterable[Report], known: set[str]) -> None:
    """:func:`assert_clean`, less the checks listed as this program's known false alarms."""
    if not known:
        assert_clean(program, reports)
        return
    new = [f for f in loud(reports) if f.check not in known]
    if new:
        lines = [f"  {f.severity} {f.check}: {f.message}" for f in new]
        raise AssertionError(
            f"{program.name}: false alarms beyond its known ones:\n" + "\n".join(lines)
        )
