"""A tiny GAN: two models, two optimizers, D stepped before G each iteration."""

import sys

import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))


class Critic(nn.Module):
    def __init__(self, ghost: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.aux = nn.Linear(8, 3) if ghost else None  # a head the losses never use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.aux is not None:
            self.aux(x)
        return self.body(x)


D = Critic("--ghost" in sys.argv[1:])
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
real = torch.randn(16, 8)
for _ in range(5):
    z = torch.randn(16, 4)
    fake = G(z)
    opt_d.zero_grad()
    loss_d = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(D(fake), torch.ones(16, 1))
    loss_g.backward()
    opt_g.step()
print("gan done")
