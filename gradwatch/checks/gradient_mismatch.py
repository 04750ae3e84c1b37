"""``gradient_mismatch``: autograd's derivative of the loss disagrees with finite differences.

A probe (:mod:`gradwatch.probes.gradient`), not a rule over watched steps: on a float64 copy
of the model it compares, per layer, the directional derivative of the loss along a random
direction that autograd gives with central finite differences of the loss itself.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["GradientMismatch", "GradientMismatchConfig"]


class GradientMismatchConfig(CheckConfig):
    """``gradient_mismatch``: the comparison's tolerance and the probe's budget."""

    severity: Severity = severity_field("error")
    rtol: float = Field(
        default=1e-2,
        gt=0,
        description="Relative disagreement between autograd and finite differences that is a "
        "mismatch (float64 differences agree to about 1e-6 on smooth models).",
    )
    budget_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds the probe may take; over it, layers are sampled and the probe "
        "says how many it compared.",
    )
    max_samples: int = Field(
        default=8,
        ge=1,
        description="Samples of the batch the probe uses, spread over it (first and last "
        "included).",
    )


class GradientMismatch(Check):
    """A layer's gradient, as autograd computes it, is not the derivative of the loss."""

    id = "gradient_mismatch"
    maturity = "preview"
    Config = GradientMismatchConfig
    doc = CheckDoc(
        summary="Autograd's derivative of the loss along a random direction of a layer's "
        "parameters disagrees with central finite differences of the loss (float64, on a "
        "copy of the model): the gradient the optimizer follows is not the loss's.",
        why="A wrong derivative trains with finite, moving, non-zero gradients, so every "
        "gradient-flow check passes; the model just learns something else, or slowly.",
        causes=(
            "A custom `torch.autograd.Function` whose `backward` is wrong (a missing factor, "
            "a wrong sign, a transposed product, the gradient of another function).",
            "A `.data` edit in the forward (`h.data = h.data.clamp(...)`, "
            "`x.data.mul_(s)`) that changes the output where autograd cannot see it.",
            "An in-place change through a view or a buffer that autograd does not track, so "
            "the recorded graph computes another function than the forward.",
        ),
        fix="Check the named layer and the first operation after it: compare the custom "
        "`backward` with `torch.autograd.gradcheck`, and replace `.data` edits by ordinary "
        "(differentiable) operations or an explicit `.detach()`.",
        silence=(
            "A stop-gradient autograd can see (`.detach()`, `torch.no_grad()`) is held at its "
            "recorded value, so it is compared, not reported.",
            "torch's documented embedding gradients are not compared: the `padding_idx` row, "
            "rows a `scale_grad_by_freq` lookup repeats, rows `max_norm` holds at its bound "
            "(`details.masked_rows`).",
            "A custom `autograd.Function` whose `backward` is measured to be a constant "
            "multiple `c` != 1 of `grad_output` (a DANN gradient reversal, a gradient scale) "
            "is a declared gradient surgery: the layers upstream of it are `explained`, not "
            "judged (`details.gradient_surgery`).",
            "A straight-through estimator (`sign`, `round`, a quantiser) is recognised by "
            "its forward, never its class name: the finite difference equals autograd's "
            "derivative with its path cut. `straight_through = True` on the class and "
            "torch's fake quantisation declare one too.",
            "A ReLU network's kinks near the point compared, which the finite difference's "
            "step crosses: where float64 rounding allows it, the difference is taken at a step "
            "a hundred times shorter first, which crosses a hundred times fewer.",
            "A loss that is not differentiable at the very point compared (a ReLU input at "
            "exactly 0, a max over exact ties, a weight projected onto a bound), where "
            "autograd's is a one-sided derivative: a mismatch is looked for again at a point "
            "1 % of the weights' size away, and one that does not show there is "
            "`inconclusive`. A wrong derivative is wrong on a whole neighbourhood.",
        ),
        detail="a probe (on a float64 copy, `gradwatch.probe`, `Watcher.probe`, `gradwatch "
        "check`): per layer, autograd's directional derivative of the loss along a random "
        "direction disagrees with central finite differences by more than `rtol` (1e-2), "
        "at a step a hundred times shorter where float64 rounding allows (fewer kinks "
        "crossed) and at the step itself, confirmed at twice the step (rounding noise moves, "
        "a wrong derivative does not): a "
        "custom `autograd.Function` with a wrong `backward`, a `.data` edit in the forward. Every "
        "evaluation seeds the global RNGs alike (dropout, augmentations) and restores the "
        "buffers; visible stop-gradients (`.detach()`, ops the user's code runs under "
        "`torch.no_grad()`: SimSiam/BYOL, VQ-VAE's `z + (q - z).detach()`, a GAN's "
        "`D(G(z).detach())`) are held at their recorded values, and torch's documented embedding "
        "gradients are left out of the direction (the `padding_idx` row, rows a "
        "`scale_grad_by_freq` lookup repeats, rows `max_norm` holds at its bound: "
        "`details.masked_rows`). Custom `autograd.Function`s are measured, never judged by their "
        "class name: one whose `backward` is a constant multiple `c` of `grad_output` (`c` != 1: "
        "DANN's gradient reversal, a gradient scale) is a declared gradient surgery, and the "
        "layers upstream of it are `explained` (`details.gradient_surgery`, each class's `c`); "
        "one whose forward is locally constant (the finite difference equals autograd's "
        "derivative with that Function's path cut: `sign`, `round`, a quantiser, whatever its "
        "straight-through `backward`) is a straight-through estimator, `explained` "
        "(`details.straight_through`), as are a class with `straight_through = True` and fake "
        "quantisation. A wrong `backward` of a Function whose forward moves stays a finding. One "
        "finding for the layers that disagree, `module` the last of them in forward order; "
        "`details.layers`, `details.between`, `details.custom_functions`. Over `budget_s` (5 s) "
        "layers are sampled, spread over the forward (said in the report's `probes`). A loss that "
        "changes between two identical evaluations is `not_observed` (`probe_not_reproducible`)",
    )
