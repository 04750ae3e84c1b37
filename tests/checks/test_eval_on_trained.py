"""``eval_on_trained_samples``: eval-mode forwards on samples the model was trained on.

Violating forms ("validation accuracy 100 %": the validation loader built on the training
set): ``val_loader = DataLoader(train_ds)``; a validation split drawn from a list that the
training set also covers (``val = train[:32]``); validation after the last step only, on
the training loader's own batches. Clean twins: a held-out split, train accuracy measured
in eval mode alongside a held-out validation, eval before any training.
"""

from __future__ import annotations

from typing import Any

import torch
from _fed_loops import dataset, found, loader, net, train
from torch.utils.data import DataLoader, Subset

ID = "eval_on_trained_samples"


def _run(train_ds: Any, val: Any, epochs: int = 2) -> Any:
    ld = loader(train_ds)
    return train(net(), lambda e: ld, epochs=epochs, evaluate=lambda: val)


def test_the_validation_loader_built_on_the_training_dataset() -> None:
    ds = dataset()
    [f] = found(_run(ds, DataLoader(ds, batch_size=32)), ID)
    assert f.severity == "warning" and f.details["trained"] >= 16
    assert f.params == ["0.weight", "0.bias"] and f.module == "0"


def test_a_validation_slice_of_the_training_samples() -> None:
    ds = dataset()
    assert found(_run(ds, DataLoader(Subset(ds, range(32)), batch_size=16)), ID)


def test_validation_after_the_last_step_only() -> None:
    ds = dataset()
    assert found(_run(ds, loader(ds, shuffle=False, bs=32), epochs=1), ID)


def test_a_held_out_split_is_silent() -> None:
    full = dataset(192)
    tr, va = Subset(full, range(128)), Subset(full, range(128, 192))
    assert not found(_run(tr, DataLoader(va, batch_size=32)), ID)


def test_train_accuracy_in_eval_mode_beside_a_held_out_validation_is_silent() -> None:
    full = dataset(192)
    tr, va = Subset(full, range(128)), Subset(full, range(128, 192))
    both = [*DataLoader(tr, batch_size=32), *DataLoader(va, batch_size=32)]
    assert not found(_run(tr, both), ID)


def test_the_batch_just_trained_on_run_again_in_eval_mode_is_silent() -> None:
    ld = loader(dataset())
    model = net()

    def batches(epoch: int) -> Any:
        for x, y in ld:
            yield x, y
            model.eval()  # a train-batch metric in eval mode, then back to training
            with torch.no_grad():
                model(x)
            model.train()

    assert not found(train(model, batches, epochs=2), ID)
