"""Crossover: several distributed training jobs share accelerators, computing in each
other's communication gaps. See README.md.

The functions below load the job side on first use, so that `import crossover` (say by
the daemon or the pipeline's partitioner) loads neither the client nor the daemon.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["communicate", "enabled", "init", "shutdown", "step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from crossover import session

        return getattr(session, name)
    raise AttributeError(f"module 'crossover' has no attribute {name!r}")
