"""``frozen_stats_updated`` on targets the program moves itself (real training loops).

BYOL's EMA target, MoCo's momentum key encoder and a DQN target network synced every k
steps all have ``requires_grad=False`` parameters and batch norms in train mode, like a
frozen backbone after ``model.train()``. What tells them apart is whether the affine values
move between steps (``gradwatch/capture/forward/_frozen_affine.py``).
"""

from __future__ import annotations

import copy
import weakref
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from _regime import problems
from torch import nn

import gradwatch
from gradwatch.capture.forward._frozen_affine import FrozenAffine
from gradwatch.checks.frozen_stats import FrozenStatsUpdated

ID = FrozenStatsUpdated.id


def _encoder(d_in: int = 8, h: int = 16, z: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, z))


class Byol(nn.Module):
    """Online encoder and predictor trained; the target an EMA of the online encoder."""

    def __init__(self, tau: float = 0.99) -> None:
        super().__init__()
        self.online = _encoder()
        self.predictor = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.tau = tau

    @torch.no_grad()
    def update_target(self) -> None:
        for po, pt in zip(self.online.parameters(), self.target.parameters()):
            pt.mul_(self.tau).add_(po.detach(), alpha=1 - self.tau)

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        p1, p2 = self.predictor(self.online(v1)), self.predictor(self.online(v2))
        with torch.no_grad():
            t1, t2 = self.target(v1), self.target(v2)  # train mode, as in BYOL's code
        return 4 - 2 * F.cosine_similarity(p1, t2).mean() - 2 * F.cosine_similarity(p2, t1).mean()


def test_byol_ema_target_with_batch_norm_in_train_mode_is_silent() -> None:
    torch.manual_seed(0)
    model = Byol()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    assert not _two_views(model, opt, after=model.update_target).by_check(ID)


def _two_views(
    model: nn.Module, opt: torch.optim.Optimizer, after: Optional[Callable[[], None]] = None
) -> gradwatch.Report:
    """12 watched steps of a two-view self-supervised loop (noisy views of one batch)."""
    with gradwatch.watch(model, opt) as w:
        for _ in range(12):
            x = torch.randn(16, 8)
            loss = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if after is not None:
                after()
    return w.report()


class MoCo(nn.Module):
    """facebookresearch/moco builder.py: the key encoder a momentum copy updated inside the
    forward (``p.data = ...``), its batch norms in train mode, a queue of negatives."""

    def __init__(self, dim: int = 4, k: int = 64, m: float = 0.99) -> None:
        super().__init__()
        self.m = m
        self.encoder_q, self.encoder_k = _encoder(z=dim), _encoder(z=dim)
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, k), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data = pk.data * self.m + pq.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        ptr, n = int(self.queue_ptr), keys.shape[0]
        self.queue[:, ptr : ptr + n] = keys.T
        self.queue_ptr[0] = (ptr + n) % self.queue.shape[1]

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone().detach()
        logits = torch.cat([l_pos, l_neg], dim=1) / 0.2
        self._dequeue_and_enqueue(k)
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


def test_moco_momentum_key_encoder_with_a_queue_is_silent() -> None:
    torch.manual_seed(0)
    model = MoCo()
    # as main_moco.py: every parameter in SGD, the key encoder's never get a gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    assert not _two_views(model, opt).by_check(ID)


