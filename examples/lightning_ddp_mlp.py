"""A PyTorch Lightning job with its DDP strategy under crossover, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp_mlp.py --out weights.pt

Lightning runs DDP over torchrun's processes (one CPU device each) and shards the data;
`crossover.hooks.lightning.CrossoverCallback` hands the DDP model to crossover's DDP
adapter. Same weights with CROSSOVER_ENABLE=0.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as pl
import torch

from crossover.hooks.lightning import CrossoverCallback
from crossover.testing import add_start_barrier_flags, start_barrier


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
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StartTogether(pl.Callback):
    """Meets the other jobs at the start barrier once Lightning has set up."""

    def __init__(self, barrier, n_jobs: int) -> None:
        self.barrier, self.n_jobs = barrier, n_jobs

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start_barrier(self.barrier, self.n_jobs, trainer.global_rank, trainer.world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=2, help="torchrun's --nproc-per-node")
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    add_start_barrier_flags(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core is one device
    torch.manual_seed(args.seed)
    model = MLP(args.hidden, args.layers)
    gen = torch.Generator().manual_seed(args.seed * 1000)
    n = args.steps * args.batch * args.devices  # Lightning gives each rank its shard
    data = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=gen),
                                          torch.randint(0, 10, (n,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=args.steps,
        max_epochs=1, callbacks=[CrossoverCallback(),
                                 StartTogether(args.start_barrier, args.start_jobs)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )
    start = time.perf_counter()
    trainer.fit(model, loader)
    elapsed = time.perf_counter() - start

    if trainer.global_rank == 0:
        if args.out:
            torch.save(model.net.state_dict(), args.out)
        print(json.dumps({"samples_per_s": n / elapsed, "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
