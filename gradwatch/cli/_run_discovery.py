"""Find what an unmodified script trains, for ``gradwatch run`` (imported only by ``run``).

Two global torch hooks, installed before the script starts and removed when it ends:

- a module forward pre-hook (and forward hook) that records the *outermost* modules that
  ran forward: those called while no other module's forward was running;
- an optimizer step post-hook that records each optimizer that stepped.

Watching begins at the first iteration boundary: once every optimizer built so far has
stepped once (a GAN's ``opt_d`` then ``opt_g``), or the first one steps a second time,
after that step. The watched models are the outermost modules that ran forward whose
parameters the optimizers hold (:func:`owners`; modules found through ``gc`` when none of
them ran forward, as in a Lightning step that runs inside ``optimizer.step``). The first
iteration is therefore not watched: its forward, backward and step happened before
the watcher existed. An optimizer built later is added with ``Watcher.add_optimizer``.

Only the launching process watches: a forked DataLoader worker inherits the hooks, which
do nothing there (``os.getpid()`` is compared with the launcher's).
"""

from __future__ import annotations

import functools
import gc
import os
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["Discovery", "owners"]


def _params(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in opt.param_groups for p in group["params"]}


def owners(candidates: list[nn.Module], wanted: set[int]) -> list[nn.Module]:
    """The outermost modules of ``candidates`` that hold a parameter in ``wanted``.

    A module inside another candidate is dropped: its parameters are watched with the
    outer one. The order is the candidates' (the order they first ran forward).
    """
    hits = [m for m in candidates if any(id(p) in wanted for p in m.parameters())]
    inner = {id(sub) for m in hits for sub in m.modules() if sub is not m}
    return [m for m in hits if id(m) not in inner]


def _gc_modules() -> list[nn.Module]:
    """Every live module (``isinstance`` on some lazy objects warns: those are not modules)."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, nn.Module):
                    found.append(obj)
            except Exception:  # a proxy whose __class__ raises
                continue
    return found


class Discovery:
    """The global hooks of one ``gradwatch run``; ``start(models, optimizers)`` is called once.

    Args:
        start: called at the first iteration boundary with the models and optimizers found
            (``start([], opts)`` when the optimizers' parameters belong to no module); it
            returns a function that adds a later optimizer, or ``None``.
        fault: called with ``(where, exc)`` when the discovery itself fails; the script runs on.
    """

    def __init__(
        self,
        start: Callable[[list[nn.Module], list[torch.optim.Optimizer]], Optional[Callable]],
        fault: Callable[[str, BaseException], None],
    ) -> None:
        self._start = start
        self._fault = fault
        self._pid = os.getpid()
        self._depth = 0
        self._ran: list[weakref.ref[nn.Module]] = []
        self._ran_ids: set[int] = set()
        self._opts: list[weakref.ref[torch.optim.Optimizer]] = []
        self._stepped: dict[int, int] = {}
        self._add: Optional[Callable] = None
        self.started = False
        self.optimizers_seen = 0
        self._handles: list[Any] = []
        self._init = torch.optim.Optimizer.__init__

    def install(self) -> None:
        """Register the global hooks and the optimizer-construction patch."""
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_post_hook(self._stepped_hook),
        ]
        original, built = self._init, self._built

        @functools.wraps(original)
        def init(opt: Any, *args: Any, **kwargs: Any) -> None:
            original(opt, *args, **kwargs)
            built(opt)

        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        """Remove every hook and the patch (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        torch.optim.Optimizer.__init__ = self._init  # type: ignore[method-assign]

    # -- hooks (never raise into the script) --------------------------------------------

    def _pre(self, module: nn.Module, _args: Any) -> None:
        if self._depth == 0 and not self.started and os.getpid() == self._pid:
            if id(module) not in self._ran_ids:
                self._ran_ids.add(id(module))
                self._ran.append(weakref.ref(module))
        self._depth += 1

    def _post(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _built(self, opt: torch.optim.Optimizer) -> None:
        if os.getpid() != self._pid:
            return
        try:
            if any(r() is opt for r in self._opts):
                return
            self._opts.append(weakref.ref(opt))
            self.optimizers_seen += 1
            if self._add is not None:
                self._add(opt)
        except Exception as exc:  # a gradwatch fault must not stop the script
            self._fault("gradwatch run: optimizer discovery", exc)

    def _stepped_hook(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self.started or os.getpid() != self._pid:
            return
        try:
            if not any(r() is opt for r in self._opts):  # built before the hooks: rare
                self._opts.append(weakref.ref(opt))
                self.optimizers_seen += 1
            self._stepped[id(opt)] = self._stepped.get(id(opt), 0) + 1
            opts = [o for o in (r() for r in self._opts) if o is not None]
            all_once = all(id(o) in self._stepped for o in opts)
            if all_once or self._stepped[id(opt)] >= 2:
                self._begin(opts)
        except Exception as exc:
            self.started = True
            self._fault("gradwatch run: discovery at the first step", exc)

    def _begin(self, opts: list[torch.optim.Optimizer]) -> None:
        self.started = True
        opts = [o for o in opts if id(o) in self._stepped] or opts
        wanted: set[int] = set().union(*(_params(o) for o in opts))
        ran = [m for m in (r() for r in self._ran) if m is not None]
        models = owners(ran, wanted)
        covered = {id(p) for m in models for p in m.parameters()}
        if wanted - covered:  # parameters of no module that ran forward: who holds them
            extra = owners(_gc_modules(), wanted - covered)
            models += [m for m in extra if all(m is not n for n in models)]
            models = owners(models, wanted)
        self._ran = []
        self._add = self._start(models, opts)
