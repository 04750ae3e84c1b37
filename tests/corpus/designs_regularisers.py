"""Canonical designs that change how a step is taken: SAM's two passes, DP-SGD (opacus),
a spectrally normalised discriminator, deep supervision, stochastic depth, center loss; ghost
batch norm and noise drawn from a module's own generator."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, images
from _harness import Built, Program
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _plain_step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
    opt.zero_grad()
    _ce(model, batch).backward()
    opt.step()


def _sam() -> Built:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rho = 0.05

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        # Foret et al. 2021 (davda54/sam): ascend to w + e(w), take the gradient there, step at w
        _ce(model, batch).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]), 2)
        eps = []
        with torch.no_grad():
            for p in params:
                e = p.grad * rho / (norm + 1e-12)
                p.add_(e)
                eps.append(e)
        opt.zero_grad()
        _ce(model, batch).backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        opt.step()
        opt.zero_grad()

    return Built(model, opt, classes(4, 16, 16, 4, seed=50), step, _ce, probe_optimizer=opt)


def _dp_sgd() -> Built:
    from opacus import PrivacyEngine

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = classes(4, 16, 16, 4, seed=51)
    xs, ys = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16)
    with warnings.catch_warnings():  # opacus's notice that secure_mode is off: third-party noise
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine()
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )  # Abadi et al. 2016: per-sample clipping and Gaussian noise (opacus tutorial)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        with warnings.catch_warnings():  # torch's notice on opacus's hook at the first layer
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            _ce(model, batch).backward()
        opt.step()

    return Built(model, opt, list(loader), step)


def _sn_gan() -> Built:
    net_g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    net_d = nn.Sequential(
        spectral_norm(nn.Linear(2, 32)), nn.LeakyReLU(0.1), spectral_norm(nn.Linear(32, 1))
    )  # Miyato et al. 2018, hinge loss
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.0, 0.9))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.0, 0.9))
    real = [x[:, :2] for x, _ in classes(4, 16, 16, 4, seed=52)]

    def step(models: Any, opts: Any, x: Any, i: int) -> None:
        opt_d.zero_grad()
        fake = net_g(torch.randn(x.size(0), 8))
        loss_d = F.relu(1 - net_d(x)).mean() + F.relu(1 + net_d(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        (-net_d(fake).mean()).backward()
        opt_g.step()

    return Built({"G": net_g, "D": net_d}, {"G": opt_g, "D": opt_d}, real, step)


class DeeplySupervised(nn.Module):
    """Szegedy et al. 2015 GoogLeNet: auxiliary classifiers on intermediate features, weight 0.3."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.stage2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> Any:
        h = self.stage1(x)
        out = self.head(self.stage2(h))
        return (out, self.aux(h)) if self.training else out


def _aux_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out, aux = model(batch[0])
    return F.cross_entropy(out, batch[1]) + 0.3 * F.cross_entropy(aux, batch[1])


def _deep_supervision() -> Built:
    model = DeeplySupervised()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = images(4, 16, 4, seed=53)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        opt.zero_grad()
        _aux_loss(model, batch).backward()
        opt.step()
        if i == len(batches) - 1:  # validation: the main head only
            model.eval()
            with torch.no_grad():
                model(batch[0])

    return Built(model, opt, batches, step, _aux_loss, probe_optimizer=opt)


