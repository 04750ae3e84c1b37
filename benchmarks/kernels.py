"""The tensor work of one statistics step on large CPU tensors, piece by piece.

Usage::

    .venv/bin/python benchmarks/kernels.py                 # 16 x 512K float32 (8.4M elements)
    .venv/bin/python benchmarks/kernels.py --size 1048576 --count 8

Where ``overhead.py`` and ``scaling.py`` time whole steps (and so carry the machine's noise
into every ratio), this times each piece of gradwatch's statistics step alone, in one
process, with one torch thread and the process's CPU time (median of ``--repeat``), next
to ``clip_grad_norm_`` on the same gradients. It shows the floor under the "every
statistic every step on large tensors" line of ``RESULTS.md``: the kernels gradwatch must
run, whatever the Python around them costs. The last two lines are what fewer statistics
would leave: without max |g| and the non-zero count (L1 and the L2 norms, still exact), and
with the gradients' L2 norms alone (``_foreach_norm``), next to the parameter side that "did
it change" and the update ratio need on every observed step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from gradwatch.measure import carry
from gradwatch.measure.chunked import ABS_CHUNK, abs_stats
from gradwatch.measure.fingerprint import Fingerprint, fingerprint, measure
from gradwatch.measure.stats import foreach_norms


def _nothing() -> None:
    return None


def _ms(fn: Callable[[], object], repeat: int, setup: Callable[[], object] = _nothing) -> float:
    setup()
    fn()  # warm-up: caches, plans, allocator
    times = []
    for _ in range(repeat):
        setup()  # untimed
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=16, help="parameter tensors")
    ap.add_argument("--size", type=int, default=1 << 19, help="elements per tensor")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.size, generator=gen)) for _ in range(args.count)]
    for p in params:
        p.grad = torch.randn(args.size, generator=gen)
        p.grad[::7] = 0.0  # some zeros, as ReLU networks have
    grads = [p.grad for p in params if p.grad is not None]
    fps: list[Fingerprint] = []  # a fingerprint is measured once: one per timed reading
    reference = "clip_grad_norm_ (the reference: one L2 pass, one scale)"

    def before_step() -> object:
        fps.append(fingerprint(params))
        return None

    def after_step() -> object:
        return measure(params, fps.pop() if fps else fingerprint(params))

    # (name, timed, untimed set-up): on every step, the after-step reading leaves the next
    # fingerprint its checksums (measure/carry.py), so the fingerprint reads samples only
    pieces: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        (
            "gradient L2, L1, max |g|, non-zero count (one chunked pass)",
            lambda: abs_stats(grads),
            _nothing,
        ),
        (
            "parameter fingerprint before the step (checksum carried, samples)",
            lambda: fingerprint(params),
            after_step,
        ),
        ("after the step: parameter norms + checksum (one pass), sample", after_step, before_step),
    ]
    n = args.count * args.size
    print(f"{args.count} x {args.size:,} float32 ({n:,} elements), 1 thread, CPU ms (median)")
    times = [_ms(lambda: _clip(params), args.repeat)]
    times += [_ms(fn, args.repeat, setup) for _, fn, setup in pieces]
    for ms, name in zip(times, [reference] + [name for name, _, _ in pieces]):
        print(f"  {ms:8.2f}  {name}")
    total = sum(times[1:])
    print(
        f"  {total:8.2f}  gradwatch's kernels together = {total / times[0]:.2f} x clip_grad_norm_"
    )
    fresh = _ms(lambda: fingerprint(params), args.repeat, setup=carry.forget)
    print(f"  {fresh:8.2f}  (the fingerprint reading its checksums: first step, or after a write)")
    buf = torch.empty(ABS_CHUNK)
    l1_alone = _ms(lambda: _l1(grads, buf), args.repeat)
    l2 = _ms(lambda: foreach_norms(grads, 2.0), args.repeat)
    _, before, after = times[1:]
    for label, ms in (
        ("floor with L1 instead of L1, max |g| and count", l2 + l1_alone + before + after),
        ("floor with the gradient L2 norms alone", l2 + before + after),
    ):
        print(f"  {ms:8.2f}  {label} = {ms / times[0]:.2f} x clip_grad_norm_")
    return 0


def _l1(grads: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Exact L1 per tensor, the way ``abs_stats`` takes it: abs of a cached chunk, then a sum."""
    for g in grads:
        for c in g.reshape(-1).split(ABS_CHUNK):
            m = c.numel()
            torch.abs(c, out=buf[:m]).sum()


def _clip(params: list[torch.nn.Parameter]) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm=1e30)


if __name__ == "__main__":
    raise SystemExit(main())
