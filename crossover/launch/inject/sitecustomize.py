"""Put on a job's PYTHONPATH by crossoverrun --crossover: hooks Horovod at start-up.

Any sitecustomize this one shadows is run after it, so a site's own set-up still happens.
"""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("CROSSOVER_INJECT") == "1":
    from crossover.launch.inject import install

    install()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
