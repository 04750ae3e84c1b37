"""The contract every registered check keeps, one parametrized test per clause.

Each check in :data:`gradwatch.checks.ALL_CHECKS` has a unique snake_case id that is its entry
in the config, typed by its own ``Config``; its default severity (its Config's ``severity``
default, written in its module only) is SPEC's; it is documented; ``enabled: false`` keeps it
from being built and a severity override reaches its findings; it is silent on clean realistic
training loops; and a buggy loop gives at most one finding per (check, layer). Real torch
training throughout, no mocks (the only stand-in is a spy that records which checks a watcher
builds).
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Any, Callable, get_args

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch._severity import Severity
from gradwatch.checks import ALL_CHECKS, Check
from gradwatch.checks.base import CheckConfig
from gradwatch.checks.docs import DOCS
from gradwatch.checks.explain import explain_text
from gradwatch.checks.registry import SELF_CHECKS
from gradwatch.config import ChecksConfig, GradWatchConfig

# SPEC.md §2 and §5: the stable ids and their default severities.
SPEC_SEVERITY = {
    "ghost_param": "error",
    "missing_zero_grad": "error",
    "step_without_grad": "error",
    "nonfinite_grad": "error",
    "exploding_grad": "warning",
    "vanishing_grad": "warning",
    "dead_param": "warning",
    "stale_param": "warning",
    "not_in_optimizer": "warning",
    "frozen_in_optimizer": "info",
    "loss_disconnected": "error",
    "double_update": "error",
    "unregistered_param": "error",
    "frozen_param_updated": "error",
    "clipped_while_scaled": "error",
    "not_observed": "error",
    # §6
    "nonfinite_param": "error",
    "eval_mode_training": "error",
    "frozen_stats_updated": "warning",
    "freeze_not_applied": "error",
    "autocast_bypassed": "warning",
    "clip_after_step": "error",
    "scheduler_misstepped": "warning",
    "double_backward": "error",
    "resume_mismatch": "error",
    "replica_divergence": "error",
}
# Every observed step, and gradwatch's own faults raised, so a broken check cannot hide.
CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise"}
OTHER = {"error": "warning", "warning": "error", "info": "warning"}  # an override != default

CHECKS = pytest.mark.parametrize("cls", ALL_CHECKS, ids=[c.id for c in ALL_CHECKS])


def _default(cls: type[Check]) -> str:
    default = cls.Config.model_fields["severity"].default
    assert isinstance(default, str)
    return default


def _batches(n: int, dim: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, dim, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    steps: int = 12,
    zero_grad: bool = True,
    config: dict[str, Any] | None = None,
) -> gradwatch.Report:
    """The ordinary loop (zero_grad, forward, backward, step) under ``gradwatch.watch``."""
    model.train()
    with gradwatch.watch(model, opt, config={**CFG, **(config or {})}) as w:
        for x, y in _batches(steps):
            if zero_grad:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )


class _NormNet(nn.Module):
    """BatchNorm, Dropout and LayerNorm: layers whose behaviour depends on ``training``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32, bias=False)  # a bias before BatchNorm would cancel out
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.1)
        self.hidden = nn.Linear(32, 32)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.inp(x))))
        return self.head(torch.relu(self.ln(self.hidden(h))))


