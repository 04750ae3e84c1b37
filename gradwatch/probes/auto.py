"""The loss-free probes inside ``watch()``: the first batch the model sees, probed once.

:class:`FirstCall` keeps references to the inputs of the model's first training forward (a
forward pre-hook, with kwargs, that removes itself after that one call: later batches are
never held). After the step that consumed that batch, :func:`run_auto` runs the probes of
:data:`~gradwatch.probes.LOSS_FREE_PROBES` once, on copies of the model, with a loss the
user never wrote: a fixed, seeded random projection of every floating output
(:func:`projection_loss`). A wrong derivative shows along almost every direction of the
outputs, and a sample's dependence on another shows in the outputs themselves.

The batch is referenced, not copied: nothing is allocated at capture, and a loop that
changes a batch tensor in place after its forward (``x.mul_(...)``, a buffer refilled by
the loader) is told apart by the tensor's version counter: the probes then say they could
not judge (``not_observed``, ``info``) instead of probing a batch the model never saw.

:func:`refusal` decides whether a copy may be made at all: ``probes: off`` never; ``auto``
(the default) only for a model of at most :data:`MAX_PARAMS` parameters whose copies
(:func:`needed_bytes`: a copy in the model's dtype, or ``gradient_mismatch``'s float64
reads) fit in half the free memory of its device; ``on`` for any size, still within the
free memory.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import SyncBatchNorm
from torch.utils.hooks import RemovableHandle

from gradwatch.checks.batch_order_dependent import BatchOrderDependent
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.config import GradWatchConfig
from gradwatch.model.hook_args import pre_kwargs
from gradwatch.probes import LOSS_FREE_PROBES, run_probes
from gradwatch.probes._copies import widened_need
from gradwatch.probes._sandbox import tensors
from gradwatch.results import Finding, ProbeResult

__all__ = [
    "FIRST_STEP",
    "GRADIENT_SAMPLES",
    "MAX_PARAMS",
    "MIN_BUDGET_S",
    "STEPS_BUDGET",
    "FirstCall",
    "as_batch",
    "free_bytes",
    "needed_bytes",
    "projection_loss",
    "refusal",
    "run_auto",
    "skipped",
]

#: ``probes: auto`` probes models of at most this many parameters (GPT-2 small, BERT-base,
#: ViT-B and every ResNet fit; a 1B-parameter model does not). ``probes: on`` lifts it.
MAX_PARAMS = 200_000_000
#: The probes' time budget, in training steps of the model: the first step, timed from its
#: forward to the end of its optimizer step or backward pass, taken as ``FIRST_STEP`` steps
#: (a first step runs the allocator's and gradwatch's first-step work: ResNet-18's and
#: GPT-2's layouts took 1.13 and 1.14 x their later steps, ``benchmarks/auto_probes.py``).
STEPS_BUDGET = 10
FIRST_STEP = 1.15
#: The budget's floor in seconds: on a tiny model ten steps are milliseconds, less than the
#: copy itself costs.
MIN_BUDGET_S = 0.25
#: The samples ``gradient_mismatch`` takes inside ``watch()`` unless ``max_samples`` is set:
#: a wrong derivative shows on any sample, and its float64 evaluations cost in proportion
#: (on 8 samples, a ResNet-18's float64 forward takes longer than its float32 training
#: step). Two, so that train-mode batch norm has a batch.
GRADIENT_SAMPLES = 2
_ARGS = "*args"  # where a call's positional arguments go when it also has keyword ones
_SEED = 48


@dataclass
class FirstCall:
    """References to the inputs of the first training forward of one model (entry point)."""

    model: nn.Module  # what is probed (the module itself, or its child that was called)
    name: Optional[str] = None  # the named model's name, for the records
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # perf_counter at the call's start
    versions: list[tuple[Tensor, int]] = field(default_factory=list)
    done: bool = False
    handles: list[RemovableHandle] = field(default_factory=list)
    on_error: Optional[Callable[[str, BaseException], None]] = None
    _called: Optional[nn.Module] = None

    @classmethod
    def install(
        cls,
        model: nn.Module,
        on_error: Callable[[str, BaseException], None],
        name: Optional[str] = None,
        hooked: Optional[nn.Module] = None,
    ) -> FirstCall:
        """Pre-hooks on ``hooked`` (a compiled wrapper; else ``model``) and on ``model``'s
        direct children: a LightningModule whose ``training_step`` calls ``self.net(x)``
        never calls its own forward. The outermost call wins (the root's starts first)."""
        first = cls(model, name, on_error=on_error)
        roots = [hooked if hooked is not None else model, *model.children()]
        for m in roots:
            first.handles.append(m.register_forward_pre_hook(first._pre, with_kwargs=True))
            first.handles.append(m.register_forward_hook(first._post, with_kwargs=True))
        return first

    def _pre(self, module: nn.Module, args: Any, *rest: Any) -> None:
        try:
            self._take(module, args, pre_kwargs(rest))
        except Exception as exc:  # never the user's forward's failure
            self.remove()
            if self.on_error is not None:
                self.on_error("probes' first-batch hook", exc)

    def _take(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._called is not None or not torch.is_grad_enabled():
            return  # an eval pass under no_grad (a sanity check) is not a training batch
        self._called = module
        if module is not self.model and not hasattr(module, "_orig_mod"):
            self.model = module  # a child called on its own: probe that child
        self.args, self.kwargs = tuple(args), dict(kwargs)
        self.started = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if module is not self._called or self.done:
            return
        self.done = True  # versions after the forward: its own in-place edits are the model's
        try:
            self.versions = [(t, t._version) for t in tensors((self.args, self.kwargs))]
        except Exception as exc:
            self.done = False
            if self.on_error is not None:
                self.on_error("probes' first-batch hook", exc)
        finally:
            self.remove()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def changed(self) -> list[int]:
        """Positions of the batch's tensors that were changed in place since the forward."""
        return [k for k, (t, v) in enumerate(self.versions) if t._version != v]

    def release(self) -> None:
        """Drop the references to the batch and the model (after the probes, or at exit)."""
        self.args, self.kwargs, self.versions = (), {}, []
        self._called = None


def as_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """The call's inputs as one batch for the probes, and how to call a model with it.

    One positional argument is the batch itself; keyword arguments make it a dict (an
    ``attention_mask`` there declares padding to ``sample_dependence``), with the positional
    ones under ``"*args"``.
    """
    if not kwargs:
        if len(args) == 1:
            return args[0], lambda m, b: m(b)
        return tuple(args), lambda m, b: m(*b)
    batch = dict(kwargs)
    if args:
        batch[_ARGS] = tuple(args)

    def call(m: nn.Module, b: Mapping[str, Any]) -> Any:
        rest = {k: v for k, v in b.items() if k != _ARGS}
        return m(*b.get(_ARGS, ()), **rest)

    return batch, call


def _floating(out: Any, found: list[Tensor], depth: int = 0) -> None:
    """Every floating tensor of a model's output: tuples, lists, dicts, ``ModelOutput``."""
    if depth > 8:
        return
    if isinstance(out, Tensor):
        if out.is_floating_point() and out.numel() > 0:
            found.append(out)
        return
    if isinstance(out, Mapping):
        values: Any = list(out.values())
    elif isinstance(out, Sequence) and not isinstance(out, (str, bytes)):
        values = list(out)
    elif hasattr(out, "__dataclass_fields__"):
        values = [getattr(out, f, None) for f in out.__dataclass_fields__]
    else:
        return
    for v in values:
        _floating(v, found, depth + 1)


def _axis_weight(k: int, axis: int, size: int, t: Tensor) -> Tensor:
    # A fixed weight, not a random draw of the forward: made out of sight of the probes'
    # function modes (the order probe replays every draw, and this one is no sample's).
    with torch._C.DisableTorchFunction():
        gen = torch.Generator().manual_seed(_SEED + 1009 * k + axis)
        w = torch.randn(size, generator=gen, dtype=torch.float64)
        return w.to(t.device, t.dtype)


def _project(t: Tensor, k: int) -> Tensor:
    """``<t, w>`` for a fixed random ``w``, separable over the axes (an outer product of one
    seeded vector per axis), so no weight of the output's size is ever made."""
    out = t
    for axis in range(t.dim() - 1, -1, -1):
        out = out @ _axis_weight(k, axis, out.shape[-1], out)
    return out.reshape(()) / math.sqrt(max(t.numel(), 1))


def projection_loss(call: Callable[..., Any]) -> Callable[[nn.Module, Any], Tensor]:
    """A loss the user never wrote: a fixed random projection of the model's outputs."""

    def loss_fn(model: nn.Module, batch: Any) -> Tensor:
        found: list[Tensor] = []
        _floating(call(model, batch), found)
        if not found:
            raise TypeError("the model returned no floating tensor")
        # At the outputs' widest precision only: a loss upcast from bf16 to float32 beside
        # float64 logits (a float64 copy of a Hugging Face model) would add float32 rounding
        # to a float64 comparison.
        widest = max(torch.finfo(t.dtype).bits for t in found)
        found = [t for t in found if torch.finfo(t.dtype).bits == widest]
        return sum((_project(t, k) for k, t in enumerate(found)), torch.zeros(()).to(found[0]))

    return loss_fn


def free_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device``: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # no /proc (macOS): the available pages, else half the physical memory
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        try:
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
        except (ValueError, OSError, AttributeError):
            return None


def needed_bytes(model: nn.Module) -> int:
    """What the probes' copies hold at most (activations aside): a copy of the model in its
    own dtype (``sample_dependence``, the order probe), or ``gradient_mismatch``'s float64
    reads of its largest parameter and that parameter's gradient (its copy reads the user's
    weights: :mod:`gradwatch.probes._widened`)."""
    params = list(model.parameters())
    own = sum(t.numel() * t.element_size() for t in (*params, *model.buffers()))
    return max(own, widened_need(model))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def refusal(model: nn.Module, mode: str) -> Optional[tuple[str, str]]:
    """Why the probes must not copy ``model`` (a reason slug and a sentence), or ``None``."""
    numel = sum(p.numel() for p in model.parameters())
    if mode == "auto" and numel > MAX_PARAMS:
        return "model_too_large", (
            f"the model has {numel:,} parameters, over the {MAX_PARAMS:,} that probes: auto copies"
        )
    if any(isinstance(m, SyncBatchNorm) for m in model.modules()):
        return "collective_in_forward", "SyncBatchNorm calls a collective in its forward"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    free = free_bytes(device)
    need = needed_bytes(model)
    if free is None:
        if mode == "on":
            return None
        return "free_memory_unknown", f"the free memory of {device} cannot be read"
    if 2 * need > free:
        return "no_memory", (
            f"its copies need about {_gib(need)} and {device} has {_gib(free)} free "
            "(the probes take at most half)"
        )
    return None


def skipped(reason: str, why: str) -> Finding:
    """The one ``info`` ``not_observed`` that says the probes did not run, and why."""
    return Finding(
        check=NotObserved.id,
        severity="info",
        message=f"the loss-free probes did not run on the first batch: {why}.",
        hint="Set probes: on to run them on a large model (never beyond the free memory), "
        "or run gradwatch.probe(model, batch, loss_fn) on a batch of your own.",
        details={"reason": f"probes_{reason}"},
    )


def _failed(check_id: str, exc: Exception) -> ProbeResult:
    """A probe that raised on the copy: its record says ``not_observed`` and why (it is
    never raised into the user's step, and inside ``watch()`` it is no finding)."""
    said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    record = ProbeResult(id=check_id, verdict=NotObserved.id, note=f"the probe failed: {said}")
    record.details["reason"] = "failed"
    return record


def run_auto(
    first: FirstCall, config: GradWatchConfig, step_seconds: float
) -> tuple[list[ProbeResult], list[Finding]]:
    """Run the loss-free probes once on the captured batch, within ``STEPS_BUDGET`` steps
    of the model (each probe an even share of what is left)."""
    budget = max(STEPS_BUDGET * step_seconds / FIRST_STEP, MIN_BUDGET_S)
    changed = first.changed()
    if changed:
        why = f"{len(changed)} tensor(s) of the first batch were changed in place after the "
        return [], [skipped("batch_changed", why + "model's forward: not the batch it saw")]
    batch, call = as_batch(first.args, first.kwargs)
    loss_fn = projection_loss(call)
    # The projection weighs each sample by its place: the order probe compares the outputs,
    # not this loss's value (which a permutation changes by design).
    config = config.model_copy(deep=True)
    order = config.check(BatchOrderDependent.id)
    if hasattr(order, "compare_loss"):
        order.compare_loss = False
    grad = config.check(GradientMismatch.id)
    if hasattr(grad, "max_samples") and "max_samples" not in grad.model_fields_set:
        grad.max_samples = GRADIENT_SAMPLES
    chosen = [c for c in LOSS_FREE_PROBES if config.check(c).enabled]
    try:  # each probe is guarded in run_probes; this is for a fault around them
        records, found = run_probes(
            first.model, batch, loss_fn, config=config, only=chosen, time_limit=budget
        )
    except Exception as exc:
        records, found = [_failed(c, exc) for c in chosen], []
    # Inside watch() the probes were not asked for: what they could not judge, and a design
    # said as info (train-mode batch norm couples the samples), stays in their record (the
    # probes section), not a finding on every such model.
    findings = [f for f in found if f.severity != "info"]
    for record in records:
        record.details.update(auto=True, budget_s=budget, step_seconds=step_seconds)
        record.details["step_ratio"] = record.seconds / step_seconds if step_seconds > 0 else None
        if first.name is not None:
            record.details["model"] = first.name
    return records, findings
