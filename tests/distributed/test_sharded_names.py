"""Sharded-engine plumbing that needs no process group: names, engine detection, local shards."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch
from gradwatch.distributed.sharded import local_norms
from gradwatch.model.engines import clean_name, engine_of, local


def test_wrapper_segments_are_stripped_and_user_names_kept() -> None:
    assert clean_name("_fsdp_wrapped_module.encoder.0.weight") == "encoder.0.weight"
    assert clean_name("a._checkpoint_wrapped_module.b._orig_mod.c") == "a.b.c"
    assert clean_name("_fsdp_wrapped_module") == ""
    # a user's own underscore names are not wrapper segments
    assert clean_name("my_fsdp_wrapped_module_x.w") == "my_fsdp_wrapped_module_x.w"
    assert clean_name("layer._private.weight") == "layer._private.weight"


def test_plain_model_is_not_sharded_and_local_is_identity() -> None:
    model = nn.Linear(3, 2)
    assert engine_of(model) is None
    assert local(model.weight) is model.weight


def test_local_norms_handle_empty_shards() -> None:
    """A shard can be empty (a 1-element bias on 2 ranks): its sums are 0, not an error."""
    a, empty = torch.tensor([3.0, -4.0]), torch.zeros(0)
    l2, l1, linf, nnz = (v.tolist() for v in local_norms([a, empty], (2.0, 1.0, float("inf"), 0.0)))
    assert l2 == [5.0, 0.0] and l1 == [7.0, 0.0] and linf == [4.0, 0.0] and nnz == [2.0, 0.0]


def test_checkpoint_wrapper_names_are_the_users() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 4)), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    names = {layer.name for layer in w.report().layers}
    assert names == {"0", "1"}
    assert w.report().findings == []


def test_flat_slices_are_stable_views_and_may_be_empty() -> None:
    """FSDP1 flattened: each original's piece is a view of the flat shard (fingerprints are
    keyed by identity, so the same object each step), empty where the rank holds none."""
    from gradwatch.distributed.fsdp1_flat import grad_pieces, shard_pieces
    from gradwatch.measure.fingerprint import fingerprint, measure

    flat = nn.Parameter(torch.arange(10, dtype=torch.float32))
    spans = {0: (0, 6), 1: (6, 4), 2: (0, 0)}
    pieces = shard_pieces([flat] * 3, [0, 1, 2], spans)
    assert [p.numel() for p in pieces] == [6, 4, 0]
    assert all(a is b for a, b in zip(pieces, shard_pieces([flat] * 3, [0, 1, 2], spans)))
    assert pieces[1].data_ptr() == flat.data_ptr() + 6 * 4  # a view, not a copy
    before = fingerprint(pieces)
    with torch.no_grad():
        flat[7] += 3.0  # only the second original moves
    m = measure(pieces, before)
    assert m.delta is not None and m.delta[:2].tolist() == [0.0, 3.0]
    flat.grad = torch.ones(10)
    g = grad_pieces([flat.grad] * 3 + [None], [0, 1, 2, 3], spans, [*pieces, pieces[0]])
    assert [t.numel() for t in g] == [6, 4, 0, 0]
