"""What ``watch()`` accepts, and optimizers attached later.

- *Models*: one module, or named models ``{"G": netG, "D": netD}``. Named models are watched
  as one :class:`~gradwatch.model.named.NamedModels` container, so every parameter is named
  with its model's prefix (``G:main.0.weight``) in findings, layers, sinks and reports.
- *Optimizers*: one, a sequence (``optimizer[0]``, ``optimizer[1]`` in messages), or named
  ``{"G": opt_g, "D": opt_d}`` (``optimizer['G']``). With named models an optimizer's name
  is the model it trains: a key that names no model, or a keyed optimizer that holds none of
  its model's parameters (the two swapped), is a :class:`~gradwatch.errors.ConfigError`. An
  optimizer may hold parameters of several models (each is named by its own model); a
  sequence of optimizers with named models is fine too.
- :meth:`OptimizerEntry.add_optimizer`: an optimizer a trainer builds after the watcher
  started (minGPT's ``Trainer.run()``). Its checks start at its first step; when gradients
  were already flowing when it was added, that first step only opens its window (what came
  before it was seen by no optimizer of its own), and the next one is judged.

Example:
    >>> with gradwatch.watch({"G": netG, "D": netD}, {"G": opt_g, "D": opt_d}) as w:  # doctest: +SKIP
    ...     train_gan()
    >>> [f.params[0] for f in w.findings()]  # doctest: +SKIP
    ['G:main.0.weight']
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

import torch
from torch import nn

from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.grads.hooks import HookSet
from gradwatch.core.faults import Faults
from gradwatch.core.steps import StepPipeline, open_window
from gradwatch.errors import ConfigError, GradWatchError, GradWatchWarning
from gradwatch.model.compiled import is_compiled
from gradwatch.model.engines import clean_name, engine_of, flat_params
from gradwatch.model.named import NamedModels, check_name, entry_points
from gradwatch.model.optimizers import delegates, unwrap_optimizer
from gradwatch.model.wrappers import ddp_find_unused, unwrap

__all__ = [
    "ModelArg",
    "Models",
    "OptimizerArg",
    "OptimizerEntry",
    "check_model",
    "check_sinks",
    "claim",
    "note_unwatched_params",
    "read_models",
    "read_optimizers",
    "release",
]

ModelArg = Union[nn.Module, Mapping[str, nn.Module]]
OptimizerArg = Union[
    torch.optim.Optimizer, Sequence[torch.optim.Optimizer], Mapping[str, Any], None
]

# model -> (its watcher, the name it is watched as)
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Optional[str]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class Models:
    """The watched model(s) as the watcher needs them."""

    root: nn.Module
    """The user's module (wrappers removed), or the container of the named models."""
    names: list[str] = field(default_factory=list)
    """The models' names (empty: one unnamed model)."""
    find_unused: Optional[bool] = None
    compiled: bool = False
    wrappers: list[nn.Module] = field(default_factory=list)
    """``torch.compile`` wrappers: their own forward hook says the model ran."""
    engine: Optional[str] = None
    flat: list[torch.Tensor] = field(default_factory=list)
    replicated: bool = False  # nn.DataParallel: replicas on device threads

    def light_hooks(self, dist: Any) -> bool:
        """Arrival hooks may be light (``capture/grads/deferred.py``): one process's autograd,
        no engine writing ``.grad`` after the accumulation (DDP, FSDP), not compiled."""
        return dist is None and self.engine is None and not self.compiled and not self.replicated


def read_models(model: Any) -> Models:
    """Check and unwrap ``watch()``'s first argument."""
    if isinstance(model, nn.Module):
        return Models(
            unwrap(model),
            find_unused=ddp_find_unused(model),
            compiled=is_compiled(model),
            wrappers=[model] if hasattr(model, "_orig_mod") else [],
            engine=engine_of(model),
            flat=flat_params(model),
            replicated=isinstance(model, nn.DataParallel),
        )
    if not isinstance(model, Mapping):
        raise ConfigError(
            "watch() needs a torch.nn.Module or a dict of named modules "
            f"({{'G': netG, 'D': netD}}), got {type(model).__name__}"
        )
    if not model:
        raise ConfigError("watch() got an empty dict of models: name at least one model")
    inner: dict[str, nn.Module] = {}
    for key, m in model.items():
        check_name(key, "model")
        if not isinstance(m, nn.Module):
            raise ConfigError(f"model {key!r} is a {type(m).__name__}, not a torch.nn.Module")
        inner[key] = unwrap(m)
        same = next((k for k, o in inner.items() if o is inner[key] and k != key), None)
        if same is not None:
            raise ConfigError(f"models {same!r} and {key!r} are the same module: name it once")
    raws = list(model.values())
    unused = [f for f in map(ddp_find_unused, raws) if f is not None]
    return Models(
        NamedModels(inner),
        names=list(inner),
        find_unused=all(unused) if unused else None,
        compiled=any(map(is_compiled, raws)),
        wrappers=[m for m in raws if hasattr(m, "_orig_mod")],
        engine=next((e for e in map(engine_of, raws) if e is not None), None),
        flat=[p for m in raws for p in flat_params(m)],
    )


