"""The registry: every evidence source, and the ``Check.needs`` names they serve.

Adding a source touches its module and :data:`ALL_SOURCES`. A ``needs`` name no source
serves is an error when the check's class is defined (:func:`unknown_needs`, called from
``Check.__init_subclass__``), and a setting a check's ``evidence()`` asks for under an
unknown name is one when the run starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from gradwatch.sources.adam_moments import AdamMomentsSource
from gradwatch.sources.arrivals import ArrivalSource
from gradwatch.sources.autocast import AutocastSource
from gradwatch.sources.backward_probe import BackwardProbeSource
from gradwatch.sources.base import EvidenceSource
from gradwatch.sources.built import BuiltSource
from gradwatch.sources.calls import BackwardCallsSource
from gradwatch.sources.clips import ClipSource
from gradwatch.sources.data_fed import DataFedSource
from gradwatch.sources.discarded import DiscardedSource
from gradwatch.sources.eval_forward import EvalForwardSource
from gradwatch.sources.forward import ForwardSource
from gradwatch.sources.loss import LossSource
from gradwatch.sources.loss_domain import LossDomainSource
from gradwatch.sources.loss_graph import LossGraphSource
from gradwatch.sources.modes import ModesSource
from gradwatch.sources.replicas import ReplicaSource
from gradwatch.sources.resume import ResumeSource
from gradwatch.sources.samples import SamplesSource
from gradwatch.sources.schedulers import SchedulerSource
from gradwatch.sources.state_calls import StateCallsSource
from gradwatch.sources.unscale import UnscaleSource
from gradwatch.sources.weight_rows import WeightRowsSource
from gradwatch.sources.zero_grad import ZeroGradSource

__all__ = ["ALL_SOURCES", "NEEDS", "unknown_needs"]

# In the order the run installs and reads them: the forward's scout first (other sources
# link to it), the arrivals (every check's) last.
ALL_SOURCES: list[type[EvidenceSource]] = [
    ForwardSource,
    ModesSource,
    AutocastSource,
    LossSource,
    LossGraphSource,
    LossDomainSource,
    EvalForwardSource,
    DataFedSource,
    BackwardProbeSource,
    UnscaleSource,
    ZeroGradSource,
    SchedulerSource,
    StateCallsSource,
    DiscardedSource,
    BackwardCallsSource,
    ResumeSource,
    ReplicaSource,
    BuiltSource,
    WeightRowsSource,
    AdamMomentsSource,
    ClipSource,
    ArrivalSource,
    SamplesSource,
]


def _needs() -> dict[str, type[EvidenceSource]]:
    out: dict[str, type[EvidenceSource]] = {}
    names: set[str] = set()
    for cls in ALL_SOURCES:
        if cls.name in names:
            raise TypeError(f"two evidence sources are named {cls.name!r}")
        names.add(cls.name)
        for need in cls.serves:
            if need in out:
                raise TypeError(f"{need!r} is served by {out[need].__name__} and {cls.__name__}")
            out[need] = cls
    return out


#: ``needs`` name -> the source that serves it.
NEEDS: dict[str, type[EvidenceSource]] = _needs()


def unknown_needs(names: Iterable[str], owner: str) -> None:
    """Raise ``TypeError`` naming ``owner`` for a name no source serves (with the closest)."""
    for name in names:
        if name not in NEEDS:
            close = difflib.get_close_matches(name, list(NEEDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{owner} needs {name!r}, which no evidence source serves{hint}; "
                f"known: {', '.join(sorted(NEEDS))}"
            )
