"""Slot hooks in Horovod's PyTorch DistributedOptimizer.

The slot's life in one step:

    step() of the last step ... yield_slot   held   (a waiting job may go first)
    zero_grad, forward, backward               held
    end of backward (allreduces launched)      released: COMMUNICATE
    step(): synchronize (wait allreduces)      not held
    step(): optimizer update                   held (acquired after synchronize)

With other jobs on the device, waiting for the allreduces polls with short sleeps
instead of Horovod's own wait, which spins a core: that spin would steal the computing
job's CPU (and on a CPU device, its compute). A job alone keeps Horovod's wait, which
wakes soonest.

The optimizer instance is patched, not subclassed: Horovod's class calls
`super(self.__class__, self)`, which recurses forever under a subclass or class swap.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from crossover import session
from crossover.client import SlotClient
from crossover.scheduler import Phase

#: Longest polite (sleeping) wait for one step's allreduces before Horovod's own wait.
QUIET_WAIT_S = 60.0


def wrap(optimizer: Any, model: torch.nn.Module | None = None,
         client: SlotClient | None = None) -> Any:
    """Put `optimizer` (an `hvd.DistributedOptimizer`) under crossover.

    Args:
        optimizer: the instance returned by hvd.DistributedOptimizer.
        model: optional; its forward takes the slot first, for loops that do not call
            optimizer.zero_grad() before forward in the first step.
        client: the slot client (default: the process's, see `crossover.session.init`).

    Returns:
        The same optimizer object, patched in place (wrapping twice is harmless).

    Raises:
        TypeError: `optimizer` is not a Horovod DistributedOptimizer.
    """
    if getattr(optimizer, "_crossover_hooks", None) is not None or not session.enabled():
        return optimizer
    if not (hasattr(optimizer, "synchronize") and hasattr(optimizer, "_handles")):
        raise TypeError(
            f"crossover.hooks.torch.wrap takes the hvd.DistributedOptimizer instance, got "
            f"{type(optimizer).__name__}: wrap hvd.DistributedOptimizer(optimizer, ...)"
        )
    if client is None:
        gpu = next((p.device.index for g in optimizer.param_groups for p in g["params"]
                    if p.is_cuda), None)
        client = session.init(gpu=gpu)
    optimizer._crossover_hooks = _SlotHooks(optimizer, client, model)
    return optimizer


class _SlotHooks:
    def __init__(self, opt: Any, client: SlotClient, model: torch.nn.Module | None) -> None:
        self.opt = opt
        self.client = client
        self.in_backward = False
        self.cuda = any(p.is_cuda for g in opt.param_groups for p in g["params"])
        # Horovod registers its gradient hooks only when hvd.size() > 1; ours sit on
        # the same gradient accumulators and fire after Horovod's.
        for acc in opt._grad_accs:
            acc.register_hook(self._on_gradient)
        if model is not None:
            model.register_forward_pre_hook(lambda *_: self.client.acquire())
        self._patch("zero_grad", self._zero_grad)
        self._patch("step", self._step)
        self._patch("synchronize", self._synchronize)

    def _patch(self, name: str, replacement) -> None:
        original = getattr(self.opt, name)  # the bound method of Horovod's class
        setattr(self.opt, name, functools.wraps(original)(
            functools.partial(replacement, original)))

    def _zero_grad(self, original, *args, **kwargs):
        self.client.acquire()
        return original(*args, **kwargs)

    def _on_gradient(self, *_):
        if not self.in_backward:
            self.in_backward = True
            self.client.acquire()  # forward ran outside the slot (first step): take it
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self.client.renew()

    def _on_backward_end(self) -> None:
        self.in_backward = False
        if self._allreduces_in_flight():
            self._device_sync()
            self.client.release(Phase.COMMUNICATE)
        # else: an accumulation pass (backward_passes_per_step > 1): compute goes on

    def _step(self, original, closure=None):
        if self.client.holding and self._allreduces_in_flight():
            self._device_sync()
            self.client.release(Phase.COMMUNICATE)
        if self.opt._should_synchronize:
            self.opt.synchronize()  # waits for the allreduces without the slot
        self.client.acquire()
        with self.opt.skip_synchronize():
            result = original(closure)
        self.client.yield_slot()
        return result

    def _synchronize(self, original):
        if not self.client.alone():  # leave the CPU to the job that computes
            self._wait_quietly()
        return original()

    def _wait_quietly(self) -> None:
        """Sleep until the in-flight allreduces are done (polling every 0.05 ms to 0.5 ms).

        Horovod's wait spins; this one costs a few syscalls per millisecond. After
        QUIET_WAIT_S the rest of the wait is Horovod's own, so a hung peer behaves as
        under plain Horovod.
        """
        from horovod.torch.mpi_ops import poll

        handles = [h for h, _ in self.opt._handles.values() if h is not None]
        deadline = time.monotonic() + QUIET_WAIT_S
        delay = 5e-5
        for handle in handles:
            while not poll(handle) and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(2 * delay, 5e-4)

    def _allreduces_in_flight(self) -> bool:
        return any(handle is not None for handle, _ in self.opt._handles.values())

    def _device_sync(self) -> None:
        # Release only after the device has finished backward's kernels: on CUDA the
        # launch returns long before the work is done.
        if self.cuda:
            torch.cuda.current_stream().synchronize()
