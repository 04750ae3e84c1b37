"""Tests for gradwatch.vectors.parammap: flatten/unflatten, locate, JSON map, quantization."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _examples import RunExample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parameters_to_vector

from gradwatch.vectors.parammap import ParamEntry, ParamMap, ParamMapError

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- models -----------------------------------------------------------------------------
def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)
    )


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(tokens)))


def frozen_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def mixed_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].to(torch.bfloat16)
    return model


def transposed_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight = nn.Parameter(torch.randn(4, 3).t())
    assert not model[0].weight.is_contiguous()
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    return state


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, value in snapshot(model).items():
        assert torch.equal(value, before[name]), name


# --- building the map -------------------------------------------------------------------
def test_entries_follow_named_parameters_order_and_match_parameters_to_vector() -> None:
    model = cnn()
    pmap = ParamMap.from_module(model)
    assert pmap.names == [n for n, _ in model.named_parameters()]
    assert pmap.numel == sum(p.numel() for p in model.parameters())
    assert torch.equal(pmap.flatten(), parameters_to_vector(model.parameters()))
    entry = pmap["4.bias"]
    assert isinstance(entry, ParamEntry)
    assert (entry.kind, entry.shape, entry.dtype, entry.requires_grad) == (
        "param",
        (5,),
        torch.float32,
        True,
    )
    assert entry.end == pmap.numel and "4.bias" in pmap and "nope" not in pmap
    assert [e.name for e in pmap] == pmap.names and len(pmap) == 6
    with pytest.raises(KeyError, match="nope"):
        pmap["nope"]


def test_cnn_round_trip_with_buffers() -> None:
    model = cnn()
    model(torch.randn(2, 3, 6, 6))  # updates running stats and num_batches_tracked
    pmap = ParamMap.from_module(model, include_buffers=True)
    assert pmap.names[-3:] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert pmap["1.running_var"].kind == "buffer"
    assert pmap["1.num_batches_tracked"].dtype == torch.int64
    assert pmap.dtype == torch.float32
    vec = pmap.flatten()
    pmap.unflatten(vec * 3)
    assert torch.equal(pmap.flatten(), vec * 3)
    assert model[1].num_batches_tracked.item() == 3
    assert model[1].num_batches_tracked.dtype == torch.int64


def test_tied_embedding_and_head_appear_once_with_both_names() -> None:
    model = TinyTransformer()
    pmap = ParamMap.from_module(model)
    assert pmap["head.weight"] is pmap["emb.weight"]
    assert pmap["emb.weight"].names == ("emb.weight", "head.weight")
    assert "head.weight" not in pmap.names
    assert pmap.numel == parameters_to_vector(model.parameters()).numel()

    model(torch.randint(0, 11, (2, 5))).sum().backward()
    grads = pmap.flatten("grad")
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pmap.unflatten(grads, "grad")
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
    pmap.unflatten(pmap.flatten() + 1)
    assert torch.equal(model.head.weight, model.emb.weight)


def test_frozen_parameters_are_skipped_or_need_missing_zeros() -> None:
    model = frozen_model()
    assert ParamMap.from_module(model).names == ["2.weight", "2.bias"]
    full = ParamMap.from_module(model, trainable_only=False)
    assert full.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert full["0.weight"].requires_grad is False
    model(torch.randn(5, 3)).sum().backward()
    with pytest.raises(ParamMapError, match=r"missing gradients for '0\.weight', '0\.bias'"):
        full.flatten("grad")
    grads = full.flatten("grad", missing="zeros")
    assert torch.equal(grads[: full["2.weight"].offset], torch.zeros(16))
    assert torch.equal(
        grads[full["2.weight"].offset :], ParamMap.from_module(model).flatten("grad")
    )


def test_mixed_float32_bfloat16_round_trip_and_dtype_checks() -> None:
    model = mixed_model()
    pmap = ParamMap.from_module(model)
    assert pmap.dtype == torch.float32
    assert pmap["1.weight"].dtype == torch.bfloat16
    vec = pmap.flatten()
    assert vec.dtype == torch.float32
    before = snapshot(model)
    pmap.unflatten(vec)
    assert_unchanged(model, before)
    assert pmap.flatten(dtype=torch.bfloat16).dtype == torch.bfloat16
    assert pmap.flatten(dtype=torch.float64).dtype == torch.float64
    pmap.unflatten(vec.double())  # a wider vector is fine
    with pytest.raises(ParamMapError, match=r"bfloat16 vector cannot hold param '0\.weight'"):
        pmap.unflatten(vec.bfloat16())


def test_non_contiguous_parameter_round_trip() -> None:
    model = transposed_model()
    pmap = ParamMap.from_module(model)
    w = model[0].weight
    vec = pmap.flatten()
    entry = pmap["0.weight"]
    assert torch.equal(vec[entry.offset : entry.end], w.detach().reshape(-1))
    pmap.unflatten(torch.arange(pmap.numel, dtype=torch.float32))
    assert not w.is_contiguous()
    assert torch.equal(w.detach(), torch.arange(12.0).view(3, 4))
    assert pmap.locate(5) == ("0.weight", (1, 1))

    model(torch.randn(2, 4)).sum().backward()
    grads = pmap.flatten("grad")
    assert torch.equal(grads[: entry.end], w.grad.reshape(-1))
    model.zero_grad(set_to_none=True)
    pmap.unflatten(grads, "grad")
    assert w.grad.stride() == w.stride()
    assert torch.equal(pmap.flatten("grad"), grads)


def test_flatten_never_aliases_and_accepts_device() -> None:
    model = nn.Linear(2, 1)
    pmap = ParamMap.from_module(model)
    vec = pmap.flatten(device="cpu")
    vec.zero_()
    assert model.weight.abs().sum() > 0


def test_empty_map() -> None:
    pmap = ParamMap.from_module(nn.ReLU())
    assert len(pmap) == 0 and pmap.numel == 0
    assert pmap.flatten().shape == (0,)
    pmap.unflatten(torch.empty(0))
    with pytest.raises(ParamMapError, match="outside the map's 0 elements"):
        pmap.locate(0)


# --- error messages -----------------------------------------------------------------------
def test_wrong_length_names_the_first_parameter_that_does_not_fit() -> None:
    model = cnn()
    pmap = ParamMap.from_module(model)
    before = snapshot(model)
    short = torch.zeros(pmap["1.weight"].offset + 1)
    with pytest.raises(
        ParamMapError, match=r"has 113 elements, the map needs 445: param '1\.weight'"
    ):
        pmap.unflatten(short)
    with pytest.raises(ParamMapError, match=r"2 extra after the last entry '4\.bias'"):
        pmap.unflatten(torch.zeros(pmap.numel + 2))
    with pytest.raises(ParamMapError, match=r"dense 1-D tensor, got shape \(445, 1\)"):
        pmap.unflatten(torch.zeros(pmap.numel, 1))
    assert_unchanged(model, before)


def test_wrong_dtype_writes_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    pmap = ParamMap.from_module(model)
    before = snapshot(model)
    with pytest.raises(
        ParamMapError, match=r"float32 vector cannot hold param '1\.weight' \(float64\)"
    ):
        pmap.unflatten(torch.ones(pmap.numel))
    assert_unchanged(model, before)  # '0.weight' passed the checks but was not written
    with pytest.raises(ParamMapError, match=r"int64 vector cannot hold param '0\.weight'"):
        pmap.unflatten(torch.ones(pmap.numel, dtype=torch.int64))


def test_meta_device_vector_and_meta_model() -> None:
    pmap = ParamMap.from_module(nn.Linear(2, 2))
    with pytest.raises(ParamMapError, match=r"vector is on meta but param 'weight' is on cpu"):
        pmap.unflatten(torch.empty(pmap.numel, device="meta"))
    meta_map = ParamMap.from_module(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ParamMapError, match=r"param 'weight' is on the meta device"):
        meta_map.flatten()
    with pytest.raises(ParamMapError, match=r"vector is on cpu but param 'weight' is on meta"):
        meta_map.unflatten(torch.zeros(6))


def test_missing_grads_listed_by_name() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(7)])
    pmap = ParamMap.from_module(model)
    with pytest.raises(ParamMapError) as info:
        pmap.flatten("grad")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("missing gradients for '0.weight', '0.bias', '1.weight'")
    assert message.endswith("and 4 more; run backward() first or pass missing='zeros'")


def test_other_errors() -> None:
    model = nn.BatchNorm1d(2)
    pmap = ParamMap.from_module(model, include_buffers=True)
    with pytest.raises(ParamMapError, match=r"buffers 'running_mean', 'running_var'"):
        pmap.flatten("grad", missing="zeros")
    with pytest.raises(ParamMapError, match=r"buffers"):
        pmap.unflatten(torch.zeros(pmap.numel), "grad")
    with pytest.raises(ParamMapError, match="source must be"):
        pmap.flatten("weights")  # type: ignore[arg-type]
    with pytest.raises(ParamMapError, match=r"flat index 9 is outside the map's 9 elements"):
        pmap.locate(9)
    with pytest.raises(ParamMapError, match=r"all_reduce_grads needs torch\.distributed"):
        ParamMap.from_module(nn.Linear(1, 1)).all_reduce_grads()
    lazy = nn.LazyLinear(2)
    with pytest.raises(ParamMapError, match=r"param 'weight' is uninitialized"):
        ParamMap.from_module(lazy)


def test_stale_map_is_detected() -> None:
    model = nn.Linear(2, 2)
    pmap = ParamMap.from_module(model)
    model.half()
    with pytest.raises(
        ParamMapError, match=r"param 'weight' changed from float32\[2, 2\] to float16"
    ):
        pmap.flatten()


# --- locate -------------------------------------------------------------------------------
def test_locate_names_a_nan_in_a_flat_gradient() -> None:
    model = cnn()
    pmap = ParamMap.from_module(model)
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    grads = pmap.flatten("grad")
    offset = pmap["0.weight"].offset
    grads[offset + 27 + 2 * 3 + 1] = math.nan  # element (1, 0, 2, 1) of a (4, 3, 3, 3) weight
    index = torch.isnan(grads).nonzero()[0, 0]
    assert pmap.locate(index) == ("0.weight", (1, 0, 2, 1))
    assert pmap.locate(pmap.numel - 1) == ("4.bias", (4,))


# --- JSON ---------------------------------------------------------------------------------
def test_json_round_trip_bind_and_compatibility(tmp_path: Path) -> None:
    model = TinyTransformer()
    pmap = ParamMap.from_module(model)
    path = tmp_path / "map.json"
    path.write_text(pmap.to_json())
    doc = json.loads(path.read_text())
    assert doc["fingerprint"].startswith("sha256:") and len(doc["fingerprint"]) == 71
    assert doc["entries"][0] == {
        "names": ["emb.weight", "head.weight"],
        "offset": 0,
        "numel": 88,
        "shape": [11, 8],
        "dtype": "float32",
        "device": "cpu",
        "kind": "param",
        "requires_grad": True,
    }
    loaded = ParamMap.from_json(path.read_text())
    assert loaded.entries == pmap.entries and loaded.fingerprint == pmap.fingerprint
    assert not loaded.is_bound
    assert loaded.locate(90) == pmap.locate(90)
    with pytest.raises(ParamMapError, match=r"call bind\(model\) first"):
        loaded.flatten()
    with pytest.raises(ParamMapError, match=r"call bind\(model\) first"):
        loaded.unflatten(torch.zeros(loaded.numel))

    other = TinyTransformer()
    assert loaded.check_compatible(other) == []
    assert loaded.bind(other) is loaded and loaded.is_bound
    assert torch.equal(loaded.flatten(), ParamMap.from_module(other).flatten())


def test_check_compatible_lists_differences() -> None:
    pmap = ParamMap.from_json(ParamMap.from_module(TinyTransformer()).to_json())
    untied = TinyTransformer()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    untied.block.linear1 = nn.Linear(8, 32)
    untied.extra = nn.Linear(1, 1, bias=False)
    untied.block.norm2.bias = None
    diffs = pmap.check_compatible(untied)
    assert diffs == [
        "'block.norm2.bias' is missing from the model",
        "the model has an extra param 'head.weight'",
        "the model has an extra param 'extra.weight'",
        "'emb.weight': names ['emb.weight', 'head.weight'] in the map, ['emb.weight'] in the model",
        "'block.linear1.weight': shape [16, 8] in the map, [32, 8] in the model",
        "'block.linear1.bias': shape [16] in the map, [32] in the model",
    ]
    with pytest.raises(ParamMapError, match=r"model does not match the map: 'block\.norm2\.bias'"):
        pmap.bind(untied)
    assert not pmap.is_bound
    half = TinyTransformer().to(torch.float64)
    assert (
        pmap.check_compatible(half)[0]
        == "'emb.weight': dtype float32 in the map, float64 in the model"
    )


def test_from_json_rejects_bad_documents() -> None:
    doc = ParamMap.from_module(nn.Linear(2, 2)).to_dict()
    with pytest.raises(ParamMapError, match="not valid JSON"):
        ParamMap.from_json("{")
    with pytest.raises(ParamMapError, match="not a gradwatch parameter map"):
        ParamMap.from_dict({**doc, "format": "other"})
    tampered = json.loads(json.dumps(doc))
    tampered["entries"][0]["shape"] = [1, 4]
    with pytest.raises(ParamMapError, match="fingerprint or numel does not match"):
        ParamMap.from_dict(tampered)
    tampered["entries"][0]["shape"] = [5]
    with pytest.raises(ParamMapError, match=r"entry 'weight' has offset 0/numel 4, expected 0/5"):
        ParamMap.from_dict(tampered)
    tampered["entries"][0]["dtype"] = "nn"
    with pytest.raises(ParamMapError, match="unknown dtype 'nn'"):
        ParamMap.from_dict(tampered)
    del tampered["entries"][0]["names"]
    with pytest.raises(ParamMapError, match="malformed parameter map document"):
        ParamMap.from_dict(tampered)


# --- quantization -------------------------------------------------------------------------
def special_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        model[0].bias.fill_(0.25)  # constant, max == min
        model[1].bias.zero_()  # all zeros
        model[1].weight.add_(5.0)  # all positive, range excludes zero
    return model


def assert_within_half_step(
    pmap: ParamMap, vec: torch.Tensor, deq: torch.Tensor, meta: dict
) -> None:
    for p in meta["params"]:
        off, n = p["offset"], p["numel"]
        err = (deq[off : off + n].double() - vec[off : off + n].double()).abs().max().item()
        assert err <= p["scale"] / 2 * (1 + 1e-5) + 1e-7, (p["name"], err, p["scale"])


@pytest.mark.parametrize("qdtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("scheme", ["affine", "symmetric"])
def test_quantize_round_trip_within_half_a_step(qdtype: torch.dtype, scheme: str) -> None:
    pmap = ParamMap.from_module(special_model())
    vec = pmap.flatten()
    qvec, meta = pmap.quantize(qdtype, scheme)  # type: ignore[arg-type]
    assert qvec.dtype == qdtype and qvec.shape == vec.shape
    meta = json.loads(json.dumps(meta))  # serialisable, and still usable afterwards
    deq = pmap.dequantize(qvec, meta)
    assert deq.dtype == torch.float32
    assert_within_half_step(pmap, vec, deq, meta)
    zeros = pmap["1.bias"]
    assert torch.equal(deq[zeros.offset : zeros.end], torch.zeros(2))
    const = meta["params"][1]
    assert const["name"] == "0.bias"
    if scheme == "symmetric":
        assert const["zero_point"] == (0 if qdtype == torch.int8 else 128)
    assert ParamMap.from_json(pmap.to_json()).dequantize(qvec, meta).equal(deq)


def test_quantize_mixed_dtypes_and_errors() -> None:
    pmap = ParamMap.from_module(mixed_model())
    qvec, meta = pmap.quantize(torch.uint8)
    assert_within_half_step(pmap, pmap.flatten(), pmap.dequantize(qvec, meta), meta)
    with pytest.raises(ParamMapError, match=r"int8 and torch\.uint8"):
        pmap.quantize(torch.int16)
    with pytest.raises(ParamMapError, match="scheme must be"):
        pmap.quantize(scheme="log")  # type: ignore[arg-type]
    with pytest.raises(ParamMapError, match="different model structure"):
        ParamMap.from_module(nn.Linear(3, 4)).dequantize(qvec, meta)
    with pytest.raises(ParamMapError, match=r"quantized vector is torch\.int8"):
        pmap.dequantize(qvec.to(torch.int8), meta)
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[0] = math.inf
    with pytest.raises(ParamMapError, match=r"cannot quantize parameter 'bias'"):
        ParamMap.from_module(model).quantize()


@PROPERTY
@given(
    values=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32) | st.just(0.0), min_size=1, max_size=40
    ),
    qdtype=st.sampled_from([torch.int8, torch.uint8]),
    scheme=st.sampled_from(["affine", "symmetric"]),
)
def test_quantize_error_bound_property(
    values: list[float], qdtype: torch.dtype, scheme: str
) -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor(values))
    model.c = nn.Parameter(torch.full((3,), values[0]))
    pmap = ParamMap.from_module(model)
    qvec, meta = pmap.quantize(qdtype, scheme)  # type: ignore[arg-type]
    assert_within_half_step(pmap, pmap.flatten(), pmap.dequantize(qvec, meta), meta)


# --- property tests over random module trees --------------------------------------------
@st.composite
def module_trees(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    torch.manual_seed(draw(st.integers(0, 2**16)))
    root = nn.Module()
    leaves = ["linear", "conv", "bn", "emb", "scalar", "empty"] + (["tree"] * (depth < 2))
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(leaves))
        if kind == "tree":
            child: nn.Module = draw(module_trees(depth + 1))
        elif kind == "linear":
            child = nn.Linear(
                draw(st.integers(1, 4)), draw(st.integers(1, 4)), bias=draw(st.booleans())
            )
            if draw(st.booleans()):  # non-contiguous weight
                child.weight = nn.Parameter(torch.randn(child.in_features, child.out_features).t())
        elif kind == "conv":
            child = nn.Conv1d(2, 3, draw(st.integers(1, 3)))
        elif kind == "bn":
            child = nn.BatchNorm1d(draw(st.integers(1, 3)))
        elif kind == "emb":
            child = nn.Embedding(draw(st.integers(1, 5)), 2)
        else:
            child = nn.Module()
            child.p = nn.Parameter(torch.randn(()) if kind == "scalar" else torch.zeros(0, 3))
        child.to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])))
        if draw(st.booleans()):
            child.requires_grad_(False)
        root.add_module(f"m{i}", child)
        if draw(st.integers(0, 4)) == 0:  # shared submodule: tied parameters
            root.add_module(f"alias{i}", child)
    return root


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


@PROPERTY
@given(model=module_trees(), trainable_only=st.booleans(), include_buffers=st.booleans())
def test_unflatten_flatten_round_trip_property(
    model: nn.Module, trainable_only: bool, include_buffers: bool
) -> None:
    pmap = ParamMap.from_module(
        model, trainable_only=trainable_only, include_buffers=include_buffers
    )
    wanted = {
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad or not trainable_only
    }
    if include_buffers:
        wanted |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    assert {n for e in pmap for n in e.names} == wanted
    distinct = {id(t): t for n, t in named_tensors(model).items() if n in wanted}
    assert pmap.numel == sum(t.numel() for t in distinct.values())

    vec = pmap.flatten()
    pmap.unflatten(vec * 2)  # doubling is exact in every dtype
    assert torch.equal(pmap.flatten(), vec * 2)
    pmap.unflatten(vec)
    assert torch.equal(pmap.flatten(), vec)


@PROPERTY
@given(model=module_trees(), data=st.data())
def test_locate_agrees_with_offsets_property(model: nn.Module, data: st.DataObject) -> None:
    pmap = ParamMap.from_module(model, trainable_only=False, include_buffers=True)
    if pmap.numel == 0:
        return
    vec = pmap.flatten()
    named = named_tensors(model)
    for index in data.draw(st.lists(st.integers(0, pmap.numel - 1), min_size=1, max_size=10)):
        name, coords = pmap.locate(index)
        entry = pmap[name]
        assert len(coords) == len(entry.shape)
        flat = 0
        for c, size in zip(coords, entry.shape):
            assert 0 <= c < size
            flat = flat * size + c
        assert entry.offset + flat == index
        assert named[name][coords].to(vec.dtype) == vec[index]


# --- example ------------------------------------------------------------------------------
def test_example_script_runs(run_example: RunExample) -> None:
    result = run_example("parammap_demo.py")
    assert result.returncode == 0, result.stderr
    assert "NaN at" in result.stdout and "max round-trip error" in result.stdout
