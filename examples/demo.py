"""gradwatch demo: train a small model with three silent bugs and print what gradwatch finds.

The bugs, as they appear in real code:
1. ``aux_head`` is built but never called (a leftover auxiliary loss): a ghost layer that
   crashes DDP without ``find_unused_parameters=True``.
2. ``text_proj`` runs under ``torch.no_grad()`` (copied from an evaluation helper): it never
   trains although it is meant to.
3. ``pooler`` runs but its output is ignored, like a Hugging Face pooler nobody reads.

Run: ``bash .ci/demo`` (installs, then runs this file). Writes gradwatch-report.json and,
with matplotlib installed, report.html next to the current directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gradwatch


class BuggyClassifier(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.text_proj = nn.Linear(dim, dim)
        self.pooler = nn.Linear(dim, dim)
        self.head = nn.Linear(2 * dim, classes)
        self.aux_head = nn.Linear(dim, classes)  # bug 1: never called

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens)).mean(dim=1)
        with torch.no_grad():  # bug 2: gradients disabled for a layer that should train
            t = self.text_proj(h)
        _pooled = torch.tanh(self.pooler(h))  # bug 3: computed, never used
        return self.head(torch.cat([h, t], dim=1))


def main(out_dir: Path = Path(".")) -> gradwatch.Report:
    torch.manual_seed(0)
    model = BuggyClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    config = gradwatch.GradWatchConfig(
        every_n_steps=5, warn=False, report_path=out_dir / "gradwatch-report.json"
    )

    with gradwatch.watch(model, optimizer, config=config) as watcher:
        for _ in range(20):  # an ordinary, unmodified training loop
            tokens = torch.randint(0, 100, (16, 12))
            labels = torch.randint(0, 4, (16,))
            optimizer.zero_grad()
            loss_fn(model(tokens), labels).backward()
            optimizer.step()

    report = watcher.report()
    report.print()
    print(f"\nJSON report: {config.report_path}")
    try:
        html = report.to_html(out_dir / "report.html")
        print(f"HTML report: {html}")
    except ImportError as exc:  # matplotlib is the optional `html` extra
        print(f"(no HTML report: {exc})")
    return report


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    main(out)
