"""The coordinator daemon: one process per node, jobs' ranks connect over a Unix socket.

The daemon processes of all nodes form one world (`member`). Every rank of a job carries
the job's place in the global order (its start and name), so every daemon grants its own
devices in the same order of jobs, and a job's ranks are in the same phase on every node,
without any cross-node message on the grant path or for a job to start; the leader
decides the modes.

Reliability: a rank whose connection closes (crash, kill, exit) loses its slot at once;
a rank that holds past its lease loses it then. Clients treat a vanished daemon as
"run uncoordinated" (see `client`).

The parts, composed here, each with its own module: `Connections` (sockets and frames),
`Ranks` (what ranks say, and their company), `TableSync` (the slot table and the
scheduler in one order), `Leader` (the leader's decisions, on a thread of their own:
`leader_thread`), `NodeStatus` (status reports and metrics figures). `Daemon` owns the
serve loop, the scheduler's clock-driven changes (leases, re-alignment), and what a node
does with the other daemons' messages.
"""

from __future__ import annotations

import logging
import os
import resource
import selectors
import signal
import time
from collections.abc import Callable

from crossover import protocol as P
from crossover.daemon.logfile import LOG_FILE
from crossover.daemon.node.conns import Connections, RankConn
from crossover.daemon.node.metrics import MetricsEndpoint, MetricsError
from crossover.daemon.node.notify import notify
from crossover.daemon.node.ranks import Node, Ranks, node_identity
from crossover.daemon.node.sockets import NodeSockets
from crossover.daemon.node.status import NodeStatus
from crossover.daemon.node.table import TableSync
from crossover.daemon.node.users import MAX_JOB, MAX_OWNER, Users
from crossover.daemon.relay.launch import relay_path
from crossover.daemon.relay.uplink import Uplink
from crossover.daemon.world.generation import is_fake
from crossover.daemon.world.leader import Leader
from crossover.daemon.world.leader_thread import LeaderThread
from crossover.daemon.world.member import TO_LEADER, Member
from crossover.daemon.world.wire import world_key
from crossover.procstats import process_state
from crossover.protocol import Mode
from crossover.scheduler import ModeController, SlotScheduler, make_policy
from crossover.scheduler.phase import PhaseAligner
from crossover.transport import socket_path

log = logging.getLogger("crossover.daemon")


