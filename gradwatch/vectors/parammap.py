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

import json
from typing import Any, Optional

from gradwatch.vectors._layout import (
    ModelLike,
    ParamEntry,
    ParamMapError,
    Patterns,
    _collect,
    _patterns,
)
from gradwatch.vectors._ops import VectorOps
from gradwatch.vectors._serial import (
    bind_model,
    layout_differences,
    map_from_dict,
    map_to_dict,
    parse_json,
)
from gradwatch.vectors.shard import Shard

__all__ = ["ParamEntry", "ParamMap", "ParamMapError", "Shard"]


class ParamMap(VectorOps):
    """Ordered memory map of a module's parameters (and optionally buffers) in one vector.

    Build it with :meth:`from_module` (bound to the module's tensors) or
    :meth:`from_json` (unbound until :meth:`bind`). Entries follow
    ``named_parameters()`` order, then ``named_buffers()``, one per distinct tensor.
    A bound map holds the tensors, not the module: after replacing a parameter
    object, build a new map (changes of shape or dtype in place are detected).

    The layout, :meth:`flatten`, :meth:`unflatten` and :meth:`locate` come from
    :mod:`gradwatch.vectors._core`; quantization, shards, sketches and
    :meth:`all_reduce_grads` from :mod:`gradwatch.vectors._ops`.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> pmap = ParamMap.from_module(model)
        >>> len(pmap), pmap.numel, [e.name for e in pmap]
        (2, 6, ['0.weight', '0.bias'])
    """

    @classmethod
    def from_module(
        cls,
        model: ModelLike,
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
            model: the module to map, or named models (``{"G": netG, "D": netD}``), whose
                parameters are then named ``G:main.0.weight`` as in gradwatch's reports.
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

    # --- documents ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The memory map as a JSON-serialisable dict (see :meth:`to_json`)."""
        return map_to_dict(self._entries, self._fingerprint, self.dtype, self._options())

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
        return map_from_dict(cls, doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamMap:
        """Load an unbound map written by :meth:`to_json`.

        Example:
            >>> pmap = ParamMap.from_json(ParamMap.from_module(torch.nn.Linear(3, 2)).to_json())
            >>> pmap.is_bound
            False
        """
        return cls.from_dict(parse_json(text))

    def check_compatible(self, model: ModelLike) -> list[str]:
        """List how ``model``'s layout differs from this map (empty when compatible).

        The model is mapped with this map's ``trainable_only``/``include_buffers`` and
        ``include``/``exclude`` selection;
        devices do not count.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> pmap.check_compatible(torch.nn.Linear(3, 4))
            ["'weight': shape [2, 3] in the map, [4, 3] in the model", "'bias': shape [2] in the map, [4] in the model"]
        """
        return layout_differences(self._entries, self._fingerprint, model, self._options())

    def bind(self, model: ModelLike) -> ParamMap:
        """Attach ``model``'s tensors (after checking the layout); returns ``self``.

        Raises:
            ParamMapError: one line naming the first difference (and how many more) when
                the model does not match; :meth:`check_compatible` lists them all.

        Example:
            >>> doc = ParamMap.from_module(torch.nn.Linear(3, 2)).to_json()
            >>> ParamMap.from_json(doc).bind(torch.nn.Linear(3, 2)).is_bound
            True
        """
        entries, tensors = bind_model(self._entries, self._fingerprint, model, self._options())
        self._entries = tuple(entries)  # same layout; devices and requires_grad refreshed
        self._tensors = tuple(tensors)
        return self
