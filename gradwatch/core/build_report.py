"""Assemble a :class:`~gradwatch.Report` from a watcher's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gradwatch._severity import at_least
from gradwatch._version import __version__
from gradwatch.core.layers import LayerTrack
from gradwatch.report import Coverage, LayerStats, Report

if TYPE_CHECKING:
    from gradwatch.core.watcher import Watcher


def build_report(w: Watcher) -> Report:
    index = w._index
    tracker = w._tracker
    in_opt = {i for t in w._tracks if t.index is not None for i in t.ids}
    trainable = {i for t in w._tracks for i in t.ids}
    layers: list[LayerStats] = []
    order = {name: seq for name, seq in tracker.fwd_first.items()}
    names = sorted(
        index.layers, key=lambda n: (order.get(n, float("inf")), list(index.layers).index(n))
    )
    for name in names:
        idxs = [i for i in index.layers[name] if index.params[i].ref() is not None or True]
        params = index.names(idxs)
        numel = sum(index.params[i].numel for i in idxs)
        track = w._layer_tracks.get(name) or LayerTrack(w.config.history)
        seen = max((tracker.seen[i] for i in idxs if i < len(tracker.seen)), default=0)
        missing = min((tracker.missing[i] for i in idxs if i < len(tracker.seen)), default=0)
        layers.append(
            track.to_stats(
                name,
                params,
                numel,
                trainable=any(i in trainable for i in idxs),
                in_optimizer=any(i in in_opt for i in idxs) if w._optimizers or in_opt else False,
                steps_with_grad=seen,
                steps_without_grad=missing,
                forward_order=order.get(name),
            )
        )
    findings = w._log.findings()
    cfg = w.config
    failed = any(at_least(f.severity, cfg.fail_on) for f in findings)
    return Report(
        gradwatch_version=__version__,
        torch_version=torch.__version__,
        config=cfg,
        steps=w.steps,
        backward_passes=w.backward_passes,
        skipped_steps=w._skipped,
        failed=failed,
        fail_on=cfg.fail_on,
        findings=findings,
        layers=layers,
        coverage=Coverage(**w._coverage),
    )
