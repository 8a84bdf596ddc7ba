"""The leader's decisions on a thread of their own.

On the leader's node the service serves its ranks and leads the world. The two must not
wait on each other: a join that makes the leader re-plan a group, or a mode decision's
tick, must not sit in front of a grant in the serve loop, and a burst of grants must not
hold the world's joins back. `LeaderThread` runs one `world.Leader` on its own thread:
the serve loop posts the leader's messages and the membership's calls (`renumber`,
`member_lost`) to its queue and goes on; the thread handles them in
the order posted, ticks the mode decisions at their deadlines and watches for the idle
shutdown. The leader's sends go through the `Uplink`, which any thread may use (a
message to this node is queued in the serve loop's inbox and wakes it).

Failure rule: an exception in the leader's code is kept in `error` and the thread ends;
the serve loop raises it (`raise_error`), so the service exits as it did when the
leader ran inline, and its relay starts it again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from crossover.daemon.world.leader import Durations, Leader

log = logging.getLogger("crossover.daemon")

#: the longest the thread sleeps without looking at the idle shutdown
IDLE_POLL_S = 0.5
#: how long a status waits for the leader's mode decisions before it shows the last ones
SNAPSHOT_WAIT_S = 0.1
#: how long `close` waits for the thread to finish what it is handling
CLOSE_WAIT_S = 2.0

_STOP = object()


class LeaderThread:
    """One `Leader`, run on a thread; see the module doc.

    Args:
        leader: the decisions to run.
        clock: the leader's clock (for its deadlines).
        wakeup: wakes the serve loop (an error is waiting for it).
    """

    def __init__(self, leader: Leader, clock: Callable[[], float],
                 wakeup: Callable[[], None]) -> None:
        self.leader, self.clock, self._wakeup = leader, clock, wakeup
        #: set by the serve loop: whether any rank on this node holds or waits
        self.busy_here = False
        self.error: BaseException | None = None
        self.handled = 0  # messages and calls handled, for tests
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()  # the leader's state, against `snapshot`
        self._last_snapshot: dict | None = None
        #: how long the mode decisions took, as of the last snapshot (for metrics)
        self.last_decisions = Durations()
        self._thread = threading.Thread(target=self._run, name="crossover-leader",
                                        daemon=True)
        self._thread.start()

    # --- what the serve loop and the membership post ------------------------------------
    @property
    def aligner(self):
        return self.leader.aligner

    def post(self, source: int, msg: tuple) -> None:
        """A message for the leader from daemon `source`, handled on the thread."""
        self._queue.put((source, msg))

    def renumber(self, ranks_now: dict[int, int]) -> None:
        self._call(self.leader.renumber, ranks_now)

    def member_lost(self, rank: int) -> None:
        self._call(self.leader.member_lost, rank)

    def reset_aligner(self) -> None:
        """The mode changed: waits of the old mode say nothing of the new."""
        if self.leader.aligner is not None:
            self._call(self.leader.aligner.reset)

    def snapshot(self, wait_s: float = SNAPSHOT_WAIT_S) -> dict | None:
        """The mode decisions, for status; the last one taken if the leader is busy
        longer than `wait_s` (status must not wait on the leader either)."""
        if self._lock.acquire(timeout=wait_s):
            try:
                self._last_snapshot = self.leader.snapshot()
                self.last_decisions = self.leader.decisions.copy()
            finally:
                self._lock.release()
        return self._last_snapshot

    def raise_error(self) -> None:
        """Raise what failed on the thread, in the caller's (the serve loop's)."""
        if self.error is not None:
            raise RuntimeError("the leader's thread failed") from self.error

    def close(self) -> None:
        """Stop the thread (this daemon no longer leads, or stops)."""
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_WAIT_S)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        # queued, not run at once: a call comes after the messages posted before it
        # (a renumbering must not re-name the senders of messages still queued)
        self._queue.put((fn, args))

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                item = self._next()
                with self._lock:
                    if item is _STOP:
                        return
                    if item is not None:
                        self._apply(item)
                        self.handled += 1
                    self.leader.tick()
                    self.leader.check_idle(self.busy_here)
        except Exception as e:  # noqa: BLE001 - handed to the serve loop, which raises
            log.exception("the leader's thread failed")
            self.error = e
            self._wakeup()

    def _next(self) -> Any:
        timeout = IDLE_POLL_S
        deadline = self.leader.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - self.clock()))
        with contextlib.suppress(queue.Empty):
            return self._queue.get(timeout=timeout)
        return None

    def _apply(self, item: tuple) -> None:
        first, rest = item
        if callable(first):
            first(*rest)
        else:
            self.leader.handle(first, rest)
