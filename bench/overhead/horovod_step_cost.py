"""What crossover adds to a Horovod PyTorch step, measured in one process: run under mpirun.

    mpirun -np 2 python -m bench.overhead.horovod_step_cost [--steps 300] [--wrapped 2]

The Horovod counterpart of `bench/overhead/ddp_step_cost.py` (whose doc says why): each rank
builds three identical MLPs of the overhead benchmark (examples/torch_mlp.py's layers
and optimizer), each with its own `hvd.DistributedOptimizer` whose parameter names carry
the model's index (so the three models' allreduces never share a name), wraps the
`--wrapped`-th with `crossover.hooks.torch.wrap` as a user would, and trains them in
alternating steps. Rank 0 prints the same JSON line: per role (plain, plain_again,
crossover), the median wall and main-thread CPU time of a step.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch

import crossover.hooks.torch as crossover_torch
from bench.overhead.ddp_step_cost import alternate, arguments, models


def main() -> None:
    args = arguments(__doc__).parse_args()
    hvd.init()
    torch.set_num_threads(1)  # one core is one device
    mlps = models(args.hidden, args.layers)
    optimizers = []
    for i, model in enumerate(mlps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optimizers.append(hvd.DistributedOptimizer(
            optimizer, named_parameters=[(f"m{i}.{name}", p)
                                         for name, p in model.named_parameters()]))
    crossover_torch.wrap(optimizers[args.wrapped])
    alternate(mlps, optimizers, args.wrapped, args.steps, hvd.rank() == 0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
