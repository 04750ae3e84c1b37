"""A transformers architecture as a corpus program: tiny model, padded batches, Trainer's loop.

The batches are right-padded (each row a different length, ``attention_mask`` 0 on the pad
positions, ``pad_token_id`` in the ids), with ``labels`` as the library expects: the ids with
-100 on padding for a causal LM, -100 outside the masked positions for a masked LM, padded
target sequences with -100 for a seq2seq model, one class per row for sequence
classification. The loop is the ``transformers.Trainer`` default: AdamW with weight decay on
all but biases and norm weights, a linear schedule, ``clip_grad_norm_(1.0)``, ``zero_grad``.
The probe's loss is the model's own, ``model(**batch).loss``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from _harness import Built, Program
from _hf_configs import CannotBuild, V, special_ids, tiny_config
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    get_scheduler,
)

AUTO = {
    "seq2seq_lm": AutoModelForSeq2SeqLM,
    "causal_lm": AutoModelForCausalLM,
    "masked_lm": AutoModelForMaskedLM,
    "sequence_classification": AutoModelForSequenceClassification,
    "base": AutoModel,
}
B, T = 4, 12  # rows, longest row
LENGTHS = (12, 9, 6, 10)  # every row but the first holds padding
STEPS = 3
MAX_PARAMS = 2_000_000  # a config the generic shrinking left large is not tiny
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0


def _text(g: torch.Generator, config: PretrainedConfig, lengths: tuple[int, ...]) -> Any:
    """Right-padded ids and their mask: text tokens never a special id."""
    specials = special_ids(config)
    words = torch.tensor([i for i in range(V) if i not in specials])
    n = max(lengths)
    ids = words[torch.randint(0, len(words), (len(lengths), n), generator=g)]
    mask = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, int(config.pad_token_id))
    return ids, mask


def _batch(g: torch.Generator, config: PretrainedConfig, task: str) -> dict[str, torch.Tensor]:
    ids, mask = _text(g, config, LENGTHS)
    batch = {"input_ids": ids, "attention_mask": mask}
    if task == "causal_lm":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif task == "masked_lm":
        chosen = (torch.rand(ids.shape, generator=g) < 0.3) & (mask == 1)
        chosen[:, 1] = True  # every row predicts at least one token
        batch["labels"] = ids.masked_fill(~chosen, -100)
        mask_id = getattr(config, "mask_token_id", None)
        if isinstance(mask_id, int) and 0 <= mask_id < V:
            batch["input_ids"] = ids.masked_fill(chosen, mask_id)
    elif task == "seq2seq_lm":
        target, tmask = _text(g, config, tuple(max(2, n - 3) for n in LENGTHS))
        batch["labels"] = target.masked_fill(tmask == 0, -100)
    elif task == "sequence_classification":
        batch["labels"] = torch.randint(0, config.num_labels, (B,), generator=g)
    return batch


def _regression_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A base model's loss: its hidden states regressed onto fixed targets, padding masked."""
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    hidden = model(**inputs).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    err = (hidden - batch["targets"].to(hidden.dtype)) ** 2 * mask
    return err.sum() / (mask.sum() * hidden.shape[-1])


def model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The program's loss: the model's own (``model(**batch).loss``), or a base's regression."""
    if "targets" in batch:
        return _regression_loss(model, batch)
    return model(**batch).loss


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The Trainer's groups: weight decay on all but biases and normalisation weights."""
    no_decay: set[str] = set()
    for mname, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, _ in module.named_parameters(recurse=False):
            if is_norm or pname == "bias" or pname.endswith("bias"):
                no_decay.add(f"{mname}.{pname}" if mname else pname)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]


def build_model(model_type: str, task: str) -> nn.Module:
    """The tiny model of ``model_type`` with ``task``'s head, in train mode, or CannotBuild."""
    config = tiny_config(model_type)
    if task == "sequence_classification":
        config.num_labels = 3
    if task == "causal_lm" and getattr(config, "is_decoder", None) is False:
        # An encoder (BERT, RoFormer, BigBird) as a causal LM, as its docs say: "add
        # is_decoder=True" (without it the model sees the tokens it predicts, which
        # sample_dependence rightly reports).
        config.is_decoder = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):  # its size first, without the memory
                size = sum(p.numel() for p in AUTO[task].from_config(config).parameters())
            if size > MAX_PARAMS:
                raise CannotBuild(f"{size} parameters once shrunk (over {MAX_PARAMS})")
            model = AUTO[task].from_config(config)
        except CannotBuild:
            raise
        except Exception as exc:
            raise CannotBuild(f"from_config: {type(exc).__name__}: {_short(exc)}") from exc
    return model.train()


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""


def _step(model: nn.Module, optimizers: Any, batch: Any, i: int) -> None:
    optimizer, scheduler = optimizers
    loss = model_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    scheduler.step()
    model.zero_grad()


def build(model_type: str, task: str) -> Built:
    """One fresh program of ``model_type``: its model, batches, loop and probe loss."""
    model = build_model(model_type, task)
    config = model.config
    g = torch.Generator().manual_seed(1234)
    batches = [_batch(g, config, task) for _ in range(STEPS)]
    try:  # a forward that fails on text is an architecture the corpus cannot run
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if task == "base":
                batches = [_with_targets(model, b, g) for b in batches]
            model_loss(model, batches[0])
    except Exception as exc:
        raise CannotBuild(f"forward: {type(exc).__name__}: {_short(exc)}") from exc
    optimizer = torch.optim.AdamW(_param_groups(model), lr=LR)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=STEPS)
    return Built(
        models=model,
        optimizers=optimizer,
        batches=batches,
        step=lambda m, _o, b, i: _step(m, (optimizer, scheduler), b, i),
        loss_fn=model_loss,
        probe_optimizer=optimizer,
    )


def _with_targets(model: nn.Module, batch: dict[str, Any], g: torch.Generator) -> dict[str, Any]:
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    return {**batch, "targets": torch.randn(hidden.shape, generator=g)}


def program(model_type: str, task: str) -> Program:
    """The corpus program of ``model_type`` with ``task``'s head."""
    return Program(
        name=f"hf-{model_type}-{task}",
        family=f"transformers {task}",
        build=lambda: build(model_type, task),
        source="transformers.Trainer's default loop, tiny config from the auto mappings",
    )
