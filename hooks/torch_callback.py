"""Slot calls for a plain PyTorch training loop, without patching the optimizer.

For users who keep `hvd.DistributedOptimizer` (or their own `hvd.allreduce_async_`
calls) as they are and mark the loop's events themselves:

    callback = CrossoverCallback()
    for x, y in batches:
        callback.on_step_begin()            # acquire: forward and backward hold the device
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()     # Horovod starts the allreduces
        callback.on_backward_end()          # release: COMMUNICATE
        optimizer.synchronize()             # wait for the allreduces without the slot
        callback.on_update_begin()          # acquire: the update holds the device
        with optimizer.skip_synchronize():
            optimizer.step()
        callback.on_step_end()              # step boundary: yield_slot

The same lifecycle as `crossover.hooks.torch.wrap`, which does all of this for you. If
`on_update_begin` is left out, `optimizer.step()` (which then synchronizes itself) runs
the update without the slot and `on_step_end` takes it back: correct, less tidy.
With CROSSOVER_ENABLE=0 every call is a no-op.
"""

from __future__ import annotations

import torch

from crossover import session
from crossover.client import SlotClient
from crossover.scheduler import Phase


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

    def on_step_begin(self) -> None:
        """Before zero_grad/forward: hold the device (waits for the grant)."""
        if self.client is not None:
            self.client.acquire()

    def on_backward_end(self) -> None:
        """After the backward pass that launched the allreduces: give the device up.

        With gradient accumulation call it after the last backward of the step only.
        """
        if self.client is not None:
            if self.device.type == "cuda":
                # the launch returns before the kernels are done: release after them
                torch.cuda.current_stream(self.device).synchronize()
            self.client.release(Phase.COMMUNICATE)

    def on_update_begin(self) -> None:
        """After waiting for the allreduces, before the optimizer update: hold again."""
        if self.client is not None:
            self.client.acquire()

    def on_step_end(self) -> None:
        """After the update: a step boundary, where a waiting job may go first."""
        if self.client is not None:
            self.client.yield_slot()

    def close(self) -> None:
        """The loop is over: give the device up (idle)."""
        if self.client is not None:
            self.client.release(Phase.IDLE)
