"""The evidence sources' registry: every ``needs`` name is served by exactly one source, an
unknown one is an error when the check is defined, and a run builds only what it needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.base import Check
from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.sources.registry import ALL_SOURCES, NEEDS


def test_an_unknown_needs_name_is_an_error_when_the_check_is_defined() -> None:
    with pytest.raises(TypeError, match="did you mean 'forward_runs'"):

        class Typo(Check):
            id = "typo"
            needs = frozenset({"forwrd_runs"})


def test_every_name_is_served_by_one_source_and_every_source_by_its_name() -> None:
    served = [n for cls in ALL_SOURCES for n in cls.serves]
    assert len(served) == len(set(served)) == len(NEEDS)
    assert len({cls.name for cls in ALL_SOURCES}) == len(ALL_SOURCES)
    for check in ALL_CHECKS:
        assert check.needs <= set(NEEDS), check.id


def test_a_run_builds_only_the_sources_its_enabled_checks_need() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    only_ghosts = {c.id: {"enabled": c.id == "ghost_param"} for c in ALL_CHECKS}
    with gradwatch.watch(model, opt, config={"checks": only_ghosts}) as w:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        built = {s.name for s in w._pipe.sources.sources}
    assert built == {cls.name for cls in ALL_SOURCES if cls.always}