class _Buggy(nn.Module):
    """One model, several bugs: each layer's finding must stay one finding as steps repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )
        self.aux = nn.Linear(8, 1)  # never called: ghost_param
        self.extra = nn.Linear(8, 1)  # used, left out of the optimizer: not_in_optimizer
        self.frozen = nn.Linear(8, 1).requires_grad_(False)  # in the optimizer: frozen_in_...
        self.blocks = [nn.Linear(8, 1)]  # a plain list: unregistered_param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.extra(x) + self.frozen(x) + self.blocks[0](x)


def _buggy_run(config: dict[str, Any] | None = None) -> gradwatch.Report:
    torch.manual_seed(0)
    model = _Buggy()
    body = model.body
    opt = torch.optim.AdamW(
        [
            {"params": [*body[0].parameters(), *body[2].parameters(), *model.aux.parameters()]},
            {"params": list(body[4].parameters()), "lr": 0.0},  # stale_param
            {"params": list(model.frozen.parameters())},
        ],
        lr=1e-3,
    )
    # No zero_grad (missing_zero_grad); a max_norm every layer exceeds (exploding_grad).
    cfg = {"checks": {"exploding_grad": {"max_norm": 1e-6}}}
    for check_id, settings in (config or {}).get("checks", {}).items():
        cfg["checks"].setdefault(check_id, {}).update(settings)
    return _train(model, opt, zero_grad=False, config=cfg)


# What the buggy loop must show, so the one-finding-per-layer test below is not vacuous.
BUGS = {
    "ghost_param",
    "missing_zero_grad",
    "exploding_grad",
    "stale_param",
    "not_in_optimizer",
    "frozen_in_optimizer",
    "unregistered_param",
}


@pytest.fixture(scope="module")
def clean_reports() -> list[gradwatch.Report]:
    torch.manual_seed(0)
    mlp = _mlp()
    torch.manual_seed(0)
    norm = _NormNet()
    return [
        _train(mlp, torch.optim.AdamW(mlp.parameters(), lr=1e-3)),
        _train(norm, torch.optim.AdamW(norm.parameters(), lr=1e-3)),
    ]


@pytest.fixture(scope="module")
def buggy_report() -> gradwatch.Report:
    return _buggy_run()


# -- identity and config ---------------------------------------------------------------------


def test_ids_are_unique_and_config_follows_the_registry() -> None:
    ids = [cls.id for cls in ALL_CHECKS]
    assert len(ids) == len(set(ids))
    assert list(ChecksConfig.model_fields) == ids
    assert set(SPEC_SEVERITY) <= set(ids), "a check of SPEC §2/§5 is not registered"


@CHECKS
def test_id_is_a_config_entry_of_its_own_model(cls: type[Check]) -> None:
    assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", cls.id), cls.id
    field = ChecksConfig.model_fields[cls.id]
    assert field.annotation is cls.Config
    assert cls.Config is not CheckConfig and issubclass(cls.Config, CheckConfig)
    entry = GradWatchConfig().check(cls.id)
    assert type(entry) is cls.Config and entry == cls.Config()


@CHECKS
def test_default_severity_is_written_once_and_is_specs(cls: type[Check]) -> None:
    default = _default(cls)
    assert default in get_args(Severity)
    assert default == SPEC_SEVERITY.get(cls.id), f"{cls.id}: not SPEC's default severity"
    assert cls.default_severity() == default
    # Its module's Config states it; its doc does not repeat it (explain reads the Config).
    assert "severity" in inspect.get_annotations(cls.Config)
    assert cls.doc is not None and cls.doc.severity is None


# -- docs ------------------------------------------------------------------------------------


@CHECKS
def test_documented_in_its_module(cls: type[Check]) -> None:
    doc = cls.doc
    assert doc is not None, f"{cls.id} has no doc"
    assert cls.id not in DOCS, "a registered check's text lives in its module, not in DOCS"
    assert doc.summary.strip() and doc.why.strip() and doc.fix.strip()
    assert doc.causes and all(c.strip() for c in doc.causes)
    text = explain_text(cls.id)
    assert text and text.startswith(f"{cls.id} (default severity: {_default(cls)})\n")


def test_gradwatchs_own_checks_document_themselves_too() -> None:
    for cls in SELF_CHECKS:
        assert cls.doc is not None and cls.doc.severity is None, cls.id
        assert cls.id not in DOCS and cls.id not in ChecksConfig.model_fields
        text = explain_text(cls.id)
        assert text and text.startswith(f"{cls.id} (default severity: {_default(cls)})\n")


def test_ids_without_a_check_class_keep_their_severity_in_docs() -> None:
    registered = {cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS]}
    for check_id, doc in DOCS.items():
        assert check_id not in registered
        assert doc.severity in get_args(Severity), check_id
        assert (explain_text(check_id) or "").startswith(f"{check_id} (default severity: ")


# -- configurable ----------------------------------------------------------------------------


def _built_checks(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> dict[str, Check]:
    """The checks a watcher builds with ``config`` (a spy on each class's ``__init__``)."""
    built: dict[str, Check] = {}
    for cls in ALL_CHECKS:
        original = cls.__init__

        def spy(self: Check, *args: Any, _init: Callable[..., None] = original, **kw: Any) -> None:
            built[self.id] = self
            _init(self, *args, **kw)

        monkeypatch.setattr(cls, "__init__", spy)
    torch.manual_seed(0)
    model = _mlp()
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps=2, config=config)
    return built


@CHECKS
def test_enabled_false_keeps_it_from_being_built(
    cls: type[Check], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cls.id in _built_checks(monkeypatch, {})
    off = _built_checks(monkeypatch, {"checks": {cls.id: {"enabled": False}}})
    assert cls.id not in off
    assert set(off) == {c.id for c in ALL_CHECKS} - {cls.id}


@CHECKS
def test_severity_override_reaches_the_check(
    cls: type[Check], monkeypatch: pytest.MonkeyPatch
) -> None:
    other = OTHER[_default(cls)]
    built = _built_checks(monkeypatch, {"checks": {cls.id: {"severity": other}}})
    assert built[cls.id].severity == other
    assert all(c.severity == type(c).default_severity() for i, c in built.items() if i != cls.id)


def test_config_applies_to_findings(buggy_report: gradwatch.Report) -> None:
    """A severity override is the severity of the findings; enabled: false removes them."""
    defaults = {cls.id: _default(cls) for cls in ALL_CHECKS}
    for check_id in BUGS:  # none of these bugs is a case with a severity of its own
        assert {f.severity for f in buggy_report.by_check(check_id)} == {defaults[check_id]}
    overridden = _buggy_run({"checks": {i: {"severity": OTHER[defaults[i]]} for i in BUGS}})
    for check_id in BUGS:
        severities = {f.severity for f in overridden.by_check(check_id)}
        assert severities == {OTHER[defaults[check_id]]}, check_id
    off = _buggy_run({"checks": {i: {"enabled": False} for i in BUGS}})
    assert not {f.check for f in off.findings} & BUGS


# -- silent on clean training, one finding per layer -----------------------------------------


@CHECKS
def test_silent_on_clean_training(cls: type[Check], clean_reports: list[gradwatch.Report]) -> None:
    for report in clean_reports:
        assert report.steps == 12
        assert [f.line() for f in report.by_check(cls.id)] == []


def test_the_buggy_loop_shows_its_bugs(buggy_report: gradwatch.Report) -> None:
    fired = {f.check for f in buggy_report.findings}
    assert fired >= BUGS, BUGS - fired
    assert any(f.count > 1 for f in buggy_report.findings), "no finding recurred"


@CHECKS
def test_one_finding_per_check_and_layer(cls: type[Check], buggy_report: gradwatch.Report) -> None:
    keys = Counter(
        (f.check, f.module or tuple(f.params) or f.details.get("reason"))
        for f in buggy_report.by_check(cls.id)
    )
    assert [k for k, n in keys.items() if n > 1] == []
