"""Checkpoint state of a watcher: findings so far and step counters, as plain data.

Kept apart from the callback so the (Trainer-free) round trip can be read on its own. The
values are plain ``dict``/``list``/``str``/``int``/``float`` so a checkpoint loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch.results import Finding

if TYPE_CHECKING:
    from gradwatch.core.watcher import Watcher

__all__ = ["STATE_VERSION", "restore_state", "watcher_state"]

STATE_VERSION = 1


def watcher_state(watcher: Watcher) -> dict[str, Any]:
    """What a resumed run needs to continue ``watcher``'s findings and counters."""
    log = watcher._log
    keys = [[check, key] for check, key in log._findings]
    report = watcher.report()
    return {
        "version": STATE_VERSION,
        "report": report.model_dump(mode="json"),
        "finding_keys": keys,
        "warned": sorted([check, name] for check, name in log._warned),
        "steps": watcher.steps,
        "backward_passes": watcher.backward_passes,
        "skipped_steps": watcher._pipe.scaler.skipped,
        "optimizer_steps": {str(t.index): t.steps for t in watcher._pipe.structure.tracks},
    }


def restore_state(watcher: Watcher, state: dict[str, Any]) -> None:
    """Load :func:`watcher_state` output into a freshly attached ``watcher``.

    Findings go back into its finding log under their original keys, so the same problem
    seen again after the resume merges into one finding (``count`` keeps growing) and is
    not warned about twice.
    """
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown gradwatch checkpoint state version {state.get('version')!r}")
    log = watcher._log
    findings = state["report"].get("findings", [])
    keys = state.get("finding_keys", [])
    if len(keys) != len(findings):
        raise ValueError("gradwatch checkpoint state: finding keys and findings do not match")
    for (check, key), data in zip(keys, findings):
        log._findings.setdefault((check, key), Finding.model_validate(data))
    log._warned.update((check, name) for check, name in state.get("warned", []))
    watcher.steps += int(state.get("steps", 0))
    backward = int(state.get("backward_passes", 0))
    watcher.backward_passes += backward
    watcher._pipe.scaler.skipped += int(state.get("skipped_steps", 0))
    done = state.get("optimizer_steps", {})
    for track in watcher._pipe.structure.tracks:
        track.steps += int(done.get(str(track.index), 0))
        track.backward_at_start += backward  # the restored passes belong to finished steps
