"""PyTorch DistributedDataParallel under crossover: one line after the model is built.

    model = DistributedDataParallel(model, ...)
    crossover.hooks.ddp.wrap(model)

DDP averages gradients inside backward: its reducer hands each bucket to the process
group as the bucket fills, and the end of backward waits for them all. The slot is
given up once the step's last bucket has been handed over and taken again when
backward returns, before the optimizer update. A rank never waits on a collective
while it holds its device: that rank's peers may wait for devices that another job's
ranks hold while those wait for theirs. DDP's forward runs collectives of its own
around the module's forward (the one-time rebuild of its buckets, the broadcast of
buffers, a join), so the slot is given up around them. Mapped onto `SlotLifecycle`:

    DDP forward (pre-hook)        end_step; release if DDP's pre-forward may communicate
    module forward (pre-hook)     begin_compute: acquire
    module forward done           release if DDP's post-forward syncs buffers
    DDP forward done              begin_compute: acquire (a no-op when held)
    the last bucket handed over   end_backward: device sync, release COMMUNICATE
    backward done                 allreduces_done (the wait), begin_update: acquire
                                  (after DDP waited for the buckets)

Which bucket is the last one, two ways:

- **DDP's own reduction** (no hook of the script's, no `find_unused_parameters`): a hook
  runs after DDP's on every parameter's gradient accumulator. DDP hands the buckets over
  in order as their gradients arrive, so once every parameter's gradient has arrived,
  every bucket has been handed over. No communication hook is registered: with one, DDP
  no longer folds the 1/world-size scaling into its copy of each gradient into its
  bucket, and the extra pass over the gradients cost 6 % of a CPU step (a 3 M-parameter
  MLP, gloo).
- **A communication hook** otherwise: a hook the script registers (`register_comm_hook`,
  or a built-in one such as FP16_COMPRESS) runs inside crossover's, which sees
  `bucket.is_last()`, and still decides how each bucket is reduced. With
  `find_unused_parameters` (some gradients never arrive) crossover's hook scales by
  1/world size and sums, as DDP's reducer does, so the weights stay the same.

Under `no_sync()` no bucket is handed over, so an accumulation pass keeps the slot.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.
import atexit
import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from crossover import session
from crossover.hooks import _lifecycle
from crossover.hooks._lifecycle import SlotLifecycle
from crossover.protocol import Phase

_BUILTIN_HOOKS = {
    "ALLREDUCE": "allreduce_hook",
    "FP16_COMPRESS": "fp16_compress_hook",
}


def _mean_allreduce(process_group: dist.ProcessGroup | None,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own reduction: scale by 1/world size (in the gradient's type), then sum."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


# The gradient accumulators and DDP's reducer that hold crossover's hooks live in C++,
# where Python's collector cannot follow a cycle back to the model (and a cycle it can
# follow is collected at some later pass, maybe only at exit). Hooks that held
# `_SlotHooks` (and so the model) strongly kept the model, its reducer and its gloo
# process group alive to interpreter exit, and a gloo group destroyed that late can
# abort the process ("terminate called without an active exception") after the script
# has finished. So the C++ side holds them weakly.
def _weakly(method: Any) -> Any:
    """`method` (bound) called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _weak_comm_hook(hooks: "_SlotHooks") -> Any:
    """`hooks.comm_hook` through a weak reference (annotated: DDP checks them)."""
    ref = weakref.ref(hooks)

    def comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return ref().comm_hook(state, bucket)

    return comm_hook


_collect_at_exit: list[bool] = []  # gc.collect registered with atexit (once a process)


