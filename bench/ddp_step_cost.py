"""What crossover adds to a DDP step, measured in one process: run under torchrun.

    torchrun --standalone --nproc-per-node 2 bench/ddp_step_cost.py [--steps 300]

End-to-end runs of a job alone against the same job plain differ by 5-10 % from run to
run on a shared machine, which hides a 1 % cost. Here each rank builds three identical
DDP models of the overhead benchmark's MLP: two plain, one wrapped by crossover
(`crossover.hooks.ddp.wrap`), and trains them in alternating steps (the order reversed
every step), so that drift hits all three alike. Where the wrapped model stands among
the three (`--wrapped`) is a parameter: the models' places in memory differ, so a
caller rotates it over runs. Rank 0 prints one JSON line: per model, the median wall
time and the median main-thread CPU time of a step. The two plain models give the noise
floor of the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import crossover.hooks.ddp as crossover_ddp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ddp_mlp import MLP  # noqa: E402  (the whole-run benchmark's model)

ROLES = ("plain", "plain_again", "crossover")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per model")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--wrapped", type=int, choices=(0, 1, 2), default=2,
                        help="which of the three models (in order built) crossover wraps")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core is one device
    dist.init_process_group("gloo")
    models = []
    for _ in ROLES:
        torch.manual_seed(0)  # the same weights in all three
        models.append(DistributedDataParallel(MLP(args.hidden, args.layers, False),
                                              bucket_cap_mb=args.bucket_mb))
    crossover_ddp.wrap(models[args.wrapped])
    # role -> model: the wrapped one, and the plain ones in the order built
    plain = [i for i in range(len(models)) if i != args.wrapped]
    roles = dict(zip(ROLES, [*plain, args.wrapped], strict=True))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        optimizers[i].zero_grad()
        loss_fn(models[i](x), y).backward()
        optimizers[i].step()
        return time.perf_counter() - wall, time.thread_time() - cpu

    for _ in range(10):  # warm-up, DDP's bucket rebuild included
        for i in range(len(models)):
            step(i)
    wall: list[list[float]] = [[] for _ in models]
    cpu: list[list[float]] = [[] for _ in models]
    order = list(range(len(models)))
    for _ in range(args.steps):
        for i in order:
            w, c = step(i)
            wall[i].append(w)
            cpu[i].append(c)
        order.reverse()
    if dist.get_rank() == 0:
        med = statistics.median
        print(json.dumps({"step_cost": {role: {"wall_us": med(wall[i]) * 1e6,
                                                "cpu_us": med(cpu[i]) * 1e6}
                                         for role, i in roles.items()}}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
