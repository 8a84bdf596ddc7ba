"""Framework adapters: they turn framework events into slot-client calls, nothing more.

crossover.hooks.torch wraps Horovod's PyTorch DistributedOptimizer.
"""
