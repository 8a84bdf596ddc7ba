"""A PyTorch DDP job under crossover: an MLP on synthetic data, seeded, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 examples/ddp_mlp.py --steps 50 --out weights.pt

The one crossover line is `crossover.hooks.ddp.wrap(model)` after DDP is built. Under a
running `crossover daemon` the job shares its devices with other jobs; with
CROSSOVER_ENABLE=0 (or no daemon) it trains plain, to the same weights. The options
exercise what DDP offers: gradient accumulation with no_sync(), a communication hook of
the script's own, unused parameters, a static graph, gradients as bucket views.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import crossover.hooks.ddp as crossover_ddp
from crossover.testing import add_start_barrier_flags, start_barrier


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, layers: int, unused_branch: bool) -> None:
        super().__init__()
        width = [64] + [hidden] * layers
        mods = []
        for a, b in zip(width, width[1:], strict=False):
            mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*mods, torch.nn.Linear(width[-1], 10))
        # a head the forward never uses: DDP must be told (find_unused_parameters)
        self.unused = torch.nn.Linear(hidden, 10) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="backward passes per optimizer step (the first ones in no_sync)")
    parser.add_argument("--fp16-hook", action="store_true",
                        help="register PyTorch's fp16 compression communication hook")
    parser.add_argument("--find-unused", action="store_true",
                        help="add an unused layer and find_unused_parameters=True")
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--bucket-view", action="store_true",
                        help="gradient_as_bucket_view=True")
    parser.add_argument("--bucket-mb", type=float, default=0.25,
                        help="bucket_cap_mb (small: several buckets per step)")
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    add_start_barrier_flags(parser)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # one core is one device
    torch.manual_seed(args.seed)
    model = DDP(MLP(args.hidden, args.layers, args.find_unused),
                find_unused_parameters=args.find_unused, static_graph=args.static_graph,
                gradient_as_bucket_view=args.bucket_view, bucket_cap_mb=args.bucket_mb)
    crossover_ddp.wrap(model)
    if args.fp16_hook:
        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    # Each rank sees its own shard of a fixed synthetic data set.
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    start_barrier(args.start_barrier, args.start_jobs, rank, size)
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizer.zero_grad()
        for i in range(args.accumulate):
            x = torch.randn(args.batch, 64, generator=gen)
            y = torch.randint(0, 10, (args.batch,), generator=gen)
            if i < args.accumulate - 1:
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            else:
                loss_fn(model(x), y).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start

    if rank == 0:
        if args.out:
            torch.save(model.module.state_dict(), args.out)
        samples = args.steps * args.accumulate * args.batch * size
        print(json.dumps({"samples_per_s": samples / elapsed, "seconds": elapsed,
                          "pid": os.getpid()}), flush=True)
    dist.barrier()  # no rank tears its process group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
