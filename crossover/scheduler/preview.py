"""What the next event on a device would grant: the plan the native fast path executes.

The daemon decides; the fast path only executes (docs/design.md). After the
daemon has applied every event on a device, `preview` asks the scheduler, for each rank,
"if this rank's request (or this holder's release) were the very next event, which
ranks would be granted?", by running that event on a trial copy of the device. The
node's slot table holds the answers while no other event has happened; a rank whose
event comes next executes the answer without waiting for the daemon. It also asks for
the chain of events the daemon expects next under antiphase (the holder releases to
communicate and asks again, then the next holder, ...) and what each grants in that
sequence: while the jobs follow it, handoffs need no daemon at all. Because every
answer is the scheduler's own, the fast path grants exactly the sequence it would.

Pure, like the scheduler: no I/O, time from the scheduler's injected clock.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import Enum

from crossover.protocol import PLANNED_PHASE
from crossover.scheduler.core import SlotScheduler
from crossover.scheduler.policies import Policy
from crossover.scheduler.state import HOLDING, IDLE, SKIPPED, DeviceEntry, SlotGrant

Key = tuple[str, int]  # (job, rank)



class Step(str, Enum):
    """An expected event's kind in a chain."""

    REQUEST = "request"
    RELEASE = "release"


@dataclass(frozen=True)
class Preview:
    """Per rank of one device, the grants its next event would cause.

    Attributes:
        on_request: rank -> the ranks granted if it asks for the device next (ranks
            that hold already are left out: they do not ask).
        on_release: holder -> the ranks granted if it releases in `PLANNED_PHASE` next.
        chain: the expected events from now on, (rank, kind, ranks granted, wake) in
            order.
        concurrent: every request is granted at once, whatever comes before it.
        wakes: the (rank, kind) answers after which the device is free but waits for
            the rank whose turn it is: only the daemon's clock ends that (patience), so
            such an event must reach it at once (as must a chain step marked `wake`).
    """

    on_request: dict[Key, tuple[Key, ...]]
    on_release: dict[Key, tuple[Key, ...]]
    chain: tuple[tuple[Key, Step, tuple[Key, ...], bool], ...]
    concurrent: bool
    wakes: frozenset[tuple[Key, Step]] = frozenset()


def preview(sched: SlotScheduler, device: str, depth: int = 32) -> Preview:
    """The plan for `device` in the scheduler's present state (the state is unchanged).

    Args:
        depth: the longest chain of expected events.

    Raises:
        KeyError: no rank was ever registered on `device`.
    """
    dev = sched._devices[device]
    on_request: dict[Key, tuple[Key, ...]] = {}
    on_release: dict[Key, tuple[Key, ...]] = {}
    wakes: set[tuple[Key, Step]] = set()
    company = sched.company(device)
    for key, r in dev.ranks.items():
        trial = _trial(sched, device)
        if r.state == HOLDING:
            on_release[key] = _keys(trial.release(*key, PLANNED_PHASE))
            kind = Step.RELEASE
        else:
            on_request[key] = _keys(trial.request(*key))
            kind = Step.REQUEST
        if _blocked(trial, device) or trial._moved or key[0] not in company:
            # The daemon must act now: patience runs out only on its clock, a rank back
            # from a pause moved its job's turns on this device alone (`realign`), and a
            # dormant job that asks is company again (the others must be told).
            wakes.add((key, kind))
    return Preview(on_request, on_release, _chain(sched, device, depth),
                   concurrent=not sched.exclusive, wakes=frozenset(wakes))


