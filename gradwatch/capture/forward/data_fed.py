"""The data as fed: per-sample prints and scales of the watched model's forward inputs.

One forward pre-hook on the root (with kwargs). On a sampled step (``active``) and on the
first ``eval_forwards`` eval-mode forwards, it reads the first tensor the forward is given
(the input) and any integer 1-D tensors among the rest (labels passed along): per-sample
prints (:func:`gradwatch.measure.batch_prints.sample_prints`, a few int64 per sample, no
copy of the data), the input's per-feature scales, and, once, the first module with
parameters that runs (the layer that reads the input). Other forwards cost one flag test.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.measure.batch_prints import column_scales, sample_prints, value_range
from gradwatch.model.hook_args import pre_kwargs

__all__ = ["NORMS", "DataFedWatch", "Fed"]

NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


@dataclass
class Fed:
    """One forward's batch as fed."""

    training: bool
    prints: list[int]
    ptr: int  # the input's storage address: the same tensor fed again, or a fresh one
    dtype: str
    scales: Optional[list[float]] = None  # per-feature std of a float (n, f) input
    absmax: Optional[float] = None
    dims: int = 0
    made: bool = False  # the input requires grad: computed by a model (a GAN's fake), not data
    range: Optional[list[float]] = None  # min, max, share of integral values (float inputs)
    labels: list[tuple[int, int]] = field(default_factory=list)  # (min, max) of int 1-D args


# A forward under ``torch.func`` (``vmap(grad(...))`` for per-sample gradients) sees one
# sample's slice as a batched tensor, where random draws and ``.tolist()`` raise: not the
# data as fed, so not read.
_transformed: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False
)


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in [*args, *(kwargs or {}).values()]:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
        elif isinstance(v, dict):
            out.extend(t for t in v.values() if isinstance(t, torch.Tensor))
    return [t for t in out if t.dim() >= 1 and t.shape[0] > 0]


class DataFedWatch:
    """Reads each sampled forward's batch (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        on_fed: Callable[[Fed], None],
        on_error: Callable[[str, BaseException], None],
        eval_forwards: int,
    ) -> None:
        self.on_fed = on_fed
        self.active = False
        self.first: Optional[tuple[str, list[str], bool]] = None  # module, params, a norm
        self._eval_left = eval_forwards
        self._ranges = 8  # train forwards whose value ranges and scales are read
        self._on_error = on_error
        self._probe: list[Any] = []
        self._names = {id(m): n for n, m in model.named_modules()}
        wself = weakref.ref(self)

        def pre(module: nn.Module, args: Any, *rest: Any) -> None:
            me = wself()
            if me is None or torch.compiler.is_compiling() or _transformed():
                return
            try:
                me._see(module, args, pre_kwargs(rest))
            except Exception as e:  # gradwatch's fault must not stop training
                me._on_error("data_as_fed forward pre-hook", e)

        self._hook = model.register_forward_pre_hook(pre, with_kwargs=True)

    def _see(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        training = module.training
        if training and not self.active:
            return
        if not training:
            if self._eval_left <= 0:
                return
            self._eval_left -= 1
        ts = _tensors(args, kwargs)
        if not ts:
            return
        x = ts[0]
        prints = sample_prints(x)
        if prints is None:
            return
        fed = Fed(training, prints.tolist(), x.untyped_storage().data_ptr(), str(x.dtype))
        fed.dims = x.dim()
        fed.made = x.requires_grad
        read = self._ranges > 0 and training
        self._ranges -= read
        rng = value_range(x) if read else None
        fed.range = rng.tolist() if rng is not None else None
        scales = column_scales(x) if read else None
        if scales is not None:
            fed.scales = scales[0].tolist()
            fed.absmax = float(scales[1])
        for t in ts[1:]:
            if t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool:
                fed.labels.append((int(t.min()), int(t.max())))
        self.on_fed(fed)
        if training and self.first is None and not self._probe:
            self._find_first(module)

    def _find_first(self, model: nn.Module) -> None:
        def hit(mod: nn.Module, args: Any) -> None:
            if self.first is None:
                params = [
                    f"{self._names.get(id(mod), '')}.{n}".lstrip(".")
                    for n, _ in mod.named_parameters(recurse=False)
                ]
                self.first = (self._names.get(id(mod), ""), params, isinstance(mod, NORMS))
            for h in self._probe:
                h.remove()

        for mod in model.modules():
            if any(True for _ in mod.parameters(recurse=False)):
                self._probe.append(mod.register_forward_pre_hook(hit))

    def remove(self) -> None:
        self._hook.remove()
        for h in self._probe:
            h.remove()
        self._probe = []
