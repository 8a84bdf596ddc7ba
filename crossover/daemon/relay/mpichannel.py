"""The relays' channel: messages between the nodes' relays over MPI (`relay`), as bytes.

Nothing here is pickled: a message is the bytes a service signed (`wire`), sent and
received as a buffer of MPI bytes, of any length up to `wire.MAX_BYTES` (mpi4py's
pickled receive took at most 32 KiB, and a longer message failed as if its peer were
dead). A longer one is counted (`oversize`) and dropped here (`DRAIN_BYTES`): it never
reaches the service. The one
collective, the relays' exchange of their node names when a generation forms, is of
JSON bytes too (`allgather_json`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from crossover.backoff import Backoff
from crossover.daemon.world.wire import MAX_BYTES

#: A message past MAX_BYTES is still received whole (a receive into a shorter buffer
#: crashed Open MPI 4.1's matched receive) and dropped, up to this size; a longer one is
#: left unread.
DRAIN_BYTES = 256 * 2**20


class MpiChannel:
    """The relays' messages over MPI, received on a polling thread.

    MPI's blocking receive spins a core; on a machine where a core is an accelerator's
    worth of compute that would be theft. A thread tests a nonblocking receive with
    backoff (1 ms to 50 ms) instead: cross-node traffic is membership, step counts and
    mode switches, never the grant hot path, so tens of milliseconds of latency cost
    nothing. Idle, the polls cost the cores the jobs compute on: each thread took 0.7 %
    of a core at a 20 ms cap, 0.25 % at 50 ms.

    A peer may die, stop or be cut off at any time (`crossover.daemon.world.membership` finds
    out which): sends are nonblocking, and MPI errors are returned, not fatal, so they
    cost that message only.

    Args:
        comm: the relays' communicator (one process per node).
        wakeup: called after a message is queued in `inbox`.
    """

    TAG = 7
    #: past this many sends in flight (a peer that reads nothing), new ones are refused:
    #: one in flight must keep its buffer until MPI is done with it
    MAX_IN_FLIGHT = 4096

    def __init__(self, comm: Any, wakeup: Callable[[], None]) -> None:
        self.comm, self.rank = comm, comm.Get_rank()
        self.inbox: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self.send_errors = self.recv_errors = 0
        self.oversize = 0  # messages past wire.MAX_BYTES, received and dropped
        self._wakeup = wakeup
        self._in_flight: list[tuple[Any, bytes]] = []
        self._sending = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="crossover-mpi", daemon=True)
        self._thread.start()

    def send(self, dest: int, data: bytes) -> None:
        """Send `data` to relay `dest`; never blocks or raises."""
        from mpi4py import MPI

        with self._sending:
            if len(self._in_flight) >= 64:
                self._reap()
            if len(self._in_flight) >= self.MAX_IN_FLIGHT:
                self.send_errors += 1
                return
            try:
                # the buffer is kept beside its request: MPI reads it until the send ends
                self._in_flight.append((self.comm.Isend([data, MPI.BYTE], dest=dest,
                                                        tag=self.TAG), data))
            except MPI.Exception:
                self.send_errors += 1

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
        """Forget the sends that completed (and their buffers)."""
        from mpi4py import MPI

        kept = []
        for req, data in self._in_flight:
            try:
                done = req.Test()
            except MPI.Exception:
                self.send_errors += 1
                done = True
            if not done:
                kept.append((req, data))
        self._in_flight = kept

    def _poll(self) -> None:
        """Match a message (nonblocking), then receive it (nonblocking too: a sender
        stopped in the middle of a long message must not wedge this thread, and with
        it every other node's messages to this one)."""
        from mpi4py import MPI

        backoff = Backoff(0.001, 0.05)
        status = MPI.Status()
        receiving: tuple[Any, bytearray, int] | None = None  # request, buffer, source
        while not self._stop.is_set():
            try:
                if receiving is None:
                    matched = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=self.TAG,
                                                status=status)
                    if matched is None:
                        self._stop.wait(backoff.next())
                        continue
                    source, size = status.Get_source(), status.Get_count(MPI.BYTE)
                    if not 0 <= size <= MAX_BYTES:
                        self.oversize += 1
                        if not 0 <= size <= DRAIN_BYTES:
                            continue  # left matched and unread: too big to take at all
                    buf = bytearray(size)
                    receiving = (matched.Irecv([buf, MPI.BYTE]), buf, source)
                req, buf, source = receiving
                if not req.Test():
                    self._stop.wait(backoff.next())
                    continue
            except Exception:  # noqa: BLE001 - a peer died mid-message, or a truncation
                self.recv_errors += 1
                receiving = None
                self._stop.wait(backoff.next())
                continue
            receiving = None
            if len(buf) > MAX_BYTES:
                continue  # received whole, so that nothing is left half read, and dropped
            self.inbox.put((source, bytes(buf)))
            self._wakeup()
            backoff.reset()


def allgather_json(comm: Any, obj: Any) -> list[Any]:
    """Every member's `obj` (JSON), in rank order: MPI's Allgather of the lengths, then
    Allgatherv of the bytes, so that nothing is pickled."""
    from mpi4py import MPI

    data = json.dumps(obj).encode()
    sizes = array("i", [0]) * comm.Get_size()
    comm.Allgather([array("i", [len(data)]), MPI.INT], [sizes, MPI.INT])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    out = bytearray(sum(sizes))
    comm.Allgatherv([data, MPI.BYTE], [out, (list(sizes), offsets), MPI.BYTE])
    return [json.loads(out[o:o + n]) for o, n in zip(offsets, sizes, strict=True)]
