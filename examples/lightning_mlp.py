"""A PyTorch Lightning job with Horovod under crossover: an MLP on synthetic data, seeded.

    mpirun -np 2 python examples/lightning_mlp.py --steps 50 --out weights.pt

One single-device Trainer per rank (Lightning 2 has no Horovod strategy), with
`hvd.DistributedOptimizer` from configure_optimizers and
`crossover.hooks.lightning.CrossoverCallback`, which also synchronizes Horovod's
gradients at the right point of Lightning's loop. Same weights with CROSSOVER_ENABLE=0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("PL_DISABLE_FORK", "1")

import horovod.torch as hvd  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

from crossover.hooks.lightning import CrossoverCallback  # noqa: E402
from crossover.testing import add_start_barrier_flags, start_barrier  # noqa: E402


class MLP(pl.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        width = [64] + [hidden] * layers
        mods = []
        for a, b in zip(width, width[1:], strict=False):
            mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*mods, torch.nn.Linear(width[-1], 10))
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return hvd.DistributedOptimizer(opt, named_parameters=self.named_parameters())


class StartTogether(pl.Callback):
    """Meets the other jobs at the start barrier once Lightning has set up (after
    crossover's on_fit_start joined the daemon), before the first batch."""

    def __init__(self, barrier, n_jobs: int) -> None:
        self.barrier, self.n_jobs = barrier, n_jobs

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start_barrier(self.barrier, self.n_jobs, hvd.rank(), hvd.size())


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
    model = MLP(args.hidden, args.layers)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    # Each rank sees its own shard of a fixed synthetic data set.
    gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    n = args.steps * args.batch
    data = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=gen),
                                          torch.randint(0, 10, (n,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, max_epochs=1,
        plugins=[LightningEnvironment()],  # Horovod is the launcher; not Lightning's MPI
        callbacks=[CrossoverCallback(), StartTogether(args.start_barrier, args.start_jobs)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )
    start = time.perf_counter()
    trainer.fit(model, loader)
    elapsed = time.perf_counter() - start

    # Horovod averaged every step only if all ranks ended with the same weights.
    digest = float(sum(p.double().sum() for p in model.parameters()))
    if len(set(hvd.allgather_object(digest))) != 1:
        raise RuntimeError("the ranks' weights diverged: the gradients were not averaged")

    if hvd.rank() == 0:
        if args.out:
            torch.save(model.net.state_dict(), args.out)
        print(json.dumps({"samples_per_s": n * hvd.size() / elapsed, "seconds": elapsed}),
              flush=True)


if __name__ == "__main__":
    main()
