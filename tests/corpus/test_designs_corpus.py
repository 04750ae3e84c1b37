"""The clean corpus's canonical designs (SPEC 8.1, issue 50): each must train without a warning.

Every program in ``designs_*.py`` is a correct training program written from its paper or
reference recipe (``Program.source``), including the designs that bend a rule on purpose
(auxiliary losses, gradient reversal, straight-through estimators, second-order gradients,
a full graph as one batch, padding rows). Each trains a few steps under ``watch()`` and goes
through ``gradwatch.probe`` when it has a loss function; any warning or error fails it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import designs_adaptation
import designs_generative
import designs_language
import designs_mechanics
import designs_recipes
import designs_regularisers
import designs_representation
import designs_rl
import designs_robust
import designs_rule_benders
import designs_semisupervised
import designs_sequence
import designs_tiny
import designs_training
import designs_vision
import pytest
from _harness import Program, assert_clean_but_known, known_false_alarms, run_program
from _threads import one_thread

__all__ = ["one_thread"]  # the autouse fixture: one thread, as the probe tests run

MODULES = (
    designs_vision,
    designs_training,
    designs_generative,
    designs_sequence,
    designs_representation,
    designs_rl,
    designs_robust,
    designs_rule_benders,
    designs_adaptation,
    designs_tiny,
    designs_regularisers,
    designs_semisupervised,
    designs_language,
    designs_recipes,
    designs_mechanics,
)
PROGRAMS: list[Program] = [p for m in MODULES for p in m.PROGRAMS]
#: The false alarms the designs still get (issue 50, open): a new one fails the test.
KNOWN = known_false_alarms(Path(__file__).with_name("designs_known_false_alarms.tsv"))

# Each family issue 50 names has at least one program here (SPEC 8.1's list of designs).
FAMILIES = {
    "moe", "bert pretraining", "mean teacher", "dann", "binary net", "vq-vae", "gan", "maml",
    "truncated bptt", "gcn", "contrastive", "metric learning", "data mixing", "pruning",
    "lora", "distillation", "dqn", "policy gradient", "adversarial training",
    "universal perturbation", "vae", "diffusion", "segmentation", "ctc", "seq2seq",
    "padded text classifier", "online sgd", "tiny model", "multi-task", "normalizing flow",
    "checkpointing", "amp", "accumulation",
}  # fmt: skip


def test_the_corpus_covers_every_named_family_with_unique_names() -> None:
    names = Counter(p.name for p in PROGRAMS)
    assert [n for n, c in names.items() if c > 1] == []
    assert len(PROGRAMS) >= 60
    assert FAMILIES - {p.family for p in PROGRAMS} == set()
    assert all(p.source for p in PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_a_correct_design_gets_no_warning(program: Program) -> None:
    assert_clean_but_known(program, run_program(program), KNOWN.get(program.name, set()))