class FineTune(nn.Module):
    """A pretrained backbone frozen by ``requires_grad_(False)`` only, and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = _encoder(z=16)
        with torch.no_grad():  # "pretrained": affine values away from their defaults
            self.backbone[1].weight.uniform_(0.5, 1.5)
            self.backbone[1].bias.uniform_(-0.5, 0.5)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_frozen_backbone_whose_weights_never_change_is_warned_over_a_long_run() -> None:
    """Past the every-step looks (the doubling schedule): still frozen, still reported."""
    model = FineTune().train()
    weight = model.backbone[1].weight.clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with gradwatch.watch(model, opt) as w:
        for _ in range(40):
            x = torch.randn(16, 8)
            opt.zero_grad()
            F.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    assert torch.equal(weight, model.backbone[1].weight)
    (f,) = w.report().by_check(ID)
    assert f.severity == "warning" and f.first_step == 1 and f.last_step == 39
    assert f.details["modules"] == ["backbone.1"] and "program_updated" not in f.details


class Dqn(nn.Module):
    """Q-network and a target network inside one module; the target synced every k steps
    (``load_state_dict``, the PyTorch DQN tutorial's hard update), both with batch norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = _encoder(z=2)
        self.target = copy.deepcopy(self.q).requires_grad_(False)

    def td_loss(self, s: torch.Tensor, s2: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = r + 0.99 * self.target(s2).max(1).values
        return F.smooth_l1_loss(self.q(s).max(1).values, y)

    def forward(self, s: torch.Tensor, s2: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.td_loss(s, s2, r)


def _dqn_run(model: nn.Module, every: int, steps: int) -> gradwatch.Report:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with gradwatch.watch(model, opt) as w:
        for step in range(steps):
            s, s2, r = torch.randn(16, 8), torch.randn(16, 8), torch.randn(16)
            opt.zero_grad()
            model(s, s2, r).backward()
            opt.step()
            if (step + 1) % every == 0:
                model.target.load_state_dict(model.q.state_dict())
    return w.report()


@pytest.mark.parametrize(("every", "steps"), [(5, 10), (20, 34)])
def test_dqn_target_synced_every_k_steps_is_revised_to_info(every: int, steps: int) -> None:
    """Until its first sync the target looks frozen (reported from step 1, as a frozen
    backbone must be); the sync moves its affine values, so the finding becomes info naming
    the design. A sync every 20 steps is seen by a later look of the doubling schedule."""
    report = _dqn_run(Dqn().train(), every, steps)
    assert problems(report) == []
    (f,) = report.by_check(ID)
    assert f.severity == "info" and f.first_step == 1
    assert f.details["modules"] == [] and f.details["program_updated"] == ["target.1"]
    assert "the program itself changes their values" in f.message


class Mixed(nn.Module):
    """A frozen pretrained backbone and a synced target network in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.fine = FineTune()
        self.dqn = Dqn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fine(x).mean() + self.dqn.td_loss(x, x.flip(0), x[:, 0])


def test_a_frozen_backbone_beside_a_synced_target_stays_reported() -> None:
    model = Mixed().train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with gradwatch.watch(model, opt) as w:
        for step in range(10):
            opt.zero_grad()
            model(torch.randn(16, 8)).backward()
            opt.step()
            if step % 5 == 4:
                model.dqn.target.load_state_dict(model.dqn.q.state_dict())
    (f,) = w.report().by_check(ID)
    assert f.severity == "warning" and f.details["modules"] == ["fine.backbone.1"]
    assert f.details["program_updated"] == ["dqn.target.1"]
    assert "'fine.backbone.1'" in f.message and "dqn.target" not in f.message


def test_frozen_affine_reads_values_on_its_schedule() -> None:
    """Held back at the first flagging; compared at looks 1-4, 8, 16 ...; a move between two
    looks is seen at the next one; a layer unfrozen since is judged by its statistics."""
    bn = nn.BatchNorm1d(3).requires_grad_(False)
    refs = {"bn": weakref.ref(bn)}
    fa = FrozenAffine()
    assert fa.settled(refs, ("bn",)) == ()
    for _ in range(5):  # looks 1..5
        assert fa.settled(refs, ("bn",)) == ("bn",)
    with torch.no_grad():
        bn.bias.add_(0.1)  # a sync between look 5 and look 8
    assert [fa.settled(refs, ("bn",)) for _ in range(3)] == [("bn",), ("bn",), ()]
    assert fa.updated == ("bn",) and fa.settled(refs, ("bn",)) == ()
    other = nn.BatchNorm1d(3)  # requires grad: not this question, kept as flagged
    assert fa.settled({"o": weakref.ref(other)}, ("o",)) == ("o",)
