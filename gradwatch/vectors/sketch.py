"""Seeded sparse random projections (sketches) of flat vectors, streamed chunk by chunk.

A sketch ``S x`` maps a vector of ``n`` numbers to ``k`` numbers so that norms and inner
products survive: ``||S x||^2 ~ ||x||^2`` and ``<S x, S y> ~ <x, y>``. Because ``S`` is
linear, the sketch of an update is the difference of the sketches before and after it,
so an update norm needs ``k`` numbers per tensor instead of a copy of the parameters.

Construction (the block sparse Johnson-Lindenstrauss transform of Kane and Nelson,
"Sparser Johnson-Lindenstrauss Transforms", J. ACM 2014): the ``k`` outputs are split
into ``s = gcd(k, density)`` blocks of ``w = k / s`` rows; in every block each input
element ``i`` is added, with a random sign, to one random row, and the result is scaled
by ``1 / sqrt(s)``. Signs and rows come from a hash of ``(seed, i)`` and one
multiply-shift per block, computed in integer arithmetic on the tensor's device: no ``n x k`` matrix, no random-number
generator state, the same projection on every device and for any split of the vector into
tensors or chunks. Memory is ``O(k + chunk)``, time ``O(n s)``.

Error bound (for ideal random signs and rows; the hash is tested against it):

* ``E ||S x||^2 = ||x||^2`` and ``Var ||S x||^2 = (2/k) (||x||^4 - ||x||_4^4) <= (2/k) ||x||^4``.
* ``E <S x, S y> = <x, y>`` and
  ``Var <S x, S y> = (1/k) (||x||^2 ||y||^2 + <x, y>^2 - 2 sum_i x_i^2 y_i^2) <= (2/k) ||x||^2 ||y||^2``.
* Hence (Chebyshev), for every ``eps > 0``:
  ``P(| ||S x||^2 - ||x||^2 | > eps ||x||^2) <= 2 / (k eps^2)``, the same for
  ``| ||S x|| - ||x|| | > eps ||x||`` (a weaker event), and
  ``P(|<S x, S y> - <x, y>| > eps ||x|| ||y||) <= 2 / (k eps^2)``. :func:`error_bound`
  gives the ``eps`` for a failure probability ``delta``.
* With ``s >= 2`` the tails are lighter than Chebyshev's (Kane and Nelson: ``k =
  O(eps^-2 log 1/delta)`` rows and ``s = O(eps^-1 log 1/delta)`` blocks give the
  Johnson-Lindenstrauss guarantee); the documented, tested figure is the Chebyshev one.

Example:
    >>> x = torch.randn(10_000)
    >>> sx = sketch(x, 256, seed=1)
    >>> abs(sx.norm().item() / x.norm().item() - 1) < error_bound(256, 0.01)
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Union

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_DENSITY",
    "error_bound",
    "sketch",
    "sketch_tensors",
    "unsketch",
]

DEFAULT_CHUNK = 1 << 16
DEFAULT_DENSITY = 4
_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 multipliers (C. Wellons, "Hash Prospector")
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9

Tensors = Union[Tensor, Sequence[Tensor], Iterable[Tensor]]


# --- hashing ----------------------------------------------------------------------------
def _mix32_int(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * _C1) & _M32
    h ^= h >> 15
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def _mul32(h: Tensor, c: int) -> Tensor:
    # (h * c) mod 2**32 for h < 2**32 without overflowing int64: split c into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32  # _C1 < 2**31: the product stays below 2**63
    h = h ^ (h >> 15)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _block_keys(seed: int, blocks: int) -> tuple[int, list[int]]:
    """The element hash's key and one odd multiplier below 2**31 per block."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    key = _mix32_int(_mix32_int(seed & _M32) ^ (seed >> 32 & _M32))
    mults = [(_mix32_int(key ^ ((b + 1) * _GOLDEN & _M32)) & 0x7FFFFFFF) | 1 for b in range(blocks)]
    return key, mults


def _codes(index: Tensor, key: int, mults: list[int], width: int, high: bool) -> Iterator[Tensor]:
    """Per block, ``2 * row + sign_bit`` of every element (multiply-shift over one mixed hash).

    ``high`` says whether any index reaches 2**32 (known on the host: no device sync).
    """
    h = _mix32((index & _M32) ^ key)
    if high:
        h = _mix32(h ^ (index >> 32))
    for b, a in enumerate(mults):
        # h < 2**32 and a < 2**31: the product fits in int64; bits 16+ depend on all of h's low bits.
        yield ((h * a) >> 16).remainder_(2 * width).add_(2 * width * b)


# --- layout -----------------------------------------------------------------------------
def _layout(k: int, density: int) -> tuple[int, int]:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"sketch size k must be a positive int, got {k!r}")
    if not isinstance(density, int) or isinstance(density, bool) or density < 1:
        raise ValueError(f"density must be a positive int, got {density!r}")
    blocks = math.gcd(k, density)
    return blocks, k // blocks


