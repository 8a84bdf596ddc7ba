"""The daemons' world, one process per node in one MPI world: the leader (daemon 0)
decides the global job order and the mode, every daemon applies them, and status and
shutdown go to all. This module holds the leader's part (`Leader`) and who a daemon is
(`node_identity`); what a node does with the leader's messages is the
daemon's (`serve`).

Messages between daemons are small tuples, through each node's relay (`uplink`):
    ("join", job) / ("leave", job)        to the leader: a job's first / last rank here
    ("order", job, n) / ("forget", job)   from the leader: the job's place, or it is gone
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
    ("beat",)                             member to leader and back (liveness)
    ("members", alive, lost_nodes)        from the leader: who is in the world now
    ("lead", epoch)                       from a new leader (or to a member back):
                                          answer with what you hold
    ("hold", orders, present, pending)    to the leader: this node's orders and jobs
    ("epoch", epoch, leader)              to a peer that follows an older leader

Who leads, and who is lost, is `membership`'s; the leader may be any rank.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

from crossover import environment as E
from crossover.daemon.uplink import Uplink
from crossover.scheduler import ModeController, ModeSwitch
from crossover.scheduler.groups import Groups
from crossover.scheduler.phase import PhaseAligner
from crossover.scheduler.predict import Profile

log = logging.getLogger("crossover.daemon")


def node_identity() -> tuple[str, list[int]]:
    """This node service's name (given on its command line, else as `E.node_name`) and
    the CPU cores its devices are made of: fake node r gets every N-th core."""
    cores = sorted(os.sched_getaffinity(0))
    fake, name = E.fake_nodes(), E.node_name()
    if not (fake and re.fullmatch(r"fake\d+", name)):
        return name, cores
    r = int(name[4:])
    return name, cores[r % len(cores) :: fake] or cores


class Leader:
    """The leader's decisions: the jobs' global order, each group's mode (policy auto),
    the nodes' phases (`--align-phases`) and the idle shutdown.

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
        self._next_order = 0
        self._members: dict[str, set[int]] = {}  # job -> daemon ranks with its ranks
        self._seen: dict[str, set[int]] = {}  # job -> daemon ranks told its order
        self._decided: dict[str, int] = {}  # job -> the order the leader gave it
        self._points: dict[str, int] = {}  # job -> its request points, reported
        self._idle_since: float | None = clock()
        self._shut = False
        # A new leader answers no join before the members said what they hold (or
        # until `_await_until`): an order given earlier could collide with one they hold.
        self._awaiting: set[int] = set()
        self._awaiting_since = self._await_until = 0.0
        self._deferred: list[tuple[int, str]] = []

    def handle(self, source: int, msg: tuple) -> bool:
        """A message for the leader from daemon `source`; False if it is not one."""
        kind = msg[0]
        if kind == "join":
            if self._awaiting:
                self._deferred.append((source, msg[1]))
            else:
                self._join(source, msg[1])
        elif kind == "hold":
            self._hold(source, *msg[1:])
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
        """The mode decisions' clock: a probe window or a hold may have ended; the
        members that were to say what they hold may have run out of time."""
        if self._awaiting and self.clock() >= self._await_until:
            log.warning("daemons %s did not say what they hold within %.0f s: answering "
                        "joins without them", sorted(self._awaiting),
                        self._await_until - self._awaiting_since)
            self._awaiting.clear()
            self._flush()
        for group, modes in list(self._modes.items()):
            self._announce(group, modes.tick())

    def next_deadline(self) -> float | None:
        ends = [self._await_until] if self._awaiting else []
        ends += [m.next_deadline() for m in self._modes.values()]
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
    def expect_holdings(self, ranks: set[int], within_s: float) -> None:
        """Daemons `ranks` were asked what they hold (this leader is new, or they are
        back): joins wait for their answers, at most `within_s`."""
        self._awaiting |= set(ranks)
        self._awaiting_since = self.clock()
        self._await_until = self._awaiting_since + within_s

    def _hold(self, source: int, orders: dict[str, int], present: list[str],
              pending: list[str]) -> None:
        """Daemon `source` says what it holds: take its jobs' orders and presence. A job
        the leader had there that is neither present nor waiting left it (its service
        was started again, say)."""
        for job in [j for j, m in self._members.items() if source in m
                    and j not in present and j not in pending]:
            self._leave(source, job)
        for job, order in orders.items():
            self._next_order = max(self._next_order, order + 1)
            if job not in present:
                continue
            known = self._decided.setdefault(job, order)
            if known != order:
                log.warning("job %s has order %d on daemon %d but %d elsewhere (two "
                            "leaders at once?): keeping %d", job, order, source, known, known)
            self._add(job, source)
        # A mode switch sent while the node changed generation was lost: say its
        # groups' modes again (a node in that mode already changes nothing).
        for group in sorted({self.groups.group_of(j) for j in present
                             if j in self._members and source in self._members[j]}):
            modes = self._modes.get(group)
            if modes is not None and modes.state != "solo":
                self.peers.send(source, ("mode", modes.mode.value, modes.reason,
                                         self._group_points(group)))
        self._deferred.extend((source, job) for job in pending)
        self._awaiting.discard(source)
        self._flush()

    def _flush(self) -> None:
        if self._awaiting:
            return
        deferred, self._deferred = self._deferred, []
        for source, job in deferred:
            self._join(source, job)

    def renumber(self, ranks_now: dict[int, int]) -> None:
        """The world was re-formed: daemon ranks become `ranks_now[rank]` (a rank not in
        it was lost, and left already)."""
        def remap(ranks: set[int]) -> set[int]:
            return {ranks_now[r] for r in ranks if r in ranks_now}
        self._members = {job: remap(m) for job, m in self._members.items()}
        self._seen = {job: remap(m) for job, m in self._seen.items()}
        self.groups.renumber(ranks_now)
        self._awaiting = remap(self._awaiting)
        self._deferred = [(ranks_now[s], j) for s, j in self._deferred if s in ranks_now]

    def member_lost(self, rank: int) -> None:
        """Daemon `rank` is lost: its jobs leave its node, as if their ranks had closed
        there (a job left on no node is forgotten)."""
        self._awaiting.discard(rank)
        self._deferred = [(s, j) for s, j in self._deferred if s != rank]
        for job in [job for job, members in self._members.items() if rank in members]:
            self._leave(rank, job)
        self._flush()

    # --- jobs -------------------------------------------------------------------------------
    def _join(self, source: int, job: str) -> None:
        """A job's first rank arrived on daemon `source`: tell it the job's order."""
        if job not in self._decided:
            if self.aligner is not None:
                self.aligner.reset()  # a new job mix: new phases
            self._decided[job] = self._next_order
            self._next_order += 1
        self.peers.send(source, ("order", job, self._decided[job]))
        self._add(job, source)

    def _add(self, job: str, node: int) -> None:
        """`job` has ranks on `node`: its group may grow or merge with others."""
        members = self._members.setdefault(job, set())
        self._seen.setdefault(job, set()).add(node)
        if node in members:
            return
        members.add(node)
        regroup = self.groups.join(job, node)
        for ended in regroup.ended:
            self._modes.pop(ended, None)
        group = regroup.group
        if self.new_modes is not None and group not in self._modes:
            self._modes[group] = self.new_modes()
        modes = self._modes.get(group)
        if modes is not None and modes.state != "solo":
            # a node new to the group serves in the group's mode from the start
            self.peers.send(node, ("mode", modes.mode.value, modes.reason,
                                   self._group_points(group)))

    def _leave(self, source: int, job: str) -> None:
        """A job's last rank on daemon `source` left."""
        # a join still waiting for the members' holdings is void now
        self._deferred = [(s, j) for s, j in self._deferred if (s, j) != (source, job)]
        members = self._members.get(job)
        if members is None:
            return  # forgotten already
        members.discard(source)
        group = self.groups.group_of(job)
        regroup = self.groups.leave(job, source)
        if members:
            return
        for node in self._seen.pop(job, set()):
            self.peers.send(node, ("forget", job))
        self._members.pop(job, None)
        self._decided.pop(job, None)
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
            nodes = sorted(self.groups.nodes(group))
            log.info("mode %s for group %d (nodes %s): %s", switch.mode.value, group,
                     _ranges(nodes), switch.reason)
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
