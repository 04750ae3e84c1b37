"""Adapter hot-swap: one base model in memory, small LoRA adapters swapped in by name.

Two copies of a base model get their own LoRA adapter (trained a few steps on different
targets). Each adapter is extracted with ``ParamMap.from_module(model, include="*lora_*")``,
saved as an int8 vector plus its JSON map, and later written into a single serving
instance of the base: outputs are reproduced within quantization error and no base
weight is touched. A map that does not fit the serving model is refused in one line.

The same patterns select peft's adapters (``include="*lora_*"`` matches
``...lora_A.default.weight``); ``tests/vectors/test_parammap_subsets.py`` does this with a real
``transformers`` GPT-2 and ``peft``.

Run with ``python examples/adapter_hotswap.py`` (gradwatch importable).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from gradwatch.vectors.parammap import ParamMap, ParamMapError


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * B A x`` with the base frozen (Hu et al., 2021)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / base.in_features**0.5)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.lora_A.t() @ self.lora_B.t())


class TinyLM(nn.Module):
    """Embedding, attention, a feed-forward block with LoRA on both linears, a head."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)  # every instance starts from the same base weights
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.up = LoRALinear(nn.Linear(dim, 2 * dim))
        self.down = LoRALinear(nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        for module in (self.emb, self.attn, self.head):
            module.requires_grad_(False)  # only the adapter trains

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.down(nn.functional.gelu(self.up(h)))
        return self.head(h)


def fine_tune(shift: int, steps: int = 30) -> TinyLM:
    """A copy of the base whose adapter learns to predict ``token + shift``."""
    model = TinyLM()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(shift)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (16, 8), generator=g)
        loss = nn.functional.cross_entropy(
            model(tokens).flatten(0, 1), ((tokens + shift) % 32).flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def save_adapter(model: nn.Module, folder: Path) -> None:
    adapter = ParamMap.from_module(model, include="*lora_*")
    qvec, meta = adapter.quantize(torch.int8)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "map.json").write_text(adapter.to_json())
    (folder / "quant.json").write_text(json.dumps(meta))
    torch.save(qvec, folder / "adapter.pt")
    print(f"saved {folder.name}: {len(adapter)} tensors, {adapter.numel:,} int8 values")


def load_adapter(model: nn.Module, folder: Path) -> None:
    slot = ParamMap.from_json((folder / "map.json").read_text()).bind(model)
    meta = json.loads((folder / "quant.json").read_text())
    slot.unflatten(slot.dequantize(torch.load(folder / "adapter.pt"), meta))


def main(out: Path) -> None:
    tenants = {"plus1": fine_tune(1), "plus5": fine_tune(5)}
    for name, model in tenants.items():
        save_adapter(model, out / name)

    serving = TinyLM().eval()
    base = {k: v.clone() for k, v in serving.state_dict().items() if "lora_" not in k}
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        # How far apart the two tenants are: the scale an int8 error must stay well below.
        apart = (tenants["plus1"](tokens) - tenants["plus5"](tokens)).abs().max().item()
        for name, model in tenants.items():
            load_adapter(serving, out / name)
            err = (serving(tokens) - model(tokens)).abs().max().item()
            acc = (serving(tokens).argmax(-1) == model(tokens).argmax(-1)).float().mean().item()
            print(
                f"{name}: max |logit error| {err:.2e} (tenants differ by {apart:.2f}), "
                f"same prediction {acc:.0%}"
            )
            assert err < 0.05 * apart and acc > 0.9, (name, err, apart, acc)
    untouched = all(torch.equal(v, serving.state_dict()[k]) for k, v in base.items())
    print(f"base weights untouched: {untouched}")
    assert untouched

    bigger = TinyLM()
    bigger.up = LoRALinear(nn.Linear(32, 64), r=8)  # a different adapter rank
    try:
        load_adapter(bigger, out / "plus1")
    except ParamMapError as exc:
        print(f"refused: {exc}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
