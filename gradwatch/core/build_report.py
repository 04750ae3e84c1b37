"""The run's end: the checks judge the whole run once (:func:`finish`), and a
:class:`~gradwatch.Report` is assembled from the watching core's state."""

from __future__ import annotations

import torch

from gradwatch._severity import at_least
from gradwatch._version import __version__
from gradwatch.capture.grads.idle import idle_optimizers
from gradwatch.checks import RunView
from gradwatch.core.layers import LayerTrack
from gradwatch.core.steps import StepPipeline
from gradwatch.distributed.layout import late_sharding
from gradwatch.report import Coverage, LayerStats, Report

__all__ = ["build_report", "finish", "run_view"]


def build_report(pipe: StepPipeline) -> Report:
    """The report of everything ``pipe`` has seen so far."""
    structure, tracker, cfg = pipe.structure, pipe.tracker, pipe.config
    index = structure.index
    in_opt = {i for t in structure.tracks if t.index is not None for i in t.ids}
    trainable = {i for t in structure.tracks for i in t.ids}
    has_optimizer = bool(structure.optimizers) or bool(in_opt)
    order = dict(tracker.fwd_first)
    position = {name: k for k, name in enumerate(index.layers)}
    names = sorted(index.layers, key=lambda n: (order.get(n, float("inf")), position[n]))
    layers: list[LayerStats] = []
    for name in names:
        idxs = index.layers[name]
        known = [i for i in idxs if i < len(tracker.seen)]
        track = pipe.recorder.tracks.get(name) or LayerTrack(cfg.history)
        layers.append(
            track.to_stats(
                name,
                index.names(idxs),
                sum(index.params[i].numel for i in idxs),
                trainable=any(i in trainable for i in idxs),
                in_optimizer=any(i in in_opt for i in idxs) if has_optimizer else False,
                steps_with_grad=max((tracker.seen[i] for i in known), default=0),
                steps_without_grad=min((tracker.missing[i] for i in known), default=0),
                forward_order=order.get(name),
            )
        )
    findings = pipe.findings.findings()
    return Report(
        gradwatch_version=__version__,
        torch_version=torch.__version__,
        config=cfg,
        steps=pipe.steps,
        backward_passes=pipe.backward_passes,
        skipped_steps=pipe.scaler.skipped,
        failed=any(at_least(f.severity, cfg.fail_on) for f in findings),
        fail_on=cfg.fail_on,
        findings=findings,
        layers=layers,
        coverage=Coverage(**structure.coverage),
        probes=[p.model_copy(deep=True) for p in pipe.probes],
    )


def finish(pipe: StepPipeline, faults: list[str]) -> None:
    """The run is over: checks judge it as a whole once."""
    pipe.judges.run(run_view(pipe, faults))


def run_view(pipe: StepPipeline, faults: list[str]) -> RunView:
    """What the whole run showed, for the checks that judge it once at the end."""
    if pipe.model is not None:  # a short run may never have re-read the layout
        late_sharding(pipe.sharded, pipe.model, pipe.record, pipe.steps)
    tracker = pipe.tracker
    return RunView(
        steps=pipe.steps,
        backward_passes=pipe.backward_passes,
        step_calls=pipe.step_calls,
        forward_ran=bool(tracker.fwd_first),
        forward_ran_with_grad=bool(tracker.fwd_grad),
        has_optimizer=bool(pipe.structure.optimizers),
        faults=faults,
        hand_written_steps=pipe.hand_written,
        skipped_steps=pipe.scaler.skipped,
        unreached=_unreached(pipe) if pipe.steps == 0 and pipe.backward_passes else [],
        idle_optimizers=idle_optimizers(tracker, pipe.structure.tracks, pipe.structure.index.names),
        optimizer_name=pipe.structure.index.optimizer_label,
    )


def _unreached(pipe: StepPipeline) -> list[str]:
    """Trainable optimizer parameters no backward pass reached, in a run without a step."""
    seq = pipe.tracker.last_seq
    ids = [
        i
        for track in pipe.structure.tracks
        for i, p in zip(track.ids, track.params)
        if p.requires_grad and i < len(seq) and seq[i] == 0
    ]
    return pipe.structure.index.names(ids)
