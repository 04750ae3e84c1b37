"""What the ``loss_graph`` rules share: their scan setting, the step's record, module names."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, StrictInt

from gradwatch.capture.loss.graph_walk import GraphDesc, Mark
from gradwatch.checks.base import CheckConfig
from gradwatch.checks.views import StepView
from gradwatch.sources.loss_graph import LossGraphRecord

__all__ = ["ScanConfig", "graph_record", "named", "scan_field"]


def scan_field() -> Any:
    return Field(
        default=8,
        ge=0,
        le=1_000_000,
        description="Optimizer steps during which the graph of each backward is described "
        "(node kinds and shapes, which module produced them; bounded by node count). "
        "0: never scan.",
    )


class ScanConfig(CheckConfig):
    """A rule over the loss's graph, read on the first ``scan_steps`` steps."""

    scan_steps: StrictInt = scan_field()


def graph_record(view: StepView) -> Optional[LossGraphRecord]:
    """The step's ``loss_graph`` record (scan steps only)."""
    rec = view.window.records.get("loss_graph")
    return rec if isinstance(rec, LossGraphRecord) else None


def named(mark: Optional[Mark]) -> Optional[str]:
    """A module as a finding names it: its path, or the model's class for the model itself."""
    if mark is None:
        return None
    return mark.module or mark.cls


def describe_producer(g: GraphDesc, i: int) -> str:
    """Where node ``i``'s value comes from, for a message."""
    mark = g.producer(i)
    if mark is not None:
        return f"the output of {mark.cls} '{named(mark)}'"
    return "a value computed outside the model's modules (in the loss code)"
