"""A Horovod tf_keras job under crossover: an MLP on synthetic data, seeded, deterministic.

    TF_USE_LEGACY_KERAS=1 mpirun -np 2 python examples/keras_mlp.py --steps 50 --out w.npz

`fit()` with `crossover.hooks.keras.CrossoverCallback` (default), or a custom loop with
`hvd.DistributedGradientTape` wrapped by `crossover.hooks.keras.wrap` (`--tape`). Under a
running `crossover daemon` the job shares its devices with other jobs; with
CROSSOVER_ENABLE=0 (or no daemon) it trains plain, to the same weights. Without
TF_USE_LEGACY_KERAS=1 it stops with an error: Horovod does not average Keras 3 gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd_tf  # noqa: E402 - after the logging setting
import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import crossover.hooks.keras as crossover_keras  # noqa: E402
from crossover import session  # noqa: E402
from crossover.testing import add_start_barrier_flags, start_barrier  # noqa: E402


class Straggle(tf.keras.callbacks.Callback):
    """Rank 1 sleeps at the end of each batch, before it yields its slot: a slow rank.

    The tests use it to order events causally: rank 0's allreduce of batch k cannot
    finish before rank 1 has computed batch k, which it starts only after its sleep at
    the end of batch k-1. A release on rank 0 before that sleep ends must have come
    while the allreduce was still running. The sleep is recorded in the trace.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        start = time.time()
        time.sleep(self.seconds)
        recorder = session.init().trace if session.enabled() else None
        if recorder is not None:
            recorder.span("straggle", start, time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tape", action="store_true",
                        help="a custom loop with DistributedGradientTape instead of fit()")
    parser.add_argument("--straggle-ms", type=float, default=0.0,
                        help="rank 1 sleeps this long at each batch end (fit only)")
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    add_start_barrier_flags(parser)
    args = parser.parse_args()

    hvd.init()
    # Made first: it refuses Keras 3 (set TF_USE_LEGACY_KERAS=1) before any work is done.
    callback = None if args.tape else crossover_keras.CrossoverCallback()
    # One core is one device, and a fixed seed gives the same weights on every run.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    tf.keras.utils.set_random_seed(args.seed)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(args.hidden, activation="relu"),
        tf.keras.layers.Dense(args.hidden, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sgd = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)

    # Each rank sees its own shard of a fixed synthetic data set.
    rng = np.random.default_rng(args.seed * 1000 + hvd.rank())
    x = rng.standard_normal((args.steps * args.batch, 64), dtype=np.float32)
    y = rng.integers(0, 10, args.steps * args.batch).astype(np.int64)

    # (before the first step, which traces: a rank that met the others after it would
    # hold its slot there, and a job whose first step needs that slot would never come)
    start_barrier(args.start_barrier, args.start_jobs, hvd.rank(), hvd.size())
    start = time.perf_counter()
    if args.tape:
        optimizer = sgd

        @tf.function
        def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = crossover_keras.wrap(hvd_tf.DistributedGradientTape(tape))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        for i in range(args.steps):
            xb, yb = x[i * args.batch:(i + 1) * args.batch], y[i * args.batch:(i + 1) * args.batch]
            if session.enabled() and i > 0:
                # step 0 traces the function (host work that can outlast the daemon's
                # lease): it runs without the slot; its hooks take it after the allreduce
                with session.step():
                    train_step(xb, yb)
            else:
                train_step(xb, yb)
    else:
        optimizer = hvd.DistributedOptimizer(sgd)
        model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)
        callbacks = [Straggle(args.straggle_ms / 1e3)] if args.straggle_ms and hvd.rank() == 1 \
            else []
        callbacks.append(callback)
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    elapsed = time.perf_counter() - start

    if hvd.rank() == 0:
        if args.out:
            np.savez(args.out, *model.get_weights())
        loss = float(loss_fn(y[:args.batch], model(x[:args.batch])))
        print(json.dumps({"samples_per_s": args.steps * args.batch * hvd.size() / elapsed,
                          "seconds": elapsed, "loss": loss}), flush=True)


if __name__ == "__main__":
    main()
