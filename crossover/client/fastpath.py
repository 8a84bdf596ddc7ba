"""A rank's side of the node's slot table (`crossover.slot_table`): request and release
through its device's ring, wait on its slot's grant word. Imports neither the scheduler
nor the daemon: a training process loads only this and the protocol.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from crossover import protocol as P
from crossover.protocol import Phase
from crossover.slot_table import PHASES, PLANNED_PHASE, UNAVAILABLE, _native
from crossover.transport import frame

#: Longest wait for a device's mutex: only a rank stopped inside its few instructions
#: holds it longer; the caller then goes on as if the daemon were slow.
LOCK_S = 0.5
RING_FRAME = frame(P.Ring())


class RankPath:
    """A rank's side: its slot in the node's table.

    Args:
        path: the table the daemon named in its welcome.
        device, slot: the rank's device index and slot in it.
        sock: the connection to the daemon, for the doorbell.

    Raises:
        RuntimeError: the table cannot be mapped (the message says why).
    """

    def __init__(self, path: str, device: int, slot: int, sock: socket.socket) -> None:
        if _native is None:
            raise RuntimeError(UNAVAILABLE)
        self.table = _native.Table.attach(path)
        self.device, self.slot, self.sock = device, slot, sock

    def acquire(self, wait_s: float, alive: Callable[[], bool]) -> bool | None:
        """Request the device and wait for the grant.

        Args:
            wait_s: the longest wait.
            alive: polled while waiting (at most every 50 ms); False ends the wait.

        Returns:
            True once granted; False if the wait ended without a grant; None if the
            table refused the request (its mutex or ring is stuck): ask over the socket.
        """
        flags, gen = self.table.request(self.device, self.slot, time.monotonic(), LOCK_S)
        if flags < 0:
            return None
        self._ring(flags)
        if flags & _native.GRANTED:
            return True
        waited = 0.0
        while waited < wait_s:
            step = min(0.05, wait_s - waited)
            if self.table.wait_grant(self.slot, gen, step):
                return True
            waited += step
            if not alive():
                return False
        return False

    def release(self, phase: Phase) -> bool:
        """Give the device up in `phase`; False if the table refused (use the socket)."""
        flags = self.table.release(self.device, self.slot, PHASES.index(phase),
                                   phase == PLANNED_PHASE, time.monotonic(), LOCK_S)
        if flags < 0:
            return False
        self._ring(flags)
        return True

    def _ring(self, flags: int) -> None:
        if flags & _native.RING_DAEMON:
            self.sock.sendall(RING_FRAME)
