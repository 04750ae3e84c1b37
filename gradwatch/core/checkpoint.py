"""A watcher's checkpoint state: findings so far and step counters, as plain data.

:meth:`~gradwatch.Watcher.state_dict` and :meth:`~gradwatch.Watcher.load_state_dict` are
built on these two functions. The values are plain ``dict``/``list``/``str``/``int``/
``float``, so a checkpoint holding them loads with ``torch.load(weights_only=True)``.

Example:
    >>> state = pipeline_state(pipe, build_report(pipe))  # doctest: +SKIP
    >>> restore_pipeline(fresh_pipe, read_state(state))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradwatch.core.steps import StepPipeline
from gradwatch.report import Report
from gradwatch.results import Finding

__all__ = ["STATE_VERSION", "SavedState", "pipeline_state", "read_state", "restore_pipeline"]

STATE_VERSION = 1


def pipeline_state(pipe: StepPipeline, report: Report) -> dict[str, Any]:
    """What a resumed run needs to continue ``pipe``'s findings and counters.

    ``report`` is the watcher's report so far (after exit: its final one); its findings are
    in the order of ``finding_keys``.
    """
    keyed = pipe.findings.keyed()
    return {
        "version": STATE_VERSION,
        "report": report.model_dump(mode="json"),
        "finding_keys": [[check, key] for (check, key), _ in keyed],
        "warned": [[check, name] for check, name in pipe.findings.warned_about()],
        "steps": pipe.steps,
        "backward_passes": pipe.backward_passes,
        "skipped_steps": pipe.scaler.skipped,
        "optimizer_steps": {str(t.index): t.steps for t in pipe.structure.tracks},
    }


@dataclass(frozen=True)
class SavedState:
    """A checked :func:`pipeline_state`, ready to go into a pipeline."""

    keyed: list[tuple[tuple[str, str], Finding]]
    warned: list[tuple[str, str]]
    steps: int
    backward_passes: int
    skipped_steps: int
    optimizer_steps: dict[str, int]


def read_state(state: Mapping[str, Any]) -> SavedState:
    """Check and convert :func:`pipeline_state` output (a checkpoint's plain data).

    Raises:
        ValueError: ``state`` is of an unknown version or its findings and keys disagree.
        pydantic.ValidationError: a saved finding is not a valid one.
    """
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown gradwatch checkpoint state version {state.get('version')!r}")
    findings = state["report"].get("findings", [])
    keys = state.get("finding_keys", [])
    if len(keys) != len(findings):
        raise ValueError("gradwatch checkpoint state: finding keys and findings do not match")
    return SavedState(
        keyed=[((str(c), str(k)), Finding.model_validate(f)) for (c, k), f in zip(keys, findings)],
        warned=[(str(check), str(name)) for check, name in state.get("warned", [])],
        steps=int(state.get("steps", 0)),
        backward_passes=int(state.get("backward_passes", 0)),
        skipped_steps=int(state.get("skipped_steps", 0)),
        optimizer_steps={str(k): int(v) for k, v in state.get("optimizer_steps", {}).items()},
    )


def restore_pipeline(pipe: StepPipeline, saved: SavedState) -> None:
    """Load a :func:`read_state` result into the pipeline of a freshly attached watcher.

    Findings go back into the finding log under their original keys, so the same problem
    seen again after the resume merges into one finding (``count`` keeps growing) and is
    not warned about twice. Counters add to what the new run has counted already.
    """
    pipe.findings.restore(saved.keyed, saved.warned)
    pipe.steps += saved.steps
    pipe.backward_passes += saved.backward_passes
    pipe.scaler.skipped += saved.skipped_steps
    for track in pipe.structure.tracks:
        track.steps += saved.optimizer_steps.get(str(track.index), 0)
        # the restored passes belong to finished steps
        track.backward_at_start += saved.backward_passes
