"""Canonical generative designs: DCGAN (both ways of watching it), WGAN-GP, VAE, VQ-VAE, DDPM,
RealNVP, a denoising autoencoder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import gen
from _harness import Built, Program
from torch import nn

NZ = 8


def _dc_g() -> nn.Sequential:  # pytorch/examples dcgan Generator, 8x8 instead of 64x64
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip


def _dc_d() -> nn.Sequential:  # pytorch/examples dcgan Discriminator
    return nn.Sequential(
        nn.Conv2d(1, 16, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Flatten(), nn.Sigmoid(),
    )  # fmt: skip


def _real_images(n: int = 4, bs: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = gen(seed)
    base = torch.zeros(1, 1, 8, 8)
    base[..., 2:6, 2:6] = 1.0
    return [(base + 0.2 * torch.randn(bs, 1, 8, 8, generator=g)).clamp(-1, 1) for _ in range(n)]


def _dcgan_step(net_g: nn.Module, net_d: nn.Module, opt_g: Any, opt_d: Any, real: Any) -> None:
    """pytorch/examples dcgan/main.py's loop body, as written there."""
    criterion = nn.BCELoss()
    b = real.size(0)
    # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
    net_d.zero_grad()
    label = torch.full((b,), 1.0)
    err_d_real = criterion(net_d(real).view(-1), label)
    err_d_real.backward()
    noise = torch.randn(b, NZ, 1, 1)
    fake = net_g(noise)
    label.fill_(0.0)
    err_d_fake = criterion(net_d(fake.detach()).view(-1), label)
    err_d_fake.backward()
    opt_d.step()
    # (2) Update G network: maximize log(D(G(z)))
    net_g.zero_grad()
    label.fill_(1.0)
    err_g = criterion(net_d(fake).view(-1), label)
    err_g.backward()
    opt_g.step()


def _dcgan_named() -> Built:
    net_g, net_d = _dc_g(), _dc_d()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step(models: Any, opts: Any, real: Any, i: int) -> None:
        _dcgan_step(models["G"], models["D"], opts["G"], opts["D"], real)

    return Built({"G": net_g, "D": net_d}, {"G": opt_g, "D": opt_d}, _real_images(), step)


def _dcgan_two_watchers() -> Built:
    net_g, net_d = _dc_g(), _dc_d()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step(models: Any, opts: Any, real: Any, i: int) -> None:
        _dcgan_step(net_g, net_d, opt_g, opt_d, real)

    # with watch(netD, optD), watch(netG, optG):
    return Built(net_d, opt_d, _real_images(seed=1), step, watches=[(net_g, opt_g)])


def _wgan_gp() -> Built:
    net_g = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(), nn.Linear(32, 2))
    critic = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))  # Alg. 1
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-4, betas=(0.0, 0.9))
    g = gen(2)
    ring = torch.linspace(0, 6.28, 8)
    real = [
        torch.stack([ring.cos(), ring.sin()], 1).repeat(2, 1)
        + 0.05 * torch.randn(16, 2, generator=g)
        for _ in range(6)
    ]
    n_critic, lam = 2, 10.0

    def step(models: Any, opts: Any, x: Any, i: int) -> None:
        opt_c.zero_grad()
        fake = net_g(torch.randn(x.size(0), NZ)).detach()
        eps = torch.rand(x.size(0), 1)
        interp = (eps * x + (1 - eps) * fake).requires_grad_(True)
        grads = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)[0]
        gp = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        loss_c = critic(fake).mean() - critic(x).mean() + lam * gp
        loss_c.backward()
        opt_c.step()
        if (i + 1) % n_critic == 0:
            opt_g.zero_grad()
            loss_g = -critic(net_g(torch.randn(x.size(0), NZ))).mean()
            loss_g.backward()
            opt_g.step()

    return Built({"G": net_g, "D": critic}, {"G": opt_g, "D": opt_c}, real, step)


