"""The slot state machine: devices, jobs, ranks, requests, grants, releases, leases.

Pure: no I/O, no threads, and time comes from an injected clock. Every mutating call
returns the grants it caused, so the daemon only has to deliver them.

One sequence everywhere: a device grants requests in the policy's key order (turn,
global job order). It waits for the rank whose key is lowest even if another rank asks
first, as long as that rank is active (it has not gone idle); that keeps every device of
a job group in the same sequence, so a job's ranks hold their devices at the same time.
A rank that keeps a device waiting longer than `patience_s` without asking is passed over
until it asks (so a slow or stuck job cannot stall the others). A job whose ranks on a
device have all been idle for `patience_s` is dormant there: it is not company (`company`)
until it asks again, so the jobs beside it keep the device through communication instead
of handing it to nobody.

A grant is for a job on a device (a gang): the ranks of one job that share a device
hold it together, or one rank would wait for the slot while its peer waits for it inside
the allreduce. A rank that held the device in the current turn may not join it again
while another job waits; that bounds how long a job keeps a device.

One sequence needs one turn offset per job. A rank's turn is its job's offset plus its
position: the request points it has passed, which the client counts and names in each
request (`pos`), the points it passed holding included (alone, or served concurrently, a
rank keeps its device where it would release it, and skips the request after; its peers,
told of company at other moments, may have asked there). Ranks of a job at the same point
of their (identical) programs so have the same key on every device, and every device
orders the jobs alike. A rank that comes back from a pause (idle, passed over, or points
passed holding) starts at its device's present turn, which moves its job's offset:
`misaligned` then says so, and `realign` (the daemon calls it at once, as a change of
every device) gives the job's other ranks the same offset. Left crossed, device 0 serves
job A while device 1 serves job B, and each job's allreduce waits for its rank on the
other device.
"""

from __future__ import annotations

from collections.abc import Callable

from crossover.protocol import Mode, Phase
from crossover.scheduler.policies import Policy
from crossover.scheduler.state import (
    ACTIVE,
    BUSY,
    HOLDING,
    IDLE,
    NEW,
    SKIPPED,
    WAITING,
    DeviceEntry,
    JobOrder,
    RankEntry,
    RankState,
    SchedulerError,
    SlotGrant,
    Spent,
)
from crossover.scheduler.switch import ModeSwitching
from crossover.scheduler.views import SchedulerViews


