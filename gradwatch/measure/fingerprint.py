"""Copy-free "did it change, and by how much": per-tensor fingerprints taken before a step.

A pre-step copy of every parameter doubles the model's memory at its peak. Instead, before
an observed optimizer step each tensor gets a :class:`Fingerprint` of a few numbers:

- an **exact checksum**: the sum of the tensor's bit patterns (its values viewed as
  integers) modulo 2**32. A change of any single element changes its bit pattern by
  ``d`` with ``0 < |d| < 2**32``, so the checksum changes: a one-element change is never
  missed. Several changes could cancel only if their bit differences sum to a multiple of
  2**32 (an exact swap of two values, say) *and* every sampled value below is unchanged.
- a **fixed random sample** of its values (at least ``MIN_SAMPLES``, about one in
  ``STRIDE`` of a large tensor): the update norm is estimated as
  ``sqrt(n / m * sum(sampled (w1 - w0)**2))``. Differences of sampled values are exact, so
  the estimate has no cancellation error however small the update is next to the weights.
  Its error is the sampling error: unbiased for ``||w1 - w0||**2``, with a relative standard
  deviation of about ``sqrt((kurtosis - 1) / m)`` for the squared norm, i.e. roughly
  ``sqrt(2 / m) / 2`` on the norm for Gaussian-like updates (m = 64: ~9 %; m = 1000:
  ~2 %), more for sparse updates (rows of an embedding). When the checksum says "changed"
  but no sampled value moved, the estimate is floored at ``TINY`` (changed, too little to
  measure). ``tests/measure/test_fingerprint.py`` checks the error against the exact value.

Memory: 4 bytes per sample plus 8 per tensor: about 0.8 % of the parameter bytes for
large tensors (one in 509), at most ``MIN_SAMPLES`` values per small tensor; temporaries
are bounded by ``GROUP_MAX`` elements (small tensors are flattened in groups). Nothing here
synchronises with the device: results are tensors until the step's single host transfer.

Example:
    >>> import torch
    >>> w = torch.randn(1000, 100)
    >>> before = fingerprint([w])
    >>> with torch.no_grad():
    ...     _ = w.add_(0.01 * torch.randn_like(w))
    >>> changed, delta = compare([w], before)
    >>> bool(changed[0]), 0.8 < float(delta[0]) / (0.01 * 100_000**0.5) < 1.2
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch._utils import _flatten_dense_tensors

from gradwatch.measure.stats import foreach_norms

__all__ = [
    "MIN_SAMPLES",
    "STRIDE",
    "TINY",
    "Fingerprint",
    "Measured",
    "compare",
    "fingerprint",
    "measure",
]

STRIDE = 509  # a prime: a strided sample does not align with the rows of a weight matrix
MIN_SAMPLES = 64
SMALL = 1 << 16  # tensors up to this many elements are flattened together with others
GROUP_MAX = 1 << 18  # elements per flattened group: bounds the temporaries (1 MiB in fp32)
TINY = 1e-30  # the estimate of a change the checksum saw but no sampled value did
_SEED = 0x5EED

_F32 = torch.float32


@dataclass
class _Group:
    """Small tensors of one device and dtype, flattened together."""

    members: list[int]  # positions in the fingerprinted list
    lengths: torch.Tensor  # numel of each member (int64, on the device)
    ends: torch.Tensor  # index of each member's last element in the flat vector
    sample_idx: torch.Tensor  # positions of the sampled values in the flat vector
    sample_lengths: torch.Tensor  # samples per member
    scale: torch.Tensor  # n / m per member (float32)
    uniform: bool = False  # every member has one shape: stacked, reduced along rows


@dataclass
class _Big:
    """One large tensor: a strided sample of its flat view."""

    position: int
    offset: int
    stride: int
    m: int
    scale: float


@dataclass
class Plan:
    """How a list of tensors is fingerprinted (cached per layout)."""

    groups: list[_Group]
    big: list[_Big]
    skipped: list[int]  # positions without a fingerprint (non-contiguous large tensors)
    order: torch.Tensor  # input position -> index into the concatenated outputs
    permuted: bool  # whether ``order`` is not the identity
    has_complex: bool  # complex tensors are read through their real view
    device: torch.device
    single_device: bool


@dataclass
class Fingerprint:
    """One list of tensors as it was before a step (device tensors; no host sync)."""

    key: tuple[int, ...]
    plan: Plan
    checksums: list[torch.Tensor]  # per group: int32 vector; per big tensor: 0-dim int
    samples: list[torch.Tensor]  # aligned with checksums


def _key(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(map(id, tensors))


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns as integers (exact: upcasting a float is injective)."""
    if flat.element_size() == 2:
        flat = flat.to(_F32)
    return flat.view(torch.int64 if flat.element_size() == 8 else torch.int32)


