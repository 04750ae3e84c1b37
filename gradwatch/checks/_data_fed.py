"""Shared by the ``data_as_fed`` checks: their config and the step's record."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks.base import CheckConfig, severity_field
from gradwatch.checks.views import StepView
from gradwatch.sources.data_fed import DataFedRecord

__all__ = ["DataFedConfig", "fed_record", "first_layer"]


class DataFedConfig(CheckConfig):
    """Read on every one of the first ``scan_steps`` steps, then on a thinning sample."""

    severity: Severity = severity_field("warning")
    scan_steps: StrictInt = Field(
        default=16,
        ge=0,
        le=1_000_000,
        description="Optimizer steps whose batches are all read (per-sample prints and "
        "feature scales of the model's inputs); later steps are read at a thinning rate "
        "(every 2nd step up to 2 * scan_steps, every 4th up to 4 *, ...). 0: never read.",
    )


def fed_record(view: StepView) -> Optional[DataFedRecord]:
    rec = view.window.records.get("data_as_fed")
    return rec if isinstance(rec, DataFedRecord) else None


def first_layer(rec: DataFedRecord) -> tuple[Optional[list[str]], Optional[str]]:
    """The parameters and name of the first module with parameters that ran."""
    if rec.first is None:
        return None, None
    return (rec.first[1] or None), (rec.first[0] or None)