def read_optimizers(
    optimizer: OptimizerArg, models: Models
) -> tuple[list[torch.optim.Optimizer], list[Optional[str]]]:
    """The real optimizers behind ``watch()``'s second argument, and their names."""
    if optimizer is None:
        return [], []
    if isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        return [unwrap_optimizer(optimizer)], [None]
    if isinstance(optimizer, Mapping):
        opts: list[torch.optim.Optimizer] = []
        names: list[Optional[str]] = []
        for key, opt in optimizer.items():
            name = check_optimizer_name(key, models, names)
            # Wrappers (accelerate, Lightning, ...) are followed to the one that really steps.
            real = unwrap_optimizer(opt, f"optimizer {key!r}")
            check_trains(real, name, models)
            opts.append(real)
            names.append(name)
        return opts, names
    if isinstance(optimizer, Sequence) and not isinstance(optimizer, (str, bytes)):
        opts = [unwrap_optimizer(o, f"optimizer[{k}]") for k, o in enumerate(optimizer)]
        return opts, [None] * len(opts)
    raise ConfigError(
        "optimizer must be a torch.optim.Optimizer, a sequence or a dict of them, or None, "
        f"not {type(optimizer).__name__}"
    )


def check_optimizer_name(key: object, models: Models, taken: Sequence[Optional[str]]) -> str:
    """``key`` as an optimizer's name: with named models, the name of one of them."""
    name = check_name(key, "optimizer")
    if models.names and name not in models.names:
        known = ", ".join(repr(n) for n in models.names)
        raise ConfigError(
            f"optimizer {name!r} names no watched model (models: {known}): key each "
            "optimizer by the model it trains, or pass a list of optimizers"
        )
    if name in taken:
        raise ConfigError(f"two optimizers are named {name!r}: give each its own name")
    return name


def check_trains(opt: torch.optim.Optimizer, name: str, models: Models) -> None:
    """With named models, optimizer ``name`` must hold some parameter of model ``name``."""
    root = models.root
    if not isinstance(root, NamedModels):
        return
    own = {id(p) for p in root.model(name).parameters()}
    if any(id(p) in own for g in opt.param_groups for p in g["params"]):
        return
    raise ConfigError(
        f"optimizer {name!r} holds no parameter of model {name!r}: are the optimizers "
        "swapped? Key each optimizer by the model it trains"
    )


def check_model(model: nn.Module, names: Sequence[str], optimizers: Sequence[Any] = ()) -> None:
    """A model gradwatch can watch (``names``: the named models'): materialised, with
    something to train: its own parameters, or tensors a watched optimizer trains beside a
    frozen model on purpose (temperature scaling, an input or a perturbation optimised)."""
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ConfigError(
                f"parameter '{clean_name(name)}' is on the meta device: materialize the model "
                "(model.to_empty(device=...) and initialise it) before watching"
            )
    held = (p for opt in optimizers for g in opt.param_groups for p in g["params"])
    if not any(p.requires_grad for p in model.parameters()) and not any(
        isinstance(p, torch.Tensor) and p.requires_grad for p in held
    ):
        what = (
            f"none of the models {', '.join(map(repr, names))} has"
            if names
            else f"{type(model).__name__} has"
        )
        raise ConfigError(f"{what} no trainable parameters (none with requires_grad=True)")


def check_sinks(sinks: Any) -> list[Any]:
    """``watch()``'s ``sinks``: a sequence of objects with a callable ``log_metrics``."""
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
        raise ConfigError(f"sinks must be a list of sink objects, not {type(sinks).__name__}")
    for k, sink in enumerate(sinks):
        if not callable(getattr(sink, "log_metrics", None)):
            raise ConfigError(f"sinks[{k}] ({type(sink).__name__}) has no log_metrics method")
    return list(sinks)


def note_unwatched_params(pipe: StepPipeline) -> None:
    """At exit: parameters replaced by never-watched ones (``model.apply(reinit)``) fail it."""
    model, index = pipe.model, pipe.structure.index
    new = [
        clean_name(n)
        for n, p in (model.named_parameters() if model is not None else ())
        if p.requires_grad and not index.uninitialized(p) and index.lookup(p) is None
    ]
    shown = ", ".join(new[:5]) + (", ..." if len(new) > 5 else "")
    message = f"{len(new)} trainable parameter(s) were replaced during the run by tensors "
    message += f"gradwatch never watched ({shown}): what trained them was not checked."
    hint = "Re-initialise in place (reset_parameters(), torch.nn.init on the parameters), or "
    hint += "watch the new optimizer: watcher.add_optimizer(opt) right after building it."
    if new:
        pipe.record(Fact(UNOBSERVABLE, pipe.steps, "params_replaced", message, hint, new))


