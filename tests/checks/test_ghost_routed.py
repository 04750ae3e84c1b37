"""``ghost_param`` on routed experts: an expert that got no token in a step is idle by design.

Top-1 routing (Switch) leaves some experts without tokens on a step, most of all at the start;
at step 0 nothing tells such an expert from a forgotten list element. The evidence is its
siblings: elements of the same layout in the same ``ModuleList`` that were called in the
step. Such a ghost is held at ``intermittent_severity`` for ``ROUTED_STEPS`` steps without a
gradient; an expert the router never picks over that many steps is a permanent ghost, and a
named module that is never called is one at once, as before. Elements in a chain (a stack of
blocks, one fed by another) are not experts: the same one idle while every other ran for
``SOLO_STEPS`` steps in a row is a block cut off.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradwatch
from gradwatch.checks.ghost import ROUTED_STEPS, SOLO_STEPS
from gradwatch.errors import GradWatchError


class Top1MoE(nn.Module):
    def __init__(self, n: int = 4, collapsed: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(8, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(n)
        )
        self.collapsed, self.n = collapsed, n
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        probs = F.softmax(self.router(x), -1)
        if self.collapsed:  # a router that always picks the first two experts (a bug)
            probs = probs[:, :2]
        gate, idx = probs.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = gate[sel, None] * expert(x[sel])
        share = F.one_hot(idx, self.n).float().mean(0)[: probs.shape[1]]
        self.aux = self.n * (share * probs.mean(0)).sum()
        return self.head(x + out)


def _train(model: Top1MoE, steps: int, config: dict, seed: int = 0) -> gradwatch.Watcher:
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with gradwatch.watch(model, opt, config=config) as w:
        for _ in range(steps):
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))  # 4 tokens, 4 experts
            loss = F.cross_entropy(model(x), y) + 0.01 * model.aux
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w


def test_an_expert_without_tokens_is_no_live_error_and_fail_fast_does_not_abort() -> None:
    torch.manual_seed(0)
    model = Top1MoE()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradwatch.GradWatchWarning)
        w = _train(model, 12, {"fail_fast": True, "probes": "off"})
    ghosts = w.findings("ghost_param")
    assert ghosts and all(f.severity == "info" for f in ghosts)
    assert all("experts." in (f.module or "") for f in ghosts)


def test_an_expert_the_router_never_picks_becomes_a_permanent_ghost() -> None:
    torch.manual_seed(0)
    w = _train(Top1MoE(collapsed=True), ROUTED_STEPS + 5, {"probes": "off"})
    errors = [f for f in w.findings("ghost_param") if f.severity == "error"]
    assert {f.module for f in errors} == {"experts.2", "experts.3"}
    assert all(f.details["steps_seen"] == 0 for f in errors)


def test_fail_fast_stops_a_collapsed_router_once_the_patience_is_spent() -> None:
    torch.manual_seed(0)
    with pytest.raises(GradWatchError):
        _train(Top1MoE(collapsed=True), ROUTED_STEPS + 5, {"fail_fast": True, "probes": "off"})


class UnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.heads = nn.ModuleDict({"cls": nn.Linear(8, 2), "aux": nn.Linear(8, 2)})

    def forward(self, x: Tensor) -> Tensor:
        return self.heads["cls"](self.body(x))  # "aux" built and forgotten


def test_a_named_module_never_called_is_still_an_error_at_step_0() -> None:
    model = UnusedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GradWatchError):
        with gradwatch.watch(model, opt, config={"fail_fast": True, "probes": "off"}):
            F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
            opt.step()


class SwitchClassifier(nn.Module):
    """The new-user trial's program: top-1 routing over 4 experts, 8 tokens a step, a
    load-balancing loss; its router starts unbalanced, so one expert may wait steps for a
    token while the other three get them."""

    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        self.inp, self.router = nn.Linear(8, d), nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d)) for _ in range(n)
        )
        self.head, self.n = nn.Linear(d, 4), n
        self.calls: list[set[int]] = []  # the experts that got a token, per forward

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        probs = F.softmax(self.router(h), -1)
        gate, idx = probs.max(-1)
        out = torch.zeros_like(h)
        self.calls.append(set())
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                self.calls[-1].add(e)
                out[sel] = gate[sel, None] * expert(h[sel])
        self.aux = self.n * (F.one_hot(idx, self.n).float().mean(0) * probs.mean(0)).sum()
        return self.head(F.layer_norm(h + out, h.shape[-1:]))


def test_an_expert_idle_while_every_other_ran_for_steps_is_held_until_it_is_called() -> None:
    torch.manual_seed(54)  # its router leaves expert 1 alone idle in steps 0 to 3
    model = SwitchClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt, config={"fail_fast": True, "probes": "off"}) as w:
            for _ in range(ROUTED_STEPS):
                x = torch.randn(8, 8)
                y = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
                loss = F.cross_entropy(model(x), y) + 0.01 * model.aux
                opt.zero_grad()
                loss.backward()
                opt.step()
    # The evidence the old rule read as a cut-off branch: one expert idle from step 0 while
    # the three others ran, SOLO_STEPS steps in a row; the router picks it later.
    idle = set(range(4)) - model.calls[0]
    assert len(idle) == 1 and all(len(c) == 3 and not idle & c for c in model.calls[:SOLO_STEPS])
    (expert,) = idle
    first = next(step for step, c in enumerate(model.calls) if expert in c)
    assert SOLO_STEPS <= first < ROUTED_STEPS
    assert [r.message for r in record if issubclass(r.category, gradwatch.GradWatchWarning)] == []
    (ghost,) = [f for f in w.findings("ghost_param") if f.module == f"experts.{expert}"]
    assert ghost.severity == "info" and ghost.details["intermittent"]
    assert ghost.details["steps_missing"] >= first  # its idle start, and any idle step later


class Stack(nn.Module):
    """Four blocks in a chain; the loop stops one short, so ``blocks.3`` never runs (a bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks[:-1]:
            x = x + block(x)
        return self.head(x)


def test_a_block_a_chain_skips_every_step_is_an_error_after_solo_steps() -> None:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    with pytest.raises(GradWatchError):
        with gradwatch.watch(model, opt, config={"fail_fast": True, "probes": "off"}):
            for _ in range(ROUTED_STEPS):
                F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
                opt.step()
                opt.zero_grad()
                steps += 1
    assert steps == SOLO_STEPS - 1  # aborted in the step SOLO_STEPS - 1, before it returned


class UnusedAttributeHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.cls, self.aux = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.cls(self.body(x))  # self.aux built and forgotten


def test_a_plain_unused_head_is_a_live_error_at_step_0() -> None:
    torch.manual_seed(0)
    model = UnusedAttributeHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(gradwatch.GradWatchWarning) as record:
        with gradwatch.watch(model, opt, config={"probes": "off"}) as w:
            for _ in range(3):
                F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
                opt.step()
                opt.zero_grad()
    ours = [str(r.message) for r in record if issubclass(r.category, gradwatch.GradWatchWarning)]
    assert any("'aux'" in m and "at step 0" in m for m in ours)
    (ghost,) = w.findings("ghost_param")
    assert ghost.severity == "error" and ghost.module == "aux" and ghost.first_step == 0
