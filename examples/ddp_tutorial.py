"""A DDP script as PyTorch's DDP tutorial writes one: nothing of crossover in it.

    torchrun --standalone --nproc-per-node 2 examples/ddp_tutorial.py
    crossover-torchrun --crossover --standalone --nproc-per-node 2 examples/ddp_tutorial.py

Under crossover-torchrun --crossover it shares its devices with other jobs, unmodified;
the weights' checksum it prints is the same either way.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 256)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(256, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps: int, seed: int):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=gen))
        labels = torch.randn(20, 5, generator=gen)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    if rank == 0:
        checksum = sum(float(p.double().sum()) for p in model.parameters())
        print(f"weights checksum {checksum!r}", flush=True)
    dist.barrier()  # no rank tears its process group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    demo_basic(args.steps, args.seed)
