"""A Horovod PyTorch job under crossover: an MLP on synthetic data, seeded.

    mpirun -np 2 python examples/torch_mlp.py --steps 50 --out weights.pt

Under a running `crossover daemon` the job shares its devices with other jobs; with
CROSSOVER_ENABLE=0 (or no daemon) it trains plain. The final weights are the same either
way: scheduling never changes the math.
"""

from __future__ import annotations

import argparse
import json
import time

import horovod.torch as hvd
import torch

import crossover.hooks.torch as crossover_torch
from crossover.testing import add_start_barrier_flags, start_barrier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="backward passes per optimizer step")
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    add_start_barrier_flags(parser)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # one core is one device; no intra-op thread fan-out
    torch.manual_seed(args.seed)
    width = [64] + [args.hidden] * args.layers
    layers = []
    for a, b in zip(width, width[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width[-1], 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=args.accumulate)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    crossover_torch.wrap(optimizer)

    # Each rank sees its own shard of a fixed synthetic data set.
    gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    loss_fn = torch.nn.CrossEntropyLoss()
    start_barrier(args.start_barrier, args.start_jobs, hvd.rank(), hvd.size())
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizer.zero_grad()
        for _ in range(args.accumulate):
            x = torch.randn(args.batch, 64, generator=gen)
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            loss_fn(model(x), y).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start

    samples = args.steps * args.accumulate * args.batch * hvd.size()
    if hvd.rank() == 0:
        if args.out:
            torch.save(model.state_dict(), args.out)
        print(json.dumps({"samples_per_s": samples / elapsed, "seconds": elapsed,
                          "loss": float(loss_fn(model(x), y).detach())}), flush=True)


if __name__ == "__main__":
    main()
