"""The daemons' world, one process per node in one MPI world: the leader decides the
global job order and the mode, every daemon applies them, and status and shutdown go
to all. Mixed into `Daemon`, whose connections and scheduler these methods read.

Messages between daemons are small tuples on `transport.PeerChannel`:
    ("join", job) / ("leave", job)        to the leader: a job's first / last rank here
    ("order", job, n) / ("forget", job)   from the leader: the job's place, or it is gone
    ("progress", job, steps, local, points)  to the leader: a job's step count (mode)
    ("mode", mode, reason, points)        from the leader: serve devices in `mode`; to
                                          antiphase, turns restart from the jobs' points
    ("status?", token) / ("status!", token, node, snapshot)
    ("shutdown",)                         from the leader: idle for idle_shutdown_s
"""

from __future__ import annotations

import logging
import os
from typing import Any

from crossover import environment as E
from crossover import protocol as P
from crossover.procstats import daemon_figures
from crossover.protocol import Mode
from crossover.scheduler import ModeSwitch

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


class DaemonWorld:
    """The cross-node half of `Daemon` (see the module docstring)."""

    def _apply_modes(self, switches: list[ModeSwitch]) -> None:
        """Leader: announce the mode decisions to every daemon (itself included)."""
        for switch in switches:
            log.info("mode %s: %s", switch.mode.value, switch.reason)
            self.peers.broadcast(("mode", switch.mode.value, switch.reason,
                                  dict(self._points)))

    def _handle_peers(self) -> None:
        while not self.peers.inbox.empty():
            source, msg = self.peers.inbox.get_nowait()
            kind = msg[0]
            if kind == "join":  # leader: a job's first rank arrived on `source`
                job = msg[1]
                if job not in self._members:
                    if self.aligner is not None:
                        self.aligner.reset()  # a new job mix: new phases
                    self._members[job] = set()
                    self._decided[job] = self._next_order
                    self._next_order += 1
                    self.peers.broadcast(("order", job, self._decided[job]))
                else:
                    # Not self._orders: the leader's own "order" message may still be
                    # queued behind this second join (two nodes joined at once).
                    self.peers.send(source, ("order", job, self._decided[job]))
                self._members[job].add(source)
            elif kind == "leave":  # leader
                members = self._members.get(msg[1], set())
                members.discard(source)
                if not members:
                    self._members.pop(msg[1], None)
                    self._decided.pop(msg[1], None)
                    self._points.pop(msg[1], None)
                    self.peers.broadcast(("forget", msg[1]))
                    if self.modes is not None:
                        self._apply_modes(self.modes.leave(msg[1]))
            elif kind == "waited":  # leader: a rank's allreduce waits (`align_phases`)
                self._align(msg[1], source, msg[2])
            elif kind == "delay":  # this node's turns ran ahead: hand over later, once
                self._delay_handovers(msg[1], msg[2])
            elif kind == "progress":  # leader: a job's step count, for the mode decision
                if self.modes is not None and msg[1] in self._members:
                    self._points[msg[1]] = max(msg[4], self._points.get(msg[1], 0))
                    self._apply_modes(self.modes.progress(msg[1], msg[2], msg[3]))
            elif kind == "mode":
                if self.aligner is not None:
                    self.aligner.reset()  # waits of the old mode say nothing of the new
                self._mode_reason = msg[2]
                self._change(None, lambda msg=msg: self._set_mode(Mode(msg[1]), msg[3]))
            elif kind == "order":
                self._orders[msg[1]] = msg[2]
                for conn in self._pending.pop(msg[1], []):
                    self._admit(conn)
            elif kind == "forget":
                if not any(j == msg[1] for j, _ in self._conns) and msg[1] not in self._pending:
                    self._orders.pop(msg[1], None)
                    self._steps.pop(msg[1], None)
            elif kind == "status?":
                snap = self.sched.snapshot()
                snap["mode_reason"] = self._mode_reason
                # the nodes' phases: hand-overs this node delayed to get back in step
                snap["handovers_delayed"] = self.handovers_delayed
                if self.modes is not None and self.peers.rank == 0:
                    snap["mode_decision"] = self.modes.snapshot()
                snap["devices_cores"] = {self._cpu_device(i)[0]: self._cpu_device(i)[1]
                                         for i in range(self.cpu_devices)}
                snap["daemon"] = {**daemon_figures(self._started),
                                  "connections": len(self._sel.get_map()) - 2}
                pids: dict[str, list[int]] = {}
                for (job, _), conn in self._conns.items():
                    pids.setdefault(job, []).append(conn.hello.pid)
                snap["job_usage"] = self._usage.job_usage(pids)
                # the native fast path: on or off, and the grants it made per device
                snap["fast_path"] = self.fast.fast_grants() if self.fast is not None \
                    else None
                self.peers.send(source, ("status!", msg[1], self.node, snap))
            elif kind == "status!":
                wait = self._status_waits.get(msg[1])
                if wait is not None:
                    wait[1][msg[2]] = msg[3]
            elif kind == "shutdown":
                self.stop()

    def _set_mode(self, mode: Mode, points: dict[str, int]) -> None:
        self._deliver(self.sched.set_mode(mode, points))
        self._tell_company()

    def _align(self, job: str, node: int, wait_s: float) -> None:
        """Leader: a rank of `job` on daemon `node` reported its allreduce waits; tell
        a node whose turns run ahead to hand over later (`crossover.scheduler.phase`)."""
        members = self._members.get(job, set())
        if self.aligner is None or not self.sched.exclusive or len(members) < 2:
            return
        correction = self.aligner.report(job, node, wait_s, self._members)
        if correction is not None:
            self.peers.send(correction.node, ("delay", correction.delay_s, correction.lead_s))

    def _delay_handovers(self, delay_s: float, lead_s: float) -> None:
        """Hand every shared device of this node to its next job `delay_s` later."""
        self._change(None, lambda: self._delay_shared(delay_s, lead_s))

    def _delay_shared(self, delay_s: float, lead_s: float) -> None:
        if not self.sched.exclusive:
            return  # the mode changed since the leader decided
        shared = [device for device in self.sched.devices()
                  if len(self.sched.company(device)) > 1]
        for device in shared:
            self.sched.delay_handover(device, delay_s)
        self.handovers_delayed += 1
        log.info("node %s's turns %.0f ms ahead of another node's: next hand-over of %s "
                 "%.0f ms later", self.node, 1000 * lead_s, ", ".join(shared) or "no device",
                 1000 * delay_s)

    def _start_status(self, conn: Any) -> None:  # a `daemon._Conn`
        self._status_token += 1
        self._status_waits[self._status_token] = (conn, {}, self.clock() + 2.0)
        self.peers.broadcast(("status?", self._status_token))

    def _finish_status_waits(self) -> None:
        now = self.clock()
        for token, (conn, nodes, deadline) in list(self._status_waits.items()):
            if len(nodes) == self.peers.size or now >= deadline:
                del self._status_waits[token]
                if conn.sock.fileno() < 0:
                    continue  # the asker left
                # A report of many nodes may outgrow the socket's buffer: give the asker
                # a second to read it (status is rare and never on the grant path).
                conn.sock.settimeout(1.0)
                self._reply(conn, P.StatusReport(nodes))
                if conn.sock.fileno() >= 0:
                    conn.sock.setblocking(False)

    def _check_idle(self) -> None:
        if self.idle_shutdown_s is None or self.peers.rank != 0:
            return
        busy = bool(self._members) or bool(self._pending) or bool(self._conns)
        now = self.clock()
        if busy:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.idle_shutdown_s and not self._stop:
            log.info("no job for %.0f s: shutting down", self.idle_shutdown_s)
            self._idle_since = now  # once: the broadcast reaches this daemon too
            self.peers.broadcast(("shutdown",))
