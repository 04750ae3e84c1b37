"""Light arrival hooks (``capture/grads/deferred.py``): tensor pre-hooks whose post-accumulation
work waits for the next such hook or the backward's end, so that torch keeps no hook of
gradwatch's on a parameter the step reads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradwatch
from gradwatch.capture.grads.step_reading import MIN_READ, PACE, ROTATE


def _deep(depth: int = 60) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(8, 8)
        nn.init.orthogonal_(lin.weight)  # a deep tanh stack that still trains
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers)


def _train(model: nn.Module, light: bool, steps: int = 30) -> tuple[Any, dict[str, int]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watcher = gradwatch.watch(model, opt)
    watcher._hooks.arrival.light = watcher._hooks.arrival.light and light
    with watcher as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
        hooks = w._hooks
        left = {
            "read": len(hooks.unhooked),
            "hooked": len(hooks.param),
            "light": len(hooks.arrival.lit),
            "post dicts": sum(
                p._post_accumulate_grad_hooks is not None for p in model.parameters()
            ),
            "pre dicts": sum(p._backward_hooks is not None for p in model.parameters()),
        }
    return w.report(), left


def test_a_read_parameter_keeps_no_hook_torch_would_still_call() -> None:
    """Post hooks torch keeps calling, emptied, once removed: only where one stays on."""
    report, left = _train(_deep(), light=True)
    assert report.findings == []
    assert left["read"] >= MIN_READ
    # every post hook dict belongs to a parameter still hooked, every pre-hook dict too
    assert left["post dicts"] == left["hooked"] - left["light"]
    assert left["pre dicts"] <= left["hooked"]
    _, post = _train(_deep(), light=False)
    assert post["post dicts"] == 120  # what light hooks spare: one per parameter read


def test_light_is_off_where_another_engine_writes_the_gradients() -> None:
    """``torch.compile`` keeps every hook; ``DataParallel`` replicates: post hooks only."""
    watcher = gradwatch.watch(nn.DataParallel(_deep(2)))
    assert not watcher._hooks.arrival.light
    assert gradwatch.watch(_deep(2))._hooks.arrival.light


def test_autograd_grad_runs_the_pre_hooks_but_accumulates_nothing() -> None:
    """A head only ever differentiated by ``torch.autograd.grad`` (read, never trained) gets
    no gradient: the pre-hooks fire there, the flush sees ``.grad`` unchanged."""
    torch.manual_seed(0)
    body, probe = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"body": body, "probe": probe})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        assert w._hooks.arrival.light
        for _ in range(12):
            opt.zero_grad()
            h = body(torch.randn(8, 4))
            sensitivity = torch.autograd.grad(probe(h.detach()).sum(), list(probe.parameters()))
            assert all(g is not None for g in sensitivity)
            h.square().mean().backward()
            opt.step()
    ghosts = {p for f in w.report().by_check("ghost_param") for p in f.params}
    assert ghosts == {"probe.weight", "probe.bias"}
    assert all(p.grad is None for p in probe.parameters())


def test_an_optimizer_hooked_in_after_watch_sees_a_post_hook_first() -> None:
    """Someone else's post-accumulate hook (an optimizer stepped in backward) turns a light
    hook into a post hook ahead of it, at the arrival itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opts = {p: torch.optim.SGD([p], lr=0.01) for p in model.parameters()}
    order: list[str] = []

    def theirs(p: torch.Tensor) -> None:
        order.append("theirs")
        opts[p].step()
        opts[p].zero_grad()

    with gradwatch.watch(model, list(opts.values())) as w:
        assert w._hooks.arrival.light
        handles = [p.register_post_accumulate_grad_hook(theirs) for p in model.parameters()]
        for _ in range(3):
            model(torch.randn(4, 4)).square().mean().backward()
        for p in model.parameters():
            first = next(iter(p._post_accumulate_grad_hooks.values()))
            assert first is not theirs  # gradwatch's, ahead of the optimizer's
        assert not w._hooks.arrival.lit
    for h in handles:
        h.remove()
    report = w.report()
    assert report.findings == [] and report.backward_passes == 3


def test_autograd_grad_moves_no_arrival_of_a_gradient_kept_in_place() -> None:
    """``zero_grad(set_to_none=False)`` keeps each ``.grad``: a ``torch.autograd.grad`` call
    over the parameters then finds the same tensor at the same version, no arrival."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        assert w._hooks.arrival.light
        for _ in range(2):
            opt.zero_grad(set_to_none=False)
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
        opt.zero_grad(set_to_none=False)
        before = list(w._tracker.last_seq)
        torch.autograd.grad(model(torch.randn(8, 4)).sum(), list(model.parameters()))
        assert w._tracker.last_seq == before


def test_a_layer_frozen_in_the_first_steps_keeps_the_same_findings() -> None:
    """Frozen before the choice and trained again after it: the light hook stays, silent,
    while frozen, becomes a post hook once it trains, and the run says what post hooks say."""

    def run(light: bool) -> set[tuple[str, str, tuple[str, ...]]]:
        model = _deep()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        watcher = gradwatch.watch(model, opt)
        watcher._hooks.arrival.light = light
        with watcher as w:
            for s in range(30):
                if s in (3, 20):
                    model[10].requires_grad_(s == 20)  # frozen, then trained again
                opt.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
        return {(f.check, f.severity, tuple(sorted(f.params))) for f in w.report().findings}

    light = run(True)
    assert not any(check == "internal_error" for check, _, _ in light)
    assert light == run(False)


def test_read_parameters_are_compared_in_turns_every_pace_steps() -> None:
    """A turn (``ROTATE`` read parameters hooked for one window, hook and reading compared)
    comes every ``PACE`` steps, none between: a turn costs each parameter a registration,
    two calls and a release. Every read parameter still has its turn within
    ``PACE * ceil(n / ROTATE)`` steps (docs/limits.md)."""
    model = _deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compared: dict[int, set[int]] = {}  # step (from 0) -> read parameters its decision hooked
    with gradwatch.watch(model, opt) as w:
        reading = w._pipe.reading
        for step in range(80):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            compared[step] = set(reading.rotating.get(0, ()))
        read = set(w._hooks.unhooked) | set(reading.rotating.get(0, ()))
    assert len(read) >= MIN_READ
    turns = {s for s, ids in compared.items() if ids}
    assert turns and all(s % PACE == 0 for s in turns)
    cycle = PACE * -(-len(read) // ROTATE)
    first = min(turns)
    seen = set().union(*(compared[s] for s in range(first, first + cycle)))
    assert seen == read
    assert all(len(compared[s]) <= ROTATE for s in turns)
