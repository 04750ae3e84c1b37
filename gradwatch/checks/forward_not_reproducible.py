"""``forward_not_reproducible``: the same batch gives other outputs on a second forward.

A probe (:mod:`gradwatch.probes.reproducible`), loss-free: two forwards of one copy on one
batch with the same RNG state must agree; the state that changed between them is named.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["ForwardNotReproducible", "ForwardNotReproducibleConfig"]


class ForwardNotReproducibleConfig(CheckConfig):
    """``forward_not_reproducible``: the tolerance, declared state, and the budget."""

    severity: Severity = severity_field("warning")
    rtol: float = Field(
        default=1e-5,
        gt=0,
        description="Change of an output between the two forwards, relative to its largest "
        "magnitude, that is a difference (never below 1000 x its dtype's epsilon).",
    )
    stateful: Optional[bool] = Field(
        default=None,
        description="Whether the model carries state across forwards on purpose (truncated "
        "BPTT feeding its hidden state back, a key/value cache): then the property is not "
        "judged and the report says so. None: recognised from the state's names (cache, "
        "mems, memory, queue, bank); false: never recognised.",
    )
    allow: list[str] = Field(
        default_factory=list,
        description="Glob patterns of state names (`module.attribute`) carried on purpose; "
        "when all the state the output reads matches, the property is not judged.",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class ForwardNotReproducible(Check):
    """A forward's outputs depend on what an earlier forward left in the model."""

    id = "forward_not_reproducible"
    maturity = "stable"
    Config = ForwardNotReproducibleConfig
    doc = CheckDoc(
        summary="The same batch, through the same weights with the same RNG state, gave "
        "other outputs on a second forward of a copy: the forward reads state that an "
        "earlier call left (`details.state`, `details.read`).",
        why="Batches of a shuffled loader are independent: an output that depends on the "
        "previous call mixes one batch into the next, and evaluation gives another result "
        "depending on what ran before.",
        causes=(
            "A recurrent state kept on the module (`self.hidden = h.detach()`) and never "
            "reset between independent batches.",
            "A cache or running value the forward writes and reads: an accumulated "
            "normaliser, a memoised tensor keyed on nothing, a counter that changes a "
            "schedule inside the forward.",
            "A hand-written norm that normalises by its running statistics in train mode, "
            "or an `nn.Module` attribute updated in place by the forward.",
        ),
        fix="Reset the state at the start of each batch (pass the initial state as an "
        "argument), or declare it (`stateful: true`, `allow`) when it is carried on purpose.",
        silence=(
            "Batch-norm running statistics and `num_batches_tracked` change in train mode "
            "but the output does not read them. State declared (`stateful`, `allow`) or "
            "named as a cache or memory is not judged, and the report says so.",
        ),
        detail="a probe (on a copy, loss-free): the same batch through the same weights with "
        "every generator seeded alike (a module's own `torch.Generator` set back too) gives other "
        "outputs on a second forward: the forward reads state an earlier call left (a recurrent "
        "state kept on the module and never reset, a value annealed per call, a hand-written norm "
        "updating and reading running statistics). `details.state` names every buffer and plain "
        "attribute the first forward changed, `details.read` those shown (each put back alone) to "
        "change the output. Batch-norm running statistics and `num_batches_tracked` are not "
        "blamed in train mode; state re-estimated by design at every call and read (quantisation "
        "observers' running ranges, spectral norm's `weight_u`/`_u`) is set back before the "
        "second forward (`details.reset`) and the rest judged. State carried on purpose is "
        "declared (`stateful: true`, `allow: [glob]`) or recognised when the outputs differ (a "
        "name with `cache`, `mems`, `memory`, `queue`, `bank`): an `info` `not_observed` "
        "(`probe_declared_stateful`) says it was not judged",
    )
