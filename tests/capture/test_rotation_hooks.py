"""A read parameter's post hook goes back on under its old handle (the rotation's cost).

torch keeps a post-accumulate hook dict after its last hook is removed; ``rehook_post`` puts
the hook back into it with one store instead of a new registration. These tests check that
the hook put back fires as a registered one does, comes off again, and that a dict replaced
since falls back to torch's own registration.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.hooks import HookSet


def _hooks(p: nn.Parameter) -> tuple[HookSet, Tracker]:
    tracker = Tracker()
    tracker.grow(1)
    hooks = HookSet(tracker, lambda: None, lambda where, exc: None)
    hooks.hook_param(0, p)
    return hooks, tracker


def _backward(p: nn.Parameter) -> None:
    p.grad = None
    (p * 2.0).sum().backward()


def test_a_hook_put_back_fires_and_comes_off_again() -> None:
    p = nn.Parameter(torch.ones(3))
    hooks, tracker = _hooks(p)
    first = hooks.param[0]
    _backward(p)
    assert tracker.last_seq[0] > 0  # the registered hook recorded the arrival

    hooks.unhook_post(0)
    before = tracker.last_seq[0]
    _backward(p)
    assert tracker.last_seq[0] == before  # off: nothing recorded
    assert 0 in hooks.unhooked

    hooks.rehook_post(0)
    assert hooks.param[0] is first  # the old handle, not a new registration
    assert list(p._post_accumulate_grad_hooks) == [first.id]
    _backward(p)
    assert tracker.last_seq[0] > before  # put back: it records again

    hooks.unhook_post(0)
    again = tracker.last_seq[0]
    _backward(p)
    assert tracker.last_seq[0] == again
    assert not p._post_accumulate_grad_hooks

    hooks.rehook_post(0)
    hooks.remove_all()
    _backward(p)
    assert tracker.last_seq[0] == again  # removed for good at exit
    assert not p._post_accumulate_grad_hooks


def test_a_replaced_hook_dict_gets_a_new_registration() -> None:
    p = nn.Parameter(torch.ones(3))
    hooks, tracker = _hooks(p)
    first = hooks.param[0]
    hooks.unhook_post(0)
    other = []
    p._post_accumulate_grad_hooks = OrderedDict()  # someone else's dict now
    p.register_post_accumulate_grad_hook(lambda t: other.append(1))
    hooks.rehook_post(0)
    assert hooks.param[0] is not first
    before = tracker.last_seq[0]
    _backward(p)
    assert tracker.last_seq[0] > before and other == [1]  # both fire
    hooks.remove_all()
    _backward(p)
    assert other == [1, 1]  # the other hook stays; gradwatch's is gone
