"""``tie_broken``: parameters meant to be one that are two objects.

Two forms, both read once per layout (``model_as_built``, :mod:`gradwatch.model.sharing`):
distinct ``Parameter`` objects over the very same memory (``load_state_dict(assign=True)``
of a tied checkpoint gives each name its own), which the optimizer steps one by one; and a
model that declares its input and output embeddings tied (Hugging Face's
``config.tie_word_embeddings``) whose two weights are different objects (an embedding
replaced after ``tie_weights``).

Correct and silent: a tie kept as one object (``head.weight = emb.weight``),
``resize_token_embeddings`` (it re-ties), views of one flat buffer at different offsets, a
model declared untied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks._as_built import AsBuiltCheck
from gradwatch.checks.base import CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class TieBrokenConfig(CheckConfig):
    """``tie_broken``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class TieBroken(AsBuiltCheck):
    """Once per layout read: aliased storages, and declared ties that are two objects."""

    id = "tie_broken"
    maturity = "stable"
    Config = TieBrokenConfig
    needs = frozenset({"model_as_built"})
    doc = CheckDoc(
        summary="Parameters meant to be one are two: distinct Parameter objects over one "
        "storage, or input and output embeddings a model declares tied that are different "
        "objects.",
        why="Over one storage, each object gets its own gradient and the optimizer steps the "
        "memory once per object (and its moments are kept twice). Declared tied but untied, "
        "the output layer trains apart from the embedding, with twice the parameters.",
        causes=(
            "`model.load_state_dict(sd, assign=True)` of a tied checkpoint: each name gets "
            "its own Parameter over the shared storage.",
            "The input embedding replaced (`model.embed = nn.Embedding(...)`, "
            "`set_input_embeddings`) after the head was tied to it.",
            "A Parameter rebuilt from another's data (`nn.Parameter(emb.weight.data)`).",
        ),
        fix="Tie by assignment after loading or replacing: `model.lm_head.weight = "
        "model.embed.weight`, or call the model's `tie_weights()`; set "
        "`tie_word_embeddings=False` if untied embeddings are meant.",
        detail="parameters meant to be one are two objects: distinct `Parameter`s over the very "
        "same memory (`load_state_dict(assign=True)` of a tied checkpoint, "
        "`nn.Parameter(emb.weight.data)`), each stepped on its own (`details.form: storage`), or "
        "a model that declares its input and output embeddings tied "
        "(`config.tie_word_embeddings`) whose two weights are different objects, e.g. an "
        "embedding replaced after `tie_weights` (`declared`). Read once per layout from storages "
        "and the model's own getters; `resize_token_embeddings`, a model declared untied and "
        "views of one flat buffer at different offsets are fine. Not judged on FSDP's flat "
        "parameters",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        built = self.fresh(view)
        if built is None:
            return
        for tie in built.ties:
            names = list(tie.names)
            if tie.how == "storage":
                message = (
                    f"{', '.join(repr(n) for n in names)} are {len(names)} Parameter objects "
                    "over the same memory: each gets its own gradient and is stepped on its "
                    "own, so the shared weight is updated once per object."
                )
                hint = (
                    f"Make them one object: `{names[-1]} = {names[0]}` (or the model's "
                    "`tie_weights()`) after `load_state_dict(..., assign=True)`."
                )
            else:
                message = (
                    f"'{tie.model}' declares its input and output embeddings tied "
                    f"(config.tie_word_embeddings) but {names[0]!r} and {names[1]!r} are "
                    "different objects: the output layer trains apart from the embedding."
                )
                hint = (
                    "Call `model.tie_weights()` after replacing the input embedding (or set "
                    "`tie_word_embeddings=False` if untied embeddings are meant)."
                )
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=message,
                hint=hint,
                params=names,
                key=f"{tie.how}:{names[0]}",
                details={
                    "form": tie.how,
                    "names": names,
                    **({"model": tie.model} if tie.model else {}),
                },
            )