class VAE(nn.Module):
    """pytorch/examples vae/main.py, 16-pixel images and a 4-d latent."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)
        self.fc3, self.fc4 = nn.Linear(4, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def _vae_loss(model: nn.Module, x: Any) -> torch.Tensor:
    recon, mu, logvar = model(x)
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def _binary_images(n: int, seed: int) -> list[torch.Tensor]:
    g = gen(seed)
    protos = (torch.rand(3, 16, generator=g) > 0.5).float()
    return [protos[torch.randint(0, 3, (16,), generator=g)] for _ in range(n)]


def _vae() -> Built:
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _vae_loss(model, x).backward()
        opt.step()

    return Built(model, opt, _binary_images(4, 3), step, _vae_loss, probe_optimizer=opt)


class VQVAE(nn.Module):
    """van den Oord et al. 2017: nearest-code quantisation, straight-through, commitment 0.25."""

    def __init__(self, codes: int = 8, d: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, d))
        self.codebook = nn.Embedding(codes, d)
        self.codebook.weight.data.uniform_(-1 / codes, 1 / codes)
        self.dec = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z_e = self.enc(x)
        idx = torch.cdist(z_e, self.codebook.weight).argmin(1)
        z_q = self.codebook(idx)
        vq_loss = F.mse_loss(z_q, z_e.detach()) + 0.25 * F.mse_loss(z_e, z_q.detach())
        z_st = z_e + (z_q - z_e).detach()  # straight-through: decoder's gradient to the encoder
        return self.dec(z_st), vq_loss


def _vq_loss(model: nn.Module, x: Any) -> torch.Tensor:
    recon, vq_loss = model(x)
    return F.mse_loss(recon, x) + vq_loss


def _vqvae() -> Built:
    model = VQVAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _vq_loss(model, x).backward()
        opt.step()

    return Built(model, opt, _binary_images(4, 4), step, _vq_loss, probe_optimizer=opt)


class Denoiser(nn.Module):
    """An epsilon-prediction MLP with a sinusoidal timestep embedding."""

    def __init__(self, d: int = 2, h: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 16, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(),
                                 nn.Linear(h, d))  # fmt: skip

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(8) * 4.0 / 8)
        emb = t[:, None].float() * freqs[None]
        return self.net(torch.cat([x, emb.sin(), emb.cos()], 1))


T_STEPS = 100
BETAS = torch.linspace(1e-4, 0.02, T_STEPS)
ALPHA_BAR = torch.cumprod(1 - BETAS, 0)


def _ddpm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x0, t, noise = batch  # Ho et al. 2020, Algorithm 1 (simple loss)
    a = ALPHA_BAR[t][:, None]
    return F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t), noise)


def _ddpm() -> Built:
    model = Denoiser()
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    g = gen(5)
    batches = []
    for _ in range(4):
        x0 = torch.randn(16, 2, generator=g) * 0.1 + torch.tensor([1.0, -1.0])
        t = torch.randint(0, T_STEPS, (16,), generator=g)
        batches.append((x0, t, torch.randn(16, 2, generator=g)))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ddpm_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return Built(model, opt, batches, step, _ddpm_loss, probe_optimizer=opt)


class Coupling(nn.Module):
    """Dinh et al. 2017 affine coupling: half the dims scale-and-shift the other half."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        d = mask.numel()
        self.s = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d), nn.Tanh())
        self.t = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xm = x * self.mask
        s, t = self.s(xm) * (1 - self.mask), self.t(xm) * (1 - self.mask)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(1)


class RealNVP(nn.Module):
    def __init__(self, d: int = 2, n: int = 4) -> None:
        super().__init__()
        masks = [torch.arange(d) % 2 == k % 2 for k in range(n)]
        self.layers = nn.ModuleList(Coupling(m.float()) for m in masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The log-likelihood of each sample under a standard normal prior."""
        logdet = torch.zeros(x.size(0))
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        prior = -0.5 * (x**2).sum(1) - 0.5 * x.size(1) * torch.log(torch.tensor(2 * torch.pi))
        return prior + logdet


def _flow_nll(model: nn.Module, x: Any) -> torch.Tensor:
    return -model(x).mean()


def _realnvp() -> Built:
    model = RealNVP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = gen(6)
    batches = []
    for _ in range(4):  # two moons, roughly
        u = torch.rand(32, generator=g) * torch.pi
        side = (torch.arange(32) % 2).float()
        x = torch.stack([u.cos() + side, u.sin() * (1 - 2 * side) + 0.5 * side], 1)
        batches.append(x + 0.05 * torch.randn(32, 2, generator=g))

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _flow_nll(model, x).backward()
        opt.step()

    return Built(model, opt, batches, step, _flow_nll, probe_optimizer=opt)


def _dae_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    noisy, clean = batch
    return F.mse_loss(model(noisy), clean)


def _denoising_ae() -> Built:
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1), nn.Sigmoid(),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = gen(7)
    batches = []
    for clean in _real_images(4, 8, seed=8):
        clean = (clean + 1) / 2
        batches.append(((clean + 0.3 * torch.randn(clean.shape, generator=g)).clamp(0, 1), clean))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _dae_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, _dae_loss, probe_optimizer=opt)


PROGRAMS = [
    Program("dcgan_named_models", "gan", _dcgan_named,
            "Radford et al. 2016 DCGAN; pytorch/examples dcgan/main.py, watched as {'G','D'}"),
    Program("dcgan_two_watchers", "gan", _dcgan_two_watchers,
            "pytorch/examples dcgan/main.py under with watch(netD, optD), watch(netG, optG)"),
    Program("wgan_gp", "gan", _wgan_gp,
            "Gulrajani et al. 2017 WGAN-GP Algorithm 1 (gradient penalty, create_graph=True)"),
    Program("vae", "vae", _vae, "Kingma & Welling 2014; pytorch/examples vae/main.py"),
    Program("vq_vae", "vq-vae", _vqvae,
            "van den Oord et al. 2017 VQ-VAE (straight-through, codebook + 0.25 commitment)"),
    Program("ddpm", "diffusion", _ddpm, "Ho et al. 2020 DDPM, Algorithm 1, epsilon prediction"),
    Program("realnvp", "normalizing flow", _realnvp, "Dinh et al. 2017 RealNVP affine coupling"),
    Program("denoising_autoencoder", "autoencoder", _denoising_ae,
            "Vincent et al. 2008 denoising autoencoder, conv encoder/decoder"),
]  # fmt: skip
