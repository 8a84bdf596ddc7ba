"""The daemons' world, one process per node in one MPI world: the leader (daemon 0)
decides the global job order and the mode, every daemon applies them, and status and
shutdown go to all. This module holds the leader's part (`Leader`) and who a daemon is
(`default_comm`, `node_identity`); what a node does with the leader's messages is the
daemon's (`serve`).

Messages between daemons are small tuples on `transport.PeerChannel`:
    ("join", job) / ("leave", job)        to the leader: a job's first / last rank here
    ("order", job, n) / ("forget", job)   from the leader: the job's place, or it is gone
    ("progress", job, steps, local, points)  to the leader: a job's step count (mode)
    ("mode", mode, reason, points)        from the leader: serve devices in `mode`; to
                                          antiphase, turns restart from the jobs' points
    ("waited", job, wait_s)               to the leader: a rank's allreduce waits (phases)
    ("delay", delay_s, lead_s)            from the leader: this node's turns run ahead
    ("status?", token) / ("status!", token, node, snapshot)
    ("shutdown",)                         from the leader: idle for idle_shutdown_s
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from crossover import environment as E
from crossover.scheduler import ModeController, ModeSwitch
from crossover.scheduler.phase import PhaseAligner
from crossover.transport import PeerChannel

log = logging.getLogger("crossover.daemon")


class _SoloComm:
    """A one-process stand-in for an MPI communicator: a daemon run without mpirun
    does not initialise MPI at all."""

    def Get_rank(self) -> int:  # noqa: N802 - mirrors mpi4py
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1


def default_comm() -> Any:
    """COMM_WORLD when launched by mpirun, else a one-process stand-in."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return _SoloComm()


def node_identity(comm: Any) -> tuple[str, list[int]]:
    """This daemon's node name and the CPU cores its devices are made of."""
    cores = sorted(os.sched_getaffinity(0))
    if E.node_setting() or not E.fake_nodes():
        return E.node_name(), cores
    r, fake = comm.Get_rank(), E.fake_nodes()  # fake node r gets every N-th core
    return E.node_name(r), cores[r % len(cores) :: fake] or cores


class Leader:
    """Daemon 0's decisions for every node: the jobs' global order, the mode (policy
    auto), the nodes' phases (`--align-phases`) and the idle shutdown.

    Args:
        peers: the daemons' channel (this daemon is its rank 0).
        modes: the mode decision, or None under a fixed policy.
        aligner: the phase aligner, or None.
        idle_shutdown_s: shut every daemon down after no job anywhere for this long.
        clock: monotonic clock.
    """

    def __init__(self, peers: PeerChannel, modes: ModeController | None,
                 aligner: PhaseAligner | None, idle_shutdown_s: float | None,
                 clock: Callable[[], float]) -> None:
        self.peers, self.modes, self.aligner = peers, modes, aligner
        self.idle_shutdown_s, self.clock = idle_shutdown_s, clock
        self._next_order = 0
        self._members: dict[str, set[int]] = {}  # job -> daemon ranks with its ranks
        self._decided: dict[str, int] = {}  # job -> the order the leader gave it
        self._points: dict[str, int] = {}  # job -> its request points, reported
        self._idle_since: float | None = clock()
        self._shut = False

    def handle(self, source: int, msg: tuple) -> bool:
        """A message for the leader from daemon `source`; False if it is not one."""
        kind = msg[0]
        if kind == "join":
            self._join(source, msg[1])
        elif kind == "leave":
            self._leave(source, msg[1])
        elif kind == "waited":
            self._align(msg[1], source, msg[2])
        elif kind == "progress":
            if self.modes is not None and msg[1] in self._members:
                self._points[msg[1]] = max(msg[4], self._points.get(msg[1], 0))
                self._announce(self.modes.progress(msg[1], msg[2], msg[3]))
        else:
            return False
        return True

    def tick(self) -> None:
        """The mode decision's clock: a probe window or a hold may have ended."""
        if self.modes is not None:
            self._announce(self.modes.tick())

    def next_deadline(self) -> float | None:
        return self.modes.next_deadline() if self.modes is not None else None

    def snapshot(self) -> dict | None:
        """The mode decision, for status."""
        return self.modes.snapshot() if self.modes is not None else None

    def check_idle(self, busy_here: bool) -> None:
        """Shut every daemon down once no job was anywhere for idle_shutdown_s."""
        if self.idle_shutdown_s is None or self._shut:
            return
        now = self.clock()
        if busy_here or self._members:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.idle_shutdown_s:
            log.info("no job for %.0f s: shutting down", self.idle_shutdown_s)
            self._shut = True  # once: the broadcast reaches this daemon too
            self.peers.broadcast(("shutdown",))

    def _join(self, source: int, job: str) -> None:
        """A job's first rank arrived on daemon `source`."""
        if job not in self._members:
            if self.aligner is not None:
                self.aligner.reset()  # a new job mix: new phases
            self._members[job] = set()
            self._decided[job] = self._next_order
            self._next_order += 1
            self.peers.broadcast(("order", job, self._decided[job]))
        else:
            # Not the node's own orders: the leader's own "order" message may still be
            # queued behind this second join (two nodes joined at once).
            self.peers.send(source, ("order", job, self._decided[job]))
        self._members[job].add(source)

    def _leave(self, source: int, job: str) -> None:
        """A job's last rank on daemon `source` left."""
        members = self._members.get(job)
        if members is None:
            return  # forgotten already
        members.discard(source)
        if not members:
            self._members.pop(job, None)
            self._decided.pop(job, None)
            self._points.pop(job, None)
            self.peers.broadcast(("forget", job))
            if self.modes is not None:
                self._announce(self.modes.leave(job))

    def _announce(self, switches: list[ModeSwitch]) -> None:
        """Tell every daemon (this one included) the mode decisions."""
        for switch in switches:
            log.info("mode %s: %s", switch.mode.value, switch.reason)
            self.peers.broadcast(("mode", switch.mode.value, switch.reason,
                                  dict(self._points)))

    def _align(self, job: str, node: int, wait_s: float) -> None:
        """A rank of `job` on daemon `node` reported its allreduce waits; tell a node
        whose turns run ahead to hand over later (`crossover.scheduler.phase`)."""
        members = self._members.get(job, set())
        if self.aligner is None or len(members) < 2:
            return
        correction = self.aligner.report(job, node, wait_s, self._members)
        if correction is not None:
            self.peers.send(correction.node, ("delay", correction.delay_s, correction.lead_s))