def _real(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def _plan(tensors: list[torch.Tensor]) -> Plan:
    has_complex = any(t.is_complex() for t in tensors)
    tensors = _real(tensors)
    gen = torch.Generator().manual_seed(_SEED)
    groups: list[_Group] = []
    big: list[_Big] = []
    skipped: list[int] = []
    pending: dict[tuple[object, ...], list[int]] = {}
    sizes: dict[tuple[object, ...], int] = {}
    # Stacked layers repeat a few shapes: then group by shape, so that a group is one
    # torch.stack (about 2.5x faster than a flatten) reduced along rows (measured).
    shapes = {
        (t.device, t.dtype, t.shape)
        for t in tensors
        if 0 < t.numel() <= SMALL and t.is_floating_point() and not t.is_sparse
    }
    n_small = sum(1 for t in tensors if 0 < t.numel() <= SMALL)
    by_shape = 0 < len(shapes) * 4 <= n_small

    def close(key: tuple[object, ...]) -> None:
        members = pending.pop(key, [])
        sizes.pop(key, None)
        if not members:
            return
        device = key[0]
        assert isinstance(device, torch.device)
        lengths = [tensors[k].numel() for k in members]
        idx: list[torch.Tensor] = []
        per: list[int] = []
        start = 0
        for n in lengths:
            m = min(n, MIN_SAMPLES)
            # A random subset, not a stride: small weights are often square (16 x 16) and a
            # stride would sample the same columns of every row.
            pick = torch.randperm(n, generator=gen)[:m].sort().values if m < n else torch.arange(n)
            idx.append(pick + start)
            per.append(m)
            start += n
        ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0) - 1
        groups.append(
            _Group(
                members=members,
                lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
                ends=ends.to(device),
                sample_idx=torch.cat(idx).to(device),
                sample_lengths=torch.tensor(per, dtype=torch.int64, device=device),
                scale=torch.tensor([n / m for n, m in zip(lengths, per)], dtype=_F32).to(device),
                uniform=by_shape,
            )
        )

    for k, t in enumerate(tensors):
        n = t.numel()
        if n == 0 or not t.is_floating_point() or t.is_sparse:
            skipped.append(k)
        elif n <= SMALL:
            key: tuple[object, ...] = (t.device, t.dtype)
            if by_shape:
                key = (t.device, t.dtype, t.shape)
            if sizes.get(key, 0) + n > GROUP_MAX:
                close(key)
            pending.setdefault(key, []).append(k)
            sizes[key] = sizes.get(key, 0) + n
        elif not t.is_contiguous():
            skipped.append(k)  # a flat view would copy it; no estimate for this one
        else:
            stride = STRIDE
            m = -(-n // stride)
            offset = int(torch.randint(0, n - (m - 1) * stride, (1,), generator=gen))
            big.append(_Big(k, offset, stride, m, n / m))
    for open_key in list(pending):
        close(open_key)
    positions = [k for g in groups for k in g.members] + [b.position for b in big] + skipped
    inverse = [0] * len(tensors)
    for j, k in enumerate(positions):
        inverse[k] = j
    devices = {t.device for t in tensors}
    device = tensors[0].device if tensors else torch.device("cpu")
    return Plan(
        groups,
        big,
        skipped,
        torch.tensor(inverse, dtype=torch.int64, device=device),
        inverse != list(range(len(tensors))),
        has_complex,
        device,
        len(devices) <= 1,
    )


def _group_values(
    tensors: list[torch.Tensor], g: _Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the flat vector, per-member checksums, sampled values) of one group."""
    members = [tensors[k] for k in g.members]
    if g.uniform and len(members) > 1:  # one shape: the same layout as a flatten, faster
        flat = torch.stack(members).view(-1)
        sums = _bits(flat).view(len(members), -1).sum(1, dtype=torch.int64)
        return flat, sums, flat[g.sample_idx].to(_F32)
    flat = _flatten_dense_tensors(members) if len(members) > 1 else members[0].reshape(-1)
    # Per-member sums of the bit patterns: a wrapping cumulative sum read at each member's
    # end (differences of a wrapping sum are exact modulo 2**32).
    cs = _bits(flat).cumsum(0, dtype=torch.int64)[g.ends]
    sums = torch.diff(cs, prepend=cs.new_zeros(1))
    return flat, sums, flat[g.sample_idx].to(_F32)  # indexing copies: no alias


def _big_values(t: torch.Tensor, b: _Big) -> tuple[torch.Tensor, torch.Tensor]:
    flat = t.detach().view(-1)
    bits = _bits(flat) if flat.element_size() != 2 else flat.view(torch.int16)
    # int32 accumulation wraps (modulo 2**32) and is several times faster than int64 here.
    total = bits.sum(dtype=torch.int32 if bits.element_size() <= 4 else torch.int64)
    sample = flat[b.offset : b.offset + (b.m - 1) * b.stride + 1 : b.stride].to(_F32)
    return total.to(torch.int64).reshape(1), sample


def _cached_plan(tensors: list[torch.Tensor]) -> Plan:
    # Keyed by identity and total size: the shape-keyed lookup walks every tensor's
    # attributes (about 1 ms for 400 tensors), too much for each statistics step.
    key = (tuple(map(id, tensors)), sum(map(torch.Tensor.numel, tensors)))
    found = _BY_ID.get(key)
    if found is None:
        if len(_BY_ID) > 64:
            _BY_ID.clear()
        found = _BY_ID[key] = _plan(tensors)
    return found


_BY_ID: dict[tuple[object, ...], Plan] = {}


def fingerprint(tensors: list[torch.Tensor]) -> Fingerprint:
    """Fingerprint ``tensors`` before a step (see the module docstring for what it holds).

    Example:
        >>> fp = fingerprint([torch.zeros(3)])
        >>> len(fp.checksums)
        1
    """
    plan = _cached_plan(tensors)
    key = _key(tensors)
    if plan.has_complex:
        tensors = _real(tensors)
    checksums: list[torch.Tensor] = []
    samples: list[torch.Tensor] = []
    with torch.no_grad():
        for g in plan.groups:
            _, c, s = _group_values(tensors, g)
            checksums.append(c)
            samples.append(s)
        for b in plan.big:
            c, s = _big_values(tensors[b.position], b)
            checksums.append(c)
            samples.append(s.clone())  # a strided view of the tensor: must not alias it
    return Fingerprint(key, plan, checksums, samples)


@dataclass
class Measured:
    """Per-tensor float32 vectors aligned with the measured list (device tensors)."""

    param_norm: torch.Tensor
    changed: Optional[torch.Tensor]  # 1.0 where any value changed; NaN: not fingerprinted
    delta: Optional[torch.Tensor]  # update-norm estimate; 0.0 exactly where nothing changed
    # the share of sampled values that changed (stale_param's precision cause); NaN: unknown
    moved_frac: Optional[torch.Tensor] = None


def measure(tensors: list[torch.Tensor], before: Optional[Fingerprint] = None) -> Measured:
    """Parameter norms (exact) and, given ``before``, what changed since then and by how much.

    One flatten per group of small tensors serves the norms, the checksums and the samples.
    ``before`` must come from :func:`fingerprint` on the same list (else ``ValueError``).

    Example:
        >>> w = torch.ones(10)
        >>> fp = fingerprint([w])
        >>> m = measure([w], fp)
        >>> m.param_norm.tolist(), m.changed.tolist()
        ([3.1622776985168457], [0.0])
    """
    if before is not None and _key(tensors) != before.key:
        raise ValueError("measure() needs the tensors that were fingerprinted")
    plan = before.plan if before is not None else _cached_plan(tensors)
    if plan.has_complex:
        tensors = _real(tensors)
    norm_parts: list[torch.Tensor] = []
    changed_parts: list[torch.Tensor] = []
    delta_parts: list[torch.Tensor] = []
    frac_parts: list[torch.Tensor] = []
    with torch.no_grad():
        j = 0
        for g in plan.groups:
            flat, c, s = _group_values(tensors, g)
            f = flat if flat.dtype is _F32 else flat.to(_F32)
            k = len(g.members)
            if g.uniform:  # rows of one length: a row reduction beats a segment reduction
                norm_parts.append((f * f).view(k, -1).sum(1).sqrt_())
            else:
                norm_parts.append(torch.segment_reduce(f * f, "sum", lengths=g.lengths).sqrt_())
            if before is not None:
                d = s - before.samples[j]
                if g.uniform:
                    rows = d.view(k, -1)
                    moved = (rows != 0).any(1).to(_F32)
                    frac_parts.append((rows != 0).to(_F32).mean(1))
                    est = (rows * rows).sum(1)
                else:
                    nz = (d != 0).to(_F32)
                    moved = torch.segment_reduce(nz, "max", lengths=g.sample_lengths)
                    frac_parts.append(torch.segment_reduce(nz, "mean", lengths=g.sample_lengths))
                    est = torch.segment_reduce(d * d, "sum", lengths=g.sample_lengths)
                changed_parts.append(((c != before.checksums[j]).to(_F32) + moved).clamp_(max=1))
                delta_parts.append((est * g.scale).sqrt_())
            j += 1
        if plan.big:
            bigs = [tensors[b.position] for b in plan.big]
            norm_parts.append(torch.stack(foreach_norms(bigs, 2.0)))
        if before is not None:
            for b in plan.big:
                c, s = _big_values(tensors[b.position], b)
                d = s - before.samples[j]
                moved = (d != 0).any().reshape(1).to(_F32)
                frac_parts.append((d != 0).to(_F32).mean().reshape(1))
                changed_parts.append(((c != before.checksums[j]).to(_F32) + moved).clamp_(max=1))
                delta_parts.append(((d * d).sum() * b.scale).sqrt_().reshape(1))
                j += 1
        skipped_norms = [_dense_norm(tensors[k]) for k in plan.skipped]
        pn = _assemble(plan, norm_parts, skipped_norms)
        if before is None:
            return Measured(pn, None, None)
        nan = [torch.full((), float("nan"), device=plan.device)] * len(plan.skipped)
        changed = _assemble(plan, changed_parts, nan)
        delta = _assemble(plan, delta_parts, nan)
        # changed, yet no sampled value moved: floor at TINY (the checksum saw it)
        delta = torch.where(changed == 0, torch.zeros_like(delta), delta.clamp(min=TINY))
        return Measured(pn, changed, delta, _assemble(plan, frac_parts, nan))


def compare(tensors: list[torch.Tensor], before: Fingerprint) -> tuple[torch.Tensor, torch.Tensor]:
    """(changed flags, update-norm estimates) per tensor since ``before`` (see :func:`measure`).

    Example:
        >>> w = torch.ones(10)
        >>> fp = fingerprint([w])
        >>> compare([w], fp)[0].tolist()
        [0.0]
    """
    m = measure(tensors, before)
    assert m.changed is not None and m.delta is not None
    return m.changed, m.delta


def _dense_norm(t: torch.Tensor) -> torch.Tensor:
    v = t.coalesce()._values() if t.is_sparse else t
    if v.numel() == 0 or not v.is_floating_point():
        return torch.zeros((), device=t.device)
    return torch.linalg.vector_norm(v.detach(), dtype=_F32)


def _assemble(plan: Plan, parts: list[torch.Tensor], skipped: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-group results and put them back in the input order."""
    if not plan.single_device:  # model parallel: the small per-tensor results on one device
        parts = [p.to(plan.device) for p in parts]
        skipped = [p.to(plan.device) for p in skipped]
    if skipped:
        parts = [*parts, torch.stack(skipped)]
    if not parts:
        return torch.zeros(0, device=plan.device)
    joined = torch.cat(parts) if len(parts) > 1 else parts[0]
    return joined[plan.order] if plan.permuted else joined


def nbytes(fp: Optional[Fingerprint]) -> int:
    """Bytes held by a fingerprint (its checksums and samples)."""
    if fp is None:
        return 0
    return sum(t.numel() * t.element_size() for t in fp.checksums + fp.samples)