class SlotScheduler(ModeSwitching, SchedulerViews):
    """Arbitrates exclusive use of devices among the ranks of several jobs.

    Args:
        policy: who goes next and when holders give up (see `policies`).
        clock: returns the current time in seconds (monotonic).
        lease_s: a holder loses its grant this long after it was granted or last
            renewed; covers ranks that hang while holding.
        patience_s: how long a free device waits for the active rank whose turn it is
            before passing it over.
    """

    def __init__(self, policy: Policy, clock: Callable[[], float], lease_s: float = 60.0,
                 patience_s: float = 1.0, max_hold_s: float | None = None):
        if lease_s <= 0 or patience_s <= 0:
            raise ValueError(f"lease_s and patience_s must be > 0, got {lease_s}, {patience_s}")
        self.policy = policy
        self.clock = clock
        self.lease_s = lease_s
        #: past this long one hold is renewed no more while another job waits for its
        #: device (None: renewed for as long as the rank asks)
        self.max_hold_s = max_hold_s
        self.patience_s = patience_s
        self._where: dict[tuple[str, int], str] = {}  # (job, rank) -> device
        self._jobs: dict[str, tuple[JobOrder, float]] = {}  # job -> (order, weight)
        self._devices: dict[str, DeviceEntry] = {}
        # Concurrent serves every request at once, as plain co-location does (see
        # `mode`); an exclusive policy starts in antiphase.
        self.mode = Mode.ANTIPHASE if policy.exclusive else Mode.CONCURRENT
        # job -> the offset a rank back from a pause gave it, until `realign` spreads it
        self._moved: dict[str, int] = {}

    # --- membership -------------------------------------------------------------------
    def register(self, job: str, rank: int, device: str, order: JobOrder,
                 weight: float = 1.0) -> None:
        """Add a rank of `job` that computes on `device`.

        Args:
            order: the job's place in the global order (the same for all its ranks, and on
                every node).
            weight: priority weight, > 0.

        Raises:
            SchedulerError: the rank is registered already, or the order/weight differ
                from the job's other ranks.
        """
        if not weight > 0:
            raise SchedulerError(f"job {job!r}: priority weight must be > 0, got {weight}")
        if self._jobs.setdefault(job, (order, weight)) != (order, weight):
            raise SchedulerError(f"job {job!r}: order/weight {(order, weight)} differ from "
                                 f"its other ranks' {self._jobs[job]}")
        if (job, rank) in self._where:
            raise SchedulerError(f"job {job!r}: rank {rank} is registered already")
        dev = self._devices.setdefault(device, DeviceEntry())
        # The job's offset if it has ranks here already (a rank that registers late
        # starts where its peers started), or the device's present turn.
        offsets = self._offsets(job)
        turn = self._moved.get(job, max(offsets)) if offsets \
            else self.policy.turn_at(dev.vtime, weight)
        self._where[(job, rank)] = device
        now = self.clock()
        dev.ranks[(job, rank)] = RankEntry(job, rank, order, weight, turn, NEW, now, joined=now,
                                           device=device)
        dev.spent.setdefault(job, Spent(since=now))

    def unregister(self, job: str, rank: int) -> list[SlotGrant]:
        """Remove a rank (it finished, crashed or lost its connection); frees its slot."""
        device = self._where.pop((job, rank), None)
        if device is None:
            return []
        dev = self._devices[device]
        r = dev.ranks.pop((job, rank))
        self._drop_holding(device, r)
        spent = dev.spent.get(job)
        if any(j == job for j, _ in dev.ranks):
            if spent is not None:
                spent.change(r.state, None, self.clock())
        else:
            dev.spent.pop(job, None)  # its last rank here: its time here goes with it
        if not any(j == job for j, _ in self._where):
            del self._jobs[job]
        if not dev.ranks:
            # Forgotten with its last rank: a node that once served a job over many
            # devices would otherwise walk them all on every change for ever.
            del self._devices[device]
            return []
        return self._dispatch(device)

    # --- the hot path -----------------------------------------------------------------
    def request(self, job: str, rank: int, pos: int | None = None) -> list[SlotGrant]:
        """The rank wants its device for compute; granted now or queued.

        A rank that holds already is granted again at once (idempotent).

        Args:
            pos: the request's point in the rank's sequence (1 for its first), counted by
                the client; None: the point after its last request.
        """
        device, r = self._lookup(job, rank)
        dev = self._devices[device]
        if r.state == HOLDING:
            r.deadline = self.clock() + self.lease_s
            return [SlotGrant(job, rank, device)]
        kept = 0 if pos is None else max(0, pos - 1 - r.pos)
        if r.anchor is not None:
            # Its turn counts from its job's points at the switch, and so do the points it
            # passes holding until it first asks after a release (it learns of the switch
            # from its daemon's notice, later than the daemon, and keeps until then).
            r.pos += kept
            r.turn = r.anchor + r.pos
            if r.anchor_ends:
                r.anchor, r.anchor_ends = None, False
        elif r.state in (IDLE, SKIPPED) or kept:
            # Back after a pause: start at the present, not with a backlog of turns. Points
            # passed holding count in the position, not in the turn (the rank did not
            # queue for them), so they lower the offset; on this device only: the job's
            # other ranks follow at `realign`.
            r.pos += kept
            turn = max(r.turn, self.policy.turn_at(dev.vtime, r.weight))
            if turn != r.turn or kept:
                r.turn = turn
                self._moved[job] = r.turn - r.pos
        self._set(r, WAITING)
        return self._dispatch(device)

    def release(self, job: str, rank: int, phase: Phase) -> list[SlotGrant]:
        """The rank enters `phase`; the policy decides whether it keeps the device.

        A release from a rank that does not hold (say its lease expired) only records
        the phase.
        """
        device, r = self._lookup(job, rank)
        if r.state == HOLDING and self.policy.keeps_device(phase):
            return []
        r.anchor_ends = r.anchor is not None  # it knows of the switch (see `request`)
        self._drop_holding(device, r)
        self._set(r, IDLE if phase == Phase.IDLE else BUSY)
        return self._dispatch(device)

    def misaligned(self) -> bool:
        """Whether a job's ranks have different turn offsets (see the module doc): the
        caller should `realign` now, else `forget_moves`. Only exclusive grants use
        turns."""
        return self.exclusive and any(o != offset for job, offset in self._moved.items()
                                      for o in self._offsets(job))

    def forget_moves(self) -> None:
        """Drop the offsets a rank back from a pause gave its job when `realign` is not
        needed (its peers agree, or grants are concurrent): while any is kept, plans are
        not previewed (`preview`), so the fast path would wait for the daemon."""
        if not self.misaligned():
            self._moved.clear()

    def realign(self) -> list[SlotGrant]:
        """Give every rank of a job the offset its latest rank back from a pause gave it;
        returns the grants that follow.

        A change of every device at once: the daemon withdraws the plans of all devices
        first (it does the same for a mode switch)."""
        for job, offset in self._moved.items():
            for r in self._ranks_of(job):
                r.turn = offset + r.pos
        self._moved.clear()
        grants: list[SlotGrant] = []
        for name in self._devices:
            grants += self._dispatch(name)
        return grants

    def delay_handover(self, device: str, seconds: float) -> None:
        """Hand `device` to the next job `seconds` later than it would be, once.

        The daemons align the nodes' phases with it: a node whose turns run ahead of
        another's (its jobs' allreduces wait for their ranks there) leaves its device
        free that long at the next hand-over, and its sequence then starts where the
        other node's does. Only exclusive grants hand over; a mode switch drops it.

        Raises:
            SchedulerError: an unknown device, or `seconds` not in (0, patience].
        """
        if device not in self._devices:
            raise SchedulerError(f"device {device!r} has no rank registered")
        if not 0 < seconds <= self.patience_s:
            raise SchedulerError(f"a hand-over delay must be in (0, patience "
                                 f"{self.patience_s} s], got {seconds}")
        self._devices[device].handover_delay = seconds

    def renew(self, job: str, rank: int) -> None:
        """Extend the rank's lease on the device it holds (no-op if it holds none), unless
        it has held it `max_hold_s` while another job waits for it: then its lease runs
        out as it stands, and `expire` revokes it (renewals alone do not keep a device
        from the others)."""
        device, r = self._lookup(job, rank)
        if r.state != HOLDING:
            return
        now = self.clock()
        if self.max_hold_s is not None and now - r.since >= self.max_hold_s and any(
                w.state == WAITING and w.job != job
                for w in self._devices[device].ranks.values()):
            return
        r.deadline = now + self.lease_s

    def expire(self) -> tuple[list[tuple[str, int, str]], list[SlotGrant]]:
        """Revoke grants whose lease ran out; pass over ranks that kept a device waiting.

        Returns:
            (revoked, grants): the (job, rank, device) that lost their slot and the
            grants that followed.
        """
        now = self.clock()
        revoked: list[tuple[str, int, str]] = []
        grants: list[SlotGrant] = []
        for device, dev in self._devices.items():
            for r in list(dev.ranks.values()):
                if r.state == HOLDING and r.deadline is not None and r.deadline <= now:
                    revoked.append((r.job, r.rank, device))
                    self._drop_holding(device, r)
                    self._set(r, SKIPPED)
            if dev.blocked_since is not None and now - dev.blocked_since >= self.patience_s:
                blocker = self._next_in_line(dev)
                if blocker is not None and blocker.state != WAITING:
                    self._set(blocker, SKIPPED)
            late = [r for r in self._behind_kept_over(dev) if now - r.since >= self.patience_s]
            if late:
                first = min(late, key=self._key)
                dev.holder = None  # served beside the hold, as in the mode it was granted
                grants += [self._grant(device, r) for r in late if r.job == first.job]
            grants += self._dispatch(device)
        return revoked, grants

    def next_deadline(self) -> float | None:
        """The earliest lease end or patience limit: when to call `expire` next."""
        ends = [r.deadline for dev in self._devices.values() for r in dev.ranks.values()
                if r.state == HOLDING and r.deadline is not None]
        ends += [dev.blocked_since + self.patience_s for dev in self._devices.values()
                 if dev.blocked_since is not None]
        ends += [r.since + self.patience_s for dev in self._devices.values()
                 for r in self._behind_kept_over(dev)]
        ends += [dev.closed_until for dev in self._devices.values()
                 if dev.closed_until is not None]
        # a rank turning dormant changes its device's company: the daemon tells the others
        now = self.clock()
        ends += [r.since + self.patience_s for dev in self._devices.values()
                 for r in dev.ranks.values()
                 if r.state == IDLE and r.since + self.patience_s > now]
        return min(ends, default=None)

    # --- internals --------------------------------------------------------------------
    def _lookup(self, job: str, rank: int) -> tuple[str, RankEntry]:
        device = self._where.get((job, rank))
        if device is None:
            raise SchedulerError(f"job {job!r} rank {rank} is not registered")
        return device, self._devices[device].ranks[(job, rank)]

    def _ranks_of(self, job: str) -> list[RankEntry]:
        return [self._devices[d].ranks[(j, r)] for (j, r), d in self._where.items() if j == job]

    def _offsets(self, job: str) -> list[int]:
        return [r.turn - r.pos for r in self._ranks_of(job)]

    def _key(self, r: RankEntry) -> tuple:
        return (*self.policy.key(r.turn, r.order, r.weight), r.rank)

    def _set(self, r: RankEntry, state: RankState) -> None:
        now = self.clock()
        spent = self._devices[r.device].spent.get(r.job)  # none in a preview's trial
        if spent is not None:
            spent.change(r.state, state, now)
        r.state, r.since = state, now

    def _next_in_line(self, dev: DeviceEntry) -> RankEntry | None:
        # A rank anchored at a switch is not waited for: until it asks, nobody knows how
        # many points it passed holding (the leader's report of them may be late).
        active = [r for r in dev.ranks.values()
                  if r.state in ACTIVE and (r.anchor is None or r.state == WAITING)]
        return min(active, key=self._key, default=None)

    def _grant(self, device: str, r: RankEntry) -> SlotGrant:
        dev = self._devices[device]
        now = self.clock()
        if dev.holder != r.job and self.exclusive:
            dev.holder, dev.hold_start, dev.served = r.job, now, set()
        dev.served.add(r.rank)
        dev.grants += 1
        r.waited_s += now - r.since
        dev.vtime = max(dev.vtime, self.policy.virtual_time(r.turn, r.weight))
        r.turn += 1
        r.pos += 1
        r.deadline = now + self.lease_s
        self._set(r, HOLDING)
        return SlotGrant(r.job, r.rank, device)

    def _drop_holding(self, device: str, r: RankEntry) -> None:
        dev = self._devices[device]
        if r.state != HOLDING:
            return
        self._set(r, BUSY)
        r.deadline, r.kept_over = None, False
        if self.exclusive and not self.holders(device):
            if dev.holder == r.job:  # (after a switch to antiphase, nobody may own the turn)
                dev.held_s[r.job] = dev.held_s.get(r.job, 0.0) + self.clock() - dev.hold_start
            dev.holder = None
            dev.served = set()

    def _dispatch(self, device: str) -> list[SlotGrant]:
        dev = self._devices[device]
        waiting = [r for r in dev.ranks.values() if r.state == WAITING]
        if not waiting:
            dev.blocked_since = None
            return []
        if not self.exclusive:
            return [self._grant(device, r) for r in waiting]
        if dev.holder is None:
            holding = {r.job for r in dev.ranks.values() if r.state == HOLDING}
            if len(holding) > 1:
                # Several jobs still hold from concurrent mode: no grant until they drain.
                return []
            if holding:  # the last one left owns the turn
                dev.holder, dev.hold_start = holding.pop(), self.clock()
                dev.served = {r.rank for r in dev.ranks.values() if r.state == HOLDING}
        if dev.holder is not None:
            dev.blocked_since = None
            # Peers of the holding job join it, except ranks that held this turn
            # already while another job waits (bounds a job's turn).
            others_wait = any(r.job != dev.holder for r in waiting)
            return [self._grant(device, r) for r in sorted(waiting, key=self._key)
                    if r.job == dev.holder and not (others_wait and r.rank in dev.served)]
        if dev.closed_until is not None:
            if self.clock() < dev.closed_until:
                return []  # a delayed hand-over (`delay_handover`): `expire` opens it
            dev.closed_until = None
        first = self._next_in_line(dev)
        if first is None or first.state != WAITING:
            # The device waits for the active rank whose turn it is (see module doc).
            if dev.blocked_since is None:
                dev.blocked_since = self.clock()
            return []
        dev.blocked_since = None
        if dev.handover_delay > 0:
            dev.closed_until = self.clock() + dev.handover_delay
            dev.handover_delay = 0.0
            return []
        # The whole gang of the chosen job that is waiting now, in key order.
        return [self._grant(device, r) for r in sorted(waiting, key=self._key)
                if r.job == first.job]