def claim(model: nn.Module, watcher: object) -> None:
    """One watcher per model: claim ``model``'s entry points (the named models) for
    ``watcher``."""
    named = model.names if isinstance(model, NamedModels) else [None]
    pairs = list(zip(named, entry_points(model)))
    for name, m in pairs:
        other, as_name = _ACTIVE.get(m, (None, None))
        if other is not None and other is not watcher:
            what = type(m).__name__ if name is None else f"model {name!r} ({type(m).__name__})"
            there = f" (as model {as_name!r})" if as_name is not None else ""
            raise GradWatchError(
                f"{what} is already watched by another gradwatch watcher{there}: "
                "exit it first (one watcher per model)"
            )
    for name, m in pairs:
        _ACTIVE[m] = (watcher, name)


def release(model: nn.Module, watcher: object) -> None:
    """Give up what :func:`claim` took."""
    for m in entry_points(model):
        if _ACTIVE.get(m, (None,))[0] is watcher:
            del _ACTIVE[m]


class _Parts(Protocol):
    """What :class:`OptimizerEntry` needs of the class it is mixed into."""

    _pipe: StepPipeline
    _hooks: HookSet
    _faults: Faults
    _attached: bool
    _closed: bool
    _fresh: set[int]
    _names: list[str]

    def _refresh(self) -> None: ...

    def _opt_hook(self, k: int, *, pre: bool) -> Callable[..., None]: ...

    def _hook_optimizer(self, k: int) -> None: ...


class OptimizerEntry:
    """The watcher's optimizer hooks, and :meth:`add_optimizer`."""

    _fresh: set[int]  # optimizers added mid-run whose first step only opens their window

    def add_optimizer(self: _Parts, optimizer: Any, name: Optional[str] = None) -> str:
        """Watch ``optimizer`` from now on: one that a trainer builds after watching began.

        minGPT's ``Trainer.run()`` builds its optimizer inside ``run()``; call this from its
        first ``on_batch_end`` callback (calling it again for the same optimizer does
        nothing). Its checks start at its first step, and optimizer coverage
        (``not_in_optimizer``) is judged from then on, never for the steps before. Its hooks
        are removed on exit with all the others.

        Args:
            optimizer: a ``torch.optim.Optimizer`` or a wrapper exposing one as ``.optimizer``.
            name: how findings name it (``optimizer['G']``); with named models, the name of
                the model it trains. ``None``: ``optimizer[k]`` by its position.

        Returns:
            How findings name it (``optimizer[1]``, ``optimizer['G']``).

        Raises:
            GradWatchError: the watcher is closed already.
            ConfigError: not an optimizer, or a name that is taken or names no model.

        Example:
            >>> trainer.add_callback(  # doctest: +SKIP
            ...     "on_batch_end", lambda t: watcher.add_optimizer(t.optimizer))
        """
        if self._closed:
            raise GradWatchError(
                "this watcher is closed: add_optimizer() works before or during the run only"
            )
        real = unwrap_optimizer(optimizer, "add_optimizer()'s optimizer")
        pipe = self._pipe
        structure = pipe.structure
        index = structure.index
        known = next((k for k, o in enumerate(structure.optimizers) if o is real), None)
        if known is not None:
            if name is not None and index.optimizer_names[known] != name:
                raise ConfigError(
                    f"this optimizer is watched already, as {index.optimizer_label(known)}"
                )
            return index.optimizer_label(known)
        assert pipe.model is not None  # released only at close
        models = Models(pipe.model, names=list(self._names))
        if name is not None:
            name = check_optimizer_name(name, models, index.optimizer_names)
            check_trains(real, name, models)
        k = structure.add_optimizer(real, name)
        if self._attached:
            if pipe.backward_passes:
                self._fresh.add(k)  # gradients before it belong to no window of its own
            self._hook_optimizer(k)
            pipe.sync(step=pipe.steps)
            track = structure.track_of(k)
            if track is not None:
                track.backward_at_start = pipe.backward_passes
        return index.optimizer_label(k)

    def _hook_optimizer(self: _Parts, k: int) -> None:
        """Pre- and post-step hooks on optimizer ``k`` (and the base a SAM steps through)."""
        opt = self._pipe.structure.optimizers[k]
        for stepper in [opt, *delegates(opt)]:
            self._hooks.add(stepper.register_step_pre_hook(self._opt_hook(k, pre=True)))
            self._hooks.add(stepper.register_step_post_hook(self._opt_hook(k, pre=False)))

    def _opt_hook(self: _Parts, k: int, *, pre: bool) -> Callable[..., None]:
        # a weak reference: a hook must not keep the watcher alive
        wself = weakref.ref(self)
        where = "optimizer pre-step hook" if pre else "optimizer step hook"

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            me = wself()
            if me is None or me._closed:
                return
            try:
                if pre:  # one stepped in backward reads .grad: the deferred hooks' work first
                    me._hooks.arrival.deferred.flush()
                    me._pipe.step_pre(k, sys._getframe(1))  # caller: torch's step wrapper
                elif k in me._fresh:
                    if me._pipe.nesting.leave(k):
                        me._fresh.discard(k)
                        open_window(me._pipe, k)
                elif me._pipe.step_post(k):
                    me._refresh()
            except (GradWatchError, GradWatchWarning):
                raise
            except Exception as exc:
                me._faults.error(where, exc)

        return hook
