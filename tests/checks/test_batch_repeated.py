"""``batch_repeated``: the same batch fed again before the data was exhausted.

Violating forms (forum reports of "loss not decreasing / model only learns a few samples"):
``next(iter(loader))`` for one batch mixed with a loader's batches (a new iterator each
step); a list of batches indexed with a stale constant after the first few; an iterator
re-created every few steps. Said as info: one batch at every step from step 0 (overfit
test, or an iterator re-created every step: the prints cannot tell). Clean twins: epochs of
an unshuffled loader, shuffled epochs, augmented views of one fixed batch, two views per step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from _check_loops import CFG
from _fed_loops import Batch, dataset, found, loader, net, train

import gradwatch

ID = "batch_repeated"


def test_each_batch_fed_twice_by_an_index_divided_by_the_accumulation_count() -> None:
    batches_list = list(loader(dataset(), shuffle=False))

    def batches(epoch: int) -> Iterator[Batch]:
        for step in range(8):
            yield batches_list[step // 2]  # meant micro-batches, fed each batch twice

    [f] = found(train(net(), batches), ID)
    assert f.severity == "warning" and f.params == ["0.weight", "0.bias"]
    assert f.module == "0"


def test_a_stale_constant_index_after_distinct_batches() -> None:
    ds = dataset()
    batches_list = list(loader(ds, shuffle=False))

    def batches(epoch: int) -> Iterator[Batch]:
        for step in range(8):
            yield batches_list[min(step, 3)]  # the index stops moving at 3

    [f] = found(train(net(), batches), ID)
    assert f.severity == "warning"


def test_next_iter_interleaved_with_a_loader_that_still_has_data() -> None:
    ld = loader(dataset(), shuffle=False)

    def batches(epoch: int) -> Iterator[Batch]:
        for i, b in enumerate(ld):
            yield b
            if i < 4:
                yield next(iter(ld))  # "just one more batch" from a fresh iterator

    [f] = found(train(net(), batches), ID)
    assert f.severity == "warning"


def test_one_batch_every_step_from_the_start_is_not_judged() -> None:
    """An overfit-one-batch test (and gradwatch check's own Probe loop) feeds one batch on
    purpose; the prints cannot tell it from an iterator re-created each step."""
    x, y = next(iter(loader(dataset())))

    def batches(epoch: int) -> Iterator[Batch]:
        for _ in range(6):
            yield x, y

    assert not found(train(net(), batches), ID)


def test_epochs_of_unshuffled_and_shuffled_loaders_are_silent() -> None:
    for shuffle in (False, True):
        ld = loader(dataset(64), shuffle=shuffle)
        assert not found(train(net(), lambda e, ld=ld: ld, epochs=4), ID)


def test_augmented_views_of_one_batch_and_two_views_per_step_are_silent() -> None:
    x, y = next(iter(loader(dataset())))
    g = torch.Generator().manual_seed(3)

    def batches(epoch: int) -> Iterator[Batch]:
        for _ in range(8):
            yield x + 0.1 * torch.randn(x.shape, generator=g), y  # augmentation as fed

    assert not found(train(net(), batches), ID)


def test_a_generators_output_fed_again_after_the_discriminators_step_is_silent() -> None:
    torch.manual_seed(0)
    g_net, d_net = torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Linear(8, 1))
    opt_d = torch.optim.SGD(d_net.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(g_net.parameters(), lr=0.01)
    bce = torch.nn.BCEWithLogitsLoss()
    x, _ = next(iter(loader(dataset())))

    with gradwatch.watch(d_net, opt_d, config=CFG) as w:
        for _ in range(6):
            real = x + 0.1 * torch.randn(x.shape)
            fake = g_net(torch.randn(16, 4))
            opt_d.zero_grad()
            d_loss = bce(d_net(real), torch.ones(16, 1))
            (d_loss + bce(d_net(fake.detach()), torch.zeros(16, 1))).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(d_net(fake), torch.ones(16, 1)).backward()  # the same fake, after D's step
            opt_g.step()
    assert not found(w.report(), ID)
