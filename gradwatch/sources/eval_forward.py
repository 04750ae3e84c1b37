"""The forward in eval mode as computed (``eval_forward``): dropout run as in training inside
the watched model's first eval-mode forwards (:mod:`gradwatch.capture.forward.eval_dropout`), each
site recorded once as an ``eval_stochastic`` fact when it runs (a validation after the last
step is seen too). Under torch.compile no hook is added: its checks are told
``not_observed``.
"""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.capture.facts import EVAL_STOCHASTIC, UNOBSERVABLE, Fact
from gradwatch.capture.forward.eval_dropout import DropoutSite, EvalDropoutWatch
from gradwatch.sources.base import EvidenceSource, SourceContext

__all__ = ["EvalForwardSource"]


class EvalForwardSource(EvidenceSource):
    name = "eval_forward"
    serves = frozenset({"eval_forward"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.watch: Optional[EvalDropoutWatch] = None
        self._done = False

    def install(self) -> None:
        ctx = self.ctx
        forwards = int(self.wanted.get("eval_forward", 0))
        if self._done or ctx.model is None or forwards <= 0:
            return
        self._done = True
        if ctx.hooks.keep_all:
            checks = ctx.needing("eval_forward")
            ctx.record(
                Fact(
                    UNOBSERVABLE,
                    step=ctx.steps,
                    key="compiled_eval_forward",
                    message="The model runs under torch.compile, where gradwatch adds no "
                    f"forward hooks of its own: {', '.join(checks)} cannot see dropout in "
                    "its eval-mode forwards.",
                    hint="Run an eval forward without torch.compile (or `gradwatch check` on "
                    "the eager model) to cover it.",
                    details={
                        "reason": "compiled_forward",
                        "part": "eval_forward",
                        "checks": checks,
                    },
                )
            )
            return
        self.watch = EvalDropoutWatch(
            ctx.model, self._found, ctx.faults.callback(), forwards=forwards
        )

    def _found(self, site: DropoutSite) -> None:
        self.ctx.record(
            Fact(
                EVAL_STOCHASTIC,
                step=self.ctx.steps,
                key=f"{site.module}:{site.function}",
                message="",
                params=site.params,
                details={
                    "module": site.module or site.cls,
                    "module_class": site.cls,
                    "function": site.function,
                    "p": site.p,
                    "called_at": site.called_at,
                },
            )
        )

    def remove(self) -> None:
        if self.watch is not None:
            self.watch.remove()
            self.watch = None
