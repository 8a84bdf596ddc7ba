"""The ranks of one node: their hellos, registration, requests, company and leaving.

`Ranks` turns what a rank's connection says into the scheduler's calls and the replies:
a hello is checked and registered at once, in its job's place in the global order, which
the job carries (its start and name, `scheduler.state.JobOrder`: no node asks another);
requests go through `TableSync.change`, so the slot table's events before
them are applied first; a closed connection frees its rank. The ranks beside each other
on a device are told of their company and the mode (`Company`), and CPU jobs that share
this host under concurrent service get their share of its cores (`placement`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from crossover import environment as E
from crossover import protocol as P
from crossover.daemon.node.conns import Connections, RankConn
from crossover.daemon.node.table import TableSync
from crossover.daemon.relay.uplink import Uplink
from crossover.placement import partition
from crossover.protocol import Mode, Phase
from crossover.scheduler import SlotGrant, SlotScheduler

log = logging.getLogger("crossover.daemon")

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Node:
    """This node: its name, its cores, and the CPU devices they form."""

    name: str
    cores: list[int]
    cpu_devices: int

    def cpu_device(self, index: int) -> tuple[str, list[int]]:
        """Device i is every cpu_devices-th core from core i: one core each by default."""
        return f"cpu{index}", self.cores[index :: self.cpu_devices]


def node_identity() -> tuple[str, list[int]]:
    """This node service's name (given on its command line, else as `E.node_name`) and
    the CPU cores its devices are made of: fake node r gets every N-th core."""
    cores = sorted(os.sched_getaffinity(0))
    fake, name = E.fake_nodes(), E.node_name()
    if not (fake and re.fullmatch(r"fake\d+", name)):
        return name, cores
    r = int(name[4:])
    return name, cores[r % len(cores) :: fake] or cores


#: What every rank of a job on a node says alike: (its hello's field, the error code, why
#: (for the log), what the rank is told: its value, then the other ranks').
SHARED = [
    ("start_ns", P.ErrorCode.DUPLICATE, "another job of that name",
     "started at {} ns, its other ranks here at {}: two jobs with one name? Give each job "
     "its own name (CROSSOVER_JOB or crossoverrun --crossover-job), or its ranks one "
     "CROSSOVER_JOB_START"),
    ("weight", P.ErrorCode.REFUSED, "weight differs from its job's",
     "has priority weight {}, its other ranks {}: give every rank of a job the same "
     "CROSSOVER_PRIORITY"),
    ("batch_job", P.ErrorCode.REFUSED, "batch job differs from its job's",
     "runs in batch job {!r}, its other ranks here in {}: two jobs with one name? Give "
     "each its own (CROSSOVER_JOB)"),
]


class Ranks:
    """The node's ranks.

    Args:
        node: this node.
        sched: the node's scheduler.
        table: the slot table's order keeper (no-op without a table).
        conns: the connections, to reply and close.
        peers: the daemons' channel (to the leader this daemon follows).
        aligning: the daemons align the nodes' phases (ranks report their waits).
        deciding: the mode is decided from step rates (ranks report their steps).
        clock: monotonic clock.
        core_shares: give each concurrent CPU job on this host its own cores (`_shares`).
        table_for: whether a rank's connection may be offered the slot table (the native
            fast path); the others are granted over their sockets.
        max_job: the longest job name (on a service for several users, its owner's name
            comes before the name its ranks gave: `users`).
    """

    def __init__(self, node: Node, sched: SlotScheduler, table: TableSync,
                 conns: Connections, peers: Uplink, aligning: bool, deciding: bool,
                 clock: Callable[[], float], core_shares: bool = True,
                 table_for: Callable[[RankConn], bool] = lambda conn: True,
                 max_job: int = 200) -> None:
        self.node, self.sched, self.table, self.conns = node, sched, table, conns
        self.table_for, self.max_job = table_for, max_job
        self.core_shares = core_shares
        self.peers, self.aligning, self.deciding, self.clock = peers, aligning, deciding, clock
        self.by_key: dict[tuple[str, int], RankConn] = {}
        # ranks whose registration waits for their device's table (`TableSync.change`)
        self.joining: dict[tuple[str, int], RankConn] = {}
        self.steps: dict[str, int] = {}  # job -> most steps a local rank reported
        self.mode_reason = "policy " + sched.policy.name
        self._company: dict[str, frozenset[str]] = {}  # device -> its jobs, less dormant
        self._last_shares: dict[str, list[int]] = {}  # for the log

    @property
    def busy(self) -> bool:
        """Whether a rank is here or on its way."""
        return bool(self.by_key) or bool(self.joining)

    def has_job(self, job: str) -> bool:
        """Whether a rank of `job` is registered here, or its registration is queued."""
        return any(j == job for j, _ in self.by_key) or any(j == job for j, _ in self.joining)

    def pids(self) -> dict[str, list[int]]:
        """Each job's pids here."""
        out: dict[str, list[int]] = {}
        for (job, _), conn in self.by_key.items():
            out.setdefault(job, []).append(conn.hello.pid)
        return out

    def batch_jobs(self) -> dict[str, str]:
        """{job: the batch system's id of the job} for the jobs here that said one."""
        return {job: conn.hello.batch_job for (job, _), conn in self.by_key.items()
                if conn.hello.batch_job}

    def pids_by_place(self) -> dict[tuple[str, str], list[int]]:
        """Each job's pids here, per device: {(job, device): pids}."""
        out: dict[tuple[str, str], list[int]] = {}
        for key, conn in self.by_key.items():
            device = self.sched.device_of(*key)
            if device is not None:
                out.setdefault((key[0], device), []).append(conn.hello.pid)
        return out

    def device_memory(self) -> tuple[dict[tuple[str, str], tuple[int, int]], dict[str, int]]:
        """What GPU ranks said of their devices' memory: {(job, device): (reserved,
        peak)} summed over the job's ranks there, and {device: capacity}."""
        used: dict[tuple[str, str], tuple[int, int]] = {}
        capacity: dict[str, int] = {}
        for key, conn in self.by_key.items():
            device = self.sched.device_of(*key)
            if conn.memory is None or device is None:
                continue
            reserved, peak, total = conn.memory
            was = used.get((key[0], device), (0, 0))
            used[(key[0], device)] = (was[0] + reserved, was[1] + peak)
            capacity[device] = max(capacity.get(device, 0), total)
        return used, capacity

    def memory_report(self) -> dict[str, dict]:
        """Each GPU's memory as its ranks said, beside its capacity, for status:
        {device: {"capacity": bytes, "jobs": {job: {"reserved": .., "peak": ..}}}}."""
        used, capacity = self.device_memory()
        out: dict[str, dict] = {}
        for (job, device), (reserved, peak) in sorted(used.items()):
            entry = out.setdefault(device, {"capacity": capacity.get(device, 0), "jobs": {}})
            entry["jobs"][job] = {"reserved": reserved, "peak": peak}
        return out

    def pids_on(self, device: str) -> list[int]:
        return sorted(conn.hello.pid for key, conn in self.by_key.items()
                      if self.sched.device_of(*key) == device)

    # --- requests -----------------------------------------------------------------------
    def handle(self, conn: RankConn, msg: P.Message) -> None:
        """A message of a rank (not Status: the daemon answers that)."""
        if isinstance(msg, P.Hello):
            self._hello(conn, msg)
            return
        if not conn.registered:
            raise P.ProtocolError(f"{msg.kind} before a completed hello")
        job, rank = conn.key
        if isinstance(msg, P.Ring):
            self.table.rang(conn.device)
        elif isinstance(msg, P.Attached):
            self.table.attached(conn.key, conn.device, msg.ok)
        elif isinstance(msg, P.Acquire):
            self.table.change(conn.device, lambda: self.conns.guard(
                conn, lambda: self._acquire(conn, msg)))
        elif isinstance(msg, P.Release):
            try:
                phase = Phase(msg.phase)
            except ValueError:
                raise P.ProtocolError(f"unknown phase {msg.phase!r}") from None
            self.table.change(conn.device, lambda: self.conns.guard(
                conn, lambda: self.deliver(self.sched.release(job, rank, phase))))
        elif isinstance(msg, P.Renew):
            self.sched.renew(job, rank)
        elif isinstance(msg, P.Memory):
            conn.memory = (msg.reserved_bytes, msg.peak_bytes, msg.capacity_bytes)
        elif isinstance(msg, P.Waited):
            if self.aligning:  # (the leader's: every daemon has the setting)
                self.peers.send_leader(("waited", job, msg.wait_s))
        elif isinstance(msg, P.Progress):
            # Only the mode decision (an adaptive policy's leader) reads step counts; a
            # client of an older version may still send them from every rank.
            if self.deciding and msg.steps > self.steps.get(job, -1):
                self.steps[job] = msg.steps
                self.peers.send_leader(("progress", job, msg.steps, conn.on_host_cpu,
                                        msg.points, msg.compute_s, msg.gap_s))
        else:
            raise P.ProtocolError(f"unexpected {msg.kind} from a client")

    def _acquire(self, conn: RankConn, msg: P.Acquire) -> None:
        if not conn.open or self.by_key.get(conn.key) is not conn:
            return  # it left while the change waited for the device's table
        self.table.asked_by_socket(conn.key)
        conn.seq = msg.seq
        job, rank = conn.key
        grants = self.sched.release(job, rank, Phase.COMPUTE) if msg.release_first else []
        self.deliver(grants + self.sched.request(job, rank, msg.pos or None))

    def deliver(self, grants: list[SlotGrant]) -> None:
        """Hand grants to their ranks: through the table, or over the socket."""
        for g in grants:
            if self.table.grant((g.job, g.rank)):
                continue
            conn = self.by_key.get((g.job, g.rank))
            if conn is not None:
                self.conns.reply(conn, P.Grant(conn.seq))

    def _hello(self, conn: RankConn, hello: P.Hello) -> None:
        if conn.hello is not None:
            raise P.ProtocolError("second hello on one connection")
        # The decoder checked the types; these are the values that make sense.
        problems = [
            name for name, ok in [
                ("job", 0 < len(hello.job) <= self.max_job and hello.job.isprintable()),
                ("size", hello.size >= 1),
                ("rank", 0 <= hello.rank < hello.size),
                ("local_size", hello.local_size >= 1),
                ("local_rank", hello.local_rank >= 0),
                ("pid", 0 <= hello.pid <= INT32_MAX),  # a C pid_t
                ("weight", math.isfinite(hello.weight) and hello.weight > 0),
                ("gpu", hello.gpu is None or 0 <= hello.gpu <= INT32_MAX),
                ("start_ns", 0 <= hello.start_ns < 2**63),
                ("batch_job", len(hello.batch_job) <= E.MAX_BATCH_JOB
                 and hello.batch_job.isprintable()),
            ] if not ok
        ]
        if problems:
            raise P.ProtocolError(f"hello with invalid {', '.join(problems)}: {hello}")
        key = (hello.job, hello.rank)
        if key in self.by_key or key in self.joining:
            self._refuse(conn, P.ErrorCode.DUPLICATE, "duplicate rank",
                         f"job {hello.job!r} rank {hello.rank} is connected already: two "
                         f"jobs with one name? Give each job its own name (CROSSOVER_JOB or "
                         f"crossoverrun --crossover-job)")
            return
        peers = [c.hello for c in [*self.by_key.values(), *self.joining.values()]
                 if c.hello.job == hello.job]
        for field, code, why, told in SHARED:  # what a job's ranks all say alike
            others = {getattr(h, field) for h in peers}
            if others and others != {getattr(hello, field)}:
                self._refuse(conn, code, why, f"job {hello.job!r} rank {hello.rank} " +
                             told.format(getattr(hello, field), sorted(others)))
                return
        conn.hello = hello
        if not peers:  # the job's first rank here: the leader counts its nodes
            self.peers.send_leader(("join", hello.job))
        self._admit(conn)

    def _refuse(self, conn: RankConn, code: P.ErrorCode, why: str, message: str) -> None:
        """Answer a hello with an error and hang up (`why`: for the log)."""
        self.conns.reply(conn, P.Error(message, code.value))
        self.conns.close(conn, why)

    def _admit(self, conn: RankConn) -> None:
        """Register a rank (after the table's events before it)."""
        hello = conn.hello
        device = f"gpu{hello.gpu}" if hello.gpu is not None \
            else self.node.cpu_device(hello.local_rank % self.node.cpu_devices)[0]
        self.joining[conn.key] = conn
        self.table.change(device, lambda: self.conns.guard(
            conn, lambda: self._register(conn, device), close=True))

    def _register(self, conn: RankConn, device: str) -> None:
        hello = conn.hello
        if self.joining.get(conn.key) is not conn:
            return  # it left while its device's table was awaited (`closed` said so)
        del self.joining[conn.key]
        cores = [] if hello.gpu is not None else self.node.cpu_device(
            hello.local_rank % self.node.cpu_devices)[1]
        order = (hello.start_ns, hello.job)
        self.sched.register(hello.job, hello.rank, device, order, hello.weight)
        # At once, before anything else can raise: `closed` unregisters what is here.
        conn.registered, conn.device = True, device
        self.by_key[conn.key] = conn
        if conn.on_host_cpu and hello.job not in self.steps:
            # The leader can serve it concurrently (and split the cores) now, not after
            # its first steps under the initial antiphase.
            self.steps[hello.job] = 0
            self.peers.send_leader(("progress", hello.job, 0, True, 0, 0.0, 0.0))
        place = self.table.reserve(conn.key, device) if self.table_for(conn) else None
        table, slot, index = (self.table.path, *place) if place else ("", -1, -1)
        log.info("job %s rank %d on node %s -> %s (started %d)",
                 hello.job, hello.rank, self.node.name, device, hello.start_ns)
        policy = self.sched.policy
        self.conns.reply(conn, P.Welcome(device, cores, self.node.name, policy.name,
                                         self.sched.lease_s, policy.release_on_communicate,
                                         policy.yield_on_step, table, slot, index,
                                         report_waits=self.aligning))
        self.tell_company()  # every device: the host's cores may be split anew

    def closed(self, conn: RankConn, why: str) -> None:
        """`conn` closed: forget a rank that waited for its device's table, free one that
        was registered (after the table's events before now), and tell the leader when
        the job has no rank left here (else it counts this node among the job's members
        for ever)."""
        key = conn.key
        if key is None:
            return
        job = key[0]
        if self.joining.get(key) is conn:
            del self.joining[key]
        elif conn.registered and self.by_key.get(key) is conn:
            del self.by_key[key]
            log.info("job %s rank %d left node %s (%s)", job, key[1], self.node.name, why)
            device = self.sched.device_of(*key)
            self.table.change(device, lambda: self._unregister(key, device))
        else:
            return  # refused, or never said hello
        if not self.has_job(job):
            self.steps.pop(job, None)
            self.peers.send_leader(("leave", job))

    def _unregister(self, key: tuple[str, int], device: str | None) -> None:
        """Free a rank that left (after the table's events before it were applied)."""
        self.deliver(self.sched.unregister(*key))
        self.table.leave(key)
        if device is not None:
            self.tell_company()  # every device: the host's cores may be split anew

    # --- the leader's decisions ---------------------------------------------------------
    def holdings(self) -> list[str]:
        """The jobs with a rank here, for a new leader to count the jobs' nodes."""
        return sorted({j for j, _ in self.by_key} | {j for j, _ in self.joining})

    def set_mode(self, mode: Mode, points: dict[str, int]) -> None:
        self.deliver(self.sched.set_mode(mode, points))
        self.tell_company()

    # --- company ------------------------------------------------------------------------
    def update_company(self) -> None:
        """A job went dormant (its time ran out) or woke (its request was applied):
        tell the ranks beside it, and re-plan, since a dormant job's request must ring."""
        for device in self.sched.devices():
            now = frozenset(self.sched.company(device))
            if self._company.get(device) != now:
                self._company[device] = now
                self.tell_company(device)
                self.table.company_changed(device)

    def tell_company(self, device: str | None = None) -> None:
        """Tell each rank on `device` (None: every device) how many other jobs share it
        and the mode, when that changed."""
        shares = self._shares()
        for key, conn in list(self.by_key.items()):
            mine = self.sched.device_of(*key)
            if mine is None or device not in (None, mine):
                continue
            told = (len(self.sched.company(mine) - {key[0]}), self.sched.mode.value,
                    shares.get(key[0], []))
            if conn.told != told:
                conn.told = told
                self.conns.reply(conn, P.Company(told[0], told[1], self.mode_reason, told[2]))

    def _shares(self) -> dict[str, list[int]]:
        """Each job's cores on this host (`crossover.placement`), while `auto` serves
        CPU jobs that all live on this host concurrently; otherwise none."""
        if not (self.core_shares and self.sched.policy.adaptive
                and self.sched.mode == Mode.CONCURRENT):
            return {}
        ranks: dict[str, int] = {}
        for (job, _), conn in self.by_key.items():
            if not conn.on_host_cpu:
                return {}  # a GPU job or one that spans hosts: leave the cores alone
            ranks[job] = ranks.get(job, 0) + 1
        jobs = sorted(ranks, key=lambda job: self.sched.order_of(job))
        shares = partition(self.node.cores, [(job, ranks[job]) for job in jobs])
        if shares != self._last_shares:
            self._last_shares = shares
            log.info("cores on node %s: %s", self.node.name,
                     ", ".join(f"{j} {c}" for j, c in shares.items()) or "shared by all")
        return shares
