"""A Horovod PyTorch job whose loop calls crossover itself: the optimizer is not wrapped.

    mpirun -np 2 python examples/torch_callback_mlp.py --steps 50 --out weights.pt

The loop marks its events on `crossover.hooks.torch_callback.CrossoverCallback`
(`examples/torch_mlp.py` does the same job with the optimizer wrapped instead). Same
weights with CROSSOVER_ENABLE=0.
"""

from __future__ import annotations

import argparse
import json
import time

import horovod.torch as hvd
import torch

from crossover.hooks.torch_callback import CrossoverCallback
from crossover.testing import add_start_barrier_flags, start_barrier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    add_start_barrier_flags(parser)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # one core is one device
    torch.manual_seed(args.seed)
    width = [64] + [args.hidden] * args.layers
    layers = []
    for a, b in zip(width, width[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width[-1], 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    callback = CrossoverCallback()
    start_barrier(args.start_barrier, args.start_jobs, hvd.rank(), hvd.size())

    gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        callback.on_step_begin()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        callback.on_backward_end()
        callback.synchronize(optimizer)  # optimizer.synchronize(), quiet when sharing
        callback.on_update_begin()
        with optimizer.skip_synchronize():
            optimizer.step()
        callback.on_step_end()
    callback.close()
    elapsed = time.perf_counter() - start

    if hvd.rank() == 0:
        if args.out:
            torch.save(model.state_dict(), args.out)
        print(json.dumps({"samples_per_s": args.steps * args.batch * hvd.size() / elapsed,
                          "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
