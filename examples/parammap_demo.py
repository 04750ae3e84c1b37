"""ParamMap demo: name the parameter behind a NaN in a flat gradient, export the map, quantize.

Run with ``python examples/parammap_demo.py`` (gradwatch importable).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from gradwatch.vectors.parammap import ParamMap


class TiedLM(nn.Module):
    """Tiny language model: embedding tied to the output head, a frozen projection."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.mlp(self.frozen(h)))


def main() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    pmap = ParamMap.from_module(model)  # trainable only: the frozen projection is left out
    print(f"{len(pmap)} entries, {pmap.numel} elements; tied: {pmap['head.weight'].names}")

    tokens = torch.randint(0, 50, (4, 8))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = pmap.flatten("grad")

    grads[pmap["mlp.2.weight"].offset + 37] = float("nan")  # simulate a bad gradient
    bad = int(torch.isnan(grads).nonzero()[0, 0])
    name, coords = pmap.locate(bad)
    print(f"NaN at flat index {bad}: {name}{list(coords)}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.parammap.json"
        path.write_text(pmap.to_json())
        loaded = ParamMap.from_json(path.read_text())
        print(f"wrote {path.name} ({path.stat().st_size} bytes), {loaded.fingerprint[:23]}...")
        print(f"compatible with a fresh model: {loaded.check_compatible(TiedLM()) == []}")

    qvec, meta = pmap.quantize(torch.int8, scheme="symmetric")
    error = (pmap.dequantize(qvec, meta) - pmap.flatten()).abs().max().item()
    step = max(p["scale"] for p in meta["params"])
    print(f"int8 max round-trip error {error:.2e} (largest step {step:.2e})")


if __name__ == "__main__":
    main()
