"""Who gets a device next: the scheduling policies.

A policy is consulted by the slot state machine (`core.SlotScheduler`) at two moments:
when a holder signals a phase change (may it keep the device?) and when the device is
free and jobs are waiting (which one is next?). Policies hold no state of their own; what
they need (the global job order, weights, accumulated hold time) is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    """What a rank is doing; sent with every release."""

    COMPUTE = "compute"
    COMMUNICATE = "communicate"
    IDLE = "idle"


@dataclass(frozen=True)
class Candidate:
    """A job waiting for a device, as a policy sees it.

    Args:
        job: the job's name.
        order: the job's place in the global order, the same on every node.
        weight: the job's priority weight (> 0).
        held_s: seconds this job has held this device so far.
    """

    job: str
    order: int
    weight: float
    held_s: float


class Policy:
    """Base policy: exclusive devices, phase-aware release, global cyclic order."""

    name = "base"
    #: False lets every request through at once (no coordination, for comparison runs).
    exclusive = True

    def keeps_device(self, phase: Phase) -> bool:
        """Whether a holder that enters `phase` keeps the device."""
        return False

    def choose(self, waiting: Sequence[Candidate], last_order: int | None) -> str:
        """Pick the next holder among `waiting` (never empty).

        Args:
            waiting: the jobs waiting for the device.
            last_order: the global order of the job that held the device last, if any.

        Returns:
            The name of the job to grant the device to.
        """
        return next_in_cycle(waiting, last_order).job


def next_in_cycle(waiting: Sequence[Candidate], last_order: int | None) -> Candidate:
    """The first waiting job after `last_order` in the cyclic global order.

    Using the one global order on every device is what keeps all ranks of a job in the
    same phase on every device of its group: job k follows job k-1 everywhere.
    """
    ordered = sorted(waiting, key=lambda c: c.order)
    if last_order is not None:
        for cand in ordered:
            if cand.order > last_order:
                return cand
    return ordered[0]


class CrossoverPolicy(Policy):
    """Phase-aware: a job entering communication hands the device to the next job.

    Work-conserving: when the next job in order is not waiting, the first waiting job
    after it gets the device; when nobody waits, the device stays free and the first
    request takes it.
    """

    name = "crossover"


class RoundRobinPolicy(Policy):
    """Whole-step time slicing: a job keeps the device through its communication.

    The baseline that crossover improves on: jobs take turns by whole steps, in the
    global cyclic order, and the device idles while its holder waits on the network.
    """

    name = "round-robin"

    def keeps_device(self, phase: Phase) -> bool:
        return phase == Phase.COMMUNICATE


class PriorityPolicy(Policy):
    """Weighted fair share: the waiting job with the least hold time per weight is next.

    A job of weight 2 gets about twice the device time of a job of weight 1 when both
    are always ready. Ties go by the global cyclic order, so every device decides alike.
    """

    name = "priority"

    def choose(self, waiting: Sequence[Candidate], last_order: int | None) -> str:
        least = min(c.held_s / c.weight for c in waiting)
        # Within 1 ms of the least share counts as a tie: keeps decisions stable
        # against clock jitter between devices.
        tied = [c for c in waiting if c.held_s / c.weight - least <= 1e-3]
        return next_in_cycle(tied, last_order).job


class OffPolicy(Policy):
    """No coordination: every request is granted at once (for comparison runs)."""

    name = "off"
    exclusive = False


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (CrossoverPolicy, RoundRobinPolicy, PriorityPolicy, OffPolicy)
}


def make_policy(name: str) -> Policy:
    """Build a policy by name.

    Raises:
        ValueError: the name is not one of `POLICIES`, with the valid names.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
