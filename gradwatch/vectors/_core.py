"""The core of a :class:`~gradwatch.vectors.parammap.ParamMap`: its layout, flatten and unflatten.

:class:`MapCore` holds the entries, the selection options and (once bound) the tensors,
and exposes them through the container protocol and properties; the copying is done by
the plain functions of :mod:`gradwatch.vectors._flat`. ``ParamMap`` adds the
constructors from modules and documents (:mod:`gradwatch.vectors.parammap`) and the
derived vectors (:mod:`gradwatch.vectors._ops`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional, SupportsIndex

import torch
from torch import Tensor

from gradwatch.vectors._flat import (
    Missing,
    Source,
    check_entries,
    flatten_tensors,
    locate_index,
    promoted_dtype,
    unflatten_into,
)
from gradwatch.vectors._layout import ParamEntry, Patterns, _fingerprint, _patterns
from gradwatch.vectors._serial import Options

__all__ = ["MapCore"]


class MapCore:
    """Entries, options and bound tensors of a :class:`~gradwatch.vectors.parammap.ParamMap`.

    Not used on its own: build a ``ParamMap``.
    """

    def __init__(
        self,
        entries: Sequence[ParamEntry],
        *,
        trainable_only: bool = True,
        include_buffers: bool = False,
        include: Patterns = None,
        exclude: Patterns = None,
    ) -> None:
        """Create an unbound map from entries (normally use :meth:`from_module`).

        Args:
            entries: contiguous entries in flat order, starting at offset 0.
            trainable_only: the option the entries were collected with.
            include_buffers: the option the entries were collected with.
            include: the selection the entries were collected with.
            exclude: the selection the entries were collected with.

        Raises:
            ParamMapError: if offsets, sizes, kinds or names are inconsistent.
        """
        self._by_name, self._numel = check_entries(entries)
        self._entries = tuple(entries)
        self._offsets = [e.offset for e in self._entries]
        self._fingerprint = _fingerprint(self._entries)
        self._trainable_only = trainable_only
        self._include_buffers = include_buffers
        self._include = _patterns("include", include)
        self._exclude = _patterns("exclude", exclude)
        self._tensors: Optional[tuple[Tensor, ...]] = None

    # --- container protocol -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ParamEntry]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> ParamEntry:
        """The entry holding parameter ``name`` (any of a tied tensor's names)."""
        try:
            return self._entries[self._by_name[name]]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the map") from None

    def __repr__(self) -> str:
        state = "bound" if self.is_bound else "unbound"
        sel = "".join(
            f", {k}={list(v)}"
            for k, v in (("include", self._include), ("exclude", self._exclude))
            if v
        )
        return f"ParamMap({len(self)} entries, {self._numel} elements, {state}{sel}, {self._fingerprint[:19]})"

    @property
    def entries(self) -> tuple[ParamEntry, ...]:
        """All entries in flat order."""
        return self._entries

    @property
    def names(self) -> list[str]:
        """Canonical names in flat order."""
        return [e.name for e in self._entries]

    @property
    def numel(self) -> int:
        """Total number of elements of the flat vector."""
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        """The dtype :meth:`flatten` uses by default: all entry dtypes promoted together."""
        return promoted_dtype(self._entries)

    @property
    def fingerprint(self) -> str:
        """``sha256:`` digest of the names, shapes, dtypes and kinds, in order."""
        return self._fingerprint

    @property
    def selection(self) -> dict[str, Optional[list[str]]]:
        """The ``include``/``exclude`` patterns the map was built with (``None``: no filter)."""
        return {
            "include": None if self._include is None else list(self._include),
            "exclude": None if self._exclude is None else list(self._exclude),
        }

    @property
    def is_bound(self) -> bool:
        """Whether the map holds tensors to flatten from and write to."""
        return self._tensors is not None

    def _options(self) -> Options:
        return self._trainable_only, self._include_buffers, self._include, self._exclude

    # --- flatten / unflatten ------------------------------------------------------------
    def flatten(
        self,
        source: Source = "data",
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        *,
        missing: Missing = "error",
    ) -> Tensor:
        """Copy every mapped tensor (or its gradient) into one new 1-D vector.

        Works for non-contiguous tensors (each is read in row-major order of its shape).

        Args:
            source: ``"data"`` for the values, ``"grad"`` for the gradients.
            dtype: the vector's dtype; default :attr:`dtype` (entry dtypes promoted).
            device: the vector's device; default the tensors' device (they must agree).
            missing: for ``"grad"``, ``"error"`` when a gradient is ``None``, or
                ``"zeros"`` to fill its span with zeros.

        Returns:
            A new vector of :attr:`numel` elements that shares no memory with the model.

        Raises:
            ParamMapError: missing gradients (all named), meta tensors, tensors on
                several devices without ``device``, or an unbound map.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> pmap.flatten("grad", missing="zeros").abs().sum().item()
            0.0
        """
        return flatten_tensors(self._entries, self._tensors, source, dtype, device, missing=missing)

    def unflatten(self, vec: Tensor, target: Source = "data") -> None:
        """Write ``vec`` back into the mapped tensors (or their ``.grad``), in place.

        Everything is checked before anything is written, so an error leaves the model
        untouched. ``vec``'s dtype must hold every entry's dtype without loss (a float32
        vector may fill bfloat16 weights, not float64 ones); its device must match each
        tensor's. Gradients that are ``None`` are created.

        Args:
            vec: 1-D vector of :attr:`numel` elements.
            target: ``"data"`` or ``"grad"``.

        Raises:
            ParamMapError: a one-line message naming the first mismatching parameter.

        Example:
            >>> model = torch.nn.Linear(3, 2)
            >>> pmap = ParamMap.from_module(model)
            >>> pmap.unflatten(torch.ones(8), "grad")
            >>> model.bias.grad.tolist()
            [1.0, 1.0]
        """
        unflatten_into(self._entries, self._tensors, vec, target)

    # --- lookup -------------------------------------------------------------------------
    def locate(self, index: SupportsIndex) -> tuple[str, tuple[int, ...]]:
        """Name the parameter and element behind a flat index.

        Args:
            index: position in the flat vector (an int or an integer 0-d tensor).

        Returns:
            ``(name, coords)``: the canonical name and the element's index tuple.

        Raises:
            ParamMapError: if ``index`` is outside ``[0, numel)``.

        Example:
            >>> ParamMap.from_module(torch.nn.Linear(3, 2)).locate(6)
            ('bias', (0,))
        """
        return locate_index(self._entries, self._offsets, self._numel, index)