class DropPath(nn.Module):
    """Huang et al. 2016 stochastic depth (timm drop_path): drop a residual branch per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.size(0), *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class ResidualMLP(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(depth)
        )
        self.drop_paths = nn.ModuleList(DropPath(0.1 * (k + 1)) for k in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block, drop in zip(self.blocks, self.drop_paths):
            h = h + drop(block(h))
        return self.out(h)


def _stochastic_depth() -> Built:
    model = ResidualMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    return Built(model, opt, classes(4, 16, 16, 4, seed=54), _plain_step, _ce, probe_optimizer=opt)


class CenterLoss(nn.Module):
    """Wen et al. 2016: pull each feature to its class's learned center."""

    def __init__(self, k: int = 4, d: int = 8) -> None:
        super().__init__()
        self.centers = nn.Parameter(torch.randn(k, d))

    def forward(self, feats: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((feats - self.centers[y]) ** 2).sum(1).mean() / 2


class FeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.fc = nn.Linear(8, 4)
        self.center_loss = CenterLoss()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.fc(f), f


def _center_loss() -> Built:
    model = FeatureNet()
    lam, alpha = 0.01, 0.5
    opt_model = torch.optim.SGD(
        [p for n, p in model.named_parameters() if not n.startswith("center_loss")],
        lr=0.05,
        momentum=0.9,
    )
    opt_center = torch.optim.SGD(model.center_loss.parameters(), lr=alpha)

    def step(model: nn.Module, opts: Any, batch: Any, i: int) -> None:
        x, y = batch  # KaiyangZhou/pytorch-center-loss main.py: two optimizers, centers rescaled
        logits, feats = model(x)
        loss = F.cross_entropy(logits, y) + lam * model.center_loss(feats, y)
        opt_model.zero_grad()
        opt_center.zero_grad()
        loss.backward()
        opt_model.step()
        for p in model.center_loss.parameters():
            p.grad.data *= 1.0 / lam  # the centers' own rate, free of lambda
        opt_center.step()

    return Built(model, [opt_model, opt_center], classes(4, 16, 16, 4, seed=55), step)


def _qat() -> Built:
    """The PyTorch quantization-aware training recipe: fake-quantised weights and activations
    (their backward is a straight-through estimator inside torch)."""
    model = nn.Sequential(
        torch.ao.quantization.QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4),
        torch.ao.quantization.DeQuantStub(),
    )  # fmt: skip
    model.train()
    with warnings.catch_warnings():  # torch.ao's deprecation notices (reduce_range, torchao)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*reduce_range will be deprecated")
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
        torch.ao.quantization.prepare_qat(model, inplace=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    return Built(model, opt, classes(4, 16, 16, 4, seed=56), _plain_step, _ce, probe_optimizer=opt)


def _weight_norm() -> Built:
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.ReLU(), weight_norm(nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # Salimans & Kingma 2016

    return Built(model, opt, classes(4, 16, 16, 4, seed=57), _plain_step, _ce, probe_optimizer=opt)


def _wgan_clip() -> Built:
    net_g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    critic = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_c = torch.optim.RMSprop(critic.parameters(), lr=5e-5)  # Arjovsky et al. 2017, Alg. 1
    opt_g = torch.optim.RMSprop(net_g.parameters(), lr=5e-5)
    real = [x[:, :2] for x, _ in classes(6, 16, 16, 4, seed=58)]

    def step(models: Any, opts: Any, x: Any, i: int) -> None:
        opt_c.zero_grad()
        loss_c = critic(net_g(torch.randn(x.size(0), 8)).detach()).mean() - critic(x).mean()
        loss_c.backward()
        opt_c.step()
        for p in critic.parameters():
            p.data.clamp_(-0.01, 0.01)
        if (i + 1) % 2 == 0:  # n_critic critic steps per generator step
            opt_g.zero_grad()
            (-critic(net_g(torch.randn(x.size(0), 8))).mean()).backward()
            opt_g.step()

    return Built({"G": net_g, "D": critic}, {"G": opt_g, "D": opt_c}, real, step)


class GhostBatchNorm(nn.Module):
    """Hoffer et al. 2017 (TabNet's GBN): batch norm over virtual batches of ``size`` samples
    in training; each sample gets its virtual batch's statistics, so its place matters."""

    def __init__(self, d: int, size: int = 4) -> None:
        super().__init__()
        self.size, self.bn = size, nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.bn(x)
        return torch.cat([self.bn(part) for part in x.split(self.size)])


def _ghost_batch_norm() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), GhostBatchNorm(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    return Built(model, opt, classes(4, 16, 16, 4, seed=59), _plain_step, _ce, probe_optimizer=opt)


class NoisyHidden(nn.Module):
    """Gaussian noise on the hidden layer, drawn from the module's own ``torch.Generator``
    (a seeded stream apart from the global one)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(123)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            h = h + 0.1 * torch.randn(h.shape, generator=self.gen)
        return self.b(h)


def _noise_from_own_generator() -> Built:
    model = NoisyHidden()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    return Built(model, opt, classes(4, 16, 16, 4, seed=60), _plain_step, _ce, probe_optimizer=opt)


PROGRAMS = [
    Program("sam_two_pass", "sharpness-aware", _sam,
            "Foret et al. 2021 SAM; davda54/sam first_step / second_step"),
    Program("dp_sgd_opacus", "differential privacy", _dp_sgd,
            "Abadi et al. 2016 DP-SGD; opacus PrivacyEngine.make_private tutorial"),
    Program("spectral_norm_hinge_gan", "gan", _sn_gan,
            "Miyato et al. 2018 spectral normalisation (torch parametrizations), hinge loss"),
    Program("deep_supervision_aux_heads", "cnn classifier", _deep_supervision,
            "Szegedy et al. 2015 GoogLeNet auxiliary classifiers (0.3 weight, train only)"),
    Program("stochastic_depth", "regularisation", _stochastic_depth,
            "Huang et al. 2016 stochastic depth; timm drop_path"),
    Program("center_loss_two_optimizers", "multiple optimizers", _center_loss,
            "Wen et al. 2016 center loss; KaiyangZhou/pytorch-center-loss (two optimizers)"),
    Program("quantization_aware_training", "straight-through", _qat,
            "Jacob et al. 2018; PyTorch QAT recipe (prepare_qat, fake quantisation)"),
    Program("weight_norm", "regularisation", _weight_norm,
            "Salimans & Kingma 2016 weight normalisation (torch parametrizations.weight_norm)"),
    Program("wgan_weight_clipping", "gan", _wgan_clip,
            "Arjovsky et al. 2017 WGAN Algorithm 1 (RMSprop, critic weights clipped to 0.01)"),
    Program("ghost_batch_norm", "normalisation", _ghost_batch_norm,
            "Hoffer et al. 2017 ghost batch norm; Arik & Pfister 2021 TabNet (virtual batches)"),
    Program("noise_from_own_generator", "regularisation", _noise_from_own_generator,
            "Gaussian noise injection from a module-held torch.Generator (a seeded stream)"),
]  # fmt: skip
