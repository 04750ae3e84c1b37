"""How a list of tensors is fingerprinted: its :class:`Plan`, made once per layout.

Small tensors (up to ``SMALL`` elements) are flattened together in groups of one device and
dtype (at most ``GROUP_MAX`` elements, which bounds the temporaries), or stacked by shape when
a model repeats a few shapes; a small tensor's sample is a seeded random subset of
``MIN_SAMPLES`` of its values (all of them when it has fewer). A large tensor is sampled at a
prime ``STRIDE`` from a seeded offset. Empty, non-float and sparse tensors, and large
non-contiguous ones (a flat view would copy them), get no fingerprint. Complex tensors are
read through their real view. The seed is fixed, so one layout always samples the same
values; the plan is cached by the tensors' identity (:func:`cached_plan`).
:mod:`gradwatch.measure.fingerprint` reads the tensors by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "GROUP_MAX",
    "MIN_SAMPLES",
    "SMALL",
    "STRIDE",
    "Big",
    "Group",
    "Plan",
    "cached_plan",
    "real_views",
]

STRIDE = 509  # a prime: a strided sample does not align with the rows of a weight matrix
MIN_SAMPLES = 64
SMALL = 1 << 16  # tensors up to this many elements are flattened together with others
GROUP_MAX = 1 << 18  # elements per flattened group: bounds the temporaries (1 MiB in fp32)
_SEED = 0x5EED

_F32 = torch.float32


@dataclass
class Group:
    """Small tensors of one device and dtype, flattened together."""

    members: list[int]  # positions in the fingerprinted list
    lengths: torch.Tensor  # numel of each member (int64, on the device)
    ends: torch.Tensor  # index of each member's last element in the flat vector
    sample_idx: torch.Tensor  # positions of the sampled values in the flat vector
    sample_lengths: torch.Tensor  # samples per member
    scale: torch.Tensor  # n / m per member (float32)
    sample_counts: torch.Tensor  # samples per member (float32)
    total: int = 0  # elements of all members (a resize since the plan is refused)
    uniform: bool = False  # every member has one shape: stacked, reduced along rows


@dataclass
class Big:
    """One large tensor: a strided sample of its flat view."""

    position: int
    offset: int
    stride: int
    m: int
    scale: float


@dataclass
class Plan:
    """How a list of tensors is fingerprinted (cached per layout)."""

    groups: list[Group]
    big: list[Big]
    skipped: list[int]  # positions without a fingerprint (non-contiguous large tensors)
    order: torch.Tensor  # input position -> index into the concatenated outputs
    permuted: bool  # whether ``order`` is not the identity
    has_complex: bool  # complex tensors are read through their real view
    device: torch.device
    single_device: bool


def real_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Complex tensors as their real views (the others as they are)."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def _plan(tensors: list[torch.Tensor]) -> Plan:
    has_complex = any(t.is_complex() for t in tensors)
    tensors = real_views(tensors)
    gen = torch.Generator().manual_seed(_SEED)
    groups: list[Group] = []
    big: list[Big] = []
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
            Group(
                members=members,
                lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
                ends=ends.to(device),
                sample_idx=torch.cat(idx).to(device),
                sample_lengths=torch.tensor(per, dtype=torch.int64, device=device),
                scale=torch.tensor([n / m for n, m in zip(lengths, per)], dtype=_F32).to(device),
                sample_counts=torch.tensor(per, dtype=_F32).to(device),
                total=start,
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
            big.append(Big(k, offset, stride, m, n / m))
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


def cached_plan(tensors: list[torch.Tensor]) -> Plan:
    """The plan of ``tensors``, made at their first fingerprint and kept for their layout."""
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
