"""One way to wait for something that cannot wake us: poll it, sleeping between polls
for a time that doubles from a short first pause up to a cap.

Every polling loop in crossover (the daemons' MPI inbox, the hooks' quiet allreduce
wait, the pipeline's MPI requests, the launcher's wait for a daemon, a client's
reconnection to a restarted daemon) uses it, so none spins a core and none waits
without a bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    """Pauses of `first`, 2*`first`, ... capped at `most` seconds.

    Args:
        first: the first pause in seconds (> 0).
        most: the longest pause (>= first).
        factor: how much each pause grows (>= 1).

    Raises:
        ValueError: a setting out of range, naming it.
    """

    def __init__(self, first: float, most: float, factor: float = 2.0) -> None:
        if not first > 0:
            raise ValueError(f"backoff first pause {first!r}: give a time > 0 seconds")
        if not most >= first:
            raise ValueError(f"backoff cap {most!r} is shorter than the first pause {first!r}")
        if not factor >= 1:
            raise ValueError(f"backoff factor {factor!r}: give a factor >= 1")
        self.first, self.most, self.factor = first, most, factor
        self._pause = first

    def next(self) -> float:
        """The pause to take now; the next one is longer (up to the cap)."""
        pause = self._pause
        self._pause = min(self._pause * self.factor, self.most)
        return pause

    def sleep(self) -> None:
        """Sleep for the next pause."""
        time.sleep(self.next())

    def reset(self) -> None:
        """Start again from the first pause (after progress)."""
        self._pause = self.first


def wait_until(done: Callable[[], bool], timeout_s: float, backoff: Backoff) -> bool:
    """Poll `done` with `backoff` pauses until it returns True or `timeout_s` passes.

    Returns:
        Whether `done` became true (False: the time ran out).
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(backoff.next(), remaining))
    return True
