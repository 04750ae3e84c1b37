"""ParamMap subsets (include/exclude, adapters between model instances) and shards."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradwatch.vectors.parammap import ParamEntry, ParamMap, ParamMapError


class LoRALinear(nn.Module):
    """A hand-made LoRA wrapper: frozen base plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def lora_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(LoRALinear(nn.Linear(6, 8)), nn.Tanh(), LoRALinear(nn.Linear(8, 3)))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


# --- selection --------------------------------------------------------------------------
def test_include_exclude_select_by_fnmatch_and_are_recorded() -> None:
    model = lora_mlp()
    pmap = ParamMap.from_module(model, include="*lora_*", exclude=["2.*_B"])
    assert pmap.names == ["0.lora_A", "0.lora_B", "2.lora_A"]
    assert pmap.selection == {"include": ["*lora_*"], "exclude": ["2.*_B"]}
    doc = json.loads(pmap.to_json())
    assert doc["include"] == ["*lora_*"] and doc["exclude"] == ["2.*_B"]
    loaded = ParamMap.from_json(pmap.to_json())
    assert loaded.selection == pmap.selection and loaded.entries == pmap.entries
    # A frozen base is out unless asked for; patterns then reach it.
    frozen = ParamMap.from_module(model, include="*.base.*", trainable_only=False)
    assert frozen.names == ["0.base.weight", "0.base.bias", "2.base.weight", "2.base.bias"]
    # Documents written before selections existed still load (no selection recorded).
    old = ParamMap.from_module(model).to_dict()
    del old["include"], old["exclude"]
    assert ParamMap.from_dict(old).selection == {"include": None, "exclude": None}


def test_tied_tensor_is_selected_by_any_name_and_excluded_by_any_name() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    assert ParamMap.from_module(model, include="1.*")[("1.weight")].names == (
        "0.weight",
        "1.weight",
    )
    assert ParamMap.from_module(model, include="0.*", exclude="1.weight").names == []


def test_bad_patterns_are_one_line_errors() -> None:
    model = lora_mlp()
    with pytest.raises(ParamMapError, match=r"include pattern '\*lora_C' matches no parameter"):
        ParamMap.from_module(model, include=["*lora_A", "*lora_C"])
    with pytest.raises(
        ParamMapError,
        match=r"matches only frozen parameters \(e\.g\. '0\.base\.weight'\); pass trainable_only=False",
    ):
        ParamMap.from_module(model, include="*.base.*")
    with pytest.raises(ParamMapError, match="include is an empty list; pass None"):
        ParamMap.from_module(model, include=[])
    with pytest.raises(ParamMapError, match="exclude patterns must be non-empty strings, got 3"):
        ParamMap.from_module(model, exclude=[3])  # type: ignore[list-item]


def test_adapter_moves_between_instances_and_leaves_the_rest_untouched(tmp_path: Path) -> None:
    src, dst = lora_mlp(0), lora_mlp(1)
    x = torch.randn(5, 6)
    adapter = ParamMap.from_module(src, include="*lora_*")
    (tmp_path / "adapter.json").write_text(adapter.to_json())
    torch.save(adapter.flatten(), tmp_path / "adapter.pt")

    before = snapshot(dst)
    target = ParamMap.from_json((tmp_path / "adapter.json").read_text()).bind(dst)
    target.unflatten(torch.load(tmp_path / "adapter.pt"))
    after = snapshot(dst)
    for name, value in after.items():
        if "lora_" in name:
            assert torch.equal(value, src.state_dict()[name]), name
        else:
            assert torch.equal(value, before[name]), name
    # The base weights differ, so the outputs differ: the adapter alone moved.
    assert not torch.allclose(src(x), dst(x))


def test_bind_refuses_a_mismatch_naming_the_first_difference() -> None:
    doc = ParamMap.from_module(lora_mlp(), include="*lora_*").to_json()
    other = nn.Sequential(
        LoRALinear(nn.Linear(6, 8), rank=3), nn.Tanh(), LoRALinear(nn.Linear(8, 3))
    )
    pmap = ParamMap.from_json(doc)
    with pytest.raises(ParamMapError) as info:
        pmap.bind(other)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "model does not match the map: '0.lora_A': shape [2, 6] in the map, [3, 6] in the model"
    )
    assert message.endswith("(and 1 more differences)")
    assert not pmap.is_bound
    bare = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(
        ParamMapError, match=r"model does not match the map: '0\.lora_A' is missing from the model"
    ):
        pmap.bind(bare)


# --- a real transformers model with a peft LoRA adapter ---------------------------------
def _gpt2_with_lora(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)  # the same base weights in every instance
    base = transformers.GPT2LMHeadModel(cfg).eval()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
    )
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a deprecated question while wrapping.
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        model = peft.get_peft_model(base, lora)
    torch.manual_seed(seed)
    with torch.no_grad():  # peft starts lora_B at zero: give each instance its own adapter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.floor  # a peft LoRA adapter on a transformers GPT-2
