"""``batch_order_dependent``: a sample's result depends on where it sits in the batch.

A probe (:mod:`gradwatch.probes.order`), loss-free: the batch and a permutation of it run
through a copy with the same weights and RNG state; each sample's outputs must move with it,
and a mean or sum loss must not change.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["BatchOrderDependent", "BatchOrderDependentConfig"]


class BatchOrderDependentConfig(CheckConfig):
    """``batch_order_dependent``: the tolerance, whether to compare the loss, the budget."""

    severity: Severity = severity_field("error")
    rtol: float = Field(
        default=1e-4,
        gt=0,
        description="Change of an output, relative to its largest magnitude, that is a move "
        "(never below 1000 x its dtype's epsilon: sums in another order round apart).",
    )
    compare_loss: bool = Field(
        default=True,
        description="Also require loss_fn's value to be unchanged (a mean or sum over "
        "samples); false for a loss that weighs samples by their place on purpose.",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class BatchOrderDependent(Check):
    """Permuting the batch does not permute each sample's outputs alike."""

    id = "batch_order_dependent"
    maturity = "stable"
    Config = BatchOrderDependentConfig
    doc = CheckDoc(
        summary="The batch and a permutation of it, through a copy of the model with the "
        "same weights and RNG state, do not give each sample the same outputs (or the mean "
        "loss changes): a sample's result depends on its position in the batch.",
        why="Every correct model treats the samples of a batch alike, whatever their order: "
        "a result that depends on the position trains on the order the loader happens to "
        "give and changes at inference with another batch or batch size.",
        causes=(
            "A tensor indexed by the batch position: a positional embedding or a per-row "
            "parameter added along dimension 0 (`x + self.pos[: x.shape[0]]`).",
            "Outputs left in another order: sequences sorted by length for "
            "`pack_padded_sequence` and the outputs never put back "
            "(`unsorted_idx`), or `sort`/`argsort` applied to the batch.",
            "A layout mistake that puts the batch on another axis: `view(seq, batch, d)` "
            "or a recurrent layer without `batch_first=True` fed `(batch, seq, d)`: the "
            "recurrence then runs over the samples.",
            "A loss that weighs samples by their index, or takes only the first ones "
            "(`loss[0]`, `out[:1]`).",
        ),
        fix="Follow the named output back to the first module whose output moved "
        "(`details.module`): index per sample, unsort after packing, permute axes instead "
        "of viewing them.",
        silence=(
            "Train-mode batch norm is order-free (its statistics are sums over the batch) "
            "and is not reported. Batch norm over parts of the batch (ghost batch norm, "
            "TabNet's virtual batches, a forward run in chunks) and experts of limited "
            "capacity couple samples by design: when the order stops mattering with the "
            "norms' running statistics, or a module has `expert_capacity`, the record says "
            "the property was not judged (`details.reason: coupled_on_purpose`). When only "
            "`loss_fn`'s value moves (the outputs permute exactly), a batch laid out on "
            "purpose gives the same evidence (a few-shot episode's support then queries, "
            "pairs or triplets by position): the finding is a warning at most, and "
            "`compare_loss: false` declares the layout. Dropout is switched off and every "
            "other random draw is replayed with its sample; a forward whose randomness "
            "cannot be aligned with the samples is judged in eval mode, and the record says "
            "so.",
        ),
        detail="a probe (on a copy, loss-free): the batch and a derangement of it, with dropout "
        "off and every other random draw replayed with its sample (stochastic depth, noise; a "
        "draw that cannot follow the samples: judged in eval mode, said in the note), do not give "
        "each sample the same outputs beyond `rtol` (1e-4, never under 1000 x the dtype's "
        "epsilon), or (`compare_loss`) change `loss_fn`'s value: a tensor indexed by the batch "
        "position (the PyTorch tutorial's `PositionalEncoding` fed batch-first tensors), outputs "
        "sorted for `pack_padded_sequence` and never unsorted, an `nn.LSTM` without `batch_first` "
        "fed `(batch, seq, d)`. `details.output`, `details.samples`, `details.change`, "
        "`details.module` (the first module whose per-sample output moved), `details.last_same`. "
        "Train-mode batch norm is order-free and passes",
    )
