"""The cost of gradwatch's one collective per observed step under sharding, on 2 gloo ranks.

Times :meth:`gradwatch.distributed.sync.DistSync.exchange` for ``N`` parameters: the DDP
form (one byte per parameter) and the sharded form (the same ``all_gather`` carrying each
rank's shard sums: 8 float32 values per parameter on an observed step), and the DDP form on
an observed step with ``replica_divergence`` on (codes and the pre-step checksums as int64:
16 bytes per parameter, plus 8 for the optimizer's step count), and the HSDP form (FSDP2 on a
(replicate, shard) mesh: the shard sums and the local shards' checksums in the same
``all_gather``, 8 bytes more per parameter). Prints one line per form: median and p90
microseconds per step over ``--reps`` calls, and the bytes each rank sends.

    python benchmarks/sharded_collective.py --params 400 --reps 300
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Track
from gradwatch.distributed.replicas import ReplicaCheck
from gradwatch.distributed.sync import DistSync
from gradwatch.measure.fingerprint import fingerprint
from gradwatch.model.engines import FSDP2
from gradwatch.model.index import ParamIndex


def _hsdp_track(ids: list[int], n: int) -> Track:
    """A track of ``n`` DTensors on a (replicate=2, shard=1) mesh, fingerprinted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    params = [distribute_tensor(torch.randn(16, 16), mesh, [Replicate(), Shard(0)]) for _ in ids]
    track = Track(index=0)
    track.set_params(ids, params, ["layer"] * n)  # type: ignore[arg-type]
    track.sharded = FSDP2
    track.fingerprint = fingerprint([p.to_local() for p in params])
    return track


def _worker(rank: int, port: int, n: int, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    sync = DistSync(rank, 2)
    tracker = Tracker()
    tracker.grow(n)
    ids, arrived = list(range(n)), [True] * n
    payload = [float(k % 7) for k in range(8 * n)]
    torch.manual_seed(0)
    track = Track(index=0)
    params = [torch.randn(16, 16) for _ in range(n)]
    track.set_params(ids, params, ["layer"] * n)
    track.fingerprint = fingerprint(params)  # what an observed step took before its update
    forms = (
        ("ddp codes only", None, None, n),
        ("sharded codes + shard sums", payload, None, 4 * 9 * n),
        ("ddp codes + replica checksums", None, track, 8 * (2 * n + 1)),
        (
            "hsdp codes + shard sums + replica checksums",
            payload,
            _hsdp_track(ids, n),
            4 * 9 * n + 8 * (n + 1),
        ),
    )
    for label, extra, observed, sent in forms:
        sync.replicas = ReplicaCheck(ParamIndex(), lambda fact: None) if observed else None
        times = []
        for k in range(reps + 20):
            dist.barrier()
            t0 = time.perf_counter()
            sync.exchange(ids, arrived, lambda i: "not_called", tracker, None, extra, 0, observed)
            if k >= 20:  # warm-up excluded
                times.append(time.perf_counter() - t0)
        if rank == 0:
            q = statistics.quantiles(times, n=10)
            print(
                f"{label}: {n} params, 2 gloo ranks: median {statistics.median(times) * 1e6:.0f} us,"
                f" p90 {q[-1] * 1e6:.0f} us per step, {sent} bytes sent per rank"
            )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=400)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.params, args.reps), nprocs=2, join=True)


if __name__ == "__main__":
    main()
