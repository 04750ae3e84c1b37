"""What the checks see: one step's view, the layout's view, the whole run's view.

The run (``core/steps.py``) builds them from the evidence that capture and measurement
gathered; the checks read them and never reach back into the hooks.
"""

from __future__ import annotations

import math
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gradwatch.capture.forward.modes import ModeSnapshot
from gradwatch.model.index import ParamIndex

__all__ = [
    "ForwardOrder",
    "LayerSample",
    "LayerTable",
    "RunView",
    "StepView",
    "StructureView",
    "WindowEvidence",
]


@dataclass(slots=True)  # 200 built per statistics step on a deep stack: cheaper init and reads
class LayerSample:
    """One layer's values on an observed step, over its parameters that received a gradient."""

    positions: list[int]
    norm: float
    mean_abs: float
    max_abs: float
    nonzero: float
    numel: int
    param_norm: Optional[float]
    delta_norm: Optional[float]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.norm)


# One observed step's per-layer values as columns: a list per field, a row per layer. The
# checks that run over every layer on every observed step (``exploding_grad``, ``dead_param``,
# ``vanishing_grad``) and the report's layer tracks read whole columns with C-level
# ``map``/``zip`` passes, not 200 LayerSample objects (each, built and read, cost about half
# a microsecond per layer per step on a deep stack). A table built from the device's fold
# shares its ``names`` list with the track's layout, the same object on every step: a reader
# caches what it derived from a layout by that list, compared by identity first (a table
# built from a dict has a new list each step, compared by value).


class LayerTable(Mapping[str, LayerSample]):
    """Per-layer values of one observed step, one list per :class:`LayerSample` field."""

    __slots__ = (
        "_finite",
        "_samples",
        "delta_norm",
        "max_abs",
        "mean_abs",
        "names",
        "nonzero",
        "norm",
        "numel",
        "param_norm",
        "positions",
    )

    def __init__(
        self,
        names: list[str],
        positions: list[list[int]],
        norm: list[float],
        mean_abs: list[float],
        max_abs: list[float],
        nonzero: list[float],
        numel: list[int],
        param_norm: Sequence[Optional[float]],
        delta_norm: Sequence[Optional[float]],
    ) -> None:
        self.names = names
        self.positions = positions
        self.norm = norm
        self.mean_abs = mean_abs
        self.max_abs = max_abs
        self.nonzero = nonzero
        self.numel = numel
        self.param_norm = param_norm
        self.delta_norm = delta_norm
        self._samples: Optional[dict[str, LayerSample]] = None
        self._finite: Optional[bool] = None

    @classmethod
    def of(cls, layers: Mapping[str, LayerSample]) -> LayerTable:
        """``layers`` as a table: itself when it is one, else its samples' columns.

        Example:
            >>> s = LayerSample([0], 3.0, 0.5, 1.0, 4.0, 4, 2.0, None)
            >>> t = LayerTable.of({"fc": s})
            >>> t.names, t.norm, t["fc"] == s, LayerTable.of(t) is t
            (['fc'], [3.0], True, True)
        """
        if isinstance(layers, LayerTable):
            return layers
        s = list(layers.values())
        return cls(
            list(layers),
            [x.positions for x in s],
            [x.norm for x in s],
            [x.mean_abs for x in s],
            [x.max_abs for x in s],
            [x.nonzero for x in s],
            [x.numel for x in s],
            [x.param_norm for x in s],
            [x.delta_norm for x in s],
        )

    @property
    def finite(self) -> bool:
        """Whether every layer's gradient norm is finite."""
        if self._finite is None:
            self._finite = all(map(math.isfinite, self.norm))
        return self._finite

    def samples(self) -> dict[str, LayerSample]:
        """The rows as :class:`LayerSample` objects, built once."""
        if self._samples is None:
            self._samples = dict(
                zip(
                    self.names,
                    map(
                        LayerSample,
                        self.positions,
                        self.norm,
                        self.mean_abs,
                        self.max_abs,
                        self.nonzero,
                        self.numel,
                        self.param_norm,
                        self.delta_norm,
                    ),
                )
            )
        return self._samples

    def items(self) -> ItemsView[str, LayerSample]:
        return self.samples().items()

    def values(self) -> ValuesView[LayerSample]:
        return self.samples().values()

    def __getitem__(self, layer: str) -> LayerSample:
        return self.samples()[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, layer: object) -> bool:
        return layer in self.samples()

    def __repr__(self) -> str:
        return f"LayerTable({len(self.names)} layers)"


