"""Slot hooks in Horovod's PyTorch DistributedOptimizer.

The slot's life in one step (`crossover.hooks._lifecycle.SlotLifecycle`):

    step() of the last step ... yield_slot   held   (a waiting job may go first)
    zero_grad, forward, backward               held
    end of backward (allreduces launched)      released: COMMUNICATE
    step(): synchronize (wait allreduces)      not held (a quiet wait when sharing)
    step(): optimizer update                   held (acquired after synchronize)

The optimizer instance is patched, not subclassed: Horovod's class calls
`super(self.__class__, self)`, which recurses forever under a subclass or class swap.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from crossover import session
from crossover.client import SlotClient

from ._lifecycle import SlotLifecycle, horovod_optimizer


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
    horovod_optimizer(optimizer, "crossover.hooks.torch.wrap")  # TypeError if not Horovod's
    device = next((p.device for g in optimizer.param_groups for p in g["params"]
                   if p.is_cuda), None)
    if client is None:
        client = session.init(gpu=device.index if device is not None else None)
    optimizer._crossover_hooks = _SlotHooks(optimizer, SlotLifecycle(client, [optimizer], device),
                                            model)
    return optimizer


class _SlotHooks:
    def __init__(self, opt: Any, life: SlotLifecycle, model: torch.nn.Module | None) -> None:
        self.opt = opt
        self.life = life
        self.in_backward = False
        # Horovod registers its gradient hooks only when hvd.size() > 1; ours sit on
        # the same gradient accumulators and fire after Horovod's.
        for acc in opt._grad_accs:
            acc.register_hook(self._on_gradient)
        if model is not None:
            model.register_forward_pre_hook(lambda *_: self.life.begin_compute())
        self._patch("zero_grad", self._zero_grad)
        self._patch("step", self._step)
        self._patch("synchronize", self._synchronize)

    def _patch(self, name: str, replacement) -> None:
        original = getattr(self.opt, name)  # the bound method of Horovod's class
        setattr(self.opt, name, functools.wraps(original)(
            functools.partial(replacement, original)))

    def _zero_grad(self, original, *args, **kwargs):
        self.life.begin_compute()
        return original(*args, **kwargs)

    def _on_gradient(self, *_):
        if not self.in_backward:
            self.in_backward = True
            self.life.begin_compute()  # forward ran outside the slot (first step): take it
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self.life.renew()

    def _on_backward_end(self) -> None:
        self.in_backward = False
        self.life.end_backward()

    def _step(self, original, closure=None):
        self.life.end_backward()  # the slot kept at backward's end, if a job came since
        if self.opt._should_synchronize:
            self.opt.synchronize()  # waits for the allreduces without the slot
        self.life.begin_update()
        with self.opt.skip_synchronize():
            result = original(closure)
        self.life.end_step()
        return result

    def _synchronize(self, original):
        return self.life.wait_for_gradients(self.opt, original)