class Daemon:
    """One node's coordinator.

    Args:
        policy: scheduling policy name (see `crossover.scheduler.POLICIES`).
        lease_s: how long a grant lasts without renewal.
        patience_s: how long a free device waits for the job whose turn it is.
        idle_shutdown_s: exit after no job has been connected anywhere for this long
            (None: never).
        runtime_dir: directory of the sockets (default: see `transport.runtime_dir`).
        relayed: this is a node's service in a world of several (`relay`): it serves its
            node and reaches the others through the relay that started it; False: a
            daemon of one node, its own world.
        cpu_devices: how many devices this node's CPU cores form (default: one per core).
        mode_probe_s: policy auto: the shortest window measuring a mode.
        mode_hold_s: policy auto: how long a mode decision holds before a re-probe.
        mode_probe_local: policy auto: probe jobs whose ranks all share one host's CPU
            too (by default they are served concurrently without a probe).
        core_shares: policy auto: CPU jobs served concurrently on this host each get
            their own share of its cores (False: where their launchers put them).
        hello_timeout_s: a connection that neither says hello nor asks for status within
            this long is dropped (a stalled or hostile client holds no descriptor long).
        beat_s: how often the daemons of a world tell each other they live.
        dead_after_s: a daemon silent this long is lost to the others (a leader's
            successor takes over; see `membership`).
        argv: this daemon's arguments after `python -m crossover`: the leader starts the
            services of new or lost nodes with them (`generation`).
        metrics: (address, port) of the Prometheus endpoint (None: none).
        users: who may use this daemon (default: its own user; `Users(shared=True)`:
            a node service for every user, or a group's).
        hosts: the hosts of a cluster's world of node services (`--hosts`): this one
            serves alone at once and forms or joins their world (None: see `relayed`).
        clock: monotonic clock, injectable for tests.

    Raises:
        ValueError: a setting out of range, naming it.
    """

    def __init__(
        self,
        policy: str = "auto",
        lease_s: float = 30.0,
        patience_s: float = 1.0,
        idle_shutdown_s: float | None = None,
        runtime_dir: str | os.PathLike | None = None,
        relayed: bool = False,
        cpu_devices: int | None = None,
        mode_probe_s: float = 2.0,
        mode_hold_s: float = 30.0,
        mode_probe_local: bool = False,
        align_phases: bool = False,
        core_shares: bool = True,
        hello_timeout_s: float = 10.0,
        beat_s: float = 1.0,
        dead_after_s: float = 5.0,
        argv: list[str] | None = None,
        metrics: tuple[str, int] | None = None,
        users: Users | None = None,
        hosts: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        relayed = relayed or bool(hosts)
        self.users = users = users or Users()
        name, cores = node_identity()
        self.node = Node(name, cores, max(1, min(cpu_devices or len(cores), len(cores))))
        self.clock = clock
        # On a service for several users a rank that renews without releasing cannot
        # keep a device from another's waiting job past a lease (it is revoked within
        # two, before that job's ranks give up waiting)
        self.sched = SlotScheduler(make_policy(policy), clock, lease_s, patience_s,
                                   max_hold_s=lease_s if users.shared else None)
        self.path = socket_path(name, runtime_dir, create=True)
        self.sockets = NodeSockets(self.path, relay_path(name, self.path.parent)
                                   if relayed else None, users.socket_mode, users.gid,
                                   serve_alone=bool(hosts))
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        # Both ends non-blocking: a full pipe already holds a wake-up, and a blocked
        # write would stall the peer thread or the signal handler that calls _wakeup.
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Descriptors for connections: the soft limit, less room for the daemon's own.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        max_conns = max(16, min(soft if soft > 0 else 65536, 65536) - 64)
        policy_ = self.sched.policy
        aligning = align_phases and policy_.exclusive
        self.conns = Connections(self._sel, clock, hello_timeout_s, max_conns,
                                 handle=self._handle, closed=lambda c, why: self.ranks.closed(
                                     c, why), users=users)
        self.table = TableSync(self.sched, deliver=lambda g: self.ranks.deliver(g),
                               pids_on=lambda device: self.ranks.pids_on(device))
        # The leader decides for all: the mode from what it measures (policy auto), the
        # nodes' phases (`align_phases`), the idle shutdown. Daemon 0 leads first; a
        # successor takes over if it is lost (`membership`).
        self._leader_args = (policy_.adaptive, mode_probe_s, mode_hold_s, mode_probe_local,
                             aligning, patience_s, idle_shutdown_s)
        # the world's key signs and checks every message to and from other nodes
        secret = world_key(self.path.parent) if relayed else b""
        self.peers = Uplink(self._wakeup, relayed, name, secret)
        run_dir = self.path.parent if relayed else None  # a world's node: logs, records
        self.member = Member(self.peers, name, clock, self._new_leader,
                             holdings=lambda: self.ranks.holdings(), argv=list(argv or []),
                             secret=secret, log_path=run_dir and run_dir / LOG_FILE,
                             run_dir=run_dir, beat_s=beat_s, dead_after_s=dead_after_s,
                             hosts=hosts)
        self.ranks = Ranks(self.node, self.sched, self.table, self.conns, self.peers,
                           aligning=aligning, deciding=policy_.adaptive, clock=clock,
                           core_shares=core_shares,
                           # the slot table is the service user's file (0600): other
                           # users' ranks are granted over their sockets
                           table_for=lambda conn: conn.uid in (None, users.service_uid),
                           max_job=MAX_JOB + (MAX_OWNER + 1 if users.shared else 0))
        self.handovers_delayed = 0  # on this node, by the leader's corrections
        self.status = NodeStatus(self.node, self.sched, self.ranks, self.table, self.member,
                                 self.conns, self.peers, users, clock,
                                 handovers_delayed=lambda: self.handovers_delayed)
        self._stop = False
        self._metrics_at = metrics
        self.metrics: MetricsEndpoint | None = None
        self._said_ready = False

    @property
    def leader(self) -> LeaderThread | None:
        """The leader's decisions, where this daemon leads."""
        return self.member.leader

    def _new_leader(self, peers: Uplink) -> LeaderThread:
        adaptive, probe_s, hold_s, probe_local, aligning, patience_s, idle_s = \
            self._leader_args
        def modes() -> ModeController:
            return ModeController(self.clock, probe_s=probe_s, hold_s=hold_s,
                                  max_hold_s=max(240.0, hold_s), probe_local=probe_local)
        aligner = PhaseAligner(self.clock, min(0.015, patience_s), min(0.25, patience_s)) \
            if aligning else None
        return LeaderThread(Leader(peers, modes if adaptive else None, aligner, idle_s,
                                   self.clock), self.clock, self._wakeup)

    # --- life cycle -------------------------------------------------------------------
    def serve(self) -> None:
        """Listen and serve until stopped (SIGTERM/SIGINT, idle shutdown or `stop`)."""
        listener, relays = self.sockets.open()
        self.table.open(self.path)
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        if relays is not None:
            self._sel.register(relays, selectors.EVENT_READ, "relay")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._ready()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        if self._metrics_at is not None:
            address, port = self._metrics_at
            if is_fake(self.node.name):  # fake nodes share this host's ports
                port += int(self.node.name[len("fake"):])
            try:
                self.metrics = MetricsEndpoint(address, port, self._wakeup)
            except MetricsError as exc:
                if not self.peers.relayed:  # run by hand: say so, and stop
                    self._close(listener, relays)
                    raise
                # a node of a world (its port taken by another user's service, say)
                # still coordinates its jobs
                log.error("node %s: %s; serving without metrics", self.node.name, exc)
        log.info("daemon %s/%s for node %s on %s: policy %s, devices %s",
                 self.peers.rank, self.peers.size, self.node.name, self.path,
                 self.sched.policy.name,
                 [self.node.cpu_device(i)[0] for i in range(self.node.cpu_devices)])
        try:
            while not self._stop:
                events = self._sel.select(self._timeout())
                # registered ranks first: a flood of new or hostile connections waits
                # behind the jobs' grants, not in front of them
                events.sort(key=lambda ev: not getattr(ev[0].data, "registered", False))
                for key, _ in events:
                    if key.data == "listen":
                        self.conns.accept(listener)
                    elif key.data == "relay":
                        hello = self.peers.accept(relays)
                        if hello is not None:
                            self.sockets.publish()
                            self._ready()
                            self.member.attached(*hello)
                        elif self.peers.outsider is not None:  # an older generation's
                            self.member.grow([self.peers.outsider])  # leader: take it in
                    elif key.data == "wake":
                        self._drain_wakeups()
                    else:
                        self.conns.read(key.data)
                if self.sockets.unreached():
                    break
                self.table.run_backlog()
                self._handle_peers()
                self.member.tick()
                self.conns.drop_silent(self.status.askers())
                self._expire()
                if self.leader is not None:
                    self.leader.busy_here = self.ranks.busy
                    self.leader.raise_error()
                self.status.answer_ready()
                self._realign()
                self.table.publish_plans()
                if self.metrics is not None:  # after the table's events are applied
                    self.metrics.answer(self.status.figures)
                self.ranks.update_company()
        finally:
            notify(STOPPING=1)
            self._close(listener, relays)
            log.info("daemon for node %s stopped", self.node.name)

    def _ready(self) -> None:
        """Once ranks can find this daemon, tell systemd (a `Type=notify` service)."""
        if self.sockets.published and not self._said_ready:
            self._said_ready = True
            notify(READY=1, STATUS=f"serving node {self.node.name} on {self.path}")

    def _close(self, listener, relays) -> None:
        self._sel.close()
        listener.close()
        if relays is not None:
            relays.close()
        self.sockets.close()
        self.table.close()
        self.peers.close()
        if self.leader is not None:
            self.leader.close()
        if self.metrics is not None:
            self.metrics.close()

    def stop(self) -> None:
        """Ask the serve loop to exit (safe from a signal handler or another thread)."""
        self._stop = True
        self._wakeup()

    def _timeout(self) -> float:
        if self.table.stuck:
            return 0.005  # a device's mutex is busy: try again soon (not at once: a spin)
        t = 0.5 if not self.table.replan else 0.01
        for deadline in (self.sched.next_deadline(), self.member.next_deadline()):
            if deadline is not None:
                t = min(t, max(0.0, deadline - self.clock()))
        return t

    def _wakeup(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wakeup is pending already

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _handle(self, conn: RankConn, msg: P.Message) -> None:
        why = self.users.refuses(conn.uid, msg, self.node.name)
        if why is not None:
            log.warning("refused %s of process %s: %s", msg.kind, conn.pid, why)
            self.conns.reply(conn, P.Error(why, P.ErrorCode.REFUSED.value))
            return
        msg = self.users.owned(conn.uid, conn.pid, msg)
        if isinstance(msg, P.Status):
            self.status.request(conn)
        elif isinstance(msg, P.Grow):
            bad = [n for n in msg.nodes if not (0 < len(n) <= 200 and n.isprintable())]
            if bad or len(msg.nodes) > 4096:
                raise P.ProtocolError(f"grow: node names must be 1-200 printable "
                                      f"characters, at most 4096 of them: {bad[:3]}")
            missing = self.member.grow(msg.nodes)
            # the nodes the leader is asked to start daemons on; status shows them joined
            self.conns.reply(conn, P.StatusReport({n: {"joining": True} for n in missing}))
        elif isinstance(msg, P.StopWorld):
            self.conns.reply(conn, P.StatusReport(
                {n: {} for n in self.member.names.values()}))
            self._stop_world()
        else:
            self.ranks.handle(conn, msg)

    def _stop_world(self) -> None:
        """Stop every daemon of this world: the leader says so to all (this one too);
        a member asks the leader, and stops."""
        if self.leader is not None:
            self.peers.broadcast(("shutdown",), lost_too=True)
        else:
            self.peers.send_leader(("stop_world",))
            self.stop()

    # --- the scheduler's clock --------------------------------------------------------
    def _realign(self) -> None:
        """A rank back from a pause moved its job's turns on one device: give its job's
        ranks on the other devices the same offset before they cross (scheduler doc)."""
        if not self.sched.misaligned():
            self.sched.forget_moves()
        elif not self.table.waiting and self.table.settle():
            self.ranks.deliver(self.sched.realign())

    def _expire(self) -> None:
        due = self.sched.next_deadline()
        # (a busy table mutex: expire on a later loop, after the events before now)
        if due is None or due > self.clock() or self.table.waiting \
                or not self.table.settle():
            return
        revoked, grants = self.sched.expire()
        for job, rank, device in revoked:
            conn = self.ranks.by_key.get((job, rank))
            state = process_state(conn.hello.pid) if conn is not None else "unknown"
            log.warning("job %s rank %d held %s past its %.0f s lease: slot revoked (its "
                        "process is %s)", job, rank, device, self.sched.lease_s, state)
        self.ranks.deliver(grants)

    # --- the other daemons --------------------------------------------------------------
    def _handle_peers(self) -> None:
        while (item := self.peers.take()) is not None:
            source, msg = item
            if self.member.route(source, msg):
                continue
            if msg[0] in TO_LEADER:
                if msg[0] != "waited" or self.sched.exclusive:  # else: another mode's
                    self.leader.post(source, msg)
            else:
                self._on_peer(source, msg)

    def _on_peer(self, source: int, msg: tuple) -> None:
        """What this node does with the leader's (or a peer's) message."""
        kind = msg[0]
        if kind == "mode":
            if self.leader is not None:
                self.leader.reset_aligner()
            self.ranks.mode_reason = msg[2]
            self.table.change(None, lambda: self.ranks.set_mode(Mode(msg[1]), msg[3]))
        elif kind == "delay":  # this node's turns ran ahead: hand over later, once
            self.table.change(None, lambda: self._delay_handovers(msg[1], msg[2]))
        elif kind == "status?":
            self.peers.send(source, ("status!", msg[1], self.node.name,
                                     self.status.snapshot()))
        elif kind == "status!":
            self.status.part(msg[1], msg[2], msg[3])
        elif kind == "shutdown":
            self.stop()

    def _delay_handovers(self, delay_s: float, lead_s: float) -> None:
        """Hand every shared device of this node to its next job `delay_s` later."""
        if not self.sched.exclusive:
            return  # the mode changed since the leader decided
        shared = [device for device in self.sched.devices()
                  if len(self.sched.company(device)) > 1]
        for device in shared:
            self.sched.delay_handover(device, delay_s)
        self.handovers_delayed += 1
        log.info("node %s's turns %.0f ms ahead of another node's: next hand-over of %s "
                 "%.0f ms later", self.node.name, 1000 * lead_s, ", ".join(shared)
                 or "no device", 1000 * delay_s)
