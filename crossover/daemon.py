"""The coordinator daemon: one process per node, jobs' ranks connect over a Unix socket.

The daemon processes of all nodes form one MPI world. Daemon 0 (the leader) decides the
global job order when a job first joins anywhere and tells every daemon; each daemon then
grants its own devices with that order, so a job's ranks are in the same phase on every
node without any cross-node message on the grant path.

Reliability: a rank whose connection closes (crash, kill, exit) loses its slot at once;
a rank that holds past its lease loses it then. Clients treat a vanished daemon as
"run uncoordinated" (see `client`).
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import resource
import selectors
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from crossover import fastpath
from crossover import protocol as P
from crossover.daemon_conns import Connections, RankConn
from crossover.daemon_world import DaemonWorld, default_comm, node_identity
from crossover.fastpath import TableDaemon
from crossover.placement import partition
from crossover.procstats import RankUsage, process_state
from crossover.protocol import Mode, Phase
from crossover.scheduler import ModeController, SlotGrant, SlotScheduler, make_policy
from crossover.scheduler.phase import PhaseAligner
from crossover.transport import PeerChannel, socket_path

log = logging.getLogger("crossover.daemon")

INT32_MAX = 2**31 - 1

class Daemon(Connections, DaemonWorld, TableDaemon):
    """One node's coordinator.

    Args:
        policy: scheduling policy name (see `crossover.scheduler.POLICIES`).
        lease_s: how long a grant lasts without renewal.
        patience_s: how long a free device waits for the job whose turn it is.
        idle_shutdown_s: exit after no job has been connected anywhere for this long
            (None: never).
        runtime_dir: directory of the sockets (default: see `transport.runtime_dir`).
        comm: the daemons' communicator (default: COMM_WORLD under mpirun).
        cpu_devices: how many devices this node's CPU cores form (default: one per core).
        mode_probe_s: policy auto: the shortest window measuring a mode.
        mode_hold_s: policy auto: how long a mode decision holds before a re-probe.
        mode_probe_local: policy auto: probe jobs whose ranks all share one host's CPU
            too (by default they are served concurrently without a probe).
        hello_timeout_s: a connection that neither says hello nor asks for status within
            this long is dropped (a stalled or hostile client holds no descriptor long).
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
        comm: Any = None,
        cpu_devices: int | None = None,
        mode_probe_s: float = 2.0,
        mode_hold_s: float = 30.0,
        mode_probe_local: bool = False,
        align_phases: bool = False,
        hello_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.comm = comm if comm is not None else default_comm()
        self.node, self.cores = node_identity(self.comm)
        self.cpu_devices = max(1, min(cpu_devices or len(self.cores), len(self.cores)))
        self.clock = clock
        self.sched = SlotScheduler(make_policy(policy), clock, lease_s, patience_s)
        self.idle_shutdown_s = idle_shutdown_s
        self.hello_timeout_s = hello_timeout_s
        # Descriptors for connections: the soft limit, less room for the daemon's own.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_conns = max(16, min(soft if soft > 0 else 65536, 65536) - 64)
        self._refused_at = -1e9  # when a connection over max_conns was last logged
        self._swept_at = clock()
        self.path = socket_path(self.node, runtime_dir, create=True)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        # Both ends non-blocking: a full pipe already holds a wake-up, and a blocked
        # write would stall the peer thread or the signal handler that calls _wakeup.
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.peers = PeerChannel(self.comm, self._wakeup)
        self._conns: dict[tuple[str, int], RankConn] = {}
        self._orders: dict[str, int] = {}  # global job order, decided by the leader
        self._pending: dict[str, list[RankConn]] = {}  # ranks waiting for their job's order
        self._status_waits: dict[int, tuple[RankConn, dict, float]] = {}
        self._status_token = 0
        self._stop = False
        # leader only
        self._next_order = 0
        self._members: dict[str, set[int]] = {}  # job -> daemon ranks with its ranks
        self._decided: dict[str, int] = {}  # job -> the order the leader gave it
        self._idle_since = clock()
        # The mode decision (policy auto): the leader measures, every daemon applies.
        self.modes = ModeController(clock, probe_s=mode_probe_s, hold_s=mode_hold_s,
                                    max_hold_s=max(240.0, mode_hold_s),
                                    probe_local=mode_probe_local) \
            if self.sched.policy.adaptive else None
        self._mode_reason = "policy " + self.sched.policy.name
        # Leader: keeps the nodes' antiphase sequences in step (`align_phases`)
        self.aligner = PhaseAligner(clock, min(0.015, patience_s), min(0.25, patience_s)) \
            if align_phases and self.sched.policy.exclusive else None
        self.handovers_delayed = 0  # on this node, by the leader's corrections
        self._last_shares: dict[str, list[int]] = {}  # for the log
        self._steps: dict[str, int] = {}  # job -> most steps a local rank reported
        self._points: dict[str, int] = {}  # leader: job -> its request points, reported
        self._started = time.monotonic()
        self._usage = RankUsage()
        # The native fast path (see `fastpath`): its table, and the devices whose events
        # wait to be applied or whose plan is to be published again.
        self.fast: fastpath.TablePlane | None = None
        self._replan: set[str] = set()
        # Changes of the scheduler waiting for a device's table mutex (`_change`), and
        # since when each device's mutex has been busy.
        self._backlog: deque[tuple[str | None, Callable[[], None]]] = deque()
        self._stuck: dict[str, float] = {}
        self._company: dict[str, frozenset[str]] = {}  # device -> its jobs, less dormant ones

    # --- life cycle -------------------------------------------------------------------
    def serve(self) -> None:
        """Listen and serve until stopped (SIGTERM/SIGINT, idle shutdown or `stop`)."""
        listener = self._listen()
        self._open_table()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        log.info("daemon %s/%s for node %s on %s: policy %s, devices %s",
                 self.peers.rank, self.peers.size, self.node, self.path,
                 self.sched.policy.name, [self._cpu_device(i)[0] for i in range(self.cpu_devices)])
        try:
            while not self._stop:
                events = self._sel.select(self._timeout())
                # registered ranks first: a flood of new or hostile connections waits
                # behind the jobs' grants, not in front of them
                events.sort(key=lambda ev: not getattr(ev[0].data, "registered", False))
                for key, _ in events:
                    if key.data == "listen":
                        self._accept(listener)
                    elif key.data == "wake":
                        self._drain_wakeups()
                    else:
                        self._read(key.data)
                self._run_backlog()
                self._handle_peers()
                self._drop_silent()
                self._expire()
                self._check_idle()
                self._finish_status_waits()
                self._realign()
                self._publish_plans()
                self._update_company()
        finally:
            self._sel.close()
            listener.close()
            self.path.unlink(missing_ok=True)
            if self.fast is not None:
                self.fast.path.unlink(missing_ok=True)
            self.peers.close()
            log.info("daemon for node %s stopped", self.node)

    def stop(self) -> None:
        """Ask the serve loop to exit (safe from a signal handler or another thread)."""
        self._stop = True
        self._wakeup()

    def _listen(self) -> socket.socket:
        # One daemon per node and directory: a lock held for the daemon's lifetime (the
        # kernel drops it if the daemon dies, so a stale socket never blocks a restart).
        self._lock = open(self.path.with_suffix(".lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"a crossover daemon already listens on {self.path}; reuse it, stop it, "
                f"or give this one another CROSSOVER_RUNTIME_DIR"
            ) from None
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = self.path.with_suffix(".new")
        tmp.unlink(missing_ok=True)
        sock.bind(str(tmp))
        os.chmod(tmp, 0o600)
        sock.listen(socket.SOMAXCONN)  # ranks that start together connect at once
        tmp.rename(self.path)  # appears only once it accepts connections
        sock.setblocking(False)
        return sock

    def _timeout(self) -> float:
        if self._backlog:
            return 0.005  # a device's mutex is busy: try again soon (not at once: a spin)
        t = 0.5 if not self._replan else 0.01
        deadlines = [self.sched.next_deadline()]
        if self.modes is not None and self.peers.rank == 0:
            deadlines.append(self.modes.next_deadline())
        for deadline in deadlines:
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

    # --- requests ---------------------------------------------------------------------
    def _handle(self, conn: RankConn, msg: P.Message) -> None:
        if isinstance(msg, P.Status):
            self._start_status(conn)
            return
        if isinstance(msg, P.Hello):
            self._hello(conn, msg)
            return
        if not conn.registered:
            raise P.ProtocolError(f"{msg.kind} before a completed hello")
        job, rank = conn.key
        if isinstance(msg, P.Ring):
            if self.fast is not None:
                self._replan.add(conn.device)  # applied at the end of this loop
        elif isinstance(msg, P.Attached):
            if self.fast is not None:
                self.fast.attach(conn.key, msg.ok)
                self._replan.add(conn.device)
        elif isinstance(msg, P.Acquire):
            self._change(conn.device, lambda: self._guard(conn, lambda: self._acquire(
                conn, msg)))
        elif isinstance(msg, P.Release):
            try:
                phase = Phase(msg.phase)
            except ValueError:
                raise P.ProtocolError(f"unknown phase {msg.phase!r}") from None
            self._change(conn.device, lambda: self._guard(conn, lambda: self._deliver(
                self.sched.release(job, rank, phase))))
        elif isinstance(msg, P.Renew):
            self.sched.renew(job, rank)
        elif isinstance(msg, P.Waited):
            if self.aligner is not None:  # (the leader's: every daemon has the setting)
                self.peers.send(0, ("waited", job, msg.wait_s))
        elif isinstance(msg, P.Progress):
            # Only the mode decision (an adaptive policy's leader) reads step counts; a
            # client of an older version may still send them from every rank.
            if self.modes is not None and msg.steps > self._steps.get(job, -1):
                self._steps[job] = msg.steps
                self.peers.send(0, ("progress", job, msg.steps, conn.on_host_cpu,
                                    msg.points))
        else:
            raise P.ProtocolError(f"unexpected {msg.kind} from a client")

    def _acquire(self, conn: RankConn, msg: P.Acquire) -> None:
        if conn.sock.fileno() < 0 or self._conns.get(conn.key) is not conn:
            return  # it left while the change waited for the device's table
        if self.fast is not None:
            self.fast.asked_by_socket(conn.key)
        conn.seq = msg.seq
        job, rank = conn.key
        grants = self.sched.release(job, rank, Phase.COMPUTE) if msg.release_first else []
        self._deliver(grants + self.sched.request(job, rank, msg.pos or None))

    def _hello(self, conn: RankConn, hello: P.Hello) -> None:
        if conn.hello is not None:
            raise P.ProtocolError("second hello on one connection")
        # The decoder checked the types; these are the values that make sense.
        problems = [
            name for name, ok in [
                ("job", 0 < len(hello.job) <= 200 and hello.job.isprintable()),
                ("size", hello.size >= 1),
                ("rank", 0 <= hello.rank < hello.size),
                ("local_size", hello.local_size >= 1),
                ("local_rank", hello.local_rank >= 0),
                ("pid", 0 <= hello.pid <= INT32_MAX),  # the slot table keeps an int32
                ("weight", math.isfinite(hello.weight) and hello.weight > 0),
                ("gpu", hello.gpu is None or 0 <= hello.gpu <= INT32_MAX),
            ] if not ok
        ]
        if problems:
            raise P.ProtocolError(f"hello with invalid {', '.join(problems)}: {hello}")
        key = (hello.job, hello.rank)
        if key in self._conns or any(c.key == key for c in self._pending.get(hello.job, [])):
            self._reply(conn, P.Error(
                f"job {hello.job!r} rank {hello.rank} is connected already: two jobs with "
                f"one name? Give each job its own name (CROSSOVER_JOB or crossoverrun "
                f"--crossover-job)", P.ErrorCode.DUPLICATE.value))
            self._close(conn, "duplicate rank")
            return
        # A job's ranks share one weight; checked here too, as ranks of a new job wait
        # for its order and are registered together later.
        weights = {c.hello.weight for c in self._pending.get(hello.job, [])}
        if self.sched.weight_of(hello.job) is not None:
            weights.add(self.sched.weight_of(hello.job))
        if weights and weights != {hello.weight}:
            self._reply(conn, P.Error(
                f"job {hello.job!r} rank {hello.rank} has priority weight {hello.weight}, "
                f"its other ranks {sorted(weights)}: give every rank of a job the same "
                f"CROSSOVER_PRIORITY", P.ErrorCode.REFUSED.value))
            self._close(conn, "weight differs from its job's")
            return
        conn.hello = hello
        if hello.job in self._orders:
            self._admit(conn)
        else:
            first = hello.job not in self._pending
            self._pending.setdefault(hello.job, []).append(conn)
            if first:
                self.peers.send(0, ("join", hello.job))

    def _admit(self, conn: RankConn) -> None:
        """Register a rank whose job has its order (after the table's events before it)."""
        device = f"gpu{conn.hello.gpu}" if conn.hello.gpu is not None \
            else self._cpu_device(conn.hello.local_rank % self.cpu_devices)[0]
        self._change(device, lambda: self._guard(conn, lambda: self._register(conn, device),
                                                 close=True))

    def _register(self, conn: RankConn, device: str) -> None:
        hello = conn.hello
        if conn.sock.fileno() < 0:  # it left while its device's table was awaited
            if not any(j == hello.job for j, _ in self._conns) \
                    and hello.job not in self._pending:
                self.peers.send(0, ("leave", hello.job))  # as `_close` would have
            return
        cores = [] if hello.gpu is not None else self._cpu_device(
            hello.local_rank % self.cpu_devices)[1]
        order = self._orders[hello.job]
        self.sched.register(hello.job, hello.rank, device, order, hello.weight)
        # At once, before anything else can raise: `_close` unregisters what is here.
        conn.registered, conn.device = True, device
        self._conns[conn.key] = conn
        self._idle_since = None
        if conn.on_host_cpu and hello.job not in self._steps:
            # The leader can serve it concurrently (and split the cores) now, not after
            # its first steps under the initial antiphase.
            self._steps[hello.job] = 0
            self.peers.send(0, ("progress", hello.job, 0, True, 0))
        place = self.fast.reserve(conn.key, device, hello.pid) if self.fast else None
        table, slot, index = (str(self.fast.path), *place) if place else ("", -1, -1)
        log.info("job %s rank %d on node %s -> %s (order %d)",
                 hello.job, hello.rank, self.node, device, order)
        policy = self.sched.policy
        self._reply(conn, P.Welcome(device, cores, self.node, order, policy.name,
                                    self.sched.lease_s, policy.release_on_communicate,
                                    policy.yield_on_step, table, slot, index,
                                    report_waits=self.aligner is not None))
        self._tell_company()  # every device: the host's cores may be split anew

    def _update_company(self) -> None:
        """A job went dormant (its time ran out) or woke (its request was applied):
        tell the ranks beside it, and re-plan, since a dormant job's request must ring."""
        for device in self.sched.devices():
            now = frozenset(self.sched.company(device))
            if self._company.get(device) != now:
                self._company[device] = now
                self._tell_company(device)
                if self.fast is not None:
                    self._replan.add(device)

    def _tell_company(self, device: str | None = None) -> None:
        """Tell each rank on `device` (None: every device) how many other jobs share it
        and the mode, when that changed."""
        shares = self._shares()
        for key, conn in list(self._conns.items()):
            mine = self.sched.device_of(*key)
            if mine is None or device not in (None, mine):
                continue
            told = (len(self.sched.company(mine) - {key[0]}), self.sched.mode.value,
                    shares.get(key[0], []))
            if conn.told != told:
                conn.told = told
                self._reply(conn, P.Company(told[0], told[1], self._mode_reason, told[2]))

    def _shares(self) -> dict[str, list[int]]:
        """Each job's cores on this host (`crossover.placement`), while `auto` serves
        CPU jobs that all live on this host concurrently; otherwise none."""
        if not (self.sched.policy.adaptive and self.sched.mode == Mode.CONCURRENT):
            return {}
        ranks: dict[str, int] = {}
        for (job, _), conn in self._conns.items():
            if not conn.on_host_cpu:
                return {}  # a GPU job or one that spans hosts: leave the cores alone
            ranks[job] = ranks.get(job, 0) + 1
        jobs = sorted(ranks, key=lambda job: self._orders[job])
        shares = partition(self.cores, [(job, ranks[job]) for job in jobs])
        if shares != self._last_shares:
            self._last_shares = shares
            log.info("cores on node %s: %s", self.node,
                     ", ".join(f"{j} {c}" for j, c in shares.items()) or "shared by all")
        return shares

    def _cpu_device(self, index: int) -> tuple[str, list[int]]:
        # Device i is every cpu_devices-th core from core i: one core each by default.
        return f"cpu{index}", self.cores[index :: self.cpu_devices]

    def _deliver(self, grants: list[SlotGrant]) -> None:
        for g in grants:
            if self.fast is not None and self.fast.grant((g.job, g.rank)):
                continue
            conn = self._conns.get((g.job, g.rank))
            if conn is not None:
                self._reply(conn, P.Grant(conn.seq))

    def _realign(self) -> None:
        """A rank back from a pause moved its job's turns on one device: give its job's
        ranks on the other devices the same offset before they cross (scheduler doc)."""
        if not self.sched.misaligned():
            self.sched.forget_moves()
        elif not self._backlog and self._before_change():
            self._deliver(self.sched.realign())

    def _expire(self) -> None:
        if self.modes is not None and self.peers.rank == 0:
            self._apply_modes(self.modes.tick())
        due = self.sched.next_deadline()
        # (a busy table mutex: expire on a later loop, after the events before now)
        if due is None or due > self.clock() or self._backlog or not self._before_change():
            return
        revoked, grants = self.sched.expire()
        for job, rank, device in revoked:
            conn = self._conns.get((job, rank))
            state = process_state(conn.hello.pid) if conn is not None else "unknown"
            log.warning("job %s rank %d held %s past its %.0f s lease: slot revoked (its "
                        "process is %s)", job, rank, device, self.sched.lease_s, state)
        self._deliver(grants)
