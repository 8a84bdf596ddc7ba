"""What a rank tells its daemon about its steps: the step count with the steps' profile
(rank 0's `Progress`), the median of its allreduce waits (`Waited`), and a GPU rank's
device memory (`Memory`).

Both are small one-way messages, rate-limited here: a report costs CPU on the cores the
jobs compute on. The reporter holds no socket. Each call that may be due a report
returns the message to send now, or None, and the client sends it on its connection
(`crossover.client.SlotClient`), so the reporting rules are pure and testable with an
injected clock, and the wire stays the client's alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from crossover import protocol as P
from crossover.client.profile import StepProfiler

#: Shortest time between two progress reports of a rank with company, and alone.
REPORT_S, ALONE_REPORT_S = 0.05, 1.0
#: Shortest time between two reports of a rank's allreduce waits, and the fewest waits
#: one reports the median of (a single step's wait carries its hold's jitter).
WAIT_REPORT_S, WAIT_REPORT_MIN = 0.5, 3
#: Shortest time between two reports of a GPU rank's memory (sent only when it changed).
MEMORY_REPORT_S = 5.0


def cuda_memory(gpu: int) -> tuple[int, int, int] | None:
    """(reserved, peak reserved, capacity) bytes of PyTorch's allocator on CUDA device
    `gpu` in this process, or None where the process has not used CUDA through torch
    (torch is not imported here for it: a job that does not use it pays nothing)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return (torch.cuda.memory_reserved(gpu), torch.cuda.max_memory_reserved(gpu),
                torch.cuda.get_device_properties(gpu).total_memory)
    except Exception:  # noqa: BLE001 - a report is never worth a job's failure
        return None


class StepReporter:
    """A rank's step count, its steps' profile and its allreduce waits, and when each
    is due to its daemon.

    Args:
        rank: the rank's place in its job; only rank 0 reports progress (its ranks step
            together, so one report a step is enough).
        clock: monotonic seconds, for the rate limits and the profile.
    """

    def __init__(self, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.clock = rank, clock
        self.steps = 0  # training steps so far (step boundaries), reported for the mode
        self.report_waits = False  # until a daemon that aligns phases says so (Welcome)
        self._profiler = StepProfiler(clock)  # what the steps are made of
        self._last_progress = 0.0
        self._waits: list[float] = []  # allreduce waits since the last report of them
        self._last_waited = 0.0
        self._last_memory_at = -MEMORY_REPORT_S
        self._last_memory: tuple[int, int, int] | None = None

    # --- the edges of a step, for its profile -----------------------------------------
    def computing(self) -> None:
        """The rank asks for its device: a gap for communication, if open, is over."""
        self._profiler.computing()

    def communicating(self) -> None:
        """The rank released (or would have) for communication: its gap starts."""
        self._profiler.communicating()

    def waited_for_grant(self, seconds: float) -> None:
        """The rank waited `seconds` for a grant: neither compute nor gap."""
        self._profiler.waited(seconds)

    # --- reports ----------------------------------------------------------------------
    def step(self, points: int, alone: bool, coordinated: bool) -> P.Progress | None:
        """A step boundary: count it. Returns rank 0's progress report (with the job's
        request `points` and the steps' profile since the last one) when one is due: at
        most every REPORT_S with company, ALONE_REPORT_S `alone` (a neighbour's arrival
        is decided on it), and only while `coordinated`; the profile keeps summing until
        a report takes it."""
        self.steps += 1
        if self.rank != 0:
            return None
        self._profiler.step()
        now = self.clock()
        every = ALONE_REPORT_S if alone else REPORT_S
        if not coordinated or now - self._last_progress < every:
            return None
        self._last_progress = now
        compute_s, gap_s = self._profiler.take()
        return P.Progress(self.steps, points, compute_s, gap_s)

    def wait(self, seconds: float, about_turns: bool) -> P.Waited | None:
        """This step's allreduces finished `seconds` after the rank released its device
        for them. `about_turns`: the rank is coordinated, has company and gives its
        device up in antiphase, so the wait measures how far the nodes' turn sequences
        are apart (`crossover.scheduler.phase`). Returns the median of the waits since
        the last report when one is due (WAIT_REPORT_MIN waits, WAIT_REPORT_S apart),
        and only to a daemon that aligns phases; a wait measured otherwise says nothing
        about the turns and drops the ones kept."""
        if not about_turns or not self.report_waits:
            self._waits.clear()
            return None
        self._waits.append(seconds)
        now = self.clock()
        if len(self._waits) < WAIT_REPORT_MIN or now - self._last_waited < WAIT_REPORT_S:
            return None
        self._last_waited = now
        waited = P.Waited(statistics.median(self._waits))
        self._waits.clear()
        return waited

    def memory(self, read: Callable[[], tuple[int, int, int] | None]) -> P.Memory | None:
        """A GPU rank's device memory (`read`: e.g. `cuda_memory`), when a report is due:
        at most every MEMORY_REPORT_S, and only when it changed since the last one."""
        now = self.clock()
        if now - self._last_memory_at < MEMORY_REPORT_S:
            return None
        self._last_memory_at = now
        figures = read()
        if figures is None or figures == self._last_memory:
            return None
        self._last_memory = figures
        return P.Memory(*figures)

    def forget_memory(self) -> None:
        """A new daemon knows nothing yet: the next report goes whatever it says."""
        self._last_memory, self._last_memory_at = None, -MEMORY_REPORT_S