def _chain(sched: SlotScheduler, device: str, depth: int
           ) -> tuple[tuple[Key, Step, tuple[Key, ...], bool], ...]:
    """The events expected next: while one rank holds, it releases to communicate, then
    asks again (another waiting rank takes the device meanwhile, or nobody does and the
    holder gets it back). Anything else (a gang, nobody holding, a policy that keeps the
    device) ends the chain: the daemon decides there."""
    if not (sched.exclusive and sched.policy.release_on_communicate):
        return ()
    trial = _trial(sched, device)
    chain: list[tuple[Key, Step, tuple[Key, ...], bool]] = []
    while len(chain) + 2 <= depth:
        holders = trial.holders(device)
        if len(holders) != 1:
            break
        (holder,) = holders
        granted = _keys(trial.release(*holder, PLANNED_PHASE))
        chain.append((holder, Step.RELEASE, granted, _blocked(trial, device)))
        granted = _keys(trial.request(*holder))
        chain.append((holder, Step.REQUEST, granted, _blocked(trial, device)))
    return tuple(chain)


def _blocked(trial: SlotScheduler, device: str) -> bool:
    """The device is free and waits for an active rank whose turn it is (patience), or
    for a delayed hand-over to end."""
    dev = trial._devices[device]
    return dev.blocked_since is not None or dev.closed_until is not None


class PlanCache:
    """`preview`, remembered by device state (the daemon plans the same few states over
    and over while jobs alternate). Under the base policy key (turn, order) a state and
    the same state with every turn shifted by one constant order ranks alike, so they
    share one plan; other policies are not cached.

    Args:
        size: plans kept (least recently used go first).
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._plans: OrderedDict[tuple, Preview] = OrderedDict()
        self.hits = self.misses = 0

    def preview(self, sched: SlotScheduler, device: str, depth: int = 32) -> Preview:
        """Like `preview`, from the cache when the state was planned before."""
        sig = _signature(sched, device, depth)
        if sig is None:
            return preview(sched, device, depth)
        plan = self._plans.get(sig)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(sig)
            return plan
        self.misses += 1
        plan = self._plans[sig] = preview(sched, device, depth)
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan


def _signature(sched: SlotScheduler, device: str, depth: int) -> tuple | None:
    """What a device's plan depends on, with turns relative to the lowest; None if the
    policy's keys are not shift-invariant."""
    if type(sched.policy).key is not Policy.key:
        return None
    dev = sched._devices[device]
    if dev.handover_delay or dev.closed_until is not None:
        return None  # rare and short-lived: not worth a place in the cache
    # A rank away (idle or skipped) is in nobody's way, and comes back at the present:
    # only that turn counts, or an idle neighbour's fixed turn would make every state new.
    # Whether it comes back behind the present counts too: that answer wakes the daemon.
    away = (IDLE, SKIPPED)
    turns = {k: max(r.turn, sched.policy.turn_at(dev.vtime, r.weight)) if r.state in away
             else r.turn for k, r in dev.ranks.items()}
    base = min(turns.values(), default=0)
    company = sched.company(device)
    ranks = tuple(sorted((k, r.state, turns[k] - base, r.order, r.weight, turns[k] > r.turn,
                          k[0] in company, r.anchor is not None, r.anchor_ends)
                         for k, r in dev.ranks.items()))
    return (sched.policy.name, sched.mode, depth, ranks, dev.holder,
            tuple(sorted(dev.served)), dev.vtime - base, dev.blocked_since is None)


def _keys(grants: list[SlotGrant]) -> tuple[Key, ...]:
    return tuple((g.job, g.rank) for g in grants)


def _trial(sched: SlotScheduler, device: str) -> SlotScheduler:
    """A scheduler that shares `sched`'s settings and read-only maps but owns a copy of
    `device`'s state (a copy of the whole scheduler per question would cost the daemon
    far more, and only the device changes)."""
    trial = copy.copy(sched)
    trial._moved = {}  # set again if the question's event moves its job's turns
    dev = sched._devices[device]
    trial._devices = {device: DeviceEntry(
        ranks={k: replace(r) for k, r in dev.ranks.items()},
        holder=dev.holder, served=set(dev.served), vtime=dev.vtime,
        hold_start=dev.hold_start, held_s=dict(dev.held_s), blocked_since=dev.blocked_since,
        handover_delay=dev.handover_delay, closed_until=dev.closed_until)}
    return trial
