"""The contract every registered check keeps, one parametrized test per clause.

Every expectation comes from the registry (:data:`gradwatch.checks.registry.ALL_CHECKS` and
``SELF_CHECKS``: each class's ``id``, ``Config``, ``default_severity()``, ``doc``, ``needs``
and ``facts``) or from SPEC.md, the contract, whose tables of check ids and default
severities are parsed here (``../shared/SPEC.md`` from the repository root, as in CI). Each
check has a unique snake_case id that is its entry in the config, typed by its own
``Config``; its default severity (its Config's ``severity`` default, written in its module
only) is SPEC's; it is documented; the evidence it needs is what it asks the run for and
what a source serves, and each kind of fact has one check to judge it; ``enabled: false``
keeps it from being built and a severity override reaches its findings; it is silent on
clean realistic training loops; and a buggy loop gives at most one finding per (check,
layer). Real torch training throughout, no mocks (the only stand-in is a spy that records
which checks a watcher builds).
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, get_args

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch._severity import Maturity, Severity
from gradwatch.capture import facts as fact_kinds
from gradwatch.checks import ALL_CHECKS, Check
from gradwatch.checks.base import CheckConfig
from gradwatch.checks.docs import DOCS
from gradwatch.checks.explain import explain_text
from gradwatch.checks.registry import SELF_CHECKS
from gradwatch.config import ChecksConfig, GradWatchConfig
from gradwatch.sources.registry import NEEDS

SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "SPEC.md"
# SPEC sections whose checks are being built this round: their ids are judged once
# registered, and may be missing until then.
BEING_BUILT: frozenset[str] = frozenset()
# Every observed step, and gradwatch's own faults raised, so a broken check cannot hide.
CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise"}
OTHER = {"error": "warning", "warning": "error", "info": "warning"}  # an override != default

CHECKS = pytest.mark.parametrize("cls", ALL_CHECKS, ids=[c.id for c in ALL_CHECKS])
EVERY_CHECK = pytest.mark.parametrize(
    "cls", [*ALL_CHECKS, *SELF_CHECKS], ids=[c.id for c in [*ALL_CHECKS, *SELF_CHECKS]]
)
SNAKE = r"[a-z][a-z0-9]*(_[a-z0-9]+)*"
_SECTION = re.compile(r"##\s+(\d+)\.")
_TABLE_HEAD = ["id", "fires when", "default severity"]
# Section 8.2's table of properties: ``| id | the property ... | measured by | default severity |``
_PROPERTY_HEAD = ("id", "default severity")


def spec_checks(text: str) -> dict[str, tuple[str, str]]:
    """``{id: (section, default severity)}`` from SPEC's tables of checks.

    A table of checks is one whose header is ``| id | fires when | default severity |``
    (or, section 8.2's, starts with ``id`` and ends with ``default severity``); the section is
    the number of the ``## N.`` heading above it.
    """
    out: dict[str, tuple[str, str]] = {}
    section, in_table = "", False
    for line in text.splitlines():
        heading = _SECTION.match(line)
        if heading:
            section = heading.group(1)
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells == _TABLE_HEAD or (cells[0], cells[-1]) == _PROPERTY_HEAD:
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            check_id = cells[0].strip("`")
            ids = [check_id]
            if not re.fullmatch(SNAKE, check_id):
                # a row that names a source and its checks (section 8.2's ``data_as_fed``
                # (source) with `a`, `b`): the checks are the names after "with"
                _, _, checks = cells[0].partition(" with ")
                ids = re.findall(r"`([a-z][a-z0-9_]*)`", checks)
            for one in ids:
                assert one not in out, f"SPEC lists {one} twice"
                out[one] = (section, cells[-1])
    return out


@pytest.fixture(scope="module")
def spec() -> dict[str, tuple[str, str]]:
    if not SPEC.is_file():
        pytest.fail(f"the contract is SPEC.md, and it is not at {SPEC} (CI checks out ../shared)")
    found = spec_checks(SPEC.read_text(encoding="utf-8"))
    assert found, f"no table of checks in {SPEC}"
    return found


def _config_default(cls: type[Check]) -> str:
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
    groups: list[dict[str, Any]] = [
        {"params": [*body[0].parameters(), *body[2].parameters(), *model.aux.parameters()]},
        {"params": list(body[4].parameters()), "lr": 0.0},  # stale_param
        {"params": list(model.frozen.parameters())},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)
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
    assert not {cls.id for cls in SELF_CHECKS} & set(ids)


def test_specs_checks_are_registered(spec: dict[str, tuple[str, str]]) -> None:
    assert {severity for _, severity in spec.values()} <= set(get_args(Severity))
    registered = {cls.id for cls in ALL_CHECKS}
    missing = sorted(
        f"{check_id} (§{section})"
        for check_id, (section, _) in spec.items()
        if check_id not in registered and section not in BEING_BUILT
    )
    assert not missing, f"checks of SPEC.md that are not registered: {missing}"
    for built in BEING_BUILT:
        ids = {check_id for check_id, (section, _) in spec.items() if section == built}
        assert ids - registered, f"every check of SPEC §{built} is registered: not BEING_BUILT"


@CHECKS
def test_id_is_a_config_entry_of_its_own_model(cls: type[Check]) -> None:
    assert re.fullmatch(SNAKE, cls.id), cls.id
    field = ChecksConfig.model_fields[cls.id]
    assert field.annotation is cls.Config
    assert cls.Config is not CheckConfig and issubclass(cls.Config, CheckConfig)
    entry = GradWatchConfig().check(cls.id)
    assert type(entry) is cls.Config and entry == cls.Config()


@CHECKS
def test_default_severity_is_written_once_and_is_specs(
    cls: type[Check], spec: dict[str, tuple[str, str]]
) -> None:
    default = cls.default_severity()
    assert default == _config_default(cls) and default in get_args(Severity)
    assert cls.id in spec, f"{cls.id} is in no table of checks of SPEC.md"
    section, specs = spec[cls.id]
    assert default == specs, f"{cls.id}: default severity {default}, SPEC §{section}: {specs}"
    # Its module's Config states it; its doc does not repeat it (explain reads the Config).
    assert "severity" in inspect.get_annotations(cls.Config)
    assert cls.doc is not None and cls.doc.severity is None


@EVERY_CHECK
def test_states_its_maturity_in_its_own_class(cls: type[Check]) -> None:
    """SPEC 8.1: ``stable`` or ``preview``, a decision written in the check's class body
    (never inherited from ``Check``), and said by ``gradwatch explain``."""
    assert "maturity" in vars(cls), f'{cls.id}: add `maturity = "stable"` (or preview)'
    assert cls.maturity in get_args(Maturity), cls.maturity
    assert f"Maturity: {cls.maturity}." in (explain_text(cls.id) or "")


# -- docs ------------------------------------------------------------------------------------


@CHECKS
def test_documented_in_its_module(cls: type[Check]) -> None:
    doc = cls.doc
    assert doc is not None, f"{cls.id} has no doc"
    assert cls.id not in DOCS, "a registered check's text lives in its module, not in DOCS"
    assert doc.summary.strip() and doc.why.strip() and doc.fix.strip()
    assert doc.causes and all(c.strip() for c in doc.causes)
    text = explain_text(cls.id)
    assert text and text.startswith(f"{cls.id} (default severity: {cls.default_severity()})\n")


def test_gradwatchs_own_checks_document_themselves_too() -> None:
    for cls in SELF_CHECKS:
        assert cls.doc is not None and cls.doc.severity is None, cls.id
        assert cls.id not in DOCS and cls.id not in ChecksConfig.model_fields
        text = explain_text(cls.id)
        assert text and text.startswith(f"{cls.id} (default severity: {cls.default_severity()})\n")


def test_ids_without_a_check_class_keep_their_severity_in_docs() -> None:
    registered = {cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS]}
    for check_id, doc in DOCS.items():
        assert check_id not in registered
        assert doc.severity in get_args(Severity), check_id
        assert (explain_text(check_id) or "").startswith(f"{check_id} (default severity: ")


# -- evidence and facts ----------------------------------------------------------------------


@EVERY_CHECK
def test_asks_the_run_for_the_evidence_it_needs(cls: type[Check]) -> None:
    """What ``needs`` names, ``evidence()`` asks for (each with its setting), and a source
    serves (:data:`gradwatch.sources.registry.NEEDS`)."""
    assert isinstance(cls.needs, frozenset)
    assert all(isinstance(n, str) and re.fullmatch(SNAKE, n) for n in cls.needs), cls.needs
    asked = set(cls(cls.Config(), GradWatchConfig()).evidence())
    assert set(cls.needs) <= asked, f"{cls.id} needs {sorted(cls.needs - asked)}"
    assert asked <= set(NEEDS), f"{cls.id} asks for {sorted(asked - set(NEEDS))}: no source"


def test_each_kind_of_fact_has_one_check_to_judge_it() -> None:
    """A fact no check declares is lost; one that two checks declare is two findings."""
    kinds = {
        value
        for value in (getattr(fact_kinds, name) for name in fact_kinds.__all__)
        if isinstance(value, str)
    }
    judges = Counter(kind for cls in [*ALL_CHECKS, *SELF_CHECKS] for kind in cls.facts)
    assert set(judges) <= kinds, f"facts no lower layer records: {sorted(set(judges) - kinds)}"
    assert {kind: judges[kind] for kind in kinds if judges[kind] != 1} == {}


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
    other = OTHER[cls.default_severity()]
    built = _built_checks(monkeypatch, {"checks": {cls.id: {"severity": other}}})
    assert built[cls.id].severity == other
    assert all(c.severity == type(c).default_severity() for i, c in built.items() if i != cls.id)


def test_config_applies_to_findings(buggy_report: gradwatch.Report) -> None:
    """A severity override is the severity of the findings; enabled: false removes them."""
    defaults = {cls.id: cls.default_severity() for cls in ALL_CHECKS}
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
