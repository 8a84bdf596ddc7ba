"""What a rank's training steps are made of, for the daemons' mode prediction.

A step is compute on the device, a gap in which the rank waits for its gradients (the
device idles for it: what another job can fill), and, with company in antiphase, waits
for the device. The hooks already mark the edges: a release for communication starts
the gap (whether or not the device is given up: a rank alone keeps it, and its gap is
the same), the next acquire ends it, and the client times its own waits for grants.
The rest of a step is compute.

The first steps are left out: they build buffers, warm caches and wait for the peers,
and one such step would weigh on the figures for many steps after it.

Costs two clock reads a step; the figures travel in the progress reports rank 0
already sends (`crossover.client.SlotClient`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Steps at the start of a run that are not profiled.
SKIP_STEPS = 2


class StepProfiler:
    """Sums a rank's compute and gap per step between two `take`s.

    Args:
        clock: monotonic seconds.
        skip: steps at the start not profiled.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 skip: int = SKIP_STEPS) -> None:
        self.clock, self.skip = clock, skip
        self._seen = 0  # step boundaries so far
        self._step_start: float | None = None
        self._gap_from: float | None = None
        self._gap = self._waits = 0.0  # within the current step
        self._compute_sum = self._gap_sum = 0.0  # over the steps since the last take
        self._steps = 0

    def communicating(self) -> None:
        """The rank released for communication: its gap starts (if not already)."""
        if self._gap_from is None:
            self._gap_from = self.clock()

    def computing(self) -> None:
        """The rank asks for its device again: the gap, if one was open, is over."""
        if self._gap_from is not None:
            self._gap += self.clock() - self._gap_from
            self._gap_from = None

    def waited(self, seconds: float) -> None:
        """The rank waited `seconds` for a grant: neither compute nor gap."""
        self._waits += seconds

    def step(self) -> None:
        """A step boundary."""
        now = self.clock()
        if self._gap_from is not None:  # a step that ends communicating: cut it here
            self._gap += now - self._gap_from
            self._gap_from = now
        self._seen += 1
        if self._step_start is not None and self._seen > self.skip:
            total = now - self._step_start
            self._gap_sum += self._gap
            self._compute_sum += max(total - self._gap - self._waits, 0.0)
            self._steps += 1
        self._step_start, self._gap, self._waits = now, 0.0, 0.0

    def take(self) -> tuple[float, float]:
        """The mean (compute, gap) per step since the last take, and start anew;
        (0, 0) if no step was profiled."""
        n = self._steps
        out = (self._compute_sum / n, self._gap_sum / n) if n else (0.0, 0.0)
        self._compute_sum = self._gap_sum = 0.0
        self._steps = 0
        return out
