"""The slot state machine: devices, jobs, ranks, requests, grants, releases, leases.

Pure: no I/O, no threads, and time comes from an injected clock. Every mutating call
returns the grants it caused, so the daemon only has to deliver them.

A grant is for a job on a device (a gang): the ranks of one job that share a device
hold it together, or one rank would wait for the slot while its peer waits for it inside
the allreduce. A rank that already held the device in the current holding may not join
it again while another job waits; that bounds how long a job can keep a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from crossover.scheduler.policies import Candidate, Phase, Policy


@dataclass(frozen=True)
class Grant:
    """The device is now held by this rank (deliver to the rank's connection)."""

    job: str
    rank: int
    device: str


@dataclass
class _Job:
    order: int
    weight: float
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> device


@dataclass
class _Device:
    holder: str | None = None  # the job holding the device (exclusive policies)
    holding: set[tuple[str, int]] = field(default_factory=set)  # (job, rank) holding now
    served: set[int] = field(default_factory=set)  # ranks of `holder` that held this turn
    waiting: dict[tuple[str, int], float] = field(default_factory=dict)  # -> request time
    last_order: int | None = None
    hold_start: float = 0.0
    held_s: dict[str, float] = field(default_factory=dict)  # job -> accumulated hold time
    deadlines: dict[tuple[str, int], float] = field(default_factory=dict)  # lease ends


class SchedulerError(ValueError):
    """A call that does not fit the scheduler's state (a client bug, reported back)."""


class SlotScheduler:
    """Arbitrates exclusive use of devices among the ranks of several jobs.

    Args:
        policy: who gets a device next (see `policies`).
        clock: returns the current time in seconds (monotonic).
        lease_s: a holder loses its grant this long after it was granted or last
            renewed; covers ranks that hang while holding.
    """

    def __init__(self, policy: Policy, clock: Callable[[], float], lease_s: float = 60.0):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.policy = policy
        self.clock = clock
        self.lease_s = lease_s
        self._jobs: dict[str, _Job] = {}
        self._devices: dict[str, _Device] = {}

    # --- membership -------------------------------------------------------------------
    def register(self, job: str, rank: int, device: str, order: int, weight: float = 1.0):
        """Add a rank of `job` that computes on `device`.

        Args:
            order: the job's place in the global order (the same for all its ranks).
            weight: priority weight, > 0.

        Raises:
            SchedulerError: the rank is registered already, or the order/weight differ
                from the job's other ranks.
        """
        if weight <= 0:
            raise SchedulerError(f"job {job!r}: priority weight must be > 0, got {weight}")
        entry = self._jobs.get(job)
        if entry is None:
            entry = self._jobs[job] = _Job(order=order, weight=weight)
        elif entry.order != order:
            raise SchedulerError(f"job {job!r}: order {order} differs from {entry.order}")
        if rank in entry.ranks:
            raise SchedulerError(f"job {job!r}: rank {rank} is registered already")
        entry.ranks[rank] = device
        self._devices.setdefault(device, _Device())

    def unregister(self, job: str, rank: int) -> list[Grant]:
        """Remove a rank (it finished, crashed or lost its connection); frees its slot."""
        entry = self._jobs.get(job)
        if entry is None or rank not in entry.ranks:
            return []
        device = entry.ranks.pop(rank)
        dev = self._devices[device]
        dev.waiting.pop((job, rank), None)
        grants = self._drop_holding(device, job, rank)
        if not entry.ranks:
            del self._jobs[job]
        return grants

    # --- the hot path -----------------------------------------------------------------
    def request(self, job: str, rank: int) -> list[Grant]:
        """The rank wants its device for compute; granted now or queued.

        A rank that holds already is granted again at once (idempotent).
        """
        device = self._device_of(job, rank)
        dev = self._devices[device]
        key = (job, rank)
        if key in dev.holding:
            dev.deadlines[key] = self.clock() + self.lease_s
            return [Grant(job, rank, device)]
        dev.waiting[key] = self.clock()
        return self._dispatch(device)

    def release(self, job: str, rank: int, phase: Phase) -> list[Grant]:
        """The rank enters `phase`; the policy decides whether it keeps the device.

        A release from a rank that does not hold (say its lease expired) is ignored.
        """
        device = self._device_of(job, rank)
        dev = self._devices[device]
        dev.waiting.pop((job, rank), None)
        if (job, rank) not in dev.holding or self.policy.keeps_device(phase):
            return []
        return self._drop_holding(device, job, rank)

    def renew(self, job: str, rank: int) -> None:
        """Extend the rank's lease on the device it holds (no-op if it holds none)."""
        device = self._device_of(job, rank)
        dev = self._devices[device]
        if (job, rank) in dev.holding:
            dev.deadlines[(job, rank)] = self.clock() + self.lease_s

    def expire(self) -> tuple[list[tuple[str, int, str]], list[Grant]]:
        """Revoke the grants whose lease has run out.

        Returns:
            (revoked, grants): the (job, rank, device) that lost their slot and the
            grants that followed.
        """
        now = self.clock()
        revoked: list[tuple[str, int, str]] = []
        grants: list[Grant] = []
        for device, dev in self._devices.items():
            for key, deadline in sorted(dev.deadlines.items()):
                if deadline <= now and key in dev.holding:
                    revoked.append((key[0], key[1], device))
                    grants += self._drop_holding(device, *key)
        return revoked, grants

    def next_deadline(self) -> float | None:
        """The earliest lease end, so the caller knows when to call `expire` next."""
        ends = [t for dev in self._devices.values() for t in dev.deadlines.values()]
        return min(ends, default=None)

    # --- views ------------------------------------------------------------------------
    def holders(self, device: str) -> set[tuple[str, int]]:
        """The (job, rank) pairs holding `device` now."""
        return set(self._devices[device].holding)

    def waiting(self, device: str) -> list[tuple[str, int]]:
        """The (job, rank) pairs waiting for `device`, oldest request first."""
        dev = self._devices[device]
        return sorted(dev.waiting, key=dev.waiting.__getitem__)

    def snapshot(self) -> dict:
        """A JSON-ready picture for status displays: devices, holders, queues, usage."""
        now = self.clock()
        devices = {}
        for name, dev in sorted(self._devices.items()):
            held = dict(dev.held_s)
            if dev.holder is not None:
                held[dev.holder] = held.get(dev.holder, 0.0) + now - dev.hold_start
            devices[name] = {
                "holder": dev.holder,
                "holding": sorted(f"{j}:{r}" for j, r in dev.holding),
                "waiting": [f"{j}:{r}" for j, r in self.waiting(name)],
                "held_s": held,
            }
        jobs = {
            name: {"order": j.order, "weight": j.weight, "ranks": dict(sorted(j.ranks.items()))}
            for name, j in sorted(self._jobs.items(), key=lambda kv: kv[1].order)
        }
        return {"policy": self.policy.name, "devices": devices, "jobs": jobs}

    # --- internals --------------------------------------------------------------------
    def _device_of(self, job: str, rank: int) -> str:
        try:
            return self._jobs[job].ranks[rank]
        except KeyError:
            raise SchedulerError(f"job {job!r} rank {rank} is not registered") from None

    def _grant(self, device: str, job: str, rank: int) -> Grant:
        dev = self._devices[device]
        now = self.clock()
        dev.waiting.pop((job, rank), None)
        if dev.holder != job and self.policy.exclusive:
            dev.holder = job
            dev.hold_start = now
            dev.served = set()
        dev.holding.add((job, rank))
        dev.served.add(rank)
        dev.deadlines[(job, rank)] = now + self.lease_s
        return Grant(job, rank, device)

    def _drop_holding(self, device: str, job: str, rank: int) -> list[Grant]:
        dev = self._devices[device]
        if (job, rank) not in dev.holding:
            return []
        dev.holding.discard((job, rank))
        dev.deadlines.pop((job, rank), None)
        if self.policy.exclusive and not dev.holding:
            dev.held_s[job] = dev.held_s.get(job, 0.0) + self.clock() - dev.hold_start
            if job in self._jobs:
                dev.last_order = self._jobs[job].order
            dev.holder = None
            dev.served = set()
        return self._dispatch(device)

    def _dispatch(self, device: str) -> list[Grant]:
        dev = self._devices[device]
        if not dev.waiting:
            return []
        if not self.policy.exclusive:
            return [self._grant(device, j, r) for j, r in self.waiting(device)]
        if dev.holder is not None:
            # Peers of the holding job join it, except ranks that held this turn
            # already while another job waits (bounds a job's turn).
            others_wait = any(j != dev.holder for j, _ in dev.waiting)
            joiners = [
                (j, r) for j, r in self.waiting(device)
                if j == dev.holder and not (others_wait and r in dev.served)
            ]
            return [self._grant(device, j, r) for j, r in joiners]
        candidates = {}
        for j, _ in dev.waiting:
            entry = self._jobs[j]
            candidates[j] = Candidate(j, entry.order, entry.weight, dev.held_s.get(j, 0.0))
        chosen = self.policy.choose(list(candidates.values()), dev.last_order)
        ranks = [(j, r) for j, r in self.waiting(device) if j == chosen]
        return [self._grant(device, j, r) for j, r in ranks]