def _pieces(tensors: Tensors) -> list[Tensor]:
    if isinstance(tensors, Tensor):
        return [tensors]
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
    return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(t: Tensor, chunk: int) -> Iterator[Tensor]:
    """Row-major pieces of ``t`` of about ``chunk`` elements (slices along dim 0, so a
    non-contiguous tensor is copied one piece at a time, never whole)."""
    if t.dim() == 0:
        yield t.reshape(1)
        return
    row = max(1, t[0].numel()) if t.shape[0] else 1
    rows = max(1, chunk // row)
    for start in range(0, t.shape[0], rows):
        yield t[start : start + rows].reshape(-1)


def _check_chunk(chunk: int) -> None:
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


# --- public -----------------------------------------------------------------------------
def sketch_tensors(
    tensors: Tensors,
    k: int,
    seed: int = 0,
    *,
    density: int = DEFAULT_DENSITY,
    chunk: int = DEFAULT_CHUNK,
    offset: int = 0,
) -> Tensor:
    """Sketch the concatenation of ``tensors`` (each read row-major) without building it.

    Args:
        tensors: a tensor or an iterable of tensors, all on one device; gradients are
            not tracked.
        k: sketch size.
        seed: selects the projection; equal seeds give equal projections everywhere.
        density: non-zeros per input element (``gcd(k, density)`` is used).
        chunk: elements processed at once (memory ``O(k + chunk)``).
        offset: position of the first element in the (virtual) flat vector: sketches
            of consecutive ranges with matching offsets add up to the sketch of the
            whole.

    Returns:
        A float32 vector of ``k`` numbers (float64 for float64 input), on the tensors'
        device (CPU when there are none).

    Example:
        >>> a, b = torch.randn(3, 4), torch.randn(5)
        >>> torch.allclose(sketch_tensors([a, b], 16), sketch(torch.cat([a.flatten(), b]), 16))
        True
    """
    blocks, width = _layout(k, density)
    _check_chunk(chunk)
    pieces = _pieces(tensors)
    device = pieces[0].device if pieces else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in pieces) else torch.float32
    # Row j accumulates + into acc[2j] and - into acc[2j + 1]: no sign multiply per element.
    acc = torch.zeros(2 * k, dtype=dtype, device=device)
    key, mults = _block_keys(seed, blocks)
    pos = int(offset)
    with torch.no_grad():
        for t in pieces:
            if t.device != device:
                raise ValueError(f"tensors are on {device} and {t.device}; move them to one device")
            if t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"cannot sketch a {t.dtype} tensor")
            for part in _chunks(t.detach(), chunk):
                n = part.numel()
                if n == 0:
                    continue
                index = torch.arange(pos, pos + n, device=device, dtype=torch.int64)
                x = part.to(dtype)
                for code in _codes(index, key, mults, width, pos + n > _M32):
                    acc.index_add_(0, code, x)
                pos += n
    out = acc[0::2] - acc[1::2]
    return out.mul_(1.0 / math.sqrt(blocks))


def sketch(
    vec: Tensor,
    k: int,
    seed: int = 0,
    *,
    density: int = DEFAULT_DENSITY,
    chunk: int = DEFAULT_CHUNK,
    offset: int = 0,
) -> Tensor:
    """Sketch one flat vector to ``k`` numbers (see the module docstring for the bound).

    Example:
        >>> x, y = torch.randn(4096), torch.randn(4096)
        >>> sx, sy = sketch(x, 512), sketch(y, 512)
        >>> abs((sx @ sy - x @ y).item()) < error_bound(512, 0.001) * (x.norm() * y.norm()).item()
        True
    """
    if not isinstance(vec, Tensor) or vec.dim() != 1:
        what = f"shape {tuple(vec.shape)}" if isinstance(vec, Tensor) else type(vec).__name__
        raise ValueError(f"sketch needs a 1-D tensor, got {what}")
    return sketch_tensors([vec], k, seed, density=density, chunk=chunk, offset=offset)


def unsketch(
    sk: Tensor,
    n: int,
    seed: int = 0,
    *,
    density: int = DEFAULT_DENSITY,
    chunk: int = DEFAULT_CHUNK,
    offset: int = 0,
) -> Tensor:
    """The transpose ``S^T sk``: an approximate reconstruction of the sketched vector.

    ``E[S^T S x] = x``: each element comes back as itself plus noise of standard
    deviation about ``||x|| / sqrt(k)`` (the other elements hashed to its rows), so the
    large elements of a vector stand out while small ones are lost in the noise. Exact
    when ``n`` elements fit in ``k`` rows without collision, which is never promised.

    Args:
        sk: a sketch from :func:`sketch` (same ``k``, ``seed``, ``density``, ``offset``).
        n: length of the vector to rebuild.
        seed: the sketch's seed.
        density: the sketch's density.
        chunk: elements rebuilt at once.
        offset: the sketch's offset.

    Returns:
        A vector of ``n`` elements, ``sk``'s dtype and device.

    Example:
        >>> x = torch.zeros(10_000); x[7] = 100.0
        >>> unsketch(sketch(x, 256), 10_000).argmax().item()
        7
    """
    if not isinstance(sk, Tensor) or sk.dim() != 1:
        raise ValueError("unsketch needs the 1-D sketch tensor")
    k = sk.numel()
    blocks, width = _layout(k, density)
    _check_chunk(chunk)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    key, mults = _block_keys(seed, blocks)
    src = sk.detach().to(_compute_dtype(sk.dtype)) / math.sqrt(blocks)
    signed = torch.stack([src, -src], dim=1).reshape(-1)  # code 2j -> +sk[j], 2j+1 -> -sk[j]
    out = torch.zeros(n, dtype=src.dtype, device=sk.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        index = torch.arange(offset + start, offset + stop, device=sk.device, dtype=torch.int64)
        part = out[start:stop]
        for code in _codes(index, key, mults, width, offset + stop > _M32):
            part += signed[code]
    return out


def error_bound(k: int, delta: float) -> float:
    """The ``eps`` with ``P(relative error > eps) <= delta`` (Chebyshev, see the module docs).

    Applies to ``||S x||^2`` relative to ``||x||^2``, to ``||S x||`` relative to ``||x||``,
    and to ``<S x, S y>`` relative to ``||x|| ||y||``.

    Example:
        >>> round(error_bound(200, 0.01), 3)
        1.0
    """
    if not 0 < delta <= 1:
        raise ValueError(f"delta must be in (0, 1], got {delta!r}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k!r}")
    return math.sqrt(2.0 / (k * delta))
