"""A plain training loop; ``--ghost`` adds a layer whose output the loss never uses."""

import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, ghost: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.ghost = nn.Linear(8, 4) if ghost else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ghost is not None:
            self.ghost(x)  # computed, never used: its weights get no gradient
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ghost", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--raise-at", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net(args.ghost)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(args.steps):
        if step == args.raise_at:
            raise RuntimeError(f"boom at step {step}")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    print(f"trained {args.steps} steps, __name__={__name__}")
    if args.exit:
        raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
