"""``sample_weight_depends_on_split``: accumulated micro-batches that weigh samples unequally.

Violating forms, as practitioners report them: a token-level LM loss averaged per
micro-batch over unequal numbers of non-padded tokens and divided by the accumulation steps
(the transformers gradient-accumulation bug, huggingface/transformers#34191, fixed in 2024
with ``num_items_in_batch``), the same through a Hugging Face model's own ``labels`` loss,
a last partial micro-batch averaged like the full ones, variable-length buckets with an
``nn.CrossEntropyLoss`` module. Correct look-alikes: ``loss / k`` over equal micro-batches,
``reduction='sum'`` divided by the step's total count, a mean rescaled by ``count / total``,
one backward per step, and a uniform scale (no ``/ k``: said nowhere).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import Tensor, nn

import gradwatch

ID = "sample_weight_depends_on_split"
V, D, PAD = 50, 16, -100


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.rnn = nn.GRU(D, D, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


def _micro(gen: torch.Generator, rows: int, length: int, real: int) -> tuple[Tensor, Tensor]:
    """``rows`` sequences of ``length`` with ``real`` non-padded target tokens each."""
    ids = torch.randint(0, V, (rows, length), generator=gen)
    labels = ids.clone()
    labels[:, real:] = PAD
    return ids, labels


Step = Callable[[nn.Module, list[tuple[Tensor, Tensor]]], None]


def _run(step: Step, shapes: list[tuple[int, int, int]], model: Any = None) -> Any:
    model = model if model is not None else TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for _ in range(3):
            micro = [_micro(gen, *s) for s in shapes]
            opt.zero_grad()
            step(model, micro)
            opt.step()
    assert torch._C._len_torch_function_stack() == 0
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _ce(model: nn.Module, ids: Tensor, labels: Tensor, **kw: Any) -> Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=PAD, **kw)


def mean_per_micro_over_k(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
    """The accumulation loop of transformers' Trainer before the fix: mean, then / k."""
    for ids, labels in micro:
        (_ce(model, ids, labels) / len(micro)).backward()


def sum_over_total(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
    """The fix: a sum over each micro-batch divided by the step's non-ignored tokens."""
    total = sum(int((labels != PAD).sum()) for _, labels in micro)
    for ids, labels in micro:
        (_ce(model, ids, labels, reduction="sum") / total).backward()


def mean_rescaled(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
    total = sum(int((labels != PAD).sum()) for _, labels in micro)
    for ids, labels in micro:
        n = int((labels != PAD).sum())
        (_ce(model, ids, labels) * n / total).backward()


def mean_no_division(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
    for ids, labels in micro:
        _ce(model, ids, labels).backward()


UNEQUAL = [(4, 12, 12), (4, 12, 3)]  # 48 and 12 non-padded target tokens
EQUAL = [(4, 12, 8), (4, 12, 8)]


def test_the_hf_accumulation_bug_mean_of_means_over_unequal_tokens_is_a_warning() -> None:
    (f,) = _found(_run(mean_per_micro_over_k, UNEQUAL))
    assert f.severity == "warning" and f.details["counts"] == [48.0, 12.0]
    assert f.details["reduction"] == "mean" and "cross_entropy" in f.message
    assert "test_sample_weight_split.py" in (f.details["called_at"] or "")
    assert f.details["element_weights"][1] == pytest.approx(
        4 * f.details["element_weights"][0], rel=1e-4
    )


def test_a_last_partial_micro_batch_averaged_like_the_full_ones_is_found() -> None:
    crit = nn.CrossEntropyLoss()

    def step(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
        for ids, labels in micro:  # no padding: only the rows differ (16, 16, 4)
            (crit(model(ids).flatten(0, 1), labels.flatten()) / len(micro)).backward()

    (f,) = _found(_run(step, [(4, 6, 6), (4, 6, 6), (1, 6, 6)]))
    assert f.details["counts"] == [24.0, 24.0, 6.0]


def test_variable_length_buckets_with_a_loss_module_are_found() -> None:
    crit = nn.CrossEntropyLoss(ignore_index=PAD)

    def step(model: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
        for ids, labels in micro:
            loss = crit(model(ids).reshape(-1, V), labels.reshape(-1))
            (loss / len(micro)).backward()

    assert _found(_run(step, [(2, 20, 20), (2, 5, 5), (2, 9, 9)]))


def test_a_hugging_face_model_labels_loss_accumulated_per_micro_batch_is_found() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)

    def step(m: nn.Module, micro: list[tuple[Tensor, Tensor]]) -> None:
        for ids, labels in micro:
            (m(input_ids=ids, labels=labels).loss / len(micro)).backward()

    (f,) = _found(_run(step, [(2, 12, 12), (2, 12, 3)], model))
    assert f.details["reduction"] == "mean"


@pytest.mark.parametrize(
    ("step", "shapes"),
    [
        (sum_over_total, UNEQUAL),
        (mean_rescaled, UNEQUAL),
        (mean_per_micro_over_k, EQUAL),
        (mean_no_division, EQUAL),
        (mean_per_micro_over_k, [(8, 12, 8)]),
    ],
    ids=["sum_over_total", "mean_rescaled", "equal_over_k", "uniform_scale", "one_backward"],
)
def test_correct_accumulation_designs_are_silent(step: Step, shapes: Any) -> None:
    assert _found(_run(step, shapes)) == []
