"""Slot hooks for PyTorch Lightning's own training loop with `hvd.DistributedOptimizer`.

Lightning 2 has no Horovod strategy (it was removed in 2.0). Each process launched by
mpirun/horovodrun runs its own single-device `Trainer`; `configure_optimizers` returns
`hvd.DistributedOptimizer`, whose gradient hooks start the allreduces during backward.

Lightning's automatic optimization calls `optimizer.step(closure)`, and Horovod's
`step()` synchronizes *before* it runs the closure: the update would then use local,
half-averaged gradients. This callback therefore also does Horovod's part: it turns
off the synchronization in `step()` and synchronizes in `on_before_optimizer_step`
(after backward, before gradient clipping and the update). That part runs even with
CROSSOVER_ENABLE=0, so a job trains correctly with or without crossover.

The slot's life in one batch (as in `crossover.hooks.torch`):

    on_train_batch_start                 acquire
    training_step, backward              held
    on_after_backward                    released: COMMUNICATE (allreduces in flight)
    on_before_optimizer_step             synchronize (not held), then acquire
    clipping, optimizer update           held
    on_train_batch_end                   yield_slot
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from crossover import session
from crossover.client import SlotClient
from crossover.scheduler import Phase


def _horovod_optimizer(optimizer: Any) -> Any:
    """The Horovod DistributedOptimizer behind `optimizer` (a LightningOptimizer too)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not (hasattr(inner, "synchronize") and hasattr(inner, "_handles")):
        raise TypeError(
            f"crossover.hooks.lightning.CrossoverCallback needs configure_optimizers to "
            f"return hvd.DistributedOptimizer(...), got {type(inner).__name__}: wrap the "
            f"optimizer with horovod.torch.DistributedOptimizer")
    return inner


class CrossoverCallback(pl.Callback):
    """Holds the device slot for Lightning's batches and gives it up while Horovod
    averages the gradients; makes Lightning's loop correct with Horovod's optimizer.

    Use one single-device Trainer per Horovod rank (`devices=1`, not a Lightning
    distributed strategy) and shard the data by `hvd.rank()` yourself.

    Args:
        client: the slot client (default: the process's, see `crossover.session.init`).
    """

    def __init__(self, client: SlotClient | None = None) -> None:
        super().__init__()
        self._client = client
        self.client: SlotClient | None = None
        self._optimizers: list[Any] = []
        self._cuda = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the set-up and take Horovod's synchronization out of `step()`.

        Raises:
            TypeError: an optimizer is not an `hvd.DistributedOptimizer`.
            ValueError: accumulate_grad_batches differs from backward_passes_per_step,
                or Lightning runs several devices per process.
        """
        if trainer.world_size != 1:
            raise ValueError(
                f"crossover.hooks.lightning runs one single-device Trainer per Horovod rank "
                f"(Trainer(devices=1)); this Trainer has world_size {trainer.world_size}: "
                f"launch one process per device with mpirun/horovodrun instead")
        self._optimizers = [_horovod_optimizer(opt) for opt in trainer.optimizers]
        for opt in self._optimizers:
            if opt.backward_passes_per_step != trainer.accumulate_grad_batches:
                raise ValueError(
                    f"hvd.DistributedOptimizer(backward_passes_per_step="
                    f"{opt.backward_passes_per_step}) but Trainer(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches}): set both to the same number")
            # synchronized in on_before_optimizer_step instead (see the module docstring)
            opt._should_synchronize = False
        self._cuda = pl_module.device.type == "cuda"
        if session.enabled():
            gpu = pl_module.device.index if self._cuda else None
            self.client = self._client or session.init(gpu=gpu)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """Forward and backward hold the device."""
        if self.client is not None:
            self.client.acquire()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Backward is done and the allreduces are running: give the device up."""
        if self.client is not None and self._allreduces_in_flight():
            if self._cuda:
                torch.cuda.current_stream().synchronize()  # backward's kernels are done
            self.client.release(Phase.COMMUNICATE)
        # else: an accumulation pass (no allreduce yet): compute goes on

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Wait for the averaged gradients without the slot, then hold it for the update."""
        _horovod_optimizer(optimizer).synchronize()
        if self.client is not None:
            self.client.acquire()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """A step boundary: a waiting job may go first."""
        if self.client is not None:
            self.client.yield_slot()

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Validation computes on the device too."""
        if self.client is not None:
            self.client.acquire()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        """A step boundary."""
        if self.client is not None:
            self.client.yield_slot()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training is over: give the device up and restore Horovod's `step()`."""
        for opt in self._optimizers:
            opt._should_synchronize = True
        if self.client is not None:
            self.client.release(Phase.IDLE)

    def _allreduces_in_flight(self) -> bool:
        return any(handle is not None for opt in self._optimizers
                   for handle, _ in opt._handles.values())
