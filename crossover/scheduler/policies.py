"""Who gets a device next, and when a holder gives it up: the scheduling policies.

Every request carries a turn (its job's offset plus the rank's position: the request
points it has passed, see `core`). A policy turns (turn, the job's global order, its
weight) into a sort key; every device grants in key order. Because a job's ranks all
make the same sequence of requests, and the global order is the same on every node, all
devices grant in the same sequence: job A's ranks compute together on all their devices
while job B's ranks communicate, then the roles swap. That is the antiphase crossover
needs, and it keeps collectives deadlock-free.

A policy also says at which phase changes a holder gives the device up.
"""

from __future__ import annotations

from crossover.protocol import Phase
from crossover.scheduler.state import JobOrder


class Policy:
    """Base policy: exclusive devices, one global sequence, release on communication."""

    name = "base"
    #: False lets every request through at once (no coordination, for comparison runs).
    exclusive = True
    #: The holder gives the device up when it starts to communicate.
    release_on_communicate = True
    #: The holder offers the device to waiting jobs at each step boundary.
    yield_on_step = False
    #: The daemon chooses antiphase or concurrent grants by measurement (`mode`).
    adaptive = False

    def keeps_device(self, phase: Phase) -> bool:
        """Whether a holder that enters `phase` keeps the device."""
        if phase == Phase.COMMUNICATE:
            return not self.release_on_communicate
        if phase == Phase.COMPUTE:
            return not self.yield_on_step
        return False

    def key(self, turn: int, order: JobOrder, weight: float) -> tuple[float, JobOrder]:
        """Sort key of a request: lower goes first.

        Args:
            turn: the rank's offset plus position (its job's step count, in effect).
            order: the job's place in the global order, the same on every node.
            weight: the job's priority weight (> 0).
        """
        return (float(turn), order)

    def virtual_time(self, turn: int, weight: float) -> float:
        """The first key component of `turn` (used to bring a newcomer up to date)."""
        return self.key(turn, 0, weight)[0]

    def turn_at(self, vtime: float, weight: float) -> int:
        """The smallest turn whose virtual time is at least `vtime`."""
        turn = int(vtime)
        while self.virtual_time(turn, weight) < vtime:
            turn += 1
        return turn


class CrossoverPolicy(Policy):
    """Phase-aware: a job entering communication hands the device to the next job in
    the global sequence; at a step boundary it keeps computing."""

    name = "crossover"


class AutoPolicy(CrossoverPolicy):
    """Crossover when it pays: the daemon measures the co-located jobs under antiphase
    and under concurrent grants and serves their devices in the faster mode (see
    `mode`). The default."""

    name = "auto"
    adaptive = True


class RoundRobinPolicy(Policy):
    """Whole-step time slicing: a job keeps the device through its communication and
    hands it over at the step boundary. The baseline crossover improves on: the device
    idles while its holder waits on the network."""

    name = "round-robin"
    release_on_communicate = False
    yield_on_step = True


class PriorityPolicy(Policy):
    """Crossover with weighted fair queuing: a job of weight w advances its key by 1/w
    per turn, so when all jobs are always ready a job of weight 2 gets two turns for
    every one of a job of weight 1."""

    name = "priority"
    yield_on_step = True  # step boundaries are where a heavier job can go first

    def key(self, turn: int, order: JobOrder, weight: float) -> tuple[float, JobOrder]:
        return (turn / weight, order)


class OffPolicy(Policy):
    """No coordination: every request is granted at once (for comparison runs)."""

    name = "off"
    exclusive = False


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (AutoPolicy, CrossoverPolicy, RoundRobinPolicy, PriorityPolicy, OffPolicy)
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
