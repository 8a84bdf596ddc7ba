"""What each mode would give a group of jobs, predicted from the jobs' own steps.

Every job's rank 0 tells its daemon, with its step count, what its steps are made of
(`Profile`): the time the device computes for it (forward, backward, the update) and
the gap in which its gradients are on the wire and the device idles for it. A job's
steps alone show both as they are. Its steps in antiphase show its compute, but the gap
can read long: the job's communication then runs while the other job computes (on a
CPU device, on the same core), and hosts whose turns crossed add a turn to it, so a
prediction from antiphase profiles can over-state what antiphase gains (gaps of 32-99
ms against 11-24 ms alone in bench/results/colocation/crossover_link.json). Concurrent steps show
neither (the neighbour's compute stretches the job's own), so the controller keeps a
profile only from the first two (`crossover.scheduler.mode`).

From the profiles, one round in which every job makes one step lasts:

- in antiphase: the device computes every job's share in turn, and no job steps faster
  than its own compute and gap: max(sum of c + a handover per job, max of c + g + h);
- concurrently (plain co-location): nothing keeps the jobs apart, and jobs sharing a
  device fall into step: they compute at once (the device's work is still the sum of
  c) and then wait out their gaps at once: max(sum of c + max of g, max of c + g).

The second is the worst case of plain co-location (jobs of unequal steps drift and
fill some of each other's gaps), so the ratio is the most antiphase can gain: an upper
bound. Measured on this project's emulated hosts (bench/results/colocation/crossover.json), rows
whose bound was about 1.14x ran 0.98-1.12x, rows whose bound was 1.4x ran 1.12-1.17x.
So a bound close to 1 says antiphase cannot pay (concurrent, which is what plain
co-location does), a bound far above says it pays, and between the two the controller
measures.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from crossover.protocol import Mode


@dataclass(frozen=True)
class Profile:
    """One job's step: `compute_s` on the device, then `gap_s` waiting for its
    gradients with the device idle (seconds per step)."""

    compute_s: float
    gap_s: float

    def blend(self, newer: Profile, weight: float) -> Profile:
        """A moving average: `newer` with `weight`, this with the rest."""
        return Profile(self.compute_s + weight * (newer.compute_s - self.compute_s),
                       self.gap_s + weight * (newer.gap_s - self.gap_s))


@dataclass(frozen=True)
class Prediction:
    """The round lengths of both modes for a group of jobs and what they say.

    Attributes:
        antiphase_s: one round (a step of every job) served in antiphase.
        concurrent_s: one round served concurrently, jobs in step (the worst case).
        figures: the profiles the prediction came from, for a reason: "a 30/10 ms".
    """

    antiphase_s: float
    concurrent_s: float
    figures: str

    @property
    def bound(self) -> float:
        """The most antiphase can gain over concurrent: the ratio of the rounds."""
        return self.concurrent_s / self.antiphase_s if self.antiphase_s > 0 else 1.0

    def favours(self, margin: float, clear: float) -> Mode | None:
        """Concurrent if antiphase cannot gain `margin`, antiphase if it may gain
        `clear` or more; None between (too close to call: measure)."""
        if self.bound < 1 + margin:
            return Mode.CONCURRENT
        return Mode.ANTIPHASE if self.bound >= 1 + clear else None

    @property
    def reason(self) -> str:
        return f"antiphase at most {self.bound:.2f}x concurrent ({self.figures})"


def predict(profiles: dict[str, Profile | None], handover_s: float = 0.0) -> Prediction | None:
    """The prediction for jobs with these profiles; a job without one (it has not
    reported a step yet) is taken to be like the mean of the others. None if no job
    has a profile, or their steps take no time.

    Args:
        profiles: each job's profile, or None.
        handover_s: what one hand-over of a device costs in antiphase.
    """
    known = [p for p in profiles.values() if p is not None]
    if not known:
        return None
    mean = Profile(sum(p.compute_s for p in known) / len(known),
                   sum(p.gap_s for p in known) / len(known))
    each = {job: p or mean for job, p in sorted(profiles.items())}
    if sum(p.compute_s + p.gap_s for p in each.values()) <= 0:
        return None
    computes = sum(p.compute_s for p in each.values())
    longest = max(p.compute_s + p.gap_s for p in each.values())
    antiphase = max(computes + handover_s * len(each), longest + handover_s)
    concurrent = max(computes + max(p.gap_s for p in each.values()), longest)
    figures = ", ".join(
        f"{job} {1e3 * p.compute_s:.1f}/{1e3 * p.gap_s:.1f} ms"
        + ("" if profiles[job] is not None else " (like the others)")
        for job, p in each.items())
    return Prediction(antiphase, concurrent, figures)


#: Weight of a job's newest report in its profile (a moving average).
PROFILE_WEIGHT = 0.3


class Profiles:
    """Each job's profile: a moving average of the reports its caller keeps."""

    def __init__(self) -> None:
        self._by_job: dict[str, Profile] = {}

    def note(self, job: str, profile: Profile) -> bool:
        """Average `profile` into `job`'s (a report of no time, or of negative time, is
        dropped); True if it is the job's first."""
        if profile.compute_s < 0 or profile.gap_s < 0 or profile.compute_s + profile.gap_s <= 0:
            return False
        old = self._by_job.get(job)
        self._by_job[job] = profile if old is None else old.blend(profile, PROFILE_WEIGHT)
        return old is None

    def forget(self, job: str) -> None:
        self._by_job.pop(job, None)

    def known(self) -> set[str]:
        """The jobs with a profile."""
        return set(self._by_job)

    def predict(self, jobs: Iterable[str], handover_s: float) -> Prediction | None:
        """`predict` for `jobs`, each with its profile if it has one."""
        return predict({j: self._by_job.get(j) for j in jobs}, handover_s)

    def snapshot(self) -> dict[str, list[float]]:
        """{job: [compute_s, gap_s]}, for status."""
        return {j: [p.compute_s, p.gap_s] for j, p in sorted(self._by_job.items())}
