"""A plain Horovod tf_keras training script, in the style of Horovod's own examples.

It knows nothing of crossover: `TF_USE_LEGACY_KERAS=1 crossoverrun --crossover -np 2 -H
localhost:2 python examples/horovod_keras_synthetic.py` runs it under crossover with no code
change. Synthetic data (nothing is downloaded); fixed seed; prints a weights checksum.
"""

import argparse

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description="Horovod tf_keras synthetic example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(args.seed)

# Each rank draws its own shard of a synthetic data set.
rng = np.random.default_rng(args.seed + hvd.rank())
x = rng.standard_normal((args.steps * args.batch_size, 64)).astype("float32")
y = rng.integers(0, 10, args.steps * args.batch_size)

model = tf.keras.Sequential([
    tf.keras.Input(shape=(64,)),
    tf.keras.layers.Dense(128, activation="relu"),
    tf.keras.layers.Dense(128, activation="relu"),
    tf.keras.layers.Dense(10),
])
# Horovod: scale the learning rate by the number of workers, wrap the optimizer.
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.5))
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

checksum = sum(float(np.asarray(w, dtype=np.float64).sum()) for w in model.get_weights())
if hvd.rank() == 0:
    print(f"weights checksum {checksum!r}", flush=True)
