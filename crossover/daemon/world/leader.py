"""The daemons' world, one process per node in one MPI world: the leader decides each group
of jobs' mode, every daemon applies it, and status and shutdown go to all. The jobs'
order is no one's decision: every rank of a job carries its place (`ranks`). This module
holds the leader's part (`Leader`); what a node does with the leader's messages is the
node service's (`crossover.daemon.node.service`).

Messages between daemons are small tuples, through each node's relay (`uplink`):
    ("join", job) / ("leave", job)        to the leader: a job's first / last rank here
    ("progress", job, steps, local, points, compute_s, gap_s)
                                          to the leader: a job's step count and profile
    ("mode", mode, reason, points)        from the leader: serve devices in `mode`; to
                                          antiphase, turns restart from the jobs' points
    ("waited", job, wait_s)               to the leader: a rank's allreduce waits (phases)
    ("delay", delay_s, lead_s)            from the leader: this node's turns run ahead
    ("status?", token) / ("status!", token, node, snapshot)
    ("shutdown",)                         from the leader: idle for idle_shutdown_s, or
                                          stopped (`crossover stop`)
    ("stop_world",)                       to the leader: `crossover stop` here
    ("beat", epoch, leader)               member to leader and back (liveness), with
                                          the sender's view; a leader's beat of a newer
                                          epoch is its lead
    ("members", alive, lost_nodes)        from the leader: who is in the world now
    ("lead", epoch)                       from a new leader (or to a member back):
                                          answer with what you hold
    ("hold", jobs)                        to the leader: the jobs with a rank here
    ("epoch", epoch, leader)              to a peer that follows an older leader
    ("prevote", epoch) / ("object", epoch, leader)
                                          next in line after a silent leader asks; a
                                          peer that still hears it objects

Who leads, and who is lost, is `membership`'s; the leader may be any rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from crossover.daemon.relay.uplink import Uplink
from crossover.scheduler import ModeController, ModeSwitch
from crossover.scheduler.groups import Groups
from crossover.scheduler.phase import PhaseAligner
from crossover.scheduler.predict import Profile

log = logging.getLogger("crossover.daemon")

#: The bounds (s) of the mode decisions' histogram: a probe takes a pair of windows of
#: at least 2 s after its jobs settle, a close call up to three pairs.
DECISION_BUCKETS_S = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Durations:
    """A histogram of durations as Prometheus keeps one: per upper bound, how many were
    at most that (cumulative), and their sum and number."""

    bounds: tuple[float, ...] = DECISION_BUCKETS_S
    at_most: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.at_most = self.at_most or [0] * len(self.bounds)

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.at_most[i] += 1
        self.sum_s += seconds
        self.count += 1

    def copy(self) -> Durations:
        return Durations(self.bounds, list(self.at_most), self.sum_s, self.count)


class Leader:
    """The leader's decisions: each group's mode (policy auto), the nodes' phases
    (`--align-phases`) and the idle shutdown.

    Messages about a job go to its nodes only, and about a group's mode to the group's
    nodes only (`crossover.scheduler.groups`): a job arriving in one group sends nothing
    to, and changes nothing in, another group's nodes.

    Args:
        peers: the daemons' channel (this daemon leads it).
        new_modes: makes one group's mode decision, or None under a fixed policy.
        aligner: the phase aligner, or None.
        idle_shutdown_s: shut every daemon down after no job anywhere for this long.
        clock: monotonic clock.
    """

    def __init__(self, peers: Uplink, new_modes: Callable[[], ModeController] | None,
                 aligner: PhaseAligner | None, idle_shutdown_s: float | None,
                 clock: Callable[[], float]) -> None:
        self.peers, self.new_modes, self.aligner = peers, new_modes, aligner
        self.idle_shutdown_s, self.clock = idle_shutdown_s, clock
        self.groups = Groups()
        self._modes: dict[int, ModeController] = {}  # group -> its mode decision
        self._members: dict[str, set[int]] = {}  # job -> daemon ranks with its ranks
        self._points: dict[str, int] = {}  # job -> its request points, reported
        self._idle_since: float | None = clock()
        self._shut = False
        self.decisions = Durations()  # how long each group's mode decisions took

    def handle(self, source: int, msg: tuple) -> bool:
        """A message for the leader from daemon `source`; False if it is not one."""
        kind = msg[0]
        if kind == "join":
            self._join(source, msg[1])
        elif kind == "hold":
            self._hold(source, msg[1])
        elif kind == "leave":
            self._leave(source, msg[1])
        elif kind == "stop_world":  # `crossover stop` on a member's node
            self.peers.broadcast(("shutdown",), lost_too=True)
        elif kind == "waited":
            self._align(msg[1], source, msg[2])
        elif kind == "progress":
            group = self.groups.group_of(msg[1])
            if group in self._modes and msg[1] in self._members:
                self._points[msg[1]] = max(msg[4], self._points.get(msg[1], 0))
                profile = Profile(*msg[5:7]) if len(msg) >= 7 else None
                self._announce(group, self._modes[group].progress(msg[1], msg[2], msg[3],
                                                                  profile))
        else:
            return False
        return True

    def tick(self) -> None:
        """The mode decisions' clock: a probe window or a hold may have ended."""
        for group, modes in list(self._modes.items()):
            self._announce(group, modes.tick())

    def next_deadline(self) -> float | None:
        ends = [m.next_deadline() for m in self._modes.values()]
        return min((e for e in ends if e is not None), default=None)

    def snapshot(self) -> dict | None:
        """Each group's mode decision and jobs, for status."""
        if self.new_modes is None:
            return None
        return {str(g): {**m.snapshot(), "jobs": sorted(self.groups.jobs(g))}
                for g, m in sorted(self._modes.items())}

    def check_idle(self, busy_here: bool) -> None:
        """Shut every daemon down once no job was anywhere for idle_shutdown_s."""
        if self.idle_shutdown_s is None or self._shut:
            return
        now = self.clock()
        if busy_here or self._members:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.idle_shutdown_s:
            log.info("no job for %.0f s: shutting down", self.idle_shutdown_s)
            self._shut = True  # once: the broadcast reaches this daemon too
            self.peers.broadcast(("shutdown",), lost_too=True)

    def close(self) -> None:
        """Nothing to release (a `leading.LeaderThread` stops its thread)."""

    # --- succession and re-formation ------------------------------------------------------
    def _hold(self, source: int, present: list[str]) -> None:
        """Daemon `source` says which jobs have a rank there (this leader is new, or the
        node is back). A job the leader had there that is not present left it (its
        service was started again, say)."""
        for job in [j for j, m in self._members.items() if source in m and j not in present]:
            self._leave(source, job)
        for job in present:
            self._join(source, job)
        # A mode switch sent while the node changed generation was lost: say its
        # groups' modes again (a node in that mode already changes nothing).
        for group in sorted({self.groups.group_of(j) for j in present}):
            modes = self._modes.get(group)
            if modes is not None and modes.state != "solo":
                self.peers.send(source, ("mode", modes.mode.value, modes.reason,
                                         self._group_points(group)))

    def renumber(self, ranks_now: dict[int, int]) -> None:
        """The world was re-formed: daemon ranks become `ranks_now[rank]` (a rank not in
        it was lost, and left already)."""
        def remap(ranks: set[int]) -> set[int]:
            return {ranks_now[r] for r in ranks if r in ranks_now}
        self._members = {job: remap(m) for job, m in self._members.items()}
        self.groups.renumber(ranks_now)

    def member_lost(self, rank: int) -> None:
        """Daemon `rank` is lost: its jobs leave its node, as if their ranks had closed
        there (a job left on no node is forgotten)."""
        for job in [job for job, members in self._members.items() if rank in members]:
            self._leave(rank, job)

    # --- jobs -------------------------------------------------------------------------------
    def _join(self, source: int, job: str) -> None:
        """`job` has ranks on daemon `source`: its group may grow or merge with others."""
        members = self._members.setdefault(job, set())
        if source in members:
            return
        if not members and self.aligner is not None:
            self.aligner.reset()  # a new job mix: new phases
        members.add(source)
        regroup = self.groups.join(job, source)
        for ended in regroup.ended:
            self._modes.pop(ended, None)
        group = regroup.group
        if self.new_modes is not None and group not in self._modes:
            self._modes[group] = self.new_modes()
        modes = self._modes.get(group)
        if modes is not None and modes.state != "solo":
            # a node new to the group serves in the group's mode from the start
            self.peers.send(source, ("mode", modes.mode.value, modes.reason,
                                     self._group_points(group)))

    def _leave(self, source: int, job: str) -> None:
        """A job's last rank on daemon `source` left."""
        members = self._members.get(job)
        if members is None:
            return  # forgotten already
        members.discard(source)
        group = self.groups.group_of(job)
        regroup = self.groups.leave(job, source)
        if members:
            return
        self._members.pop(job, None)
        self._points.pop(job, None)
        modes = self._modes.get(group)
        for number, part in regroup.split.items():
            if modes is not None:  # the jobs that split off are decided apart
                for moved in part:
                    modes.leave(moved)
                self._modes[number] = self.new_modes()
        if modes is not None:
            self._announce(group, modes.leave(job))
        for ended in regroup.ended:
            self._modes.pop(ended, None)

    def _group_points(self, group: int) -> dict[str, int]:
        return {j: self._points[j] for j in self.groups.jobs(group) if j in self._points}

    def _announce(self, group: int, switches: list[ModeSwitch]) -> None:
        """Tell the group's nodes its mode decisions."""
        for switch in switches:
            took = ""
            if switch.decided_after_s is not None:
                self.decisions.observe(switch.decided_after_s)
                took = f" (decided in {switch.decided_after_s:.3f} s)"
            nodes = sorted(self.groups.nodes(group))
            log.info("mode %s for group %d (nodes %s): %s%s", switch.mode.value, group,
                     _ranges(nodes), switch.reason, took)
            msg = ("mode", switch.mode.value, switch.reason, self._group_points(group))
            for node in nodes:
                self.peers.send(node, msg)

    def _align(self, job: str, node: int, wait_s: float) -> None:
        """A rank of `job` on daemon `node` reported its allreduce waits; tell a node
        whose turns run ahead to hand over later (`crossover.scheduler.phase`)."""
        members = self._members.get(job, set())
        if self.aligner is None or len(members) < 2:
            return
        correction = self.aligner.report(job, node, wait_s, self._members)
        if correction is not None:
            self.peers.send(correction.node, ("delay", correction.delay_s, correction.lead_s))


def _ranges(ranks: list[int]) -> str:
    """0-3,7 for [0, 1, 2, 3, 7]: a group's nodes in one short log field."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)
