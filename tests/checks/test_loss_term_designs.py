"""``loss_term_dominates`` on designs whose auxiliary terms are small on purpose (SPEC 8.1).

Correct designs that gave a warning (issue 50): the Mixtral and Qwen2-MoE causal LMs as
``transformers`` builds them (``output_router_logits=True``: the router's load-balancing
loss, weighted by ``router_aux_loss_coef``, at balance from the start), BERT's own
pretraining heads (MLM + NSP: the NSP head is small behind its pooler, not its loss), a top-2
MoE with a capacity factor and a load-balancing loss, and a mean teacher's consistency term
(ramped weight, teacher copied from the student). Beside them, the bug forms that must still
fire: a term mis-scaled by 1e3 (millimetres), a main loss summed over tokens next to a
router loss whose coefficient was set for a mean, a drowned term weighted on purpose next
to a term in pixels, a feature regulariser summed over the batch.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch

ID = "loss_term_dominates"


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _train(model: nn.Module, step: Callable[[int], torch.Tensor], steps: int = 4) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(steps):
            step(k).backward()
            opt.step()
            opt.zero_grad()
    return w.report()


def _lm_batch(k: int, vocab: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(1, vocab, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # right padding, as a collator makes it
    mask[1, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_moe(kind: str) -> nn.Module:
    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "max_position_embeddings": 64,
    }
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **small))
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **small
    )
    return Qwen2MoeForCausalLM(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_moe_router_loss_is_silent(kind: str) -> None:
    torch.manual_seed(0)
    model = _hf_moe(kind)
    assert not _found(_train(model, lambda k: model(**_lm_batch(k)).loss))


def test_bert_pretraining_heads_are_silent() -> None:
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = BertForPreTraining(cfg)

    def step(k: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(5, 100, (8, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[:3, 12:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (mask == 1)  # 15 % masked
        labels = torch.full_like(ids, -100).masked_scatter(chosen, ids[chosen])
        segments = torch.zeros_like(ids)
        segments[:, 8:] = 1
        out = model(
            input_ids=ids.masked_fill(chosen, 4),  # [MASK]
            attention_mask=mask,
            token_type_ids=segments,
            labels=labels,
            next_sentence_label=torch.randint(0, 2, (8,), generator=g),
        )
        return out.loss

    assert not _found(_train(model, step))


class Top2MoE(nn.Module):
    """A token-level top-2 MoE block (GShard): capacity factor 1.25, dropped overflow tokens,
    and the load-balancing loss ``E * sum(f_e * P_e)`` returned beside the logits."""

    def __init__(self, d: int = 32, experts: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(ids).flatten(0, 1)
        probs = self.gate(h).softmax(-1)
        w, idx = probs.topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        n_exp = len(self.experts)
        capacity = int(1.25 * h.shape[0] * 2 / n_exp)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            tok, slot = tok[:capacity], slot[:capacity]  # over capacity: dropped
            out = out.index_add(0, tok, w[tok, slot, None] * expert(h[tok]))
        first = F.one_hot(idx[:, 0], n_exp).float().mean(0)  # tokens sent to each expert
        aux = n_exp * (first * probs.mean(0)).sum()
        return self.head(h + out).view(*ids.shape, -1), aux


def _tokens(k: int) -> torch.Tensor:
    return torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(k))


def test_top2_moe_with_capacity_and_balancing_loss_is_silent() -> None:
    torch.manual_seed(0)
    model = Top2MoE()

    def step(k: int) -> torch.Tensor:
        ids = _tokens(k)
        logits, aux = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + 0.01 * aux

    assert not _found(_train(model, step))


def test_moe_whose_main_loss_is_summed_over_tokens_still_fires() -> None:
    """The router coefficient was set for a mean; the LM loss summed over 120 tokens."""
    torch.manual_seed(0)
    model = Top2MoE()

    def step(k: int) -> torch.Tensor:
        ids = _tokens(k)
        logits, aux = model(ids[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        return lm + 0.01 * aux

    (f,) = _found(_train(model, step))
    assert f.details["dominant"].startswith("cross_entropy") and f.details["row_grad"] > 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 32), nn.ReLU()
        )
        self.cls = nn.Linear(32, 4)
        self.reg = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.reg(h)


def _batch(k: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g), g


def test_mean_teacher_consistency_is_silent() -> None:
    """Tarvainen & Valpola: a few labelled samples, the rest through a consistency term to an
    EMA teacher, both with their own input noise and dropout; the weight ramps up."""
    torch.manual_seed(0)
    student = Net()
    teacher = copy.deepcopy(student).requires_grad_(False)

    def step(k: int) -> torch.Tensor:
        if k:  # the EMA update after each step
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.mul_(0.99).add_(s, alpha=0.01)
        x, y, g = _batch(k)
        s_logits, _ = student(x + 0.1 * torch.randn(x.shape, generator=g))
        with torch.no_grad():
            t_logits, _ = teacher(x + 0.1 * torch.randn(x.shape, generator=g))
        ramp = 10.0 * math.exp(-5 * (1 - k / 30) ** 2)  # sigmoid ramp-up, as the paper's
        consistency = F.mse_loss(s_logits.softmax(1), t_logits.softmax(1))
        return F.cross_entropy(s_logits[:8], y[:8]) + ramp * consistency

    assert not _found(_train(student, step))


def test_term_in_millimetres_still_fires() -> None:
    """Depth in millimetres (x 1e3 the metres the head is built for) next to a class loss."""
    torch.manual_seed(0)
    model = Net()

    def step(k: int) -> torch.Tensor:
        x, y, g = _batch(k)
        logits, depth = model(x)
        depth_mm = 1000 * (1 + torch.rand(32, 1, generator=g))
        return F.cross_entropy(logits, y) + F.mse_loss(depth, depth_mm)  # an L1 would not care

    (f,) = _found(_train(model, step))
    assert f.details["dominant"] == "mse_loss (reg)" and f.details["exit_share"] > 0.98


def test_weighted_term_next_to_a_term_in_pixels_still_fires() -> None:
    """``0.1 * ce`` is weighted on purpose, but a box loss in pixels drowns it: the main term's
    gradient per sample is hundreds, not that of a unit-scale loss."""
    torch.manual_seed(0)
    model = Net()

    def step(k: int) -> torch.Tensor:
        x, y, g = _batch(k)
        logits, box = model(x)
        return F.mse_loss(box, 640 * torch.rand(32, 1, generator=g)) + 0.1 * F.cross_entropy(
            logits, y
        )

    (f,) = _found(_train(model, step))
    assert f.details["dominant"] == "mse_loss (reg)" and f.details["row_grad"] > 100


def test_feature_regulariser_summed_over_the_batch_still_fires() -> None:
    torch.manual_seed(0)
    model = Net()

    def step(k: int) -> torch.Tensor:
        x, y, _ = _batch(k)
        h = model.body(x)
        return F.cross_entropy(model.cls(h), y) + h.pow(2).sum()  # an activation L2, meant a mean

    (f,) = _found(_train(model, step))
    assert f.details["dominant"].startswith("squared_error")
