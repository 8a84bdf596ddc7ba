"""What crossover adds to a DDP step, measured in one process: run under torchrun.

    torchrun --standalone --nproc-per-node 2 -m bench.overhead.ddp_step_cost [--steps 300]

End-to-end runs of a job alone against the same job plain differ by 5-10 % from run to
run on a shared machine, which hides a 1 % cost. Here each rank builds three identical
DDP models of the overhead benchmark's MLP: two plain, one wrapped by crossover
(`crossover.hooks.ddp.wrap`), and trains them in alternating steps (the order reversed
every step), so that drift hits all three alike. Where the wrapped model stands among
the three (`--wrapped`) is a parameter: the models' places in memory differ, so a
caller rotates it over runs. Rank 0 prints one JSON line: per model, the median wall
time and the median main-thread CPU time of a step. The two plain models give the noise
floor of the comparison. `bench/overhead/horovod_step_cost.py` does the same for Horovod with
this file's `arguments` and `alternate`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch

from crossover import session
from examples.ddp_mlp import MLP  # noqa: E402  (the whole-run benchmarks' model)

ROLES = ("plain", "plain_again", "crossover")
#: Steps of every model before the timed ones (DDP's bucket rebuild, Horovod's first
#: negotiation of each tensor).
WARMUP = 10


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options both step-cost scripts take."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per model")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--wrapped", type=int, choices=range(len(ROLES)), default=2,
                        help="which of the three models (in order built) crossover wraps")
    return parser


def models(hidden: int, layers: int) -> list[torch.nn.Module]:
    """One bare MLP per role, all with the same weights."""
    out = []
    for _ in ROLES:
        torch.manual_seed(0)
        out.append(MLP(hidden, layers, False))
    return out


def alternate(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              wrapped: int, steps: int, report: bool) -> None:
    """Train the models in alternating steps (the order reversed every step) after
    WARMUP steps each; with `report`, print one JSON line: per role, the median wall
    and main-thread CPU time of a step (µs), and whether the wrapped model's slot
    client was coordinated by a daemon and kept its device (a job alone)."""
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        optimizers[i].zero_grad()
        loss_fn(models[i](x), y).backward()
        optimizers[i].step()
        return time.perf_counter() - wall, time.thread_time() - cpu

    for _ in range(WARMUP):
        for i in range(len(models)):
            step(i)
    wall: list[list[float]] = [[] for _ in models]
    cpu: list[list[float]] = [[] for _ in models]
    order = list(range(len(models)))
    for _ in range(steps):
        for i in order:
            w, c = step(i)
            wall[i].append(w)
            cpu[i].append(c)
        order.reverse()
    if report:
        # role -> model: the plain ones in the order built, then the wrapped one
        plain = [i for i in range(len(models)) if i != wrapped]
        roles = dict(zip(ROLES, [*plain, wrapped], strict=True))
        med = statistics.median
        # the wrapped model's client (the process has one; none with CROSSOVER_ENABLE=0)
        client = session.init() if session.enabled() else None
        print(json.dumps({"step_cost": {role: {"wall_us": med(wall[i]) * 1e6,
                                                "cpu_us": med(cpu[i]) * 1e6}
                                         for role, i in roles.items()},
                          "coordinated": client is not None and client.coordinated,
                          "kept_device": client is not None and client.keeps_device()}),
              flush=True)


def main() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import crossover.hooks.ddp as crossover_ddp

    parser = arguments(__doc__)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core is one device
    dist.init_process_group("gloo")
    ddp = [DistributedDataParallel(m, bucket_cap_mb=args.bucket_mb)
           for m in models(args.hidden, args.layers)]
    crossover_ddp.wrap(ddp[args.wrapped])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in ddp]
    alternate(ddp, optimizers, args.wrapped, args.steps, dist.get_rank() == 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
