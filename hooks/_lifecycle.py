"""The slot's life in one PyTorch training step, shared by the PyTorch adapters.

`crossover.hooks.torch` (the patched optimizer), `crossover.hooks.torch_callback` (a
hand-marked loop) and `crossover.hooks.lightning` only map their framework's events onto
`SlotLifecycle`, as Horovod's Keras callbacks map onto `horovod/_keras/callbacks.py`:

    begin_compute        acquire: zero_grad, forward, backward hold the device
    end_backward         allreduces in flight: device sync, then release COMMUNICATE
    wait_for_gradients   wait for the allreduces without the slot
    allreduces_done      (or) the framework waited for them itself: report the wait
    begin_update         acquire: the optimizer update holds the device
    end_step             yield_slot: a step boundary, a waiting job may go first
    close                release IDLE

With other jobs on the device the wait polls the allreduces with short sleeps instead
of Horovod's own wait, which spins a core: that spin would steal the computing job's CPU
(and on a CPU device, its compute). A job alone, one served concurrently (plain
co-location, unpinned: see `SlotClient`), or one whose waits are too short to matter
keeps Horovod's wait, which wakes soonest. With CROSSOVER_ENABLE=0 (client None) the slot
calls are no-ops and the wait is Horovod's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from crossover.backoff import Backoff, wait_until
from crossover.client import SlotClient
from crossover.protocol import Phase

#: Longest polite (sleeping) wait for one step's allreduces before Horovod's own wait.
QUIET_WAIT_S = 60.0
#: Shortest measured wait (moving average) for which the quiet wait pays.
QUIET_MIN_WAIT_S = 0.002
#: Weight of the newest wait in `SlotLifecycle.wait_ema_s`.
WAIT_EMA_WEIGHT = 0.2


def wait_quietly(handles: Sequence[int]) -> bool:
    """Sleep until Horovod's allreduce `handles` are done, polling every 0.05 ms to 0.5 ms,
    for at most QUIET_WAIT_S.

    Horovod's wait spins; this one costs a few syscalls per millisecond.

    Returns:
        Whether they are done (False: the time ran out).
    """
    from horovod.torch.mpi_ops import poll

    return wait_until(lambda: all(poll(h) for h in handles), QUIET_WAIT_S,
                      Backoff(5e-5, 5e-4))


def horovod_optimizer(obj: Any, where: str) -> Any:
    """The Horovod DistributedOptimizer that `obj` is, or that a LightningOptimizer wraps.

    Raises:
        TypeError: neither is one; the message names `where` and the fix.
    """
    # A LightningOptimizer passes the check too (it forwards attribute reads), but
    # Horovod's methods must run on the original: what they write lands on `self`.
    for candidate in (getattr(obj, "_optimizer", None), obj):
        if hasattr(candidate, "synchronize") and hasattr(candidate, "_handles"):
            return candidate
    name = type(getattr(obj, "_optimizer", obj)).__name__
    raise TypeError(
        f"{where} needs the hvd.DistributedOptimizer instance, got {name}: wrap the "
        f"optimizer as horovod.torch.DistributedOptimizer(optimizer, named_parameters=...)")


def allreduces_in_flight(optimizers: Iterable[Any]) -> bool:
    """Whether a Horovod optimizer has allreduces running (none: an accumulation pass)."""
    return any(handle is not None for opt in optimizers for handle, _ in opt._handles.values())


def device_sync(device: torch.device | None) -> None:
    """Block until `device` has run the work queued on it (a no-op off CUDA).

    A CUDA launch returns long before its kernels are done: releasing without this would
    hand the device over while backward still runs on it.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class SlotLifecycle:
    """The slot calls of one rank's training steps.

    Args:
        client: the slot client; None when crossover is off (slot calls do nothing).
        optimizers: the Horovod optimizers whose allreduces end backward; None when the
            caller marks the end of backward itself (every `end_backward` releases).
        device: where the step computes; a CUDA device is synchronized before release.
    """

    def __init__(self, client: SlotClient | None, optimizers: Sequence[Any] | None = None,
                 device: torch.device | None = None) -> None:
        self.client = client
        self.optimizers = optimizers
        self.device = device
        #: Moving average of the waits for the allreduces (s); None before the first.
        self.wait_ema_s: float | None = None
        self._released = False  # this step's end_backward gave the device up
        self._released_at = 0.0  # when (monotonic s)

    def begin_compute(self) -> None:
        """Forward and backward hold the device (waits for the grant)."""
        self._released = False  # a step that ended without its wait (it raised) reports none
        if self.client is not None:
            self.client.acquire()

    def renew(self) -> None:
        """Still computing: keep a long hold's lease alive."""
        if self.client is not None:
            self.client.renew()

    def end_backward(self) -> None:
        """Backward is done: give the device up while its allreduces run.

        An accumulation pass (no allreduce in flight) keeps the slot. Calling it again
        before the wait is harmless, and releases a slot kept at the end of backward (a
        job alone keeps it) if a job has arrived since.
        """
        if self.client is None or not self.client.holding:
            return
        if self.optimizers is None or allreduces_in_flight(self.optimizers):
            device_sync(self.device)
            self.client.release(Phase.COMMUNICATE)
            self._released = not self.client.holding
            self._released_at = time.monotonic()

    def wait_for_gradients(self, optimizer: Any,
                           synchronize: Callable[[], Any] | None = None) -> Any:
        """Wait for `optimizer`'s allreduces without the slot, then synchronize.

        Args:
            optimizer: the Horovod DistributedOptimizer.
            synchronize: Horovod's synchronize (default `optimizer.synchronize`); it
                finishes the step's allreduces once they are done or the quiet wait
                gave up.

        Returns:
            What `synchronize` returns.
        """
        start = time.monotonic()
        if self.client is not None and self._quiet_wait_pays():
            self._wait_quietly(optimizer)
        result = (synchronize or optimizer.synchronize)()
        waited = time.monotonic() - start
        self.wait_ema_s = waited if self.wait_ema_s is None else (
            self.wait_ema_s + WAIT_EMA_WEIGHT * (waited - self.wait_ema_s))
        self._report_wait(waited)
        return result

    def allreduces_done(self) -> None:
        """The step's allreduces are done, waited for by the framework itself (DDP, at the
        end of backward): report the wait since the release, as `wait_for_gradients`
        does, for the daemons that keep the nodes' phases in step."""
        self._report_wait(time.monotonic() - self._released_at)

    def _report_wait(self, waited: float) -> None:
        if self._released:  # the wait started as the device went to the other job
            self.client.note_wait(waited)
            self._released = False

    def begin_update(self) -> None:
        """The gradients are averaged: the optimizer update holds the device."""
        if self.client is not None:
            self.client.acquire()

    def end_step(self) -> None:
        """A step boundary: a waiting job may go first."""
        if self.client is not None:
            self.client.yield_slot()

    def close(self) -> None:
        """Training is over: give the device up (idle)."""
        if self.client is not None:
            self.client.release(Phase.IDLE)

    def _quiet_wait_pays(self) -> bool:
        """Whether to wait by sleeping between polls rather than with Horovod's spin.

        The one place this is decided. Sleeping leaves the CPU to the job whose turn it
        is, but wakes up to 0.5 ms late. A rank that keeps its device (alone, or served
        concurrently, which is plain co-location) waits as plain Horovod does; so does
        one whose waits, measured, are shorter than QUIET_MIN_WAIT_S: they free too
        little CPU to pay for waking late.
        """
        if self.client.keeps_device():
            return False
        return self.wait_ema_s is None or self.wait_ema_s >= QUIET_MIN_WAIT_S

    def _wait_quietly(self, optimizer: Any) -> None:
        """Sleep until the in-flight allreduces are done (`wait_quietly`). After
        QUIET_WAIT_S the rest of the wait is Horovod's own, so a hung peer behaves as
        under plain Horovod.
        """
        wait_quietly([h for h, _ in optimizer._handles.values() if h is not None])
