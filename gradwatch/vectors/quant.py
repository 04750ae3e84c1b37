"""Per-parameter int8/uint8 quantization of a flat vector (the maths behind ``ParamMap.quantize``).

Plain functions over ``(name, offset, numel)`` spans so that they know nothing of
modules; :mod:`gradwatch.vectors.parammap` supplies the spans and the fingerprint.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["QUANT_FORMAT", "Scheme", "dequantize_flat", "qparams", "quantize_flat"]

Scheme = Literal["affine", "symmetric"]
Span = tuple[str, int, int]  # (name, offset, numel)

QUANT_FORMAT = "gradwatch.vectors.parammap.quant"
_QUANT_VERSION = 1
_QRANGES: dict[torch.dtype, tuple[int, int]] = {torch.int8: (-128, 127), torch.uint8: (0, 255)}
_TINY = torch.finfo(torch.float32).tiny


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _round_f32(value: float) -> float:
    # The scale is applied in float32 arithmetic; storing the float32 value keeps the
    # metadata and the computation in exact agreement.
    return float(struct.unpack("f", struct.pack("f", value))[0])


def qparams(
    lo: float, hi: float, qdtype: torch.dtype, scheme: Scheme, *, exact64: bool = False
) -> tuple[float, int, int, int]:
    """Scale, zero point and clamp range for values in ``[lo, hi]``.

    Affine widens the range to include 0 so that zero is exactly representable and the
    zero point is an integer in ``[qmin, qmax]`` (the convention of PyTorch and most
    inference engines). Symmetric uses a zero point in the middle of the range (0 for
    int8, 128 for uint8) and drops one code to keep the range symmetric.

    Args:
        lo: smallest value of the tensor.
        hi: largest value of the tensor.
        qdtype: ``torch.int8`` or ``torch.uint8``.
        scheme: ``"affine"`` or ``"symmetric"``.
        exact64: keep the scale in float64 (for float64 data) instead of float32.

    Returns:
        ``(scale, zero_point, qmin, qmax)``; the round-trip error is at most ``scale / 2``.

    Example:
        >>> qparams(-1.0, 1.0, torch.int8, "symmetric")[:2]
        (0.007874015718698502, 0)
    """
    qmin, qmax = _QRANGES[qdtype]
    if scheme == "symmetric":
        zero = (qmin + qmax + 1) // 2
        half = min(qmax - zero, zero - qmin)
        qmin, qmax = zero - half, zero + half
        span, steps = max(abs(lo), abs(hi)), half
    else:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        span, steps = hi - lo, qmax - qmin
    scale = span / steps if span > 0 else 1.0
    if not exact64:
        scale = _round_f32(scale)
    scale = max(scale, _TINY)  # denormal ranges would divide by zero
    if scheme == "affine":
        zero = min(max(qmin - round(lo / scale), qmin), qmax)
    return scale, zero, qmin, qmax


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_flat(
    vec: Tensor, spans: Sequence[Span], qdtype: torch.dtype, scheme: Scheme, fingerprint: str
) -> tuple[Tensor, dict[str, Any]]:
    """Quantize each span of ``vec`` with its own scale and zero point.

    Args:
        vec: 1-D flat vector (any real dtype).
        spans: ``(name, offset, numel)`` per parameter, covering ``vec`` in order.
        qdtype: ``torch.int8`` or ``torch.uint8``.
        scheme: ``"affine"`` or ``"symmetric"``.
        fingerprint: structure fingerprint recorded in the metadata.

    Returns:
        The quantized vector and a JSON-serialisable metadata dict.

    Raises:
        ValueError: on an unsupported dtype or scheme, or a non-finite value (the
            message names the parameter).

    Example:
        >>> q, meta = quantize_flat(torch.tensor([0.0, 1.0]), [("w", 0, 2)], torch.uint8, "affine", "x")
        >>> q.tolist(), meta["params"][0]["zero_point"]
        ([0, 255], 0)
    """
    if qdtype not in _QRANGES:
        raise ValueError(f"quantize supports torch.int8 and torch.uint8, not {qdtype}")
    if scheme not in ("affine", "symmetric"):
        raise ValueError(f"scheme must be 'affine' or 'symmetric', not {scheme!r}")
    compute = _compute_dtype(vec.dtype)
    x = vec.detach().to(compute)
    live = [s for s in spans if s[2] > 0]
    # One host transfer for all ranges instead of one .item() per parameter.
    bounds: list[list[float]] = []
    if live:
        pairs = [torch.stack(torch.aminmax(x[off : off + n])) for _, off, n in live]
        bounds = torch.stack(pairs).tolist()
    ranges = {name: (lo, hi) for (name, _, _), (lo, hi) in zip(live, bounds)}
    out = torch.empty(x.numel(), dtype=qdtype, device=x.device)
    params: list[dict[str, Any]] = []
    for name, off, n in spans:
        lo, hi = ranges.get(name, (0.0, 0.0))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"cannot quantize parameter {name!r}: it holds NaN or infinite values")
        scale, zero, qmin, qmax = qparams(lo, hi, qdtype, scheme, exact64=compute == torch.float64)
        if n:
            q = torch.round(x[off : off + n] / scale).add_(zero).clamp_(qmin, qmax)
            out[off : off + n] = q.to(qdtype)
        params.append({"name": name, "offset": off, "numel": n, "scale": scale, "zero_point": zero})
    meta = {
        "format": QUANT_FORMAT,
        "version": _QUANT_VERSION,
        "scheme": scheme,
        "qdtype": _dtype_name(qdtype),
        "dtype": _dtype_name(vec.dtype if vec.dtype.is_floating_point else compute),
        "fingerprint": fingerprint,
        "numel": x.numel(),
        "params": params,
    }
    return out, meta


def dequantize_flat(
    qvec: Tensor, meta: dict[str, Any], spans: Sequence[Span], fingerprint: str
) -> Tensor:
    """Invert :func:`quantize_flat`, after checking the metadata fits ``spans``.

    Args:
        qvec: the quantized 1-D vector.
        meta: the metadata returned by :func:`quantize_flat` (possibly via JSON).
        spans: ``(name, offset, numel)`` of the map that dequantizes.
        fingerprint: fingerprint of that map.

    Returns:
        A float vector of the dtype recorded in the metadata, on ``qvec``'s device.

    Raises:
        ValueError: when the metadata, the vector and the map disagree.

    Example:
        >>> q, meta = quantize_flat(torch.tensor([0.5]), [("w", 0, 1)], torch.int8, "symmetric", "x")
        >>> dequantize_flat(q, meta, [("w", 0, 1)], "x").tolist()
        [0.5]
    """
    try:
        if meta["format"] != QUANT_FORMAT or meta["version"] != _QUANT_VERSION:
            raise ValueError(f"not gradwatch quantization metadata (format {meta['format']!r})")
        qdtype = getattr(torch, meta["qdtype"])
        dtype = getattr(torch, meta["dtype"])
        params = meta["params"]
        if meta["fingerprint"] != fingerprint:
            raise ValueError("quantization metadata was made for a different model structure")
        if qvec.dtype != qdtype:
            raise ValueError(f"quantized vector is {qvec.dtype}, the metadata says {qdtype}")
        if qvec.dim() != 1 or qvec.numel() != meta["numel"]:
            raise ValueError(
                f"quantized vector has shape {tuple(qvec.shape)}, expected ({meta['numel']},)"
            )
        for (name, off, n), p in zip(spans, params):
            if (p["name"], p["offset"], p["numel"]) != (name, off, n):
                raise ValueError(f"quantization metadata for parameter {name!r} does not match")
        if len(params) != len(spans):
            raise ValueError(f"metadata lists {len(params)} parameters, the map {len(spans)}")
        compute = _compute_dtype(dtype)
        out = torch.empty(qvec.numel(), dtype=compute, device=qvec.device)
        for p in params:
            off, n = p["offset"], p["numel"]
            out[off : off + n] = (qvec[off : off + n].to(compute) - p["zero_point"]) * p["scale"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed quantization metadata: {exc!r}") from exc
    return out.to(dtype)
