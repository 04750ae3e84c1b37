"""``shared_module``: one module object registered at several sibling places.

``nn.ModuleList([Block(d)] * n)`` repeats one ``Block``: the n layers are one, sharing
their weights, and the model has a sixth of the capacity it was built for. The same comes
of passing one instance to every sibling's constructor, or ``[mlp] * 2`` heads. The
evidence (``model_as_built``, :mod:`gradwatch.model.sharing`) is read once per layout.

Correct and silent: a module registered once and applied several times (ALBERT's one
layer, a Siamese encoder), an alias under another name (``self.backbone =
self.model.encoder``), tied embeddings (a parameter, not a module), a parameterless module
(one ``nn.ReLU`` used twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks._as_built import AsBuiltCheck
from gradwatch.checks._params import under
from gradwatch.checks.base import CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class SharedModuleConfig(CheckConfig):
    """``shared_module``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


class SharedModule(AsBuiltCheck):
    """Once per layout read: each module object registered at several sibling places."""

    id = "shared_module"
    maturity = "stable"
    Config = SharedModuleConfig
    needs = frozenset({"model_as_built"})
    doc = CheckDoc(
        summary="One module object is registered at several sibling places (the same "
        "instance in several slots of a container, or passed to several sibling layers), so "
        "layers meant to be distinct are one.",
        why="The repeated layers share one set of weights: the model has the capacity of one "
        "of them, and every update to one changes all. It trains, and underfits quietly.",
        causes=(
            "`nn.ModuleList([Block(d)] * n)`: list repetition copies the reference, not the block.",
            "One `norm = nn.LayerNorm(d)` passed to every layer's constructor.",
            "`self.heads = nn.ModuleList([mlp] * 2)`.",
        ),
        fix="Build each with its own constructor call: `nn.ModuleList([Block(d) for _ in "
        "range(n)])` (or `copy.deepcopy(block)` per slot). If sharing is meant, register the "
        "module once and apply it n times (ALBERT).",
        detail="one module object with parameters is registered at several sibling places: "
        "several slots of one container (`nn.ModuleList([Block(d)] * n)`, `nn.ModuleList([mlp] * "
        "2)` heads) or the same attribute of several parents of one class (one `LayerNorm` passed "
        "to every layer's constructor), so layers meant to be distinct are one. Read from the "
        "module tree once per layout (enter, `add_optimizer`, `add_param_group`, a replaced "
        "layer); named by the container (`module`, with `details.defined_at`: the line that built "
        "it). A module registered once and applied several times (ALBERT, a Siamese encoder), an "
        "alias under another name (`self.backbone = self.model.encoder`), tied embeddings and a "
        "parameterless module used twice are fine. `details.paths`, `details.class`, "
        "`details.numel`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        built = self.fresh(view)
        if built is None:
            return
        for shared in built.shared:
            n, paths = len(shared.paths), list(shared.paths)
            where = f"'{shared.container}'" if shared.container else "the model"
            shown = ", ".join(paths[:4]) + (f", ... ({n} places)" if n > 4 else "")
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"{n} places of {where} hold one {shared.cls} object ({shown}): its "
                f"{shared.numel:,} parameters are shared, so {n} layers meant to be distinct "
                "are one.",
                hint=f"Build each with its own constructor call (`[{shared.cls}(...) for _ in "
                f"range({n})]`, not `[{shared.cls.lower()}] * {n}`); if sharing is meant, "
                "register it once and apply it several times.",
                params=under(view.index, paths),  # the one module's, under each place
                module=shared.container or paths[0],
                key=paths[0],
                details={"paths": paths, "class": shared.cls, "numel": shared.numel},
            )
