"""Named, checked flattening of a module's parameters into one vector.

``torch.nn.utils.parameters_to_vector`` trusts that the vector, the parameter order,
the dtypes and the devices all line up; when they do not, gradients land silently in
the wrong layer. :class:`ParamMap` records the layout once (names, offsets, shapes,
dtypes, tied parameters), checks every vector against it before writing anything, and
can name the parameter behind any flat index.

Example:
    >>> model = torch.nn.Linear(3, 2)
    >>> pmap = ParamMap.from_module(model)
    >>> vec = pmap.flatten()
    >>> pmap.unflatten(vec * 0)
    >>> pmap.locate(4)
    ('weight', (1, 1))
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Optional, SupportsIndex

import torch
from torch import Tensor, nn

from gradwatch.vectors._layout import (
    ParamEntry,
    ParamMapError,
    Patterns,
    _collect,
    _dtype_name,
    _fingerprint,
    _listed,
    _patterns,
    _unravel,
    entry_from_dict,
    entry_to_dict,
    layout_diffs,
)
from gradwatch.vectors.quant import Scheme, dequantize_flat, quantize_flat
from gradwatch.vectors.shard import Shard, shard_spans
from gradwatch.vectors.sketch import (
    DEFAULT_CHUNK,
    DEFAULT_DENSITY,
    sketch,
    sketch_tensors,
    unsketch,
)

__all__ = ["ParamEntry", "ParamMap", "ParamMapError", "Shard"]

Source = Literal["data", "grad"]
Missing = Literal["error", "zeros"]

_FORMAT = "gradwatch.vectors.parammap"
_FORMAT_VERSION = 1


class ParamMap:
    """Ordered memory map of a module's parameters (and optionally buffers) in one vector.

    Build it with :meth:`from_module` (bound to the module's tensors) or
    :meth:`from_json` (unbound until :meth:`bind`). Entries follow
    ``named_parameters()`` order, then ``named_buffers()``, one per distinct tensor.
    A bound map holds the tensors, not the module: after replacing a parameter
    object, build a new map (changes of shape or dtype in place are detected).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> pmap = ParamMap.from_module(model)
        >>> len(pmap), pmap.numel, [e.name for e in pmap]
        (2, 6, ['0.weight', '0.bias'])
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
        offset = 0
        by_name: dict[str, int] = {}
        for i, e in enumerate(entries):
            if e.offset != offset or e.numel != math.prod(e.shape) or e.numel < 0:
                raise ParamMapError(
                    f"entry {e.name!r} has offset {e.offset}/numel {e.numel}, expected {offset}/{math.prod(e.shape)}"
                )
            if e.kind not in ("param", "buffer") or not e.names:
                raise ParamMapError(f"entry {i} has kind {e.kind!r} and names {e.names!r}")
            for n in e.names:
                if by_name.setdefault(n, i) != i:
                    raise ParamMapError(f"name {n!r} appears in two entries")
            offset += e.numel
        self._entries = tuple(entries)
        self._by_name = by_name
        self._offsets = [e.offset for e in self._entries]
        self._numel = offset
        self._fingerprint = _fingerprint(self._entries)
        self._trainable_only = trainable_only
        self._include_buffers = include_buffers
        self._include = _patterns("include", include)
        self._exclude = _patterns("exclude", exclude)
        self._tensors: Optional[tuple[Tensor, ...]] = None

    @classmethod
    def from_module(
        cls,
        model: nn.Module,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        trainable_only: bool = True,
        include_buffers: bool = False,
    ) -> ParamMap:
        """Map ``model``'s parameters (or the subset the patterns select), bound to its tensors.

        ``include``/``exclude`` are ``fnmatch`` patterns (case-sensitive, ``*`` crosses
        dots) over parameter names; a tied tensor is selected when any of its names
        matches and dropped when any matches ``exclude``. The selection is recorded in
        the JSON map, so :meth:`bind` maps the same subset of another instance: that is
        how an adapter (LoRA weights, a head) travels between copies of a base model.

        Args:
            model: the module to map.
            include: keep only tensors with a name matching one of these patterns.
            exclude: drop tensors with a name matching one of these patterns.
            trainable_only: skip parameters with ``requires_grad=False``.
            include_buffers: append ``named_buffers()`` after the parameters.

        Returns:
            A bound map.

        Raises:
            ParamMapError: an ``include`` pattern that matches nothing (or only frozen
                parameters while ``trainable_only``), or a malformed pattern.

        Example:
            >>> ParamMap.from_module(torch.nn.BatchNorm1d(3), include_buffers=True).names
            ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
            >>> ParamMap.from_module(torch.nn.Linear(3, 2), exclude="bias").names
            ['weight']
        """
        inc, exc = _patterns("include", include), _patterns("exclude", exclude)
        entries, tensors = _collect(model, trainable_only, include_buffers, inc, exc)
        pmap = cls(
            entries,
            trainable_only=trainable_only,
            include_buffers=include_buffers,
            include=inc,
            exclude=exc,
        )
        pmap._tensors = tuple(tensors)
        return pmap

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
        dtypes = [e.dtype for e in self._entries] or [torch.float32]
        return functools.reduce(torch.promote_types, dtypes)

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

    # --- checks ---------------------------------------------------------------------
    def _bound(self, what: str) -> tuple[Tensor, ...]:
        if self._tensors is None:
            raise ParamMapError(
                f"{what} needs tensors: this map was loaded from JSON; call bind(model) first"
            )
        for e, t in zip(self._entries, self._tensors):
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ParamMapError(
                    f"{e.kind} {e.name!r} changed from {_dtype_name(e.dtype)}{list(e.shape)} to "
                    f"{_dtype_name(t.dtype)}{list(t.shape)} since the map was built; build a new map"
                )
        return self._tensors

    def _no_buffers(self, what: str) -> None:
        buffers = [e.name for e in self._entries if e.kind == "buffer"]
        if buffers:
            raise ParamMapError(
                f"{what} needs parameters only, but the map has buffers {_listed(buffers)}; build it with include_buffers=False"
            )

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
        if source not in ("data", "grad"):
            raise ParamMapError(f"source must be 'data' or 'grad', not {source!r}")
        if missing not in ("error", "zeros"):
            raise ParamMapError(f"missing must be 'error' or 'zeros', not {missing!r}")
        tensors = self._bound("flatten")
        for e, t in zip(self._entries, tensors):
            if t.device.type == "meta":
                raise ParamMapError(f"{e.kind} {e.name!r} is on the meta device and holds no data")
        if source == "grad":
            self._no_buffers("flatten(source='grad')")
            pieces: list[Optional[Tensor]] = [t.grad for t in tensors]
            absent = [e.name for e, g in zip(self._entries, pieces) if g is None]
            if absent and missing == "error":
                raise ParamMapError(
                    f"missing gradients for {_listed(absent)}; run backward() first or pass missing='zeros'"
                )
        else:
            pieces = [t.detach() for t in tensors]
        out_dtype = dtype if dtype is not None else self.dtype
        if device is None:
            devices = list(dict.fromkeys(t.device for t in tensors))
            if len(devices) > 1:
                raise ParamMapError(
                    f"tensors are on several devices ({', '.join(map(str, devices))}); pass device="
                )
            device = devices[0] if devices else torch.device("cpu")
        if not pieces:
            return torch.empty(0, dtype=out_dtype, device=device)
        flat = [
            torch.zeros(e.numel, dtype=out_dtype, device=device)
            if p is None
            else (p.to_dense() if p.layout != torch.strided else p)
            .reshape(-1)
            .to(device, out_dtype)
            for e, p in zip(self._entries, pieces)
        ]
        return torch.cat(flat)

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
        if target not in ("data", "grad"):
            raise ParamMapError(f"target must be 'data' or 'grad', not {target!r}")
        tensors = self._bound("unflatten")
        if not isinstance(vec, Tensor) or vec.dim() != 1 or vec.layout != torch.strided:
            what = f"shape {tuple(vec.shape)}" if isinstance(vec, Tensor) else type(vec).__name__
            raise ParamMapError(f"unflatten needs a dense 1-D tensor, got {what}")
        if target == "grad":
            self._no_buffers("unflatten(target='grad')")
        n = vec.numel()
        if n < self._numel:
            e = next(e for e in self._entries if e.end > n)
            raise ParamMapError(
                f"vector has {n} elements, the map needs {self._numel}: {e.kind} {e.name!r} "
                f"(elements {e.offset}..{e.end - 1}) does not fit"
            )
        if n > self._numel:
            last = f"the last entry {self._entries[-1].name!r}" if self._entries else "an empty map"
            raise ParamMapError(
                f"vector has {n} elements, the map needs {self._numel}: {n - self._numel} extra after {last}"
            )
        for e, t in zip(self._entries, tensors):
            if vec.device != t.device:
                raise ParamMapError(
                    f"vector is on {vec.device} but {e.kind} {e.name!r} is on {t.device}"
                )
            if t.device.type == "meta":
                raise ParamMapError(f"{e.kind} {e.name!r} is on the meta device and holds no data")
            if torch.promote_types(vec.dtype, t.dtype) != vec.dtype:
                raise ParamMapError(
                    f"a {_dtype_name(vec.dtype)} vector cannot hold {e.kind} {e.name!r} "
                    f"({_dtype_name(t.dtype)}) without loss; flatten with a wider dtype"
                )
        with torch.no_grad():
            for e, t, chunk in zip(
                self._entries, tensors, vec.split([e.numel for e in self._entries])
            ):
                src = chunk.view(e.shape)
                if target == "data":
                    t.copy_(src)
                elif t.grad is None or t.grad.layout != torch.strided:
                    grad = torch.empty_like(t)  # keeps the parameter's strides
                    grad.copy_(src)
                    t.grad = grad
                else:
                    t.grad.copy_(src)

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
        i = operator.index(index)
        if not 0 <= i < self._numel:
            raise ParamMapError(f"flat index {i} is outside the map's {self._numel} elements")
        e = self._entries[bisect.bisect_right(self._offsets, i) - 1]
        return e.name, _unravel(i - e.offset, e.shape)

    # --- documents ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The memory map as a JSON-serialisable dict (see :meth:`to_json`)."""
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "fingerprint": self._fingerprint,
            "numel": self._numel,
            "flat_dtype": _dtype_name(self.dtype),
            "offsets_in": "elements",
            "trainable_only": self._trainable_only,
            "include_buffers": self._include_buffers,
            **self.selection,
            "entries": [entry_to_dict(e) for e in self._entries],
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The memory map as a JSON document another program can read.

        Offsets count elements of a row-major flat vector of ``flat_dtype``; the
        ``fingerprint`` is a sha256 over names, shapes, dtypes and kinds.

        Example:
            >>> json.loads(ParamMap.from_module(torch.nn.Linear(3, 2)).to_json())["numel"]
            8
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ParamMap:
        """Load an unbound map from :meth:`to_dict` output, verifying its fingerprint."""
        try:
            if doc.get("format") != _FORMAT or doc.get("version") != _FORMAT_VERSION:
                raise ParamMapError(
                    f"not a gradwatch parameter map v{_FORMAT_VERSION} (format {doc.get('format')!r}, version {doc.get('version')!r})"
                )
            pmap = cls(
                [entry_from_dict(d) for d in doc["entries"]],
                trainable_only=bool(doc["trainable_only"]),
                include_buffers=bool(doc["include_buffers"]),
                include=doc.get("include"),
                exclude=doc.get("exclude"),
            )
        except (KeyError, TypeError, RuntimeError, AttributeError) as exc:
            raise ParamMapError(f"malformed parameter map document: {exc!r}") from exc
        if doc.get("fingerprint") != pmap.fingerprint or doc.get("numel") != pmap.numel:
            raise ParamMapError(
                "parameter map document is corrupt: fingerprint or numel does not match its entries"
            )
        return pmap

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamMap:
        """Load an unbound map written by :meth:`to_json`.

        Example:
            >>> pmap = ParamMap.from_json(ParamMap.from_module(torch.nn.Linear(3, 2)).to_json())
            >>> pmap.is_bound
            False
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ParamMapError(f"parameter map is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ParamMapError("parameter map document must be a JSON object")
        return cls.from_dict(doc)

    def check_compatible(self, model: nn.Module) -> list[str]:
        """List how ``model``'s layout differs from this map (empty when compatible).

        The model is mapped with this map's ``trainable_only``/``include_buffers`` and
        ``include``/``exclude`` selection;
        devices do not count.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> pmap.check_compatible(torch.nn.Linear(3, 4))
            ["'weight': shape [2, 3] in the map, [4, 3] in the model", "'bias': shape [2] in the map, [4] in the model"]
        """
        other = ParamMap(
            _collect(model, *self._options(), check_patterns=False)[0],
            trainable_only=self._trainable_only,
            include_buffers=self._include_buffers,
        )
        if other.fingerprint == self._fingerprint:
            return []
        return layout_diffs(self._entries, other._entries)

    def bind(self, model: nn.Module) -> ParamMap:
        """Attach ``model``'s tensors (after checking the layout); returns ``self``.

        Raises:
            ParamMapError: one line naming the first difference (and how many more) when
                the model does not match; :meth:`check_compatible` lists them all.

        Example:
            >>> doc = ParamMap.from_module(torch.nn.Linear(3, 2)).to_json()
            >>> ParamMap.from_json(doc).bind(torch.nn.Linear(3, 2)).is_bound
            True
        """
        diffs = self.check_compatible(model)
        if diffs:
            more = f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else ""
            raise ParamMapError(f"model does not match the map: {diffs[0]}{more}")
        entries, tensors = _collect(model, *self._options(), check_patterns=False)
        self._entries = tuple(entries)  # same layout; devices and requires_grad refreshed
        self._tensors = tuple(tensors)
        return self

    def _options(self) -> tuple[bool, bool, Optional[tuple[str, ...]], Optional[tuple[str, ...]]]:
        return self._trainable_only, self._include_buffers, self._include, self._exclude

    # --- quantization -------------------------------------------------------------------
    def _spans(self) -> list[tuple[str, int, int]]:
        return [(e.name, e.offset, e.numel) for e in self._entries]

    def quantize(
        self, dtype: torch.dtype = torch.int8, scheme: Scheme = "affine", *, source: Source = "data"
    ) -> tuple[Tensor, dict[str, Any]]:
        """Quantize the flat vector with a scale and zero point per parameter.

        Args:
            dtype: ``torch.int8`` or ``torch.uint8``.
            scheme: ``"affine"`` (range widened to include 0, integer zero point) or
                ``"symmetric"`` (zero point 0 for int8, 128 for uint8).
            source: quantize ``"data"`` or ``"grad"``.

        Returns:
            ``(qvec, metadata)``; metadata is a JSON-serialisable dict. The round-trip
            error of each element is at most half its parameter's ``scale``.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> qvec, meta = pmap.quantize(torch.uint8)
            >>> (pmap.dequantize(qvec, meta) - pmap.flatten()).abs().max().item() < 0.01
            True
        """
        try:
            return quantize_flat(
                self.flatten(source), self._spans(), dtype, scheme, self._fingerprint
            )
        except ParamMapError:
            raise
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    def dequantize(self, qvec: Tensor, metadata: dict[str, Any]) -> Tensor:
        """Invert :meth:`quantize`; works on unbound maps too (checked by fingerprint).

        Returns:
            A float vector (the dtype :meth:`flatten` gave) for :meth:`unflatten`.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> pmap.dequantize(*pmap.quantize()).shape
            torch.Size([8])
        """
        try:
            return dequantize_flat(qvec, metadata, self._spans(), self._fingerprint)
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    # --- shards and sketches -------------------------------------------------------
    def shard(self, rank: int, world_size: int) -> Shard:
        """The contiguous slice of the flat vector that ``rank`` of ``world_size`` owns.

        Rank ``r`` owns ``[r * numel // world_size, (r + 1) * numel // world_size)``;
        together the shards cover the vector exactly once. The shard lists the entries
        it covers (``pieces``, the first and last possibly partial), so optimizer state
        or a checkpoint can be split by rank. Works on unbound maps.

        Raises:
            ParamMapError: on a rank or world size out of range.

        Example:
            >>> shard = ParamMap.from_module(torch.nn.Linear(3, 2)).shard(1, 2)
            >>> shard.start, shard.end, [(p.name, p.start, p.numel) for p in shard.pieces]
            (4, 8, [('weight', 4, 2), ('bias', 0, 2)])
        """
        try:
            return shard_spans(
                [(e.name, e.offset, e.numel, e.shape) for e in self._entries],
                self._numel,
                rank,
                world_size,
            )
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    def sketch(
        self,
        vec: Optional[Tensor],
        k: int,
        seed: int = 0,
        *,
        source: Source = "data",
        density: int = DEFAULT_DENSITY,
    ) -> Tensor:
        """A seeded random projection of a flat vector (or of the mapped tensors) to ``k`` numbers.

        Norms and inner products survive within the bound documented in
        :mod:`gradwatch.vectors.sketch`: the relative error of a norm or an inner
        product exceeds ``eps`` with probability at most ``2 / (k eps^2)``. Sketches are
        linear, so the sketch of an update is the difference of the sketches before and
        after it. Memory is ``O(k + chunk)``: no ``numel x k`` matrix is built.

        Args:
            vec: a flat vector of :attr:`numel` elements, or ``None`` to sketch the bound
                tensors (``source``) in place, without flattening them.
            k: sketch size.
            seed: selects the projection (the same seed gives the same projection on
                every device).
            source: with ``vec=None``, ``"data"`` or ``"grad"``.
            density: non-zeros per element of the projection (see the sketch module).

        Returns:
            A float32 (float64 for float64 data) vector of ``k`` numbers.

        Raises:
            ParamMapError: a vector of the wrong length, or missing gradients.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(300, 100))
            >>> s = pmap.sketch(None, 256)
            >>> 0.5 < (s.norm() / pmap.flatten().norm()).item() < 1.5
            True
        """
        try:
            if vec is not None:
                if not isinstance(vec, Tensor) or vec.dim() != 1 or vec.numel() != self._numel:
                    what = tuple(vec.shape) if isinstance(vec, Tensor) else type(vec).__name__
                    raise ParamMapError(
                        f"sketch needs a 1-D vector of the map's {self._numel} elements, got {what}"
                    )
                return sketch(vec, k, seed, density=density)
            tensors = self._bound("sketch")
            if source == "grad":
                self._no_buffers("sketch(source='grad')")
                absent = [e.name for e, t in zip(self._entries, tensors) if t.grad is None]
                if absent:
                    raise ParamMapError(
                        f"missing gradients for {_listed(absent)}; run backward() first"
                    )
                return sketch_tensors(
                    [t.grad for t in tensors if t.grad is not None], k, seed, density=density
                )
            if source != "data":
                raise ParamMapError(f"source must be 'data' or 'grad', not {source!r}")
            return sketch_tensors(tensors, k, seed, density=density)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, ParamMapError):
                raise
            raise ParamMapError(f"cannot sketch: {exc}") from exc

    def unsketch(self, sk: Tensor, seed: int = 0, *, density: int = DEFAULT_DENSITY) -> Tensor:
        """The approximate reconstruction ``S^T sk`` of a :meth:`sketch`, a flat vector.

        Unbiased (``E[S^T S x] = x``) with per-element noise of about ``||x|| / sqrt(k)``:
        it shows where a vector's large elements are (pass it to :meth:`locate` or
        :meth:`unflatten`), not the small ones.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(300, 100))
            >>> pmap.unsketch(pmap.sketch(None, 64)).shape
            torch.Size([30100])
        """
        try:
            return unsketch(sk, self._numel, seed, density=density, chunk=DEFAULT_CHUNK)
        except (ValueError, TypeError) as exc:
            raise ParamMapError(f"cannot unsketch: {exc}") from exc

    # --- distributed --------------------------------------------------------------------
    def all_reduce_grads(
        self, group: Any = None, average: bool = True, *, missing: Missing = "error"
    ) -> Tensor:
        """Sum (or average) gradients across ranks with one collective, in place.

        One ``all_reduce`` on the flat gradient replaces one per parameter; the result
        is written back into each ``.grad``. Every rank must hold the same layout.

        Args:
            group: process group (default: the world).
            average: divide by the group's size, as DDP does.
            missing: ``"zeros"`` to treat absent gradients as zeros (they get created).

        Returns:
            The reduced flat gradient.

        Raises:
            ParamMapError: if ``torch.distributed`` is not initialized, or as
                :meth:`flatten`/:meth:`unflatten`.

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> pmap.all_reduce_grads()  # doctest: +SKIP
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ParamMapError("all_reduce_grads needs torch.distributed to be initialized")
        vec = self.flatten("grad", missing=missing)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
        if average:
            vec.div_(dist.get_world_size(group))
        self.unflatten(vec, "grad")
        return vec
