"""``resume_mismatch``: a resumed run does not continue what its checkpoint saved.

``Watcher.state_dict()`` records, at checkpoint time, the parameters' exact bit checksums,
each optimizer's step counts and moment checksum, its learning rates, its LR schedulers'
epochs and the step counter (``gradwatch/capture/loop/resume.py``); after ``load_state_dict()``
the first optimizer step reads them again before it changes anything and records a
``resumed`` fact per aspect that differs. This check judges those facts.

Correct and silent: a resume that restores the model, the optimizer and the scheduler from
the checkpoint that holds the gradwatch state (plain ``torch.save``/``torch.load``, the
Lightning and Hugging Face callbacks).
"""

from __future__ import annotations

from gradwatch._severity import Severity
from gradwatch.capture.facts import RESUMED
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["ResumeMismatch", "ResumeMismatchConfig"]


class ResumeMismatchConfig(CheckConfig):
    """``resume_mismatch``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class ResumeMismatch(Check):
    """Once per resume, at its first optimizer step: the facts of what was not restored."""

    id = "resume_mismatch"
    maturity = "stable"
    Config = ResumeMismatchConfig
    needs = frozenset({"resume_state"})
    facts = frozenset({RESUMED})
    doc = CheckDoc(
        summary="A run resumed from a checkpoint does not continue what was saved: its "
        "parameters, its optimizer's state (step counts, moments), its learning rates, its LR "
        "scheduler or its step counter differ from what the watcher recorded at save time.",
        why="A resume that loses state trains on silently: a fresh Adam restarts its bias "
        "correction and moments (a loss spike, then a slower run), a restarted scheduler "
        "replays warmup at the wrong time, another checkpoint's weights throw the progress "
        "away. The loss curve looks plausible, so nobody notices.",
        causes=(
            "A fresh optimizer after loading the weights (optimizer.state_dict() not saved "
            "or not loaded).",
            "The LR scheduler's state not saved or not loaded (its epoch restarts at 0).",
            "Weights loaded from another run's or an older checkpoint than the state.",
            "The training loop's step counter restarted at 0 (pass step= to state_dict() and "
            "load_state_dict() to compare it).",
        ),
        fix="Save model, optimizer, scheduler and `watcher.state_dict()` in one checkpoint "
        "and load all of them from it: `model.load_state_dict(ck['model'])`, "
        "`opt.load_state_dict(ck['opt'])`, `sched.load_state_dict(ck['sched'])`, "
        "`watcher.load_state_dict(ck['gradwatch'])`.",
        silence=(
            "A deliberate change at resume (a new learning rate, fine-tuning from a "
            "checkpoint): do not load the gradwatch state, or turn the check off.",
        ),
        detail="a run resumed with `watcher.load_state_dict(state)` does not continue what "
        "`watcher.state_dict()` recorded at save time, compared at the first resumed optimizer "
        "step before it changes anything: parameters whose exact bit checksums differ (weights of "
        "another checkpoint: `details.aspect: params`, `params` names them), an optimizer with "
        "fresh or other state (step counts, moment checksum: `optimizer`), other learning rates "
        "(`lr`), an LR scheduler at another epoch (`scheduler`), or, where `step=` is given to "
        "both, the loop's step counter (`step`). One pass over parameters and optimizer state at "
        "save and at resume, nothing per step. The Lightning callback's checkpoint state, the HF "
        "callback (the Trainer's checkpoint folder) and accelerate "
        "(`accelerator.register_for_checkpointing(watcher)`, then `save_state`/`load_state`) "
        "carry it. Across world sizes: whole parameters (DDP) compare at any world size; FSDP "
        "shards compare on the rank that saved them at the same world size, and a resharded "
        "resume (`torch.distributed.checkpoint` at another world size) compares the counters, "
        "rates and schedulers only (an `info` `not_observed`, `details.reason = "
        '"resume_resharded"`). `details.saved`, `details.resumed`',
    )
