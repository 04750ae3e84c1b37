"""``ghost_param`` inside a library's own model (issue 50): by its design, ``info``.

A Hugging Face model's forward leaves parts of itself out (a pooler no masked LM uses, the
cross-attention of a decoder run alone): the corpus's correct programs gave 19 ghost errors
on such parameters. Leaving out the library model itself, or running it under ``no_grad``, is
still the user's ghost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradwatch

transformers = pytest.importorskip("transformers")

CHECK = "ghost_param"


def _bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertModel(config)


class Tagger(nn.Module):
    """The user's own model: a token head on a Hugging Face encoder's last hidden state."""

    def __init__(self, frozen_by_mistake: bool = False) -> None:
        super().__init__()
        self.bert, self.head = _bert(), nn.Linear(16, 3)
        self.frozen_by_mistake = frozen_by_mistake

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(not self.frozen_by_mistake and torch.is_grad_enabled()):
            hidden = self.bert(input_ids=ids).last_hidden_state
        return self.head(hidden)


def _train(model: nn.Module, forward: Any, config: dict[str, Any] | None = None) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(1, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    with gradwatch.watch(model, opt, config={"probes": "off", **(config or {})}) as w:
        for _ in range(3):
            opt.zero_grad()
            forward(model, ids).pow(2).mean().backward()
            opt.step()
    return w.report().by_check(CHECK)


def test_a_pooler_the_users_loss_never_reads_is_the_librarys_design() -> None:
    (found,) = _train(_bert(), lambda m, ids: m(input_ids=ids).last_hidden_state)
    assert found.severity == "info" and found.module == "pooler.dense"
    assert found.details["library_design"] == "transformers"
    assert "transformers's own model" in found.hint


def test_inside_the_users_own_model_it_is_the_users_ghost() -> None:
    """The user's model discards the pooler's output: plain DDP crashes on it."""
    (found,) = _train(Tagger(), lambda m, ids: m(ids))
    assert found.severity == "error" and "library_design" not in found.details
    assert found.params == ["bert.pooler.dense.weight", "bert.pooler.dense.bias"]


def test_a_head_the_user_set_on_the_library_model_is_the_users() -> None:
    model = _bert()
    model.aux = nn.Linear(16, 2)  # not in BertModel's source: set from outside

    def forward(m: Any, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids).pooler_output

    (found,) = _train(model, forward)
    assert found.severity == "error" and found.module == "aux"


def test_a_library_layer_whose_forward_the_user_replaced_is_the_users() -> None:
    model = _bert()
    layer = model.encoder.layer[0].attention.output.dense
    layer.forward = lambda h: torch.zeros_like(h)  # type: ignore[method-assign]
    found = _train(model, lambda m, ids: m(input_ids=ids).pooler_output)
    dense = [f for f in found if "encoder.layer.0.attention.output.dense.weight" in f.params]
    assert dense and dense[0].severity == "error" and "library_design" not in dense[0].details


def test_the_library_model_run_under_no_grad_by_the_user_is_the_users_ghost() -> None:
    (found,) = _train(Tagger(frozen_by_mistake=True), lambda m, ids: m(ids))
    assert found.severity == "error" and found.module == "bert"
    assert "library_design" not in found.details


def test_library_severity_is_configurable() -> None:
    cfg = {"checks": {CHECK: {"library_severity": "warning"}}}
    (found,) = _train(_bert(), lambda m, ids: m(input_ids=ids).last_hidden_state, cfg)
    assert found.severity == "warning"
