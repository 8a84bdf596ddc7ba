"""Read-only views of the slot scheduler's state: who is where, who holds, who waits,
and the picture `crossover status` shows.

A mixin of `SlotScheduler` (core.py): it reads the scheduler's tables and changes
nothing, so the state machine stays in one module and its queries in another.
"""

from __future__ import annotations

from collections.abc import Callable

from crossover.protocol import Mode
from crossover.scheduler.policies import Policy
from crossover.scheduler.state import HOLDING, IDLE, WAITING, DeviceEntry, JobOrder, RankEntry


class SchedulerViews:
    """The queries of `SlotScheduler` (see core.py for the state they read)."""

    policy: Policy
    clock: Callable[[], float]
    patience_s: float
    mode: Mode
    _where: dict[tuple[str, int], str]
    _jobs: dict[str, tuple[int, float]]
    _devices: dict[str, DeviceEntry]
    _key: Callable[[RankEntry], tuple]  # the grant order (core.py)

    def device_of(self, job: str, rank: int) -> str | None:
        """The device the rank is registered on, None if it is not."""
        return self._where.get((job, rank))

    def order_of(self, job: str) -> JobOrder:
        """The place in the global order of a job with a rank here."""
        return self._jobs[job][0]

    def jobs_on(self, device: str) -> set[str]:
        """The jobs with a rank registered on `device`."""
        dev = self._devices.get(device)
        return {r.job for r in dev.ranks.values()} if dev else set()

    def devices(self) -> list[str]:
        """Every device a rank is registered on."""
        return list(self._devices)

    def company(self, device: str) -> set[str]:
        """The jobs on `device` that are not dormant there (module doc): the ones a rank
        shares the device with."""
        return {job for job in self.jobs_on(device) if not self.dormant(job, device)}

    def dormant(self, job: str, device: str) -> bool:
        """Whether every rank of `job` on `device` has been idle for `patience_s`."""
        dev = self._devices.get(device)
        mine = [r for r in dev.ranks.values() if r.job == job] if dev else []
        now = self.clock()
        return bool(mine) and all(self._dormant(r, now) for r in mine)

    def holders(self, device: str) -> set[tuple[str, int]]:
        """The (job, rank) pairs holding `device` now (none where no rank is)."""
        dev = self._devices.get(device)
        return {k for k, r in dev.ranks.items() if r.state == HOLDING} if dev else set()

    def waiting(self, device: str) -> list[tuple[str, int]]:
        """The (job, rank) pairs waiting for `device`, in the order they will be served."""
        dev = self._devices.get(device)
        if dev is None:
            return []
        ranks = sorted((r for r in dev.ranks.values() if r.state == WAITING), key=self._key)
        return [(r.job, r.rank) for r in ranks]

    def snapshot(self) -> dict:
        """A JSON-ready picture for status displays: devices, holders, queues, usage."""
        now = self.clock()
        devices = {}
        for name, dev in sorted(self._devices.items()):
            usage = dev.usage(now)
            for job, shares in usage.items():
                shares["dormant"] = self.dormant(job, name)
            devices[name] = {
                "holder": dev.holder,
                "holding": sorted(f"{j}:{r}" for j, r in self.holders(name)),
                "waiting": [f"{j}:{r}" for j, r in self.waiting(name)],
                "held_s": dev.held_now(now),
                "usage": usage,
                "ranks": {f"{r.job}:{r.rank}": {"state": r.state, "turn": r.turn}
                          for r in dev.ranks.values()},
            }
        jobs = {name: {"order": o, "weight": w}
                for name, (o, w) in sorted(self._jobs.items(), key=lambda kv: kv[1])}
        return {"policy": self.policy.name, "mode": self.mode.value, "devices": devices,
                "jobs": jobs}

    def accounts(self) -> dict[str, dict]:
        """Per device, the ranks granted it so far and, per job with a rank on it, the
        seconds it held it and waited for it (while any of its ranks there did; the
        present hold or wait included) and since when it is there. A job's time on a
        device goes when its last rank there leaves (for metrics)."""
        now = self.clock()
        out = {}
        for name, dev in sorted(self._devices.items()):
            jobs = {}
            for job, spent in sorted(dev.spent.items()):
                held, waited = spent.at(now)
                jobs[job] = {"held_s": held, "waited_s": waited, "since": spent.since}
            out[name] = {"grants": dev.grants, "jobs": jobs}
        return out

    def _dormant(self, r: RankEntry, now: float) -> bool:
        return r.state == IDLE and now - r.since >= self.patience_s
