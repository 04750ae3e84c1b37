"""ParamMap.all_reduce_grads against DDP's averaged gradients, 2 gloo processes on CPU."""

from __future__ import annotations

import copy
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import join_gloo, spawn_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradwatch.vectors.parammap import ParamMap

WORLD = 2


class Net(nn.Module):
    """Tied embedding/head, a frozen layer and a non-contiguous weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(4, 4)
        self.mid.weight = nn.Parameter(torch.randn(4, 4).t())  # non-contiguous
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.frozen(self.emb(tokens)))))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _worker(rank: int, port: int) -> None:
    join_gloo(rank, port, WORLD)
    try:
        torch.manual_seed(0)
        model = Net()
        ddp = DistributedDataParallel(copy.deepcopy(model))
        torch.manual_seed(100 + rank)  # different data on each rank
        tokens = torch.randint(0, 7, (3, 5))

        ddp(tokens).square().mean().backward()
        expected = _grads(ddp.module)

        pmap = ParamMap.from_module(model)
        assert pmap.names == ["emb.weight", "mid.weight", "mid.bias"]
        model(tokens).square().mean().backward()
        local = _grads(model)
        assert any(not torch.allclose(local[n], expected[n]) for n in local)
        reduced = pmap.all_reduce_grads()
        got = _grads(model)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, msg=f"rank {rank}: {name}")
        torch.testing.assert_close(reduced, pmap.flatten("grad"))
        assert model.frozen.weight.grad is None

        model.zero_grad(set_to_none=True)
        model(tokens).square().mean().backward()
        pmap.all_reduce_grads(average=False)
        for name, grad in expected.items():
            torch.testing.assert_close(model.get_parameter(name).grad, grad * WORLD)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_all_reduce_grads_matches_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform == "linux" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo otherwise picks an interface from the hostname, which fails without a network.
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    spawn_gloo(_worker, nprocs=WORLD)
