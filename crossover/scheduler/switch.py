"""Switching a scheduler between serving devices concurrently and in antiphase.

A mixin of `SlotScheduler` (core.py), as the views are: the daemons' mode decision
(`mode.py`) flips it while ranks hold, wait and step, so a switch has to leave every
node's turns in one order and must not strand a rank behind a hold it cannot see end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from crossover.protocol import Mode
from crossover.scheduler.policies import Policy
from crossover.scheduler.state import (
    HOLDING,
    WAITING,
    DeviceEntry,
    RankEntry,
    SchedulerError,
    SlotGrant,
)


class ModeSwitching:
    """`SlotScheduler.set_mode` and what follows from it (see core.py for the state)."""

    policy: Policy
    clock: Callable[[], float]
    mode: Mode
    _devices: dict[str, DeviceEntry]
    _moved: dict[str, int]
    _dispatch: Callable[[str], list[SlotGrant]]  # core.py

    @property
    def exclusive(self) -> bool:
        """Whether devices are held by one job at a time now (policy and mode)."""
        return self.policy.exclusive and self.mode == Mode.ANTIPHASE

    def set_mode(self, mode: Mode, points: Mapping[str, int] | None = None) -> list[SlotGrant]:
        """Serve devices in `mode` from now on; returns the grants that follows.

        Going to concurrent grants every waiting rank. Going to antiphase grants
        nothing new on a device while two jobs still hold it (they drain at their next
        release); a device held by one job keeps it as the holder of the turn. Such
        holds, kept over from concurrent mode, exclude another job that waits for
        `patience_s` only (`_behind_kept_over`).

        Args:
            points: going to antiphase, each job's request points so far, the same on
                every node (the leader's, from the jobs' reports): the turns restart from
                them. Without them each node restarts from where its own ranks are,
                and nodes that apply the switch at different moments (ranks that passed
                different points holding) order the jobs differently: each job's ranks
                then compute one turn apart, and every step waits out both jobs'
                communication (seen at 0.83-0.92x concurrent on the emulated hosts).

        Raises:
            SchedulerError: antiphase under a policy that is never exclusive (off).
        """
        if mode == Mode.ANTIPHASE and not self.policy.exclusive:
            raise SchedulerError(f"policy {self.policy.name!r} cannot serve in antiphase")
        if mode == self.mode:
            return []
        self.mode = mode
        now = self.clock()
        grants: list[SlotGrant] = []
        for dev in self._devices.values():
            if mode == Mode.CONCURRENT and dev.holder is not None:
                dev.held_s[dev.holder] = dev.held_s.get(dev.holder, 0.0) + now - dev.hold_start
            dev.holder, dev.served = None, set()  # antiphase: _dispatch finds the holder
            dev.handover_delay, dev.closed_until = 0.0, None  # phases of the old mode
        if mode == Mode.ANTIPHASE:
            self._restart_turns(points or {})
            for dev in self._devices.values():
                for r in dev.ranks.values():
                    r.kept_over = r.state == HOLDING
        for name in self._devices:
            grants += self._dispatch(name)
        return grants

    def _restart_turns(self, points: Mapping[str, int]) -> None:
        """Start the turn sequence afresh: turns drift apart while jobs step at their own
        rates, and a job behind would take every turn until it caught up. Every job's
        next point (from `points`, else its leading rank's) gets the present turn; its
        ranks keep their distance to it in the job's sequence, so every device orders
        the jobs alike (global order breaks ties)."""
        ranks = [r for dev in self._devices.values() for r in dev.ranks.values()]
        if not ranks:
            return
        now = max(self.policy.virtual_time(r.turn, r.weight) for r in ranks)
        for job in {r.job for r in ranks}:
            mine = [r for r in ranks if r.job == job]
            lead = points.get(job, max(r.pos for r in mine))
            offset = self.policy.turn_at(now, mine[0].weight) - lead
            for r in mine:
                r.turn, r.anchor = offset + r.pos, offset if job in points else None
                r.anchor_ends = False
        self._moved.clear()
        for dev in self._devices.values():
            if dev.ranks:
                dev.vtime = now

    def _behind_kept_over(self, dev: DeviceEntry) -> list[RankEntry]:
        """Ranks of other jobs waiting while only holds kept over from concurrent mode
        hold the device. Such a holder learns of the switch at its next release point
        and keeps the device through its communication until then; inside its allreduce
        it may wait for a peer that waits, on another device, behind the other job's
        kept-over hold (a cycle that only the lease would end). So after `patience_s`
        `expire` serves the first such job beside the hold, as concurrently."""
        holding = [r for r in dev.ranks.values() if r.state == HOLDING]
        if not self.exclusive or not holding or not all(r.kept_over for r in holding):
            return []
        jobs = {r.job for r in holding}
        return [r for r in dev.ranks.values() if r.state == WAITING and r.job not in jobs]
