"""DataLoader workers (num_workers=2) under the start method given as argv[1]."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i) / 64)
        return x, x.sum(0, keepdim=True) ** 2


def main(method: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Squares(), batch_size=16, num_workers=2, multiprocessing_context=method)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    print(f"workers done ({method})")


if __name__ == "__main__":
    main(sys.argv[1])
