"""What the next event on a device would grant: the plan the native fast path executes.

The daemon decides; the fast path only executes (DESIGN.md, invariant 8). After the
daemon has applied every event on a device, `preview` asks the scheduler, for each rank,
"if this rank's request (or this holder's release) were the very next event, which
ranks would be granted?", by running that event on a scratch copy of the device. The
node's slot table holds the answers while no other event has happened; a rank whose
event comes next executes the answer without waiting for the daemon. Because the answer
is the scheduler's own, the fast path grants exactly the sequence the scheduler would.

Pure, like the scheduler: no I/O, time from the scheduler's injected clock.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from crossover.protocol import Phase
from crossover.scheduler.core import HOLDING, SlotScheduler, _Device

Key = tuple[str, int]  # (job, rank)

#: The release phase a plan is made for: the one a holder gives the device up in under
#: crossover (the handoff that happens every step).
PLANNED_PHASE = Phase.COMMUNICATE


@dataclass(frozen=True)
class Preview:
    """Per rank of one device, the grants its next event would cause.

    Attributes:
        on_request: rank -> the ranks granted if it asks for the device next (ranks
            that hold already are left out: they do not ask).
        on_release: holder -> the ranks granted if it releases in `PLANNED_PHASE` next.
        concurrent: every request is granted at once, whatever comes before it.
    """

    on_request: dict[Key, tuple[Key, ...]]
    on_release: dict[Key, tuple[Key, ...]]
    concurrent: bool


def preview(sched: SlotScheduler, device: str) -> Preview:
    """The plan for `device` in the scheduler's present state (the state is unchanged).

    Raises:
        KeyError: no rank was ever registered on `device`.
    """
    dev = sched._devices[device]
    on_request: dict[Key, tuple[Key, ...]] = {}
    on_release: dict[Key, tuple[Key, ...]] = {}
    for key, r in dev.ranks.items():
        scratch = _scratch(sched, device)
        if r.state == HOLDING:
            grants = scratch.release(*key, PLANNED_PHASE)
            on_release[key] = tuple((g.job, g.rank) for g in grants)
        else:
            grants = scratch.request(*key)
            on_request[key] = tuple((g.job, g.rank) for g in grants)
    return Preview(on_request, on_release, concurrent=not sched.exclusive)


def _scratch(sched: SlotScheduler, device: str) -> SlotScheduler:
    """A scheduler that shares `sched`'s settings and read-only maps but owns a copy of
    `device`'s state (a copy of the whole scheduler per question would cost the daemon
    far more, and only the device changes)."""
    scratch = copy.copy(sched)
    dev = sched._devices[device]
    scratch._devices = {device: _Device(
        ranks={k: replace(r) for k, r in dev.ranks.items()},
        holder=dev.holder, served=set(dev.served), vtime=dev.vtime,
        hold_start=dev.hold_start, held_s=dict(dev.held_s), blocked_since=dev.blocked_since)}
    return scratch
