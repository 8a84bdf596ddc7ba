"""A plain Horovod PyTorch training script, in the style of Horovod's own examples.

It knows nothing of crossover: `crossoverrun --crossover -np 2 -H localhost:2 python
examples/horovod_torch_synthetic.py` runs it under crossover with no code change.
Synthetic data (nothing is downloaded); fixed seed; prints a checksum of the weights.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="Horovod PyTorch synthetic example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = torch.nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = torch.nn.Linear(256, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


model = Net()
# Horovod: scale learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

# Each rank draws its own shard of a synthetic MNIST-shaped data set.
gen = torch.Generator().manual_seed(args.seed + hvd.rank())
model.train()
for _ in range(args.steps):
    data = torch.randn(args.batch_size, 1, 28, 28, generator=gen)
    target = torch.randint(0, 10, (args.batch_size,), generator=gen)
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()

checksum = sum(float(p.double().sum()) for p in model.parameters())
if hvd.rank() == 0:
    print(f"final loss {loss.item():.6f} weights checksum {checksum!r}", flush=True)
