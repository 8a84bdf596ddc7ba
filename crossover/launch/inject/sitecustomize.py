"""Put on a job's PYTHONPATH by crossoverrun --crossover: hooks Horovod at start-up.

Any sitecustomize this one shadows is run after it, so a site's own set-up still happens.
"""

import importlib.machinery
import importlib.util
import os
import sys

# Every Python process started with this PYTHONPATH runs this file (mpirun's helpers
# included): without CROSSOVER_INJECT it does not import crossover (about 0.2 s).
if os.environ.get("CROSSOVER_INJECT"):
    from crossover import environment

    if environment.inject():  # a bad value is said once, and means no hooks
        from crossover.launch.inject import install

        install()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
