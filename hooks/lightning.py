"""Slot hooks for PyTorch Lightning's own training loop: with `hvd.DistributedOptimizer`,
or under Lightning's DDP strategy.

Under `Trainer(strategy="ddp")` (launched by torchrun, or by Lightning itself) the
callback hands the DDP model to `crossover.hooks.ddp`, whose hooks do all the slot
calls: the rest of this docstring is about Horovod.

Lightning 2 has no Horovod strategy (it was removed in 2.0). Each process launched by
mpirun/horovodrun runs its own single-device `Trainer`; `configure_optimizers` returns
`hvd.DistributedOptimizer`, whose gradient hooks start the allreduces during backward.

Lightning's automatic optimization calls `optimizer.step(closure)`, and Horovod's
`step()` synchronizes *before* it runs the closure: the update would then use local,
half-averaged gradients. This callback therefore also does Horovod's part: it turns
off the synchronization in `step()` and synchronizes in `on_before_optimizer_step`
(after backward, before gradient clipping and the update). That part runs even with
CROSSOVER_ENABLE=0, so a job trains correctly with or without crossover.

The slot's life in one batch (`crossover.hooks._lifecycle`, as in `crossover.hooks.torch`):

    on_train_batch_start                 acquire
    training_step, backward              held
    on_after_backward                    released: COMMUNICATE (allreduces in flight)
    on_before_optimizer_step             synchronize (not held), then acquire
    clipping, optimizer update           held
    on_train_batch_end                   yield_slot

While other jobs share the device the synchronization waits quietly, sleeping between
polls instead of spinning a core.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from crossover import session
from crossover.client import SlotClient

from . import ddp as crossover_ddp
from ._lifecycle import SlotLifecycle, horovod_optimizer

_WHERE = "crossover.hooks.lightning.CrossoverCallback (configure_optimizers' optimizer)"


class CrossoverCallback(pl.Callback):
    """Holds the device slot for Lightning's batches and gives it up while the gradients
    are averaged; makes Lightning's loop correct with Horovod's optimizer.

    With Horovod, use one single-device Trainer per Horovod rank (`devices=1`) and shard
    the data by `hvd.rank()` yourself. With `strategy="ddp"`, Lightning does both.

    Args:
        client: the slot client (default: the process's, see `crossover.session.init`).
    """

    def __init__(self, client: SlotClient | None = None) -> None:
        super().__init__()
        self._client = client
        self.client: SlotClient | None = None
        self._optimizers: list[Any] = []
        self._life = SlotLifecycle(None)  # until on_fit_start knows the client and device
        self._ddp = False  # under Lightning's DDP strategy: crossover.hooks.ddp does it all

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the set-up and take Horovod's synchronization out of `step()`.

        Raises:
            TypeError: an optimizer is not an `hvd.DistributedOptimizer`.
            ValueError: accumulate_grad_batches differs from backward_passes_per_step,
                or Lightning runs several devices per process.
        """
        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, DistributedDataParallel):
            # DDP's hooks take and give up the slot (crossover.hooks.ddp); this
            # callback's own calls stand down (its lifecycle has no client)
            crossover_ddp.wrap(model)
            self._ddp = True
            return
        if trainer.world_size != 1:
            raise ValueError(
                f"crossover.hooks.lightning runs one single-device Trainer per Horovod rank "
                f"(Trainer(devices=1)), or Lightning's DDP strategy; this Trainer has "
                f"world_size {trainer.world_size} under {type(trainer.strategy).__name__}: "
                f"launch one process per device with mpirun/horovodrun, or use "
                f"strategy='ddp'")
        self._optimizers = [horovod_optimizer(opt, _WHERE) for opt in trainer.optimizers]
        for opt in self._optimizers:
            if opt.backward_passes_per_step != trainer.accumulate_grad_batches:
                raise ValueError(
                    f"hvd.DistributedOptimizer(backward_passes_per_step="
                    f"{opt.backward_passes_per_step}) but Trainer(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches}): set both to the same number")
            # synchronized in on_before_optimizer_step instead (see the module docstring)
            opt._should_synchronize = False
        device = pl_module.device
        if session.enabled():
            gpu = device.index if device.type == "cuda" else None
            self.client = self._client or session.init(gpu=gpu)
        self._life = SlotLifecycle(self.client, self._optimizers, device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """Forward and backward hold the device."""
        self._life.begin_compute()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Backward is done and the allreduces are running: give the device up."""
        self._life.end_backward()  # an accumulation pass (no allreduce yet) keeps it

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Wait for the averaged gradients without the slot, then hold it for the update."""
        if self._ddp:
            return  # DDP averaged them inside backward
        self._life.wait_for_gradients(horovod_optimizer(optimizer, _WHERE))
        self._life.begin_update()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """A step boundary: a waiting job may go first."""
        self._life.end_step()

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Validation computes on the device too."""
        self._life.begin_compute()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        """A step boundary."""
        self._life.end_step()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training is over: give the device up and restore Horovod's `step()`."""
        for opt in self._optimizers:
            opt._should_synchronize = True
        self._life.close()

