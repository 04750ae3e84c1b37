"""``eval_mode_training``: training steps taken while the model, or part of it, is in eval mode.

A validation or sampling helper that calls ``model.eval()`` and never ``model.train()``, a
model put in eval once before the loop, ``decoder.eval()`` for a preview left on: every
later step trains with dropout off and batch norm on frozen running statistics, and nothing
fails. The evidence (``module_modes``, ``gradwatch/capture/forward/modes.py``) is the mode of the
modules whose behaviour depends on it, read at the start of the latest training forward of
each step's window: a handful of attribute reads per forward, no tensor, no sync. Where
``eval()`` was called (``gradwatch/capture/forward/mode_calls.py``): ``nn.Module.train`` is wrapped
while watching, so the finding names that line (``details.eval_called_at``).

Correct and silent: a validation forward in eval mode followed by ``model.train()``;
frozen normalisation layers kept in eval (their own parameters frozen, often by a
``train()`` override); one norm layer put in eval on its own while its parent trains
(statistics frozen on purpose, ``norm_eval``); a frozen teacher or EMA copy in eval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog
    from gradwatch.model.index import ParamIndex

ROOT = "(root)"


def params_under(index: ParamIndex, modules: tuple[str, ...] | list[str]) -> list[str]:
    """Names of the parameters owned by ``modules`` or by modules inside them."""
    ids: list[int] = []
    for layer, layer_ids in index.layers.items():
        if any(m == ROOT or layer == m or layer.startswith(m + ".") for m in modules):
            ids.extend(layer_ids)
    return index.names(ids)


def _listed(names: tuple[str, ...]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class EvalModeTrainingConfig(CheckConfig):
    """``eval_mode_training``: root in eval is ``severity``; a submodule only, a warning."""

    severity: Severity = severity_field("error")


class EvalModeTraining(Check):
    """On each optimizer step with a backward: the modes of its latest training forward."""

    id = "eval_mode_training"
    maturity = "stable"
    Config = EvalModeTrainingConfig
    needs = frozenset({"module_modes"})
    doc = CheckDoc(
        summary="Training steps ran with the model (error), or a submodule whose behaviour "
        "depends on `training` (warning), in eval mode.",
        why="In eval mode dropout is off, batch norm normalises with its running statistics "
        "and never updates them, stochastic depth and LayerDrop keep every layer: the model "
        "trains as a different network from the one you designed, and nothing fails.",
        causes=(
            "A validation or sampling helper calls `model.eval()` and never `model.train()` "
            "(or it returns early before restoring the mode).",
            "`model.eval()` before the training loop (a notebook cell, after loading a "
            "checkpoint), with no `model.train()`.",
            "A submodule put in eval for a preview or a generation step "
            "(`model.decoder.eval()`) and left there.",
        ),
        fix="The finding names the line that called `eval()` (`details.eval_called_at`) when "
        "it ran while watching. Call `model.train()` at the start of each training epoch (or "
        "after every validation/sampling call); restore the previous mode in helpers "
        "(`was = model.training; model.eval(); ...; model.train(was)`).",
        silence=(
            "Freeze on purpose: a norm layer kept in eval whose own parameters are frozen "
            "(`requires_grad_(False)`) is not reported.",
            "To train without dropout on purpose (RLHF, some fine-tuning recipes), set the "
            "dropout probabilities to 0 instead of calling `eval()`: batch norm and other "
            "mode-dependent layers then still train as they should.",
        ),
        detail="an optimizer step consumed a forward that ran with the model in eval mode (error) "
        "or, while the model trained, with a trainable submodule holding dropout / batch norm / "
        "any layer that reads `self.training` in eval (warning): a validation or sampling helper "
        "that calls `eval()` and never `train()`, `model.eval()` before the loop, "
        "`decoder.eval()` for a preview. Read from `module.training` at the start of each "
        "training forward (attribute reads, no tensor); the message names the line that called "
        '`eval()` (`details.eval_called_at`: "`eval()` was called at `train.py:88`, after step '
        '2, and `train()` never after"; `nn.Module.train` is wrapped while watching, nothing is '
        "set on the model), else the last step that trained in train mode, or that the model was "
        'in eval when watching began. With named models (`watch({"G": netG, "D": netD}, '
        "...)`) each model the loop calls is a root: a generator left in eval is the error, "
        "naming its layers (`G:1`). Frozen norm layers kept in eval, one norm layer put in eval "
        "on its own (`norm_eval`), a frozen teacher/EMA copy, and a validation forward followed "
        "by `train()` are fine. `details.modules`",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._last_clean: Optional[int] = None
        self._sites: dict[str, str] = {}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        snap = view.window.modes
        if snap is None or view.optimizer is None or not view.backward_in_window:
            return
        if not snap.root_eval and not snap.eval_modules:
            self._last_clean = view.step
            return
        self._sites = dict(snap.eval_sites)  # module -> the line that called its eval()
        if snap.root_eval:
            self._root(view, log, snap.eval_modules, snap.eval_at_start)
        else:
            self._submodules(view, log, snap.eval_modules)

    def _since(self, eval_at_start: bool, module: str = ROOT) -> tuple[str, dict[str, Any]]:
        site = self._sites.get(module)
        if site is not None:
            what = "`eval()`" if module == ROOT else f"`{module}.eval()`"
            after = f", after step {self._last_clean}," if self._last_clean is not None else ""
            return (
                f" {what} was called at {site}{after} and `train()` never after.",
                {"eval_called_at": site, "last_train_step": self._last_clean},
            )
        if self._last_clean is not None:
            return (
                f" Steps up to {self._last_clean} trained in train mode: `eval()` was called "
                f"after step {self._last_clean} (a validation or sampling helper?) and "
                "`train()` never after.",
                {"last_train_step": self._last_clean},
            )
        if eval_at_start:
            return (
                " The model was already in eval mode when watching began (`model.eval()` "
                "before the loop, and `train()` never called).",
                {"eval_at_start": True},
            )
        return "", {}

    def _root(self, view: StepView, log: FindingLog, modules: tuple[str, ...], start: bool) -> None:
        said, details = self._since(start)
        affected = [m for m in modules if m != ROOT]
        what = (
            f"; {len(affected)} module(s) whose behaviour depends on it ({_listed(modules)}) "
            "trained with dropout off / batch norm on frozen running statistics"
            if affected
            else " (its forward reads `self.training`)"
        )
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{view.optimizer_name} stepped on a forward that ran with the model "
            f"in eval mode{what}.{said}",
            hint="Call model.train() before the training forward (at the start of each epoch "
            "and after validation or sampling); in helpers restore the mode: "
            "`was = model.training; model.eval(); ...; model.train(was)`.",
            # the layers whose behaviour changed, else (parameterless ones: dropout) every
            # parameter the step updated on that forward
            params=params_under(view.index, tuple(affected)) or view.index.names(view.ids),
            module=ROOT,
            key=ROOT,
            details={"modules": list(modules), "root": True, **details},
        )

    def _submodules(self, view: StepView, log: FindingLog, modules: tuple[str, ...]) -> None:
        severity = "warning" if self.severity == "error" else self.severity
        for module in modules:
            said, details = self._since(False, module)
            log.emit(
                self.id,
                severity=severity,
                step=view.step,
                message=f"{view.optimizer_name} stepped on a forward in which '{module}' "
                "(trainable, with dropout / batch norm / mode-dependent layers) was in eval "
                f"mode while the model trained.{said}",
                hint=f"Call model.train() (or {module}.train()) before the training forward; "
                "to freeze a part on purpose, freeze its parameters too "
                "(requires_grad_(False)).",
                params=params_under(view.index, (module,)),
                module=module,
                key=module,
                details={"modules": [module], "root": False, **details},
            )
