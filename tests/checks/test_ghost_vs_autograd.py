"""gradwatch agrees with autograd on random models.

Hypothesis builds random module graphs: Linear, Conv1d and Embedding blocks wired as a DAG,
with unused outputs, ``.detach()`` edges, ``no_grad`` blocks, frozen blocks, tied weights and
blocks that never run. After one training step gradwatch's ghost set (the parameters named by
``ghost_param`` findings) must equal the set autograd itself reports as unreachable:
``torch.autograd.grad(loss, params, allow_unused=True)`` returning ``None`` on a copy of the
same model and inputs, restricted to trainable parameters. On graphs without such defects no
check at warning level or above may fire.

Failing examples are kept in hypothesis' example database (``.hypothesis/``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import gradwatch

D = 6  # feature width of every node
V = 7  # embedding vocabulary
B = 3  # batch

KINDS = ("linear", "conv", "embedding")


@dataclass(frozen=True)
class Block:
    """One block: ``out = tanh(layer(sum of inputs))``; an embedding adds ``emb(ids)``."""

    kind: str
    inputs: tuple[int, ...]  # node ids: 0 is the input ``x``, block k writes node k + 1
    detached: tuple[bool, ...]  # per input edge
    no_grad: bool
    frozen: bool
    tie_to: Optional[int]  # share the weight of an earlier block of the same kind


@dataclass(frozen=True)
class Spec:
    blocks: tuple[Block, ...]  # blocks that run, in order
    never_called: tuple[str, ...]  # kinds of extra blocks that never run
    loss_nodes: tuple[int, ...]
    seed: int

    def defect_free(self) -> bool:
        used = {i for b in self.blocks for i in b.inputs} | set(self.loss_nodes)
        return (
            not self.never_called
            and not any(b.no_grad or any(b.detached) for b in self.blocks)
            and all(k + 1 in used for k in range(len(self.blocks)))
        )


def make_layer(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(D, D)
    if kind == "conv":
        return nn.Conv1d(1, 1, 3, padding=1)
    return nn.Embedding(V, D)


@st.composite
def block_graphs(draw: st.DrawFn, *, clean: bool = False) -> Spec:
    n = draw(st.integers(1, 5))
    blocks: list[Block] = []
    for k in range(n):
        kind = draw(st.sampled_from(KINDS))
        inputs = tuple(sorted(draw(st.sets(st.integers(0, k), min_size=1, max_size=min(3, k + 1)))))
        same = [j for j, b in enumerate(blocks) if b.kind == kind]
        blocks.append(
            Block(
                kind=kind,
                inputs=inputs,
                detached=tuple(False if clean else draw(st.integers(0, 3)) == 0 for _ in inputs),
                no_grad=False if clean else draw(st.integers(0, 4)) == 0,
                frozen=draw(st.integers(0, 4)) == 0,
                tie_to=draw(st.sampled_from([None, *same])) if same else None,
            )
        )
    if clean:
        used = {i for b in blocks for i in b.inputs}
        dangling = [k + 1 for k in range(n) if k + 1 not in used]
        extra = draw(st.sets(st.integers(1, n), max_size=2))
        loss_nodes = tuple(sorted(set(dangling) | extra))
        never: tuple[str, ...] = ()
    else:
        loss_nodes = tuple(sorted(draw(st.sets(st.integers(1, n), min_size=1))))
        never = tuple(draw(st.lists(st.sampled_from(KINDS), max_size=2)))
    return Spec(tuple(blocks), never, loss_nodes, draw(st.integers(0, 2**16)))


class Graph(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.blocks = nn.ModuleList(make_layer(b.kind) for b in spec.blocks)
        self.unused = nn.ModuleList(make_layer(kind) for kind in spec.never_called)
        for layer, b in zip(self.blocks, spec.blocks):
            if b.tie_to is not None:
                layer.weight = self.blocks[b.tie_to].weight
        for layer, b in zip(self.blocks, spec.blocks):
            if b.frozen:
                layer.requires_grad_(False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for layer, b in zip(self.blocks, self.spec.blocks):
            h = sum(nodes[i].detach() if d else nodes[i] for i, d in zip(b.inputs, b.detached))
            with torch.set_grad_enabled(torch.is_grad_enabled() and not b.no_grad):
                if b.kind == "linear":
                    out = layer(h)
                elif b.kind == "conv":
                    out = layer(h.unsqueeze(1)).squeeze(1)
                else:
                    out = layer(ids) + h
            nodes.append(torch.tanh(out))
        return sum(nodes[i].pow(2).mean() for i in self.spec.loss_nodes)  # type: ignore[return-value]


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g), torch.randint(0, V, (B,), generator=g)


def names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def autograd_ghosts(model: nn.Module, spec: Spec) -> Optional[set[str]]:
    """Names of trainable parameters autograd cannot reach (``None``: loss needs no grad)."""
    twin = copy.deepcopy(model)
    params = [p for p in twin.parameters() if p.requires_grad]
    loss = twin(*inputs(spec.seed))
    if not loss.requires_grad:
        return None
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = names_by_tensor(twin)
    return {n for p, g in zip(params, grads) if g is None for n in names[id(p)]}


def watched_run(model: nn.Module, spec: Spec, steps: int) -> gradwatch.Report:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    cfg = {"every_n_steps": 1, "on_internal_error": "raise", "warn": False}
    with gradwatch.watch(model, opt, config=cfg) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(*inputs(spec.seed)).backward()
            opt.step()
    return w.report()


SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@SETTINGS
@given(spec=block_graphs())
def test_ghost_set_equals_autograd_unreachable_set(spec: Spec) -> None:
    model = Graph(spec)
    assume(any(p.requires_grad for p in model.parameters()))  # else watch() refuses it
    expected = autograd_ghosts(model, spec)
    assume(expected is not None)  # nothing trainable reaches the loss: backward() would fail
    assert expected is not None
    report = watched_run(model, spec, steps=1)
    ghosts = {n for f in report.by_check("ghost_param") for n in f.params}
    assert ghosts == expected

    # causes, for layers whose parameters belong to them alone (no tie either way)
    tied = {b.tie_to for b in spec.blocks} | {
        k for k, b in enumerate(spec.blocks) if b.tie_to is not None
    }
    for f in report.by_check("ghost_param"):
        kind, _, k = (f.module or "").partition(".")
        if kind == "unused":
            assert f.details["cause"] == "not_called"
        elif kind == "blocks" and int(k) not in tied:
            want = "no_grad" if spec.blocks[int(k)].no_grad else "disconnected"
            assert f.details["cause"] == want


@SETTINGS
@given(spec=block_graphs(clean=True))
def test_no_warning_on_graphs_without_defects(spec: Spec) -> None:
    assert spec.defect_free()
    model = Graph(spec)
    assume(any(p.requires_grad for p in model.parameters()))
    expected = autograd_ghosts(model, spec)
    assert expected == set()  # the generator's notion of "defect-free" matches autograd's
    report = watched_run(model, spec, steps=3)
    loud = [f.line() for f in report.findings if f.severity in ("warning", "error")]
    assert loud == []
    assert report.steps == 3


def test_generator_covers_the_defects() -> None:
    """The ghost test is only as good as its graphs: make sure every defect is drawn."""
    seen: set[str] = set()

    @settings(max_examples=60, deadline=None, database=None)
    @given(spec=block_graphs())
    def collect(spec: Spec) -> None:
        for b in spec.blocks:
            seen.update(
                name
                for name, on in (
                    ("detach", any(b.detached)),
                    ("no_grad", b.no_grad),
                    ("frozen", b.frozen),
                    ("tied", b.tie_to is not None),
                    (b.kind, True),
                )
                if on
            )
        if spec.never_called:
            seen.add("never_called")
        used = {i for b in spec.blocks for i in b.inputs} | set(spec.loss_nodes)
        if any(k + 1 not in used for k in range(len(spec.blocks))):
            seen.add("unused_output")

    collect()
    assert seen >= {"detach", "no_grad", "frozen", "tied", "never_called", "unused_output", *KINDS}


@pytest.mark.parametrize(
    "spec",
    [
        # a tied pair whose second use is detached: the shared weight still learns
        Spec(
            (
                Block("linear", (0,), (False,), False, False, None),
                Block("linear", (1,), (True,), False, False, 0),
            ),
            (),
            (2,),
            0,
        ),
        # an embedding run under no_grad feeding the loss: a no_grad ghost
        Spec(
            (
                Block("embedding", (0,), (False,), True, False, None),
                Block("conv", (0,), (False,), False, False, None),
            ),
            ("linear",),
            (1, 2),
            1,
        ),
    ],
    ids=["tied-detached", "embedding-no-grad"],
)
def test_known_graphs(spec: Spec) -> None:
    model = Graph(spec)
    expected = autograd_ghosts(model, spec)
    assert expected is not None
    report = watched_run(model, spec, steps=1)
    assert {n for f in report.by_check("ghost_param") for n in f.params} == expected
