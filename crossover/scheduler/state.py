"""What the slot scheduler keeps per rank and per device, and the grants it hands out.

Plain data: `SlotScheduler` (core.py) owns every instance and is the only writer; the
fast path's preview (preview.py) copies them to look ahead. A device also sums up how
long each job has held it and waited for it, for `crossover status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RankState(str, Enum):
    """Where a rank stands on its device (shown by `crossover status`)."""

    NEW = "new"  # registered, has not asked yet
    WAITING = "waiting"  # asked for the device
    HOLDING = "holding"  # holds it
    BUSY = "busy"  # released to communicate (or at a step boundary), back soon
    IDLE = "idle"  # released for a while (crossover.step() ended)
    SKIPPED = "skipped"  # passed over after --patience; rejoins at the present turn

    def __str__(self) -> str:
        return self.value


NEW, WAITING, HOLDING = RankState.NEW, RankState.WAITING, RankState.HOLDING
BUSY, IDLE, SKIPPED = RankState.BUSY, RankState.IDLE, RankState.SKIPPED
#: The states of a rank a device waits for when its turn comes (see core.py).
ACTIVE = (NEW, WAITING, BUSY)


#: A job's place in the global order: (its start in ns since the epoch, its name), carried
#: by every rank of the job, so every node orders any two jobs alike with no agreement
#: between nodes, and no two jobs share a place (names are unique). Only compared.
JobOrder = tuple[int, str]


class SchedulerError(ValueError):
    """A call that does not fit the scheduler's state (a client bug, reported back)."""


@dataclass(frozen=True)
class SlotGrant:
    """The device is now held by this rank (deliver to the rank's connection)."""

    job: str
    rank: int
    device: str


@dataclass
class RankEntry:
    """One rank registered on a device."""

    job: str
    rank: int
    order: JobOrder
    weight: float
    turn: int  # the key of this rank's next request: its job's offset + `pos`
    state: RankState = NEW
    since: float = 0.0  # when the rank entered `state`
    deadline: float | None = None  # lease end while holding
    joined: float = 0.0
    waited_s: float = 0.0  # accumulated time in WAITING
    pos: int = 0  # requests so far, points passed holding included: where the rank is in
    # its job's request sequence (the same on every rank of the job at the same point)
    # Its job's turn offset from a switch to antiphase, set from the job's points as the
    # leader knew them (the same on every node), until its next request: points passed
    # holding before then count in its turn, not as a pause (`SlotScheduler.set_mode`)
    anchor: int | None = None
    anchor_ends: bool = False  # it released since: it knows, its next request is the last
    # It holds since before the latest switch to antiphase (granted concurrently) and has
    # not released since: its hold excludes other jobs only for a while (`expire`)
    kept_over: bool = False
    device: str = ""  # the device it is registered on


@dataclass
class Spent:
    """One job's time on one device, holding it and waiting for it: the time at least
    one of its ranks there did (wall-clock, not summed over ranks), for metrics."""

    since: float  # its first rank here registered then: a job run again is a new one
    held_s: float = 0.0  # the present hold left out
    waited_s: float = 0.0
    holding: int = 0  # its ranks holding now
    waiting: int = 0
    hold_from: float = 0.0
    wait_from: float = 0.0

    def change(self, old: RankState | None, new: RankState | None, now: float) -> None:
        """One of its ranks goes from `old` to `new` (None: it registers or leaves)."""
        if old == HOLDING:
            self.holding -= 1
            if not self.holding:
                self.held_s += now - self.hold_from
        elif old == WAITING:
            self.waiting -= 1
            if not self.waiting:
                self.waited_s += now - self.wait_from
        if new == HOLDING:
            self.holding += 1
            if self.holding == 1:
                self.hold_from = now
        elif new == WAITING:
            self.waiting += 1
            if self.waiting == 1:
                self.wait_from = now

    def at(self, now: float) -> tuple[float, float]:
        """(held, waited) seconds up to `now`, the present hold and wait included."""
        return (self.held_s + (now - self.hold_from if self.holding else 0.0),
                self.waited_s + (now - self.wait_from if self.waiting else 0.0))


@dataclass
class DeviceEntry:
    """One device: its ranks, the job holding it, and the hold time per job."""

    ranks: dict[tuple[str, int], RankEntry] = field(default_factory=dict)
    holder: str | None = None  # the job holding the device (exclusive policies)
    served: set[int] = field(default_factory=set)  # ranks of `holder` that held this turn
    vtime: float = 0.0  # virtual time of the latest grant: where newcomers start
    hold_start: float = 0.0
    held_s: dict[str, float] = field(default_factory=dict)  # job -> accumulated hold time
    grants: int = 0  # ranks granted it so far (a holder's renewal is not a grant)
    spent: dict[str, Spent] = field(default_factory=dict)  # job -> its time on it
    blocked_since: float | None = None  # free, with waiters, waiting for an active rank
    # The next hand-over to another job waits this long (`SlotScheduler.delay_handover`),
    # and until when the device, free, is closed because of it
    handover_delay: float = 0.0
    closed_until: float | None = None

    def held_now(self, now: float) -> dict[str, float]:
        """Per job, the seconds it has held the device, the present hold included."""
        held = dict(self.held_s)
        if self.holder is not None:
            held[self.holder] = held.get(self.holder, 0.0) + now - self.hold_start
        return held

    def usage(self, now: float) -> dict[str, dict[str, float]]:
        """Per job, the % of time since its first rank joined that it held the device
        and that its ranks (on average) waited for it."""
        held = self.held_now(now)
        usage = {}
        for job in sorted({r.job for r in self.ranks.values()}):
            ranks = [r for r in self.ranks.values() if r.job == job]
            span = max(now - min(r.joined for r in ranks), 1e-9)
            waited = sum(r.waited_s + (now - r.since if r.state == WAITING else 0.0)
                         for r in ranks) / len(ranks)
            usage[job] = {"hold_pct": 100 * held.get(job, 0.0) / span,
                          "wait_pct": 100 * waited / span}
        return usage
