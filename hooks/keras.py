"""Slot hooks for TensorFlow: tf_keras `fit()` and custom loops with Horovod.

The slot's life in one `fit()` batch (the same as `crossover.hooks.torch`):

    on_train_batch_begin                       acquire (a no-op when still held)
    forward, backward (compiled train step)    held
    all gradients computed                     released: COMMUNICATE   (in the graph)
    allreduce of the gradients                 not held
    all allreduces done                        acquire                 (in the graph)
    optimizer update                           held
    on_train_batch_end                         yield_slot (a waiting job may go first)

`fit()` runs the train step as one `tf.function`, so a callback alone only sees batch
boundaries. The release and the acquire are `tf.py_function` ops put into the graph
around Horovod's allreduce: the release depends (control dependencies) on every
gradient, the acquire on every averaged gradient and on the release, and the gradients
handed to the update depend on the acquire. Horovod's own overlap of allreduce with
the rest of backward is kept: the allreduces are not made to wait for the release.

The hook sits on the instance attribute `_allreduce_grads` that Horovod's Keras
DistributedOptimizer and DistributedGradientTape both call; the instance is patched,
never subclassed (see `crossover.hooks.torch`).

Keras 3 is refused: Horovod 0.28.1's Keras optimizer is never asked to aggregate
gradients by Keras 3, so ranks silently diverge.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import tensorflow as tf

from crossover import session
from crossover.client import SlotClient
from crossover.protocol import Phase

LEGACY_FLAG = "TF_USE_LEGACY_KERAS"


class KerasVersionError(RuntimeError):
    """Keras 3 is in use where Horovod needs tf_keras (Keras 2)."""


def check_legacy_keras(obj: Any = None) -> None:
    """Refuse Keras 3: Horovod's Keras optimizer does not average gradients under it.

    Args:
        obj: optionally a model or optimizer; it must come from tf_keras too (with the
            flag set, `import keras` still gives Keras 3).

    Raises:
        KerasVersionError: tf.keras is Keras 3, or `obj` is a Keras 3 object.
    """
    version = getattr(tf.keras, "__version__", "0")
    if int(version.split(".")[0]) >= 3:
        raise KerasVersionError(
            f"tf.keras is Keras {version}: Horovod 0.28.1's DistributedOptimizer does not "
            f"average gradients under Keras 3 (the ranks diverge with no error). Set "
            f"{LEGACY_FLAG}=1 in the environment before TensorFlow is imported (it makes "
            f"tf.keras the tf_keras package; {LEGACY_FLAG}={os.environ.get(LEGACY_FLAG)!r} "
            f"now)"
        )
    if obj is not None:
        keras3 = [c for c in type(obj).__mro__ if c.__module__.split(".")[0] == "keras"]
        if keras3:
            raise KerasVersionError(
                f"{type(obj).__name__} is a Keras 3 class ({keras3[0].__module__}): Horovod "
                f"does not average its gradients. With {LEGACY_FLAG}=1 build the model and "
                f"optimizer from tf.keras (or `import tf_keras`), not `import keras`"
            )


def wrap(obj: Any, client: SlotClient | None = None) -> Any:
    """Put a Horovod DistributedOptimizer (tf_keras) or DistributedGradientTape under
    crossover: the slot is released while its gradients are averaged.

    For `fit()` use `CrossoverCallback`, which also wraps the model's optimizer. For a
    custom loop wrap the tape where it is made (inside the `tf.function` is fine) and
    hold the slot for the step with `crossover.session.step()`.

    Args:
        obj: the object returned by `hvd.DistributedOptimizer` (horovod.tensorflow.keras)
            or `hvd.DistributedGradientTape` (horovod.tensorflow).
        client: the slot client (default: the process's, see `crossover.session.init`).

    Returns:
        The same object, patched in place (wrapping twice is harmless).

    Raises:
        TypeError: `obj` is not one of Horovod's TensorFlow gradient reducers.
        KerasVersionError: `obj` is a Keras 3 optimizer.
    """
    if not session.enabled() or getattr(obj, "_crossover_hooks", None) is not None:
        return obj
    if not callable(getattr(obj, "_allreduce_grads", None)):
        raise TypeError(
            f"crossover.hooks.keras.wrap takes hvd.DistributedOptimizer(...) from "
            f"horovod.tensorflow.keras or hvd.DistributedGradientTape(...) from "
            f"horovod.tensorflow, got {type(obj).__name__}: wrap the Horovod object"
        )
    if not isinstance(obj, tf.GradientTape):
        check_legacy_keras(obj)
    hooks = _AllreduceHooks(client or session.init())
    obj._allreduce_grads = hooks.around(obj._allreduce_grads)
    helper = getattr(obj, "_agg_helper", None)  # backward_passes_per_step > 1
    if helper is not None and callable(getattr(helper, "_allreduce_grads", None)):
        helper._allreduce_grads = hooks.around(helper._allreduce_grads)
    obj._crossover_hooks = hooks
    return obj


class _AllreduceHooks:
    """Release before and acquire after one allreduce of a gradient list, in the graph."""

    def __init__(self, client: SlotClient) -> None:
        self.client = client
        self.releases = 0  # how many times the release ran (not traced: executed)
        self.traced = 0  # how many graphs (or eager calls) the hook was put into

    def around(self, allreduce_grads):
        @functools.wraps(allreduce_grads)
        def allreduce_with_slot(grads, *args, **kwargs):
            self.traced += 1
            grads = list(grads)
            computed = _flat(grads)
            if not computed:
                return allreduce_grads(grads, *args, **kwargs)
            with tf.control_dependencies(computed):
                released = tf.py_function(self._release, [], tf.int64, name="crossover_release")
            reduced = allreduce_grads(grads, *args, **kwargs)
            with tf.control_dependencies([released, *_flat(reduced)]):
                acquired = tf.py_function(self._acquire, [], tf.int64, name="crossover_acquire")
            with tf.control_dependencies([acquired]):
                return [None if g is None else tf.identity(g) for g in reduced]

        return allreduce_with_slot

    def _release(self) -> int:
        self.releases += 1
        self.client.release(Phase.COMMUNICATE)
        return 0

    def _acquire(self) -> int:
        self.client.acquire()
        return 0


def _flat(tensors: list) -> list[tf.Tensor]:
    """The plain tensors of a gradient list (IndexedSlices opened, None dropped)."""
    return [t for t in tf.nest.flatten([g for g in tensors if g is not None],
                                       expand_composites=True) if isinstance(t, tf.Tensor)]


class CrossoverCallback(tf.keras.callbacks.Callback):
    """Holds the device slot for `fit()`, `evaluate()` and `predict()` batches and gives
    it up while the gradients are averaged (see the module docstring).

    Put it in `callbacks=[...]` after callbacks that do work at batch end, with the
    model compiled with `hvd.DistributedOptimizer` (horovod.tensorflow.keras) and
    TF_USE_LEGACY_KERAS=1. The first batch of fit/evaluate/predict traces the step:
    it runs without the slot (tracing can outlast the daemon's lease), the slot is
    taken after its allreduce. Not supported: `jit_compile=True` (XLA cannot compile
    `tf.py_function`).

    Args:
        client: the slot client (default: the process's, see `crossover.session.init`).

    Raises:
        KerasVersionError: tf.keras is Keras 3 (set TF_USE_LEGACY_KERAS=1).
    """

    def __init__(self, client: SlotClient | None = None) -> None:
        check_legacy_keras()
        super().__init__()
        self._supports_tf_logs = True  # we never read the logs: do not force a sync
        self.enabled = session.enabled()
        self.client = (client or session.init()) if self.enabled else None
        self._hooks: _AllreduceHooks | None = None
        self._releases_seen = 0
        self._warned = False

    def set_model(self, model: Any) -> None:  # noqa: D102 - Keras API
        super().set_model(model)
        if self.enabled and getattr(model, "optimizer", None) is not None:
            self._wrap_optimizer(model)

    def _wrap_optimizer(self, model: Any) -> None:
        optimizer = model.optimizer
        if getattr(optimizer, "_crossover_hooks", None) is None:
            if getattr(model, "_jit_compile", False):
                raise ValueError(
                    "crossover.hooks.keras cannot hook a train step compiled with XLA: "
                    "compile the model with jit_compile=False")
            wrap(optimizer, self.client)
            # A train function traced before the hook went in has no hook in its graph.
            fn = getattr(model, "train_function", None)
            if fn is not None and getattr(fn, "experimental_get_tracing_count", lambda: 0)():
                model.train_function = model.make_train_function(force=True)
        self._hooks = optimizer._crossover_hooks

    def on_train_begin(self, logs: dict | None = None) -> None:  # noqa: D102
        if not self.enabled:
            return
        self._wrap_optimizer(self.model)  # compile() may have come after set_model
        self._releases_seen = self._hooks.releases

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled and _traced(self.model.train_function):
            self.client.acquire()
        # else: this batch traces and optimizes the step first (host work that can outlast
        # the lease): its forward and backward run without the slot, which the in-graph
        # acquire takes after the allreduce

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:  # noqa: D102
        if not self.enabled:
            return
        if self._hooks.releases == self._releases_seen and not self._warned:
            self._warned = True
            print("crossover: WARNING: the Keras train step averaged no gradients through "
                  "hvd.DistributedOptimizer (a custom train_step, or a plain optimizer?): the "
                  "slot is held through the whole step; compile the model with "
                  "hvd.DistributedOptimizer", file=sys.stderr, flush=True)
        self._releases_seen = self._hooks.releases
        self.client.yield_slot()

    def on_train_end(self, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled:
            self.client.release(Phase.IDLE)

    # evaluate() and predict() compute too; they have no allreduce to release for
    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled and _traced(self.model.test_function):
            self.client.acquire()

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled and _traced(self.model.predict_function):
            self.client.acquire()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled:
            self.client.yield_slot()

    def on_test_end(self, logs: dict | None = None) -> None:  # noqa: D102
        if self.enabled:
            self.client.release(Phase.IDLE)

    on_predict_batch_end = on_test_batch_end
    on_predict_end = on_test_end


def _traced(fn: Any) -> bool:
    """False while a tf.function has not been traced yet (its next call traces it)."""
    count = getattr(fn, "experimental_get_tracing_count", None)
    return count is None or count() > 0
