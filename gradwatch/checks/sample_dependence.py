"""``sample_dependence``: one sample's output depends on another sample's input.

A probe (:mod:`gradwatch.probes.samples`): one backward from one sample's output of the
model, on a copy; a gradient on any other sample's input is a dependence the batch must not
have; so is one on a later position where the model declares itself causal, or on a
padded position where the batch's ``attention_mask`` zeroes it.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["SampleDependence", "SampleDependenceConfig"]


class SampleDependenceConfig(CheckConfig):
    """``sample_dependence``: the share of gradient that is a dependence, and the budget."""

    severity: Severity = severity_field("error")
    min_share: float = Field(
        default=1e-6,
        ge=0,
        description="Gradient norm on other samples' inputs, relative to the sample's own, "
        "above which it is a dependence (independent samples give exactly zero).",
    )
    causal: Optional[bool] = Field(
        default=None,
        description="Whether position t of the model's output must not depend on its inputs "
        "after t. None: as the model declares (an attention module's `is_causal = True`, a "
        "class named `Causal...`; never for an encoder-decoder); true or false to say so.",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class SampleDependence(Check):
    """The model's output for one sample depends on other samples of the batch."""

    id = "sample_dependence"
    maturity = "stable"
    Config = SampleDependenceConfig
    doc = CheckDoc(
        summary="One sample's output of the model has a gradient on another sample's input: "
        "samples of the batch change each other's outputs.",
        why="The model then learns from the batch's composition: it scores well in training "
        "and differently at inference with another batch size or batch (at batch size 1 "
        "it is another model).",
        causes=(
            "A softmax or other normalisation over dimension 0 (the batch) instead of the "
            "classes or positions: `softmax(x, dim=0)`.",
            "A reshape that mixes samples: `x.view(seq, batch, d)` on a `(batch, seq, d)` "
            "tensor, or `transpose` then `view` in the wrong order.",
            "Statistics taken over the batch in the forward (`x - x.mean(0)`, a hand-written "
            "normaliser), outside a `BatchNorm` layer.",
            "Inside a sample, what the model or batch declares: a causal model whose mask "
            "lets a position see later ones (`triu` for `tril`, `is_causal` not passed to "
            "`scaled_dot_product_attention`), or outputs that read the positions a batch's "
            "`attention_mask` zeroes (the mask not passed to the model, a PyTorch "
            "`key_padding_mask` given Hugging Face's 1-for-keep convention, a mean pooling "
            "over the padding).",
        ),
        fix="Find the operation that reduces or reshapes over the batch dimension and make "
        "it act per sample (`dim=-1`, `permute` before `reshape`).",
        silence=(
            "Train-mode `BatchNorm` couples samples by design: reported as `info` when the "
            "dependence vanishes with the batch norms in eval mode.",
            "A graph network over a whole graph (the batch holds an `(N, N)` adjacency, "
            "dense or sparse, or an `edge_index`) couples its nodes by design: a dependence "
            "that stays within as many hops of the edges as the model has layers is not "
            "judged, said as `not_observed` (`probe_graph_batch`).",
            "A time-major model (a `batch_first=False` RNN or attention layer reads the "
            "batch's leading dim as time and its batch axis is the output's dim 1, as in "
            "pytorch/examples word_language_model) is not judged (`probe_time_major`).",
            "A pairwise `(N, N)` output (CLIP's image-text logits) whose entry `[i, j]` "
            "reads samples i and j only is not judged (`probe_pairwise_output`).",
        ),
        detail="a probe (on a copy): one backward from a random weighting of one sample's output "
        "of the model (its first output with the batch's leading dimension; a GAN's children when "
        "the root is not called) reaches another sample's input (the batch's floating tensors, or "
        "the outputs of embedding layers for token ids) with more than `min_share` (1e-6) of the "
        "gradient on its own: a softmax or statistics over dim 0, a `view` that mixes the batch "
        "with another dimension. When the model trains batch norms and the dependence vanishes "
        "with them in eval mode, an `info` (`details.cause: batch_norm`). `details.sample`, "
        "`details.other_samples`, `details.inputs`, `details.share`. A batch of one is "
        "`not_observed`. Inside a sample, what is declared must hold too (same leaves, batch "
        "norms in eval): where the model declares itself causal (an attention module's `is_causal "
        "= True`, as Hugging Face's decoders; a class named `Causal...`; or `causal: true`; never "
        "an encoder-decoder), the middle position's output must not reach a later input (a `triu` "
        "mask, `is_causal` not passed to `scaled_dot_product_attention`, `nn.TransformerEncoder` "
        "without its mask); where the batch has a 0/1 `attention_mask` and the model's `forward` "
        "takes one, the kept positions' outputs (a pooled output whole) must not reach the padded "
        "inputs (the mask not passed, a `key_padding_mask` given Hugging Face's 1-for-keep "
        "convention, a mean pooling over the padding). `details.independence` (`batch`, `causal`, "
        "`padding`), `details.reached_positions`; the probes section's `declared` says what was "
        "judged. The padding form on a third-party library's own model (FNet's Fourier mixer, "
        "ConvBERT's convolutions, Funnel's pooling span the padding by design) is `info`, "
        "`details.library_design` naming the package. A batch that declares a graph over its samples (a full-graph GCN: an `(N, N)` "
        "adjacency, dense or sparse, or an `edge_index` `(2, E)` of node numbers below `N`) "
        "couples its nodes by design: when every other sample reached lies within as many hops of "
        "its edges as the model has layers with parameters, the property is not judged, said as "
        "`not_observed` (`probe_graph_batch`) with the hops in the note; a softmax or mean over "
        "the nodes reaches beyond the edges and stays a finding",
    )
