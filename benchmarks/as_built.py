"""What the model-as-built source costs (issue 39, SPEC 7 source 1).

Three parts, timed with the process's CPU time (one torch thread):

- the layout read (``gradwatch.sources.built``: shared modules, storage aliases, declared
  ties, param groups and kinds) on the *structure* of a 1.1B-parameter Llama-style model on
  the meta device (no memory for weights), once per layout;
- on a 12-layer GPT-2 (transformers, d=768, random weights, CPU): the same read, the two
  unit looks of ``weight_rows`` (one projection per unit of every Linear/Conv1D weight) and
  the one ``adam_moments`` read, each against one training step of the model;
- the first 8 steps of ``watch()`` on that GPT-2 with the six model-as-built checks on and
  off (every other check as in the default config).

Usage::

    .venv/bin/python benchmarks/as_built.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

import gradwatch
from gradwatch.measure.moments import eps_dominance
from gradwatch.measure.rows import duplicate_rows
from gradwatch.model.hparams import decay_misses, degenerate, param_kinds, read_groups
from gradwatch.model.sharing import declared_ties_broken, shared_modules, storage_aliases
from gradwatch.sources.built import is_transformer

SIX = (
    "shared_module",
    "tie_broken",
    "symmetric_units",
    "optimizer_hparams_degenerate",
    "decay_on_excluded_params",
    "clip_without_effect",
)


def _cpu(fn: Callable[[], Any], repeats: int) -> float:
    """Median CPU seconds of ``fn``."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def layout_read(model: nn.Module, opt: Any) -> None:
    """What BuiltSource._read does, without a watcher."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = read_groups([opt], param_kinds(model), lambda p: names.get(id(p), "?"))
    shared_modules(model)
    declared_ties_broken(model)
    storage_aliases(iter(model.named_parameters()))
    degenerate(groups)
    decay_misses(groups, is_transformer(model))


def llama_1b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=128))


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    big = llama_1b()
    n_big = sum(p.numel() for p in big.parameters())
    opt_big = torch.optim.AdamW(big.parameters(), lr=1e-4)
    read_big = _cpu(lambda: layout_read(big, opt_big), repeats)
    print(
        f"1.1B layout ({n_big / 1e9:.2f}B params, meta): layout read {read_big * 1e3:.1f} ms, once"
    )

    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()
    t_step = _cpu(step, repeats)
    weights = [m.weight for m in model.modules() if type(m).__name__ in ("Conv1D", "Linear")]
    dims = [
        1 if type(m).__name__ == "Conv1D" else 0
        for m in model.modules()
        if type(m).__name__ in ("Conv1D", "Linear")
    ]
    t_read = _cpu(lambda: layout_read(model, opt), repeats)
    t_rows = _cpu(lambda: duplicate_rows(weights, dims).tolist(), repeats)
    t_eps = _cpu(lambda: [eps_dominance(opt, g) for g in opt.param_groups], repeats)
    print(f"GPT-2 12 layers: one step {t_step * 1e3:.0f} ms")
    for label, t, when in (
        ("layout read", t_read, "once per layout"),
        ("unit look", t_rows, "twice per run"),
        ("adam moments", t_eps, "once per run"),
    ):
        print(f"  {label:<13} {t * 1e3:7.1f} ms = {t / t_step:6.1%} of a step, {when}")

    def run(on: bool) -> None:
        checks = {c: {"enabled": on} for c in SIX}
        with gradwatch.watch(model, opt, config={"checks": checks}):
            for _ in range(8):
                step()

    on, off = _cpu(lambda: run(True), 1), _cpu(lambda: run(False), 1)
    print(
        f"  first 8 steps watched: six checks on {on:.2f} s, off {off:.2f} s "
        f"({(on - off) / off:+.1%}, one run each: within the noise below a few %)"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
