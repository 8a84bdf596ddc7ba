"""Keeping the nodes' antiphase sequences in step: which node should hand over later.

In antiphase every node alternates its devices between the jobs in one shared order,
but nothing ties the nodes' timing together except each job's allreduce. Where a job's
communication is shorter than the other job's hold, a node's whole sequence can drift
ahead of another's by up to a hold: one node runs job A while the other still runs job
B, and each job's allreduce waits for its later rank (docs/benchmarks.md; in one traced
run a step took 212 ms in such stretches against 177 ms aligned).

An allreduce ends at nearly the same moment on all of a job's ranks, so the difference
of two ranks' waits for it is the difference of the moments they started it: how far
one node's sequence runs ahead of the other's, with no shared clock needed. Each rank
reports the median of its recent waits; the leader compares a job's nodes, and a node
that leads every multi-node job by more than `threshold_s` is told to delay its next
hand-over by that lead (`SlotScheduler.delay_handover`): its device stays free that
long once, and its sequence then starts where the other node's does.

After a correction the reports made before it are stale: the aligner forgets them and
listens again after `settle_s`.

Pure: time comes from an injected clock; the daemon sends the delays it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Correction:
    """`node` runs `lead_s` ahead of the latest node: delay its next hand-over by
    `delay_s` (the lead, capped)."""

    node: int
    lead_s: float
    delay_s: float


class PhaseAligner:
    """Decides from the ranks' allreduce waits which node should hand over later.

    Args:
        clock: monotonic seconds.
        threshold_s: a lead shorter than this is left alone (jitter of the holds).
        max_delay_s: the longest single delay (a lead beyond it is corrected in parts).
        settle_s: after a correction, reports are ignored this long (they describe the
            sequence before it).
        max_age_s: a report older than this does not count.
    """

    def __init__(self, clock: Callable[[], float], threshold_s: float = 0.015,
                 max_delay_s: float = 0.25, settle_s: float = 1.0,
                 max_age_s: float = 3.0) -> None:
        if not (0 < threshold_s <= max_delay_s and settle_s >= 0 and max_age_s > 0):
            raise ValueError(
                f"phase aligner: need 0 < threshold_s <= max_delay_s, settle_s >= 0, "
                f"max_age_s > 0; got threshold_s={threshold_s}, max_delay_s={max_delay_s}, "
                f"settle_s={settle_s}, max_age_s={max_age_s}")
        self.clock = clock
        self.threshold_s, self.max_delay_s = threshold_s, max_delay_s
        self.settle_s, self.max_age_s = settle_s, max_age_s
        self._waits: dict[str, dict[int, tuple[float, float]]] = {}  # job -> node -> (s, t)
        self._quiet_until = float("-inf")
        self.corrections: list[Correction] = []  # every one made, for status

    def report(self, job: str, node: int, wait_s: float,
               members: Mapping[str, Collection[int]]) -> Correction | None:
        """A rank of `job` on `node` waited a median `wait_s` for its recent allreduces
        while its device was served in antiphase; `members` holds the nodes of every
        job. Returns the correction to make, if any."""
        now = self.clock()
        if now < self._quiet_until:
            return None
        self._waits.setdefault(job, {})[node] = (wait_s, now)
        lead = self._leads(now, members)
        if not lead:
            return None
        node, lead_s = max(lead.items(), key=lambda kv: (kv[1], -kv[0]))
        if lead_s < self.threshold_s:
            return None
        correction = Correction(node, lead_s, min(lead_s, self.max_delay_s))
        self.corrections.append(correction)
        self.reset(quiet_s=self.settle_s)
        return correction

    def reset(self, quiet_s: float = 0.0) -> None:
        """Forget every report (the mode or the job mix changed); listen again after
        `quiet_s`."""
        self._waits = {}
        self._quiet_until = self.clock() + quiet_s

    def _leads(self, now: float, members: Mapping[str, Collection[int]]) -> dict[int, float]:
        """Per node heard from, how far its sequence runs ahead of the latest node's: the
        least of its jobs' excess waits over the job's shortest wait. Every job it shares
        with another node must have fresh reports from it and from another node, or
        nothing is known of it yet."""
        fresh = {job: {n: w for n, (w, t) in by_node.items() if now - t <= self.max_age_s}
                 for job, by_node in self._waits.items()}
        leads: dict[int, float] = {}
        for node in {n for by_node in fresh.values() for n in by_node}:
            excess = []
            for job, nodes in members.items():
                if node not in nodes or len(nodes) < 2:
                    continue
                waits = fresh.get(job, {})
                if node not in waits or len(waits) < 2:
                    break
                excess.append(waits[node] - min(waits.values()))
            else:
                if excess:
                    leads[node] = min(excess)
        return leads
