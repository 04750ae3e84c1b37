"""The watcher of one ``gradwatch run``: entered when discovery finds the models, closed at the end.

:class:`Session` owns the :class:`~gradwatch.cli._run_discovery.Discovery` hooks and the
watcher. A script that never steps an optimizer, or whose optimizers' parameters belong to no
module, gets a report with one ``not_observed`` error saying so: nothing was judged, and that
must not read as a pass.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.cli._run_discovery import Discovery

__all__ = ["Session"]


def _names(models: list[nn.Module]) -> list[str]:
    """A name per model: its class name, numbered when two share one."""
    names: list[str] = []
    for model in models:
        base = type(model).__name__
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}{k}"
        names.append(name)
    return names


class Session:
    """Discovery, then watching, for one script run in this process."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.watcher: Any = None
        self.lightning = False
        self.orphan = False
        self.models: list[nn.Module] = []
        self.faults: list[str] = []
        self.discovery = Discovery(self._start, self._fault)

    def install(self) -> None:
        self.discovery.install()

    def remove(self) -> None:
        self.discovery.remove()

    def _fault(self, where: str, exc: BaseException) -> None:
        self.faults.append(f"{where}: {type(exc).__name__}: {exc}")

    def _start(
        self, models: list[nn.Module], opts: list[torch.optim.Optimizer]
    ) -> Optional[Callable[[torch.optim.Optimizer], None]]:
        from gradwatch import watch

        if not models:
            self.orphan = True
            return None
        self.lightning = any(
            c.__name__ == "LightningModule" for m in models for c in type(m).__mro__
        )
        model: Any = models[0] if len(models) == 1 else dict(zip(_names(models), models))
        watcher = watch(model, list(opts), config=self.config)
        watcher.__enter__()
        self.watcher = watcher
        self.models = models
        return self._add

    def _add(self, opt: torch.optim.Optimizer) -> None:
        mine = {id(p) for m in self.models for p in m.parameters()}
        if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            self.watcher.add_optimizer(opt)

    def finish(self) -> Any:
        """Close the watcher and return the report (or the not_observed one)."""
        if self.watcher is not None:
            self.watcher.__exit__(None, None, None)
            report = self.watcher.report()
            for fault in self.faults:
                self._not_observed(report, "run_discovery", fault)
            return report
        return self._unwatched()

    def _unwatched(self) -> Any:
        import gradwatch
        from gradwatch.report import Report

        report = Report(
            gradwatch_version=gradwatch.__version__,
            torch_version=torch.__version__,
            config=self.config,
            fail_on=self.config.fail_on,
        )
        seen = self.discovery.optimizers_seen
        if self.faults:
            reason, message = "run_discovery", "; ".join(self.faults)
        elif self.orphan:
            reason = "no_module"
            message = (
                "the script's optimizers hold parameters that belong to no nn.Module: "
                "nothing could be watched"
            )
        elif seen == 0:
            reason = "no_optimizer"
            message = "the script never built a torch.optim optimizer: nothing was watched"
        else:
            reason = "no_step"
            message = (
                f"the script built {seen} optimizer{'s' if seen != 1 else ''} but ended before "
                "a full iteration (every optimizer stepped once): nothing was watched"
            )
        return self._not_observed(report, reason, message)

    @staticmethod
    def _not_observed(report: Any, reason: str, message: str) -> Any:
        from gradwatch.checks.not_observed import NotObserved
        from gradwatch.cli.probe import add_finding
        from gradwatch.results import Finding

        finding = Finding(
            check=NotObserved.id,
            severity="error",
            message=f"gradwatch run: {message}.",
            hint="gradwatch run watches from the first iteration boundary: the script must "
            "build a torch.optim optimizer over an nn.Module's parameters and step it at "
            "least twice; otherwise call gradwatch.watch(model, optimizer) in the script.",
            details={"reason": reason},
        )
        return add_finding(report, finding)
