"""The relays' channel: small messages between the nodes' relays over MPI (`relay`)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from crossover.backoff import Backoff


class MpiChannel:
    """The relays' messages over MPI, received on a polling thread.

    MPI's blocking receive spins a core; on a machine where a core is an accelerator's
    worth of compute that would be theft. A thread tests a nonblocking receive with
    backoff (1 ms to 50 ms) instead: cross-node traffic is membership, step counts and
    mode switches, never the grant hot path, so tens of milliseconds of latency cost
    nothing. Idle, the polls cost the cores the jobs compute on: each thread took 0.7 %
    of a core at a 20 ms cap, 0.25 % at 50 ms.

    A peer may die, stop or be cut off at any time (`crossover.daemon.membership` finds
    out which): sends are nonblocking, and MPI errors are returned, not fatal, so they
    cost that message only.

    Args:
        comm: the relays' communicator (one process per node).
        wakeup: called after a message is queued in `inbox`.
    """

    TAG = 7
    #: sends still in flight beyond this many are dropped (a peer that reads nothing)
    MAX_IN_FLIGHT = 4096

    def __init__(self, comm: Any, wakeup: Callable[[], None]) -> None:
        self.comm, self.rank = comm, comm.Get_rank()
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.send_errors = 0
        self._wakeup = wakeup
        self._in_flight: list[Any] = []
        self._sending = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="crossover-mpi", daemon=True)
        self._thread.start()

    def send(self, dest: int, obj: Any) -> None:
        """Send a small picklable object to relay `dest`; never blocks or raises."""
        from mpi4py import MPI

        with self._sending:
            try:
                self._in_flight.append(self.comm.isend(obj, dest=dest, tag=self.TAG))
            except MPI.Exception:
                self.send_errors += 1
                return
            if len(self._in_flight) >= 64:
                self._reap()

    def flush(self, timeout_s: float) -> int:
        """Complete the sends in flight, for at most `timeout_s`; how many did not. Before
        MPI_Finalize: a send still in flight there may never leave (a node of a stopping
        world never told to stop keeps every relay's finalize waiting)."""
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(0.001, 0.05)
        while True:
            with self._sending:
                self._reap()
                left = len(self._in_flight)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(backoff.next())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _reap(self) -> None:
        """Forget the sends that completed; past MAX_IN_FLIGHT, the oldest too."""
        from mpi4py import MPI

        kept = []
        for req in self._in_flight:
            try:
                done = req.Test()
            except MPI.Exception:
                self.send_errors += 1
                done = True
            if not done:
                kept.append(req)
        self._in_flight = kept[-self.MAX_IN_FLIGHT:]

    def _poll(self) -> None:
        from mpi4py import MPI

        req = None
        backoff = Backoff(0.001, 0.05)
        status = MPI.Status()
        while not self._stop.is_set():
            if req is None:
                req = self.comm.irecv(source=MPI.ANY_SOURCE, tag=self.TAG)
            try:
                done, obj = req.test(status=status)
            except MPI.Exception:  # a message from a peer that died while sending
                done, obj, req = False, None, None
            if done:
                req = None
                self.inbox.put((status.Get_source(), obj))
                self._wakeup()
                backoff.reset()
            else:
                self._stop.wait(backoff.next())
        if req is not None:
            req.Cancel()
