"""Slot calls for a plain PyTorch training loop, without patching the optimizer.

For users who keep `hvd.DistributedOptimizer` (or their own `hvd.allreduce_async_`
calls) as they are and mark the loop's events themselves:

    callback = CrossoverCallback()
    for x, y in batches:
        callback.on_step_begin()            # acquire: forward and backward hold the device
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()     # Horovod starts the allreduces
        callback.on_backward_end()          # release: COMMUNICATE
        callback.synchronize(optimizer)     # wait for the allreduces without the slot
        callback.on_update_begin()          # acquire: the update holds the device
        with optimizer.skip_synchronize():
            optimizer.step()
        callback.on_step_end()              # step boundary: yield_slot

The same lifecycle as `crossover.hooks.torch.wrap`, which does all of this for you
(`crossover.hooks._lifecycle`). `callback.synchronize(optimizer)` is Horovod's
`optimizer.synchronize()` with the quiet wait of the wrapped optimizer: while other jobs
share the device it sleeps between polls instead of spinning a core. Calling
`optimizer.synchronize()` yourself is correct too, with Horovod's spinning wait. If
`on_update_begin` is left out, `optimizer.step()` (which then synchronizes itself) runs
the update without the slot and `on_step_end` takes it back: correct, less tidy.
With CROSSOVER_ENABLE=0 every call is a no-op (`synchronize` is Horovod's).
"""

from __future__ import annotations

from typing import Any

import torch

from crossover import session
from crossover.client import SlotClient

from ._lifecycle import SlotLifecycle, horovod_optimizer


class CrossoverCallback:
    """Turns the events of a hand-written PyTorch loop into slot-client calls.

    Args:
        device: the device the loop computes on (default CPU). On CUDA the release
            waits for the device to finish backward's kernels first, and the client
            is told the GPU index.
        client: the slot client (default: the process's, see `crossover.session.init`).
    """

    def __init__(self, device: torch.device | str | None = None,
                 client: SlotClient | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.enabled = session.enabled()
        self.client: SlotClient | None = None
        if self.enabled:
            gpu = (self.device.index or 0) if self.device.type == "cuda" else None
            self.client = client or session.init(gpu=gpu)
        # no optimizers: the loop's on_backward_end is the release point
        self._life = SlotLifecycle(self.client, device=self.device)

    def on_step_begin(self) -> None:
        """Before zero_grad/forward: hold the device (waits for the grant)."""
        self._life.begin_compute()

    def on_backward_end(self) -> None:
        """After the backward pass that launched the allreduces: give the device up.

        With gradient accumulation call it after the last backward of the step only.
        """
        self._life.end_backward()

    def synchronize(self, optimizer: Any) -> None:
        """Wait for `optimizer`'s allreduces, in place of `optimizer.synchronize()`.

        Raises:
            TypeError: `optimizer` is not an `hvd.DistributedOptimizer`.
        """
        self._life.wait_for_gradients(horovod_optimizer(
            optimizer, "crossover.hooks.torch_callback.CrossoverCallback.synchronize"))

    def on_update_begin(self) -> None:
        """After waiting for the allreduces, before the optimizer update: hold again."""
        self._life.begin_update()

    def on_step_end(self) -> None:
        """After the update: a step boundary, where a waiting job may go first."""
        self._life.end_step()

    def close(self) -> None:
        """The loop is over: give the device up (idle)."""
        self._life.close()
