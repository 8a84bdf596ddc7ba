"""Framework adapters: they turn framework events into slot-client calls, nothing more.

- crossover.hooks.torch: wraps Horovod's PyTorch DistributedOptimizer.
- crossover.hooks.keras: tf_keras fit() callback and DistributedOptimizer /
  DistributedGradientTape wrapper (release inside the compiled step).
- crossover.hooks.torch_callback: a callback for plain PyTorch loops.
- crossover.hooks.lightning: a PyTorch Lightning callback.

The three PyTorch adapters share one slot lifecycle, crossover.hooks._lifecycle.
"""