class _SlotHooks:
    """The slot calls of one DDP model (see the module's docstring)."""

    def __init__(self, model: DistributedDataParallel, life: SlotLifecycle) -> None:
        # weakly: the model owns its hooks (no cycle; the module's docstring above)
        self._model, self.life = weakref.ref(model), life
        self.inner: tuple[Any, Any] = (model.process_group, _mean_allreduce)
        self._grad_forwards = 0  # forwards with gradients: DDP rebuilds buckets in the 2nd
        #: The parameters DDP reduces, while their accumulators count arrivals (DDP's own
        #: reduction); None while a communication hook marks the last bucket.
        self.counted: list[torch.Tensor] | None = None
        self._pending = 0  # gradients still to arrive in this backward (0: not counting)
        self._handles: list[Any] = []

    @property
    def model(self) -> DistributedDataParallel:
        model = self._model()
        assert model is not None, "a DDP model's hooks ran after the model was freed"
        return model

    def count_gradients(self) -> None:
        """Mark the last bucket by counting gradient arrivals (DDP's own reduction)."""
        ignored = getattr(self.model, "parameters_to_ignore", set())
        self.counted = [p for name, p in self.model.module.named_parameters()
                        if p.requires_grad and name not in ignored]
        with torch.enable_grad():
            # A leaf's accumulator is the node DDP hooked; a hook added to it now runs
            # after DDP's, once DDP has marked the gradient ready (and maybe handed over
            # its bucket). DDP keeps the nodes alive.
            accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.counted]
        arrived = _weakly(self._gradient_arrived)
        self._handles = [acc.register_hook(arrived) for acc in accumulators]

    def use_comm_hook(self) -> None:
        """Mark the last bucket from a communication hook (DDP takes only one)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.counted, self._pending = [], None, 0
        DistributedDataParallel.register_comm_hook(self.model, None, _weak_comm_hook(self))

    def ddp_forward_pre(self, _module: Any, _inputs: Any) -> None:
        self.life.end_step()
        if self.counted is not None:
            # Under no_sync() this forward's backward hands no bucket over: no count.
            syncs = torch.is_grad_enabled() and self.model.require_backward_grad_sync
            self._pending = len(self.counted) if syncs else 0
        if self._pre_forward_communicates():
            self._release_for_collectives()

    def module_forward_pre(self, _module: Any, _inputs: Any) -> None:
        self.life.begin_compute()

    def module_forward_done(self, _module: Any, _inputs: Any, _output: Any) -> None:
        if torch.is_grad_enabled() and self.model._check_sync_bufs_post_fwd():
            self._release_for_collectives()

    def ddp_forward_done(self, _module: Any, _inputs: Any, _output: Any) -> None:
        self.life.begin_compute()

    def _pre_forward_communicates(self) -> bool:
        """Whether DDP's forward may run a collective before the module's forward."""
        if torch.is_grad_enabled():
            self._grad_forwards += 1
        rebuild = torch.is_grad_enabled() and self._grad_forwards <= 2 and \
            not getattr(self.model, "_has_rebuilt_buckets", False)
        return rebuild or self.model._check_sync_bufs_pre_fwd() or \
            self.model._join_config.enable

    def _release_for_collectives(self) -> None:
        client = self.life.client
        if client is not None and client.holding:
            _lifecycle.device_sync(self.life.device)  # the one patch point (bench/)
            client.release(Phase.COMMUNICATE)

    def comm_hook(self, _state: Any,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state, hook = self.inner
        fut = hook(state, bucket)
        if bucket.is_last():
            self._buckets_handed_over()
        return fut

    def _gradient_arrived(self, _grad_inputs: Any, _grad_outputs: Any) -> None:
        if self._pending:
            self._pending -= 1
            if not self._pending:
                self._buckets_handed_over()

    def _buckets_handed_over(self) -> None:
        """Every bucket is with the process group: backward's compute is done."""
        self.life.end_backward()
        # DDP queues its end-of-backward callback, which waits for the buckets, only
        # once its hook returns: the acquire is queued from a callback queued now, so
        # that it runs after DDP's (a rank waiting while it holds its device can stall
        # another job's ranks, and so its own peers).
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(lambda: queue(self._buckets_reduced))

    def _buckets_reduced(self) -> None:
        """DDP has waited for every bucket: the update holds the device. The wait since
        the release tells the daemons how far this node's turns run ahead of the others'
        (`--align-phases`), as Horovod jobs' waits do. (With gloo DDP's wait blocks until
        the allreduces are done; NCCL's would only order the streams and read near 0.)"""
        self.life.allreduces_done()
        self.life.begin_update()

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """The script's own hook: runs inside crossover's (DDP takes only one)."""
        self.model._check_comm_hook(hook)  # DDP's own check of the hook's signature
        self.inner = (state, hook)
        if self.counted is not None:
            self.use_comm_hook()

    def register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in _BUILTIN_HOOKS:
            raise ValueError(f"crossover runs DDP's built-in {name} hook only as one of "
                             f"{sorted(_BUILTIN_HOOKS)}; register it as a Python hook "
                             f"with register_comm_hook instead")
        self.inner = (self.model.process_group, getattr(default_hooks, _BUILTIN_HOOKS[name]))
        if self.counted is not None:
            self.use_comm_hook()


def wrap(model: DistributedDataParallel) -> DistributedDataParallel:
    """Run `model`'s steps under crossover; returns the same model.

    Call it after building the DDP model and before the first backward (and before
    `register_comm_hook`, if the script registers one). With CROSSOVER_ENABLE=0 the
    model is left as it is.

    Raises:
        TypeError: `model` is not a DistributedDataParallel.
        RuntimeError: a communication hook was registered on it already.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"crossover.hooks.ddp.wrap needs the DistributedDataParallel model, "
                        f"got {type(model).__name__}: wrap DDP(model, ...), not the module "
                        f"inside it")
    if getattr(model, "_crossover_hooks", None) is not None or not session.enabled():
        return model
    if getattr(model, "_comm_hooks", None):
        raise RuntimeError("crossover.hooks.ddp.wrap(model) must come before "
                           "model.register_comm_hook(...): DDP takes one hook, and "
                           "crossover's runs the script's inside it")
    device = _device_of(model)
    client = session.init(gpu=device.index if device.type == "cuda" else None)
    hooks = _SlotHooks(model, SlotLifecycle(client, None, device))
    if model.find_unused_parameters:  # unused parameters' gradients never arrive
        hooks.use_comm_hook()
    else:
        hooks.count_gradients()
    model.register_forward_pre_hook(hooks.ddp_forward_pre)
    model.register_forward_hook(hooks.ddp_forward_done)
    model.module.register_forward_pre_hook(hooks.module_forward_pre)
    model.module.register_forward_hook(hooks.module_forward_done)
    model.register_comm_hook = hooks.register_comm_hook
    model._register_builtin_comm_hook = hooks.register_builtin_comm_hook
    model._crossover_hooks = hooks
    if not _collect_at_exit:
        # DDP's modules form Python cycles, so a model the script dropped waits for a
        # collector pass, which may come only while the interpreter is torn down, when
        # destroying its gloo group can abort a finished script (SIGABRT; plain torchrun
        # runs of examples/ddp_mlp.py: 2 in 12, with this collection 0 in 24): collect
        # while the interpreter is whole.
        atexit.register(gc.collect)
        _collect_at_exit.append(True)
    return model


def _device_of(model: DistributedDataParallel) -> torch.device:
    """Where the model computes: its first parameter's device (CPU if it has none)."""
    param = next(model.module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
