"""Where a rank's process runs: pinned to its device's cores in antiphase (as a GPU
rank is bound to its GPU), to its job's share of the host while the daemon splits the
cores, or where its launcher put it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from crossover.placement import pin_process
from crossover.protocol import Mode
from crossover.trace import TraceRecorder


class Pinning:
    """A rank's CPU affinity, set from what its daemon says.

    Args:
        pin_cpu: pin to the device's cores in antiphase (CPU devices only).
        warn: says a problem once (`DaemonLink._warn`).
        trace: a recorder for the cores a process was given, or None.
    """

    def __init__(self, pin_cpu: bool, warn: Callable[[str], None],
                 trace: TraceRecorder | None) -> None:
        self.pin_cpu, self._warn, self.trace = pin_cpu, warn, trace
        self.pin = False  # set once the daemon has named the device's cores
        self.cores: list[int] = []  # the device's
        self.unpinned = os.sched_getaffinity(0)  # where the launcher put us
        self.share: list[int] = []  # the job's cores on the host (Company), if any
        self.placed: list[int] = []  # the share the process is pinned to now

    def welcomed(self, cores: list[int]) -> None:
        """A (re)registration named the device's cores; no share until told one."""
        self.cores, self.share = cores, []
        self.pin = self.pin_cpu and bool(cores)

    def place(self, coordinated: bool, mode: Mode, label: str | None) -> None:
        """Pin to the device's cores in antiphase, as a GPU rank is bound to its GPU.
        Concurrent grants are plain co-location, placement included: pinned there, a
        rank waiting on its allreduce and a rank computing share one core, and the
        kernel cannot move either to the other core when it idles. An uncoordinated
        rank is co-located too: pinned and uncoordinated, two jobs once ran 100x slower
        after their daemon died.

        A share of the host's cores for the whole job (`crossover.placement`: CPU jobs
        on one host, served concurrently) pins every thread of the process, and holds
        only while the daemon is there to change it when the jobs change."""
        share = self.share if coordinated else []
        if share != self.placed:
            self._pin_process(share or sorted(self.unpinned), share, label)
            self.placed = list(share)
        if not self.pin or share:
            return
        pinned = mode == Mode.ANTIPHASE and coordinated
        try:
            os.sched_setaffinity(0, self.cores if pinned else self.unpinned)
        except OSError as exc:  # the launcher's cpuset changed under us: train on
            self._warn(f"cannot set CPU affinity ({exc})")

    def _pin_process(self, cores: list[int], share: list[int], label: str | None) -> None:
        """Every thread of the process onto `cores` (`share`: the job's, for the trace)."""
        try:
            pin_process(cores)
        except OSError as exc:  # no /proc, or the launcher's cpuset changed: train on
            self._warn(f"cannot set CPU affinity ({exc})")
            return
        if self.trace is not None:
            self.trace.instant("cores " + (",".join(map(str, share)) or "all"), time.time(),
                               device=label, share=share,
                               applied=sorted(os.sched_getaffinity(0)))