@dataclass(frozen=True)
class ForwardOrder:
    """The order and data flow of the layers' forwards (the hooks' stamps, shared, not copied).

    ``stamps``: layer -> the event number of its latest forward in grad mode (later runs have
    larger numbers). ``links``: layer -> the layers whose parameters are nearest upstream of
    its inputs in autograd's graph, recorded during the first window
    (:mod:`gradwatch.capture.forward.flow`); a layer missing from it was not seen then.
    """

    stamps: dict[str, int] = field(default_factory=dict)
    links: dict[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowEvidence:
    """What one step's window showed besides its gradients, each part gathered only where an
    enabled check needs it (``Check.needs``); the defaults say "nothing known"."""

    model_ran: Optional[str] = None
    """``"grad"`` / ``"no_grad"``: the model's forward ran in the window, in that grad mode."""
    backward_called: Optional[bool] = None
    """An integration saw ``backward()`` requested in the window (``None``: unknown)."""
    modes: Optional[ModeSnapshot] = None
    """The modules' modes at the window's latest training forwards (``module_modes``)."""
    freeze_flags: list[tuple[str, str]] = field(default_factory=list)
    """(module, attribute): freezing flags PyTorch ignores on trainable modules."""
    autocast: dict[str, Any] = field(default_factory=dict)
    """Layer -> its output inside an autocast region (``capture.autocast_probe.LayerDtype``),
    during the first steps (``autocast_dtypes``)."""
    acc_state: Optional[Callable[[int], tuple[int, Any]]] = None
    """Parameter ``i`` -> (its last accumulation's event number, the gradient it left)."""
    grads_assigned: bool = False
    """A ``.grad`` was replaced by hand since the last step (not a cut-off loss)."""
    scaled_edits: Optional[list[int]] = None
    """Parameters whose gradients changed while still scaled by the GradScaler."""
    unregistered: list[tuple[str, str]] = field(default_factory=list)
    """(attribute path, module class) of unregistered parameters that got a gradient."""
    nan_trace: Optional[dict[str, Any]] = None
    """The NaN probe's verdict for this window: where a non-finite value was born."""
    discarded_passes: int = 0
    samples: Optional[int] = None
    """Samples the model's training forwards took since the previous step (``None``: unseen)."""
    """Backward passes of the window whose gradients were reset before this step used them."""
    edited_after_step: Optional[list[int]] = None
    """Parameters whose gradients changed after the previous step, before their reset."""
    scheduler_steps: list[tuple[int, bool]] = field(default_factory=list)
    """Per LR scheduler of the optimizer: (its steps since the optimizer's previous step,
    taken before its first step), and how many a healthy schedule may take then."""
    scheduler_allowed: int = 1
    repeated_backward: int = 0
    """Backward passes of the window that repeated an earlier one of the same loss."""
    loose: list[Any] = field(default_factory=list)
    """Loose leaves found (``capture.loss.loose.LooseLeaf``): persistent tensors that get
    gradients from the loss and are in no watched model or optimizer (``loose_leaves``)."""
    loss_finite: Optional[bool] = None
    """``False``: a loss backpropagated (or reported by an integration) in the window was
    NaN/Inf; ``None``: no loss seen (``loss_value``)."""
    records: dict[str, Any] = field(default_factory=dict)
    """Source name -> the record an evidence source hands the checks
    (:meth:`gradwatch.sources.EvidenceSource.record`), for the sources that have one."""


@dataclass
class StepView:
    """What one step exposes to the checks. Per-parameter lists align with ``ids``.

    ``arrived`` comes from the hooks that fired (a gradient really accumulated since the
    optimizer's previous step), never from ``.grad is None``. ``grad_norm`` has ``None`` for
    a parameter without ``.grad``; the other statistics are per layer (``layers``), filled on
    observed steps only (see ``every_n_steps``).
    """

    step: int
    optimizer: Optional[int]
    index: ParamIndex
    ids: list[int]
    arrived: list[bool]
    has_grad: list[bool]
    grad_norm: list[Optional[float]]
    nonfinite: list[bool]
    order: list[int]
    backward_in_window: bool
    observed: bool
    cause: Callable[[int], str]
    seen: list[int]
    missing: list[int]
    dirty: list[bool] = field(default_factory=list)
    cleared: list[bool] = field(default_factory=list)
    # Per position: no gradient arrived from a backward pass, yet ``.grad`` holds a non-zero
    # tensor the last step did not leave (written by hand). Empty: none.
    written: list[bool] = field(default_factory=list)
    numel: list[int] = field(default_factory=list)
    ranks_missing: Optional[list[list[int]]] = None
    world_size: int = 1
    scaler: bool = False
    layers: Mapping[str, LayerSample] = field(default_factory=dict)
    # Whether parameter ``i`` (any watched one, also outside this step's ids) ever received
    # a gradient while watched.
    received: Callable[[int], bool] = field(default=lambda i: False)
    # What the window showed besides the gradients (where a check needs it).
    window: WindowEvidence = field(default_factory=lambda: WindowEvidence())
    # ids of frozen (requires_grad=False) parameters of this optimizer whose values changed
    # across this step (observed steps only; exact change detection, no parameter copy)
    frozen_changed: list[int] = field(default_factory=list)
    # The learning rate of the param group that holds parameter ``i`` (a watched id) in this
    # step's optimizer; ``None``: not known. For messages: it reads the optimizer each call.
    group_lr: Callable[[int], Optional[float]] = field(default=lambda i: None)
    # Per position (observed steps): the share of the sampled values that changed across the
    # step (``None``: not measured). ``stale_param``'s precision cause reads it.
    moved_frac: Optional[list[Optional[float]]] = None
    # Whether the optimizer compensates rounding for parameter ``i`` (Kahan summation,
    # stochastic rounding): updates below the dtype's resolution are kept, not lost.
    compensated: Callable[[int], bool] = field(default=lambda i: False)
    # The index of the param group of this step's optimizer that holds parameter ``i``.
    group_of: Callable[[int], Optional[int]] = field(default=lambda i: None)
    # The watched ids of param group ``g`` of this step's optimizer (``stale_param``'s lr 0).
    group_ids: Callable[[Optional[int]], list[int]] = field(default=lambda g: [])
    # When and from what the layers ran in the forward (``ghost_param`` groups by it).
    forward: ForwardOrder = field(default_factory=ForwardOrder)

    @property
    def optimizer_name(self) -> str:
        """How messages name this step's optimizer: ``optimizer[0]``, or ``optimizer['G']``
        when the user named it (``watch(models, {"G": opt_g, ...})``)."""
        return self.index.optimizer_label(self.optimizer)

    def by_layer(self) -> dict[str, list[int]]:
        """Positions into ``ids`` grouped by the parameters' layer, in first-seen order."""
        out: dict[str, list[int]] = {}
        for k, i in enumerate(self.ids):
            out.setdefault(self.index.params[i].layer, []).append(k)
        return out


@dataclass
class StructureView:
    """The parameter/optimizer layout, given to checks when it is first seen or changes."""

    index: ParamIndex
    trainable: list[int]
    frozen: list[int]
    in_optimizer: set[int]
    optimizer_of: dict[int, list[int]]
    has_optimizer: bool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunView:
    """The whole run as the watcher saw it, given to checks once when the watcher closes."""

    steps: int
    backward_passes: int
    step_calls: int  # optimizer step hooks entered (decided or not)
    forward_ran: bool
    forward_ran_with_grad: bool
    has_optimizer: bool
    faults: list[str]  # gradwatch's own places that failed
    hand_written_steps: int = 0  # steps with gradients that no backward pass made
    skipped_steps: int = 0  # optimizer steps a GradScaler skipped (inf/NaN gradients)
    # In a run without a step: the trainable parameters no backward pass reached.
    unreached: list[str] = field(default_factory=list)
    # Optimizers that never stepped while another did: (index, params that got gradients).
    idle_optimizers: list[tuple[int, list[str]]] = field(default_factory=list)
    # How messages name optimizer ``k`` (``optimizer[0]``, or ``optimizer['G']`` when named).
    optimizer_name: Callable[[int], str] = field(default=lambda k: f"optimizer[{k}]")
    extra: dict[str, Any] = field(default_factory=dict)
