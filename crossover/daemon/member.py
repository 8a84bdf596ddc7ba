"""This daemon as a member of the world: its channel to the others, who leads, who is
lost, and the world's re-formation when nodes join or come back.

`membership` holds the rules (pure); this part applies them: it beats, follows a new
leader and tells it what this node holds, becomes the leader when it is next in line,
and, as the leader, re-forms the world (`reform`) to take in the nodes a job asked for
(`grow`) and to start a new daemon on a lost node (after `RESPAWN_S`, then backing off,
`RESPAWN_TRIES` times). The node's own service (`serve`, `ranks`) sees only a leader to
send to and, on the leader, a `Leader` that decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from crossover.daemon.membership import Changes, Membership
from crossover.daemon.reform import REFORM_TIMEOUT_S, Reformation, spawn_for
from crossover.daemon.world import Leader
from crossover.transport import PeerChannel

log = logging.getLogger("crossover.daemon")

#: a lost node's new daemon is started this long after the loss, then twice as long
#: after each try that did not bring one back
RESPAWN_S = 2.0
RESPAWN_TRIES = 6

#: what only the leader a daemon follows may tell it
FROM_LEADER = frozenset({"order", "forget", "mode", "delay", "shutdown", "members",
                         "reform"})
#: what only a leader acts on
TO_LEADER = frozenset({"join", "leave", "waited", "progress", "hold", "grow"})


class Member:
    """This daemon's membership of the world.

    Args:
        comm: the daemons' communicator.
        name: this daemon's node name.
        clock: monotonic clock.
        new_leader: makes the leader's decision-maker (this daemon leads, or took over).
        holdings: what this node holds (`Ranks.holdings`), for a new leader.
        wakeup: wakes the serve loop (a message or a re-formation is in).
        stop: stops this daemon (it was left out of a re-formed world).
        argv: this daemon's arguments after `-m crossover`, for the daemons it starts.
        beat_s, dead_after_s: see `Membership`.
    """

    def __init__(self, comm: Any, name: str, clock: Callable[[], float],
                 new_leader: Callable[[PeerChannel], Leader],
                 holdings: Callable[[], tuple], wakeup: Callable[[], None],
                 stop: Callable[[], None], argv: list[str],
                 beat_s: float = 1.0, dead_after_s: float = 5.0) -> None:
        self.name, self.clock, self.argv = name, clock, argv
        self._new_leader, self._holdings, self._stop = new_leader, holdings, stop
        self.peers = PeerChannel(comm, wakeup)
        self.world = Membership(self.peers.rank, self.peers.size, clock, beat_s, dead_after_s)
        # Every daemon's node name, for the log and status once it is lost: gathered at
        # the start (and at each re-formation), before any member can be lost.
        self.names: dict[int, str] = dict(enumerate(comm.allgather(name))) \
            if self.peers.size > 1 else {0: name}
        self.lost_nodes: list[str] = []  # as the leader last said
        self.leader = new_leader(self.peers) if self.world.leads else None
        self._respawn: dict[str, float] = {}  # lost node -> when to start its daemon
        self._tries: dict[str, int] = {}  # node -> daemons started since one served
        self._wanted: set[str] = set()  # nodes a job asked for
        self._reform: tuple[int, float, list[int]] | None = None  # (tag, since, members)
        self._spawning: list[str] = []  # the nodes whose daemons it starts
        self._current: Reformation | None = None  # the re-formation under way here
        self._stuck: list[Reformation] = []  # re-formations given up, maybe stuck
        self._wedged_said = False
        self._tag = 0

    # --- messages -----------------------------------------------------------------------
    def route(self, source: int, msg: tuple) -> bool:
        """Membership's part of a peer message; False if it is the node's to handle
        (for the leader's kinds, only when this daemon leads)."""
        self._apply(self.world.heard(source))
        kind = msg[0]
        stale = kind == "beat" and not self.world.leads and source != self.world.leader
        if stale or (kind in FROM_LEADER and source != self.world.leader) or (
                kind in TO_LEADER and self.leader is None):
            # an old leader resumed after its succession, a member that follows one, or
            # a message for the leader: say who leads
            self.peers.send(source, ("epoch", self.world.epoch, self.world.leader))
            return True
        if kind == "hold":  # a daemon that serves: its node needs no more tries
            self._tries.pop(self.names.get(source, ""), None)
            return False
        if kind == "grow":
            self._wanted |= {n for n in msg[1] if n not in self.names.values()}
            return True
        if kind == "members":
            if self.world.members(source, msg[1]):
                self.lost_nodes = list(msg[2])
                self.peers.lost = set(self.world.lost)
        elif kind == "lead":
            changes = self.world.lead(source, msg[1])
            if changes.follow is None:  # an older claim: say which is newer
                self.peers.send(source, ("epoch", self.world.epoch, self.world.leader))
            self._apply(changes)
        elif kind == "epoch":
            self._apply(self.world.newer(msg[1], msg[2]))
        elif kind == "reform":
            self._join_reform(*msg[1:])
        elif kind == "reformed":
            self._reformed(*msg[1:])
        elif kind == "retire":
            log.warning("this daemon (node %s) was left out of a re-formed world while it "
                        "was lost: stopping, so that the world's new daemon serves this "
                        "node", self.name)
            self._stop()
        elif kind != "beat":
            return False
        return True

    def grow(self, nodes: list[str]) -> list[str]:
        """A job asks for `nodes` in the world; returns those not in it yet."""
        missing = sorted(set(nodes) - set(self.names.values()))
        if missing:
            self.peers.send_leader(("grow", missing))
        return missing

    # --- time -----------------------------------------------------------------------------
    def tick(self) -> None:
        """Beat, act on peers lost, and (the leader) re-form the world when due."""
        if self.peers.size > 1:
            if time.monotonic() - self.peers.polled_at > self.world.beat_s:
                self.world.forgive()  # this daemon did not listen: nobody is to blame
            self._apply(self.world.tick())
        if self._reform is not None and self.clock() - self._reform[1] > REFORM_TIMEOUT_S:
            log.error("re-forming the world (%d) did not finish in %.0f s (a member lost "
                      "in the middle?): serving on in the world as it was",
                      self._reform[0], REFORM_TIMEOUT_S)
            self._give_up()
        if self.leader is not None and self._reform is None:
            self._start_reform()

    def next_deadline(self) -> float | None:
        ends = [self.world.next_deadline()] if self.peers.size > 1 else []
        if self.leader is not None:
            ends += list(self._respawn.values())
            if self._wanted:
                ends.append(self.clock())
        return min(ends, default=None)

    def snapshot(self) -> dict:
        """The world as this daemon sees it, for status."""
        return {"size": self.peers.size, "leader": self.world.leader,
                "leader_node": self.names.get(self.world.leader, "?"),
                "epoch": self.world.epoch, "members": len(self.world.alive),
                "lost": list(self.lost_nodes)}

    # --- leaders and losses -----------------------------------------------------------------
    def _apply(self, changes: Changes) -> None:
        world = self.world
        if changes.stepped_down and self.leader is not None:
            log.warning("daemon %d follows daemon %d from epoch %d: no longer the leader",
                        self.peers.rank, world.leader, world.epoch)
            self.leader = None
        if changes.took_over:
            log.warning("the leader is lost: daemon %d (node %s) leads from epoch %d and "
                        "rebuilds the jobs' order from what the %d members hold",
                        self.peers.rank, self.name, world.epoch, len(world.alive))
            self.leader = self._new_leader(self.peers)
            self._lead(world.alive)
            for rank in world.lost:  # the old leader's node, and any lost before it
                self._respawn_later(self.names.get(rank, f"daemon {rank}"))
        if changes.follow is not None:
            self.peers.leader = changes.follow
            self.peers.send(changes.follow, ("hold", *self._holdings()))
        elif not world.leads:
            self.peers.leader = world.leader
        for rank in changes.lost:
            node = self.names.get(rank, f"daemon {rank}")
            log.warning("daemon %d (node %s) is lost: silent for %.0f s; its jobs leave "
                        "that node", rank, node, world.dead_after_s)
            if self.leader is not None:
                self.leader.member_lost(rank)
                self._respawn_later(node)
                if self._reform is not None and rank in self._reform[2]:
                    # its collective calls wait for that member for ever: start again
                    log.warning("re-forming the world (%d) waits for the lost daemon %d: "
                                "given up", self._reform[0], rank)
                    self._give_up()
        for rank in changes.back:
            log.warning("daemon %d (node %s) is back: taking in what it holds", rank,
                        self.names.get(rank, "?"))
            self._respawn.pop(self.names.get(rank, ""), None)
            if self.leader is not None:
                self.leader.expect_holdings({rank}, world.dead_after_s)
            self.peers.send(rank, ("lead", world.epoch))
        if (changes.lost or changes.back) and world.leads:
            self.peers.lost = set(world.lost)
            self._tell_members()
        for rank in changes.beat_to:
            self.peers.send(rank, ("beat",))

    def _respawn_later(self, node: str) -> None:
        tries = self._tries.get(node, 0)
        if tries >= RESPAWN_TRIES:
            log.error("node %s: %d daemons started there did not serve; no more tries "
                      "(start one there by hand: it joins as a new world's node)", node,
                      tries)
            return
        self._respawn[node] = self.clock() + RESPAWN_S * 2 ** tries

    def _lead(self, ranks: set[int]) -> None:
        """Lead: ask `ranks` what they hold, and say who is in the world."""
        self.leader.expect_holdings(ranks, self.world.dead_after_s)
        self.peers.lost = set(self.world.lost)
        self.peers.broadcast(("lead", self.world.epoch))
        self._tell_members()

    def _tell_members(self) -> None:
        self.lost_nodes = [self.names.get(r, f"daemon {r}") for r in self.world.lost]
        self.peers.broadcast(("members", sorted(self.world.alive), self.lost_nodes))

    # --- re-forming the world ---------------------------------------------------------------
    def _start_reform(self) -> None:
        """The leader: re-form the world with the nodes wanted and those due again."""
        now = self.clock()
        due = {n for n, when in self._respawn.items() if when <= now}
        nodes = sorted(due | self._wanted)
        if not nodes:
            return
        if any(r.thread.is_alive() for r in self._stuck):
            # Open MPI 4.1 cannot cancel a spawn that lost a member, and the next one in
            # this process waits behind it: starting more only piles them up.
            if not self._wedged_said:
                self._wedged_said = True
                log.error("a re-formation that lost a member is stuck inside MPI: this "
                          "leader cannot start daemons any more (nodes %s wait); the "
                          "world serves on as it is; restart it to take them in",
                          ", ".join(nodes))
            return
        for node in nodes:
            self._respawn.pop(node, None)
            self._tries[node] = self._tries.get(node, 0) + 1
        self._wanted.clear()
        self._spawning = nodes
        self._tag += 1
        tag = self.world.epoch * 1000 + self._tag % 1000
        members = sorted(self.world.alive)
        log.info("re-forming the world (%d): %d members, starting daemons for %s", tag,
                 len(members), ", ".join(nodes))
        spawns = [spawn_for(n) for n in nodes]
        for rank in members:
            self.peers.send(rank, ("reform", tag, members, self.peers.rank,
                                   [(s.host, s.node, s.node_arg) for s in spawns]))

    def _give_up(self) -> None:
        """Stop waiting for the re-formation under way (its thread may wait for ever)."""
        self._reform = None
        if self._current is not None:
            self._stuck.append(self._current)
            self._current = None
        self._retry_spawns()

    def _retry_spawns(self) -> None:
        """The leader: the nodes of a re-formation that did not happen are due again
        (it was no try of theirs)."""
        if self.leader is not None:
            for node in self._spawning:
                self._tries[node] = max(0, self._tries.get(node, 1) - 1)
                self._respawn_later(node)
        self._spawning = []

    def _join_reform(self, tag: int, members: list[int], root: int,
                     spawns: list[tuple]) -> None:
        from crossover.daemon.reform import Spawn

        if self._reform is not None:
            # The leader gave that one up (a member was lost in it), or a new leader
            # starts afresh: its thread may wait for ever, but MPI tells concurrent
            # group creations apart by their tags, so this one can go ahead.
            log.warning("re-forming the world (%d) instead of (%d), which the leader gave "
                        "up", tag, self._reform[0])
        self._reform = (tag, self.clock(), members)
        peers = self.peers

        def done(world: Any, names: list[str] | None, exc: BaseException | None) -> None:
            peers.inbox.put((peers.rank, ("reformed", tag, members, root, world, names,
                                          exc)))
            peers._wakeup()

        reformation = Reformation(peers.comm, members, root, [Spawn(*s) for s in spawns],
                                  tag, self.name, self.argv, done)
        if self._current is not None:  # superseded: its thread may wait for ever
            self._stuck.append(self._current)
        self._stuck = [r for r in self._stuck if r.thread.is_alive()]
        self._current = reformation
        reformation.start()

    def _reformed(self, tag: int, members: list[int], root: int, world: Any,
                  names: list[str] | None, exc: BaseException | None) -> None:
        if self._reform is None or self._reform[0] != tag:
            log.warning("re-formation %d finished after it was given up", tag)
            return
        self._reform, self._current = None, None
        if exc is not None:
            log.error("re-forming the world (%d) failed (%s): serving on as it was", tag, exc)
            self._retry_spawns()
            return
        old_epoch = self.world.epoch
        self.peers.swap(world, {old: new for new, old in enumerate(members)})
        leader = members.index(root)
        self.world = Membership(self.peers.rank, self.peers.size, self.clock,
                                self.world.beat_s, self.world.dead_after_s,
                                leader=leader, epoch=old_epoch + 1)
        self.peers.leader = leader
        self.names = dict(enumerate(names))
        self.lost_nodes = []
        log.info("the world is re-formed (%d): %d members (%s), daemon %d here, leader %d",
                 tag, self.peers.size, ", ".join(names), self.peers.rank, leader)
        self._spawning = []
        if self.world.leads:
            self.leader.renumber({old: new for new, old in enumerate(members)})
            for rank in range(len(members), self.peers.size):
                self.peers.send(rank, ("lead", self.world.epoch))  # a new daemon: follow
            self._tell_members()
