"""What a node's service tells of itself: its part of a status report, and its figures
for a metrics scrape.

A status request gathers every live node's part through the world (`status?` to all,
each answers `status!`); `NodeStatus` keeps the requests waiting for their parts and
answers each once every node answered or two seconds passed. Another user's asker is
never waited for: the serve loop must not block on a client that does not read.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

import psutil

from crossover import protocol as P
from crossover.daemon.node.conns import Connections, RankConn
from crossover.daemon.node.metrics import NodeFigures
from crossover.daemon.node.ranks import Node, Ranks
from crossover.daemon.node.table import TableSync
from crossover.daemon.node.users import Users, user_name
from crossover.daemon.relay.uplink import Uplink
from crossover.daemon.world.member import Member
from crossover.procstats import RankUsage, daemon_figures
from crossover.scheduler import SlotScheduler

#: the node's memory, which its CPU devices share (for metrics)
HOST_MEMORY = psutil.virtual_memory().total
#: How long a status request waits for the other nodes' parts.
STATUS_WAIT_S = 2.0


class NodeStatus:
    """This node's status parts and metrics figures, and the status requests waiting.

    Args:
        handovers_delayed: how many hand-overs this node delayed to get back in step
            with the other nodes' phases (the daemon counts them).
    """

    def __init__(self, node: Node, sched: SlotScheduler, ranks: Ranks, table: TableSync,
                 member: Member, conns: Connections, peers: Uplink, users: Users,
                 clock: Callable[[], float], handovers_delayed: Callable[[], int]) -> None:
        self.node, self.sched, self.ranks, self.table = node, sched, ranks, table
        self.member, self.conns, self.peers, self.users = member, conns, peers, users
        self.clock = clock
        self._handovers_delayed = handovers_delayed
        self._waits: dict[int, tuple[RankConn, dict, float]] = {}
        self._token = 0
        self._started = time.monotonic()
        self._usage = RankUsage()
        self._user = user_name(users.service_uid)

    def snapshot(self) -> dict:
        """This node's part of a status report."""
        leader = self.member.leader
        snap = self.sched.snapshot()
        snap["mode_reason"] = self.ranks.mode_reason
        # the nodes' phases: hand-overs this node delayed to get back in step
        snap["handovers_delayed"] = self._handovers_delayed()
        decision = leader.snapshot() if leader is not None else None
        if decision is not None:
            snap["mode_decision"] = decision
        # the world as this daemon sees it: who leads, and the nodes lost
        snap["world"] = self.member.snapshot()
        snap["devices_cores"] = dict(self.node.cpu_device(i)
                                     for i in range(self.node.cpu_devices))
        snap["daemon"] = {**daemon_figures(self._started),
                          "connections": self.conns.count()}
        snap["job_usage"] = self._usage.job_usage(self.ranks.pids())
        # the native fast path: on or off, and the grants it made per device
        snap["fast_path"] = self.table.fast_grants()
        snap["table"] = self.table.pending()
        snap["memory"] = self.ranks.memory_report()
        return snap

    def figures(self) -> NodeFigures:
        """What a metrics scrape shows of this node (copied: it renders elsewhere)."""
        leader = self.member.leader
        groups = leader.snapshot(wait_s=0.0) if leader is not None else None
        device_memory, capacity = self.ranks.device_memory()
        return NodeFigures(
            node=self.node.name, user=self._user, leads=leader is not None,
            world=self.member.snapshot(), mode=self.sched.mode.value,
            accounts=self.sched.accounts(), pids=self.ranks.pids_by_place(), groups=groups,
            device_memory=device_memory, capacity=capacity, host_memory=HOST_MEMORY,
            decisions=leader.last_decisions if leader is not None else None,
            batch_jobs=self.ranks.batch_jobs())

    def askers(self) -> set[int]:
        """The connections waiting for a report (ids): not silent, only patient."""
        return {id(conn) for conn, _, _ in self._waits.values()}

    def request(self, conn: RankConn) -> None:
        """`conn` asks for the world's status: ask every live node for its part."""
        if any(waiting is conn for waiting, _, _ in self._waits.values()):
            raise P.ProtocolError("a status request before the answer to the last one")
        self._token += 1
        self._waits[self._token] = (conn, {}, self.clock() + STATUS_WAIT_S)
        self.peers.broadcast(("status?", self._token))  # the lost are skipped

    def part(self, token: int, node: str, snap: dict) -> None:
        """A node's part of the request `token` arrived."""
        wait = self._waits.get(token)
        if wait is not None:
            wait[1][node] = snap

    def answer_ready(self) -> None:
        """Answer each request that has every live node's part, or waited long enough."""
        now = self.clock()
        for token, (conn, nodes, deadline) in list(self._waits.items()):
            if len(nodes) >= len(self.member.world.alive) or now >= deadline:
                del self._waits[token]
                if conn.open:  # else the asker left
                    self._reply(conn, P.StatusReport(nodes))

    def _reply(self, conn: RankConn, report: P.StatusReport) -> None:
        if self.users.manages(conn.uid):
            # A report of many nodes may outgrow the socket's buffer: give the service's
            # own user a second to read it (status is rare and never on the grant path).
            conn.sock.settimeout(1.0)
            self.conns.reply(conn, report)
            if conn.open:
                conn.sock.setblocking(False)
        else:
            # another user's asker: the loop never waits for it to read; a report that
            # does not fit its socket's buffer closes it
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                     min(len(P.encode(report)) + 64, 1 << 24))
            self.conns.reply(conn, report)