@pytest.mark.parametrize("scheme", ["affine", "symmetric"])
def test_quantized_peft_adapter_reproduces_outputs_in_another_instance(
    scheme: str, tmp_path: Path
) -> None:
    trained, serving = _gpt2_with_lora(1), _gpt2_with_lora(2)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(tokens).logits
        before_serving_logits = serving(tokens).logits

    adapter = ParamMap.from_module(trained, include="*lora_*")
    assert adapter.names and all("lora_" in n for n in adapter.names)
    assert adapter.numel == 2 * (4 * 16 + 48 * 4)  # 2 blocks x (lora_A + lora_B of c_attn)
    qvec, meta = adapter.quantize(torch.int8, scheme)
    (tmp_path / "map.json").write_text(adapter.to_json())
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    torch.save(qvec, tmp_path / "adapter.pt")
    assert qvec.dtype == torch.int8 and qvec.numel() == adapter.numel

    before = snapshot(serving)
    slot = ParamMap.from_json((tmp_path / "map.json").read_text()).bind(serving)
    vec = slot.dequantize(
        torch.load(tmp_path / "adapter.pt"), json.loads((tmp_path / "meta.json").read_text())
    )
    slot.unflatten(vec)

    for name, value in snapshot(serving).items():
        if "lora_" not in name:
            assert torch.equal(value, before[name]), name  # the base is untouched
    # Each adapter weight is within half a quantization step...
    steps = {p["name"]: p["scale"] for p in meta["params"]}
    for name, p in serving.named_parameters():
        if "lora_" in name:
            ref = dict(trained.named_parameters())[name]
            assert float((p - ref).detach().abs().max()) <= steps[name] / 2 + 1e-7, name
    # ...so the outputs match up to quantization error, far closer than another adapter.
    with torch.no_grad():
        got = serving(tokens).logits
    err = float((got - want).abs().max())
    other = float((before_serving_logits - want).abs().max())
    assert err < 0.05 * other, (err, other)
    # And the exact (float) vector reproduces them exactly.
    slot.unflatten(adapter.flatten())
    with torch.no_grad():
        torch.testing.assert_close(serving(tokens).logits, want)


# --- shards -----------------------------------------------------------------------------
def _map_of(sizes: list[int]) -> ParamMap:
    entries, offset = [], 0
    for i, n in enumerate(sizes):
        entries.append(
            ParamEntry(
                (f"p{i}",), offset, n, (n,), torch.float32, torch.device("cpu"), "param", True
            )
        )
        offset += n
    return ParamMap(entries)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=0, max_size=12), world=st.integers(1, 20))
def test_shards_cover_the_vector_exactly_once(sizes: list[int], world: int) -> None:
    pmap = _map_of(sizes)
    shards = [pmap.shard(r, world) for r in range(world)]
    assert shards[0].start == 0 and shards[-1].end == pmap.numel
    for a, b in zip(shards, shards[1:]):
        assert a.end == b.start  # contiguous, no gap, no overlap
    sizes_owned = [s.numel for s in shards]
    assert max(sizes_owned) - min(sizes_owned) <= 1  # balanced
    covered: list[tuple[str, int]] = []
    for s in shards:
        flat = s.start
        for piece in s.pieces:
            assert piece.offset == flat and piece.numel > 0  # pieces tile the shard in order
            entry = pmap[piece.name]
            assert entry.offset + piece.start == piece.offset
            assert piece.partial == (piece.numel < entry.numel)
            covered += [(piece.name, piece.start + j) for j in range(piece.numel)]
            flat += piece.numel
        assert flat == s.end
    expected = [(e.name, j) for e in pmap for j in range(e.numel)]
    assert covered == expected  # every element of every entry exactly once, in order
    vec = torch.arange(float(pmap.numel))
    assert torch.equal(torch.cat([s.take(vec) for s in shards]), vec)


def test_shard_of_a_real_model_and_errors() -> None:
    pmap = ParamMap.from_module(nn.Linear(3, 2))  # weight: 6, bias: 2
    first, second = pmap.shard(0, 3), pmap.shard(1, 3)
    assert (first.start, first.end, first.names) == (0, 2, ["weight"])
    assert (second.start, second.end) == (2, 5)
    assert [(p.name, p.start, p.numel, p.partial) for p in pmap.shard(2, 3).pieces] == [
        ("weight", 5, 1, True),
        ("bias", 0, 2, False),
    ]
    with pytest.raises(ParamMapError, match=r"rank 3 is outside 0\.\.2"):
        pmap.shard(3, 3)
    with pytest.raises(ParamMapError, match="world_size must be at least 1"):
        pmap.shard(0, 0)
    with pytest.raises(ValueError, match="cannot slice shape"):
        first.take(torch.zeros(7))
