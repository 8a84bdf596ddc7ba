"""A window of measured step rates: every job's progress in one mode, for a while.

The mode controller (`crossover.scheduler.mode`) opens one per probe window, per watch
window of a hold, and one over a whole antiphase hold. Steps right after a switch are
not counted: the devices' queues drain and refill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from crossover.protocol import Mode


@dataclass
class RateWindow:
    """A measurement of every job's step rate in one mode."""

    mode: Mode
    start: float
    min_s: float  # the window's shortest length
    settle: int  # steps ignored after the window opened
    base: dict[str, int]  # each job's steps when the window opened
    first: dict[str, tuple[int, float]] = field(default_factory=dict)  # after settling
    last: dict[str, tuple[int, float]] = field(default_factory=dict)

    def note(self, job: str, steps: int, now: float) -> None:
        """`job` reached `steps` steps at `now` (steps before settling are not counted)."""
        if job not in self.base:
            return
        if job in self.first:
            self.last[job] = (steps, now)
        elif steps >= self.base[job] + self.settle:
            self.first[job] = self.last[job] = (steps, now)

    def measured(self, job: str, min_steps: int) -> bool:
        """Whether `job` made `min_steps` steps after settling in this window."""
        return job in self.first and self.last[job][0] - self.first[job][0] >= min_steps

    def rate(self, job: str, now: float) -> float:
        """Steps per second of `job` in this window (from the window's start if it never
        made two reports after settling)."""
        if job in self.first and self.last[job][1] > self.first[job][1]:
            (s0, t0), (s1, t1) = self.first[job], self.last[job]
            return (s1 - s0) / (t1 - t0)
        steps = self.last[job][0] - self.base.get(job, 0) if job in self.last else 0
        return steps / max(now - self.start, 1e-9)

    def against(self, references: list[dict[str, float]], jobs: Iterable[str],
                min_steps: int, now: float) -> tuple[float, str] | None:
        """The jobs' mean rate in this window against their mean rates in `references`
        (each {job: steps/s}), and each job's figure; None before every job of `jobs`
        in all references made `min_steps` steps here."""
        if not references:
            return None
        common = set.intersection(*(set(r) for r in references)) & set(jobs)
        if not common or not all(self.measured(j, min_steps) for j in common):
            return None
        per_job = {j: self.rate(j, now) * len(references) / sum(r[j] for r in references)
                   for j in sorted(common) if all(r[j] > 0 for r in references)}
        if not per_job:
            return None
        return sum(per_job.values()) / len(per_job), each_job(per_job)


def each_job(per_job: dict[str, float]) -> str:
    """Each job's figure, for a reason: "a 1.30x, b 1.25x"."""
    return ", ".join(f"{j} {s:.2f}x" for j, s in per_job.items())


def per_job(pairs: list[dict[str, float]]) -> dict[str, float]:
    """Each job's speedup under antiphase averaged over `pairs` (each {job: speedup}),
    for the jobs in every pair."""
    jobs = set.intersection(*(set(p) for p in pairs)) if pairs else set()
    return {j: sum(p[j] for p in pairs) / len(pairs) for j in sorted(jobs)}


def mean_speedup(pairs: list[dict[str, float]]) -> float:
    """The jobs' mean of `per_job` (0 without a job in every pair)."""
    each = per_job(pairs)
    return sum(each.values()) / max(len(each), 1)
