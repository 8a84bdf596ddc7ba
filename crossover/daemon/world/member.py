"""This daemon as a member of the world: who leads, who is lost, and (the leader) the
world's new generations when nodes join, are lost, or come back.

`membership` holds the rules (pure); this part applies them: it beats, follows a new
leader and tells it what this node holds, becomes the leader when it is next in line,
and, as the leader, forms a new generation of the world (`generation`) to take in the
nodes a job asked for (`grow`), to start a lost node's service again, and to take back a
node whose relay died. A node that does not come back costs bounded effort: its tries
back off from `RESPAWN_S` to `RESPAWN_MAX_S` (every generation that did not form with it
counts), stop after `RESPAWN_TRIES` (status names it down until a job asks for it), and
a generation that tries it again gives way to one without it as soon as another node
needs one, so a dead host never holds the others back. A relay's hello switches this
node to its generation (`attached`); with no relay (`detached`) the node serves on and
its membership waits for one. The node's own service (`service`, `ranks`) sees only a
leader to send to and, on the leader, a `Leader` that decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from crossover.daemon.relay.uplink import Uplink
from crossover.daemon.world.generation import Generation, reap_orphans
from crossover.daemon.world.leader import Leader
from crossover.daemon.world.membership import Changes, Membership

if TYPE_CHECKING:
    from crossover.daemon.world.leader_thread import LeaderThread

log = logging.getLogger("crossover.daemon")

#: a lost node's new service is started this long after the loss, then twice as long
#: after each try that did not bring one back, at most RESPAWN_MAX_S; after RESPAWN_TRIES
#: tries the node is left down (with 21 s a failed generation: 11 tries in the first
#: hour, given up after about 66 minutes)
RESPAWN_S, RESPAWN_MAX_S = 2.0, 900.0
RESPAWN_TRIES = 12
#: a leader whose relay is gone forms a new generation this long after (then backing
#: off while they fail)
DETACHED_S = 1.0
#: a member whose relay is gone and that no generation took back within this long leads
#: and forms one itself: its leader may be gone too (nothing else would bring the world
#: back if that leader's whole node died before it formed a generation)
ORPHANED_S = 30.0
#: a service of a cluster's world (`hosts`) that no generation took in forms one: the
#: first host's at once, the others' ORPHANED_S later and this far apart by their place,
#: up to MAX_APART places (one of them forms it, not all at once, should the first host
#: be down)
HOSTS_APART_S, MAX_APART = 5.0, 12

#: what only the leader a daemon follows may tell it
FROM_LEADER = frozenset({"mode", "delay", "shutdown", "members"})
#: what only a leader acts on
TO_LEADER = frozenset({"join", "leave", "waited", "progress", "hold", "grow",
                       "stop_world"})


class Member:
    """This daemon's membership of the world.

    Args:
        peers: the other nodes' services, through this node's relay.
        name: this daemon's node name.
        clock: monotonic clock.
        new_leader: makes the leader's decision-maker (this daemon leads, or took over).
        holdings: the jobs with a rank on this node (`Ranks.holdings`), for a new leader.
        argv: this daemon's arguments after `-m crossover`, for the generations it forms.
        log_path: where the generations it forms write their output (None: inherited).
        run_dir: the node's runtime directory, where the generations it forms are
            recorded (`generation.record`; None: not recorded).
        secret: the world's key, handed to the relays of the generations it forms.
        beat_s, dead_after_s: see `Membership`.
        hosts: the world's hosts, for a node service of a cluster (`--hosts`; None: a
            world its launcher starts): it serves alone until a generation takes it in.
    """

    def __init__(self, peers: Uplink, name: str, clock: Callable[[], float],
                 new_leader: Callable[[Uplink], Leader | LeaderThread],
                 holdings: Callable[[], list[str]], argv: list[str],
                 log_path: Path | None = None, secret: bytes = b"", beat_s: float = 1.0,
                 dead_after_s: float = 5.0, run_dir: Path | None = None,
                 hosts: list[str] | None = None) -> None:
        self.peers, self.name, self.clock, self.argv = peers, name, clock, argv
        self.log_path, self._secret, self.run_dir = log_path, secret, run_dir
        self._new_leader, self._holdings = new_leader, holdings
        self.world = Membership(0, 1, clock, beat_s, dead_after_s)
        self.names: dict[int, str] = {0: name}  # every member's node, by rank
        self.lost_nodes: list[str] = []  # as the leader last said
        # A node's service leads only once its relay said who leads (a one-node daemon
        # is its own world and leads at once).
        self.leader = None if peers.relayed else new_leader(peers)
        self._respawn: dict[str, float] = {}  # lost node -> when to start its service
        self._tries: dict[str, int] = {}  # node -> services started since one served
        self.down: set[str] = set()  # nodes given up after RESPAWN_TRIES (status says)
        self._wanted: set[str] = set()  # nodes a job asked for
        self._spawning: list[str] = []  # the nodes new to the generation being formed
        self._retrying: list[str] = []  # those of them tried before
        self._forming: Generation | None = None  # the generation being formed
        self._formed: list[Generation] = []  # those this leader formed, still running
        self._epoch = 0  # the highest generation this daemon knows of or started
        self._detached_at: float | None = clock() if peers.relayed else None
        self._fails = 0  # generations in a row that did not form
        self._cut_off = False  # a peer objected to this daemon's succession (said once)
        self._of_hosts = bool(hosts)
        if hosts:  # the other hosts are lost to it until a generation takes it in
            self.lost_nodes = [h for h in hosts if h != name]
            place = hosts.index(name)
            # (`_orphaned` fires ORPHANED_S after this)
            self._detached_at = clock() + HOSTS_APART_S * min(place - 1, MAX_APART) \
                if place else clock() - ORPHANED_S

    # --- messages -----------------------------------------------------------------------
    def route(self, source: int, msg: tuple) -> bool:
        """Membership's part of a peer message; False if it is the node's to handle
        (for the leader's kinds, only when this daemon leads)."""
        kind = msg[0]
        if kind == "detached":
            self._detached(msg[1])
            return True
        self._apply(self.world.heard(source))
        if source == self.world.leader:
            self._cut_off = False
        stale = kind == "beat" and not self.world.leads and source != self.world.leader
        if stale or (kind in FROM_LEADER and source != self.world.leader) or (
                kind in TO_LEADER and self.leader is None):
            # an old leader resumed after its succession, a member that follows one, or
            # a message for the leader: say who leads
            self.peers.send(source, ("epoch", self.world.epoch, self.world.leader))
            return True
        if kind == "hold":  # a service that serves: its node needs no more tries
            self._tries.pop(self.names.get(source, ""), None)
            self.down.discard(self.names.get(source, ""))
            return False
        if kind == "grow":
            self._wanted |= self._outside(msg[1])
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
            self._apply(self.world.newer(msg[1], msg[2], source))
        elif kind == "prevote":  # next in line asks: do you still hear the leader?
            if self.world.objects(source, msg[1]):
                self.peers.send(source, ("object", self.world.epoch, self.world.leader))
        elif kind == "object":
            self._apply(self.world.objection(source, msg[1], msg[2]))
        elif kind == "beat":
            if msg[2] != source:
                pass  # a member's
            elif self.world.leads and source != self.peers.rank:
                # two leaders (each lost the other a while): the older steps down
                changes = self.world.lead(source, msg[1])
                if changes.follow is None:
                    self.peers.send(source, ("lead", self.world.epoch))
                self._apply(changes)
            elif source == self.world.leader and msg[1] > self.world.epoch:
                # the leader's `lead` was lost on the way: its beat says it leads
                self._apply(self.world.lead(source, msg[1]))
        else:
            return False
        return True

    def grow(self, nodes: list[str]) -> list[str]:
        """A job asks for `nodes` in the world; returns those not in it yet."""
        missing = sorted(self._outside(nodes))
        if missing and not self.peers.relayed:
            log.warning("a job asks for nodes %s, but this daemon was started alone "
                        "(without mpirun): it cannot form a world with them",
                        ", ".join(missing))
        elif missing:
            self.peers.send_leader(("grow", missing))
        return missing

    def _outside(self, nodes: list[str]) -> set[str]:
        """Of `nodes`, those that do not serve in this world now: never members, lost
        (a lost member's service started again), or given up."""
        serving = {self.names[r] for r in self.world.alive if r in self.names}
        return {n for n in nodes if n not in serving or n in self.down}

    # --- generations --------------------------------------------------------------------
    def attached(self, epoch: int, rank: int, names: list[str], leader: int) -> None:
        """A relay of generation `epoch` said hello: this node is rank `rank` of the
        members `names`, led by rank `leader`."""
        by_name = {n: r for r, n in self.names.items()}
        ranks_now = {by_name[n]: new for new, n in enumerate(names) if n in by_name}
        # A node this service knew, lost or a member, that the new generation left out
        # (one that gave way, or one a service that did not know it formed) stays lost:
        # forgotten here, no one might ever bring it back.
        left_out = (set(self.names.values()) | set(self.lost_nodes)) - set(names) \
            - self.down - {self.name}
        world = self.world
        self.world = Membership(rank, len(names), self.clock, world.beat_s,
                                world.dead_after_s, leader=leader, epoch=epoch)
        self.names, self.lost_nodes = dict(enumerate(names)), sorted(left_out)
        self._epoch = max(self._epoch, epoch)
        self._detached_at = None
        log.info("generation %d of the world: %d members (%s), this node is daemon %d, "
                 "the leader is %s", epoch, len(names), ", ".join(names), rank,
                 names[leader])
        forming = self._forming
        if forming is not None and forming.epoch <= epoch:
            self._forming, self._spawning, self._fails = None, [], 0
            if forming.epoch == epoch:
                self._retire_formed()
                self._formed.append(forming)
            else:
                forming.kill()
        for node in names:
            self._respawn.pop(node, None)
        if self.run_dir is not None:
            reap_orphans(self.run_dir, epoch)
        if self.world.leads:
            if self.leader is None:
                self.leader = self._new_leader(self.peers)
            else:
                self.leader.renumber(ranks_now)
            for node in left_out - set(self._respawn) - set(self._spawning):
                self._respawn_later(node)
            self._lead()
        else:
            if self.leader is not None:
                log.warning("daemon %d follows %s from generation %d: no longer the "
                            "leader", rank, names[leader], epoch)
                self._step_down()
                self._retire_formed()
            # what this node holds now (a service started again holds nothing)
            self.peers.send_leader(("hold", self._holdings()))

    def _step_down(self) -> None:
        # A generation it is forming runs on: the newest generation wins at every
        # service, so it may still be the one the world settles on (killing it could
        # leave none, where its rival's leader killed its own for this one), and if it
        # forms, this daemon leads it.
        if self.leader is not None:
            self.leader.close()
            self.leader = None

    def _detached(self, epoch: int) -> None:
        self._detached_at = self.clock()
        log.warning("node %s: its relay (generation %d) is gone; serving its ranks on "
                    "in the last mode, %s", self.name, epoch,
                    "and forming a new generation" if self.leader is not None else
                    "until the leader forms a new generation")

    def _retire_formed(self) -> None:
        """Earlier generations of this leader: their members took a newer one."""
        for generation in self._formed:
            generation.kill()
        self._formed = []

    # --- time -----------------------------------------------------------------------------
    def tick(self) -> None:
        """Beat, act on peers lost, and (the leader) form a generation when due."""
        if self.peers.attached and self.peers.size > 1:
            self._apply(self.world.tick())
        elif self._orphaned():
            self._lead_orphaned()
        forming = self._forming
        if forming is not None and self._gives_way(forming):
            log.warning("generation %d gives way: it tries %s again, and %s cannot wait "
                        "for it", forming.epoch, ", ".join(self._retrying),
                        ", ".join(self._waiting()) or "this node")
            forming.kill()
            self._forming = None
            self._retry_spawns()
        elif forming is not None and (forming.failed or self.clock() - forming.started_at
                                      > forming.timeout_s):
            self._fails += 1
            log.error("generation %d (%s) did not form within %.0f s%s: killed; trying "
                      "again", forming.epoch, ", ".join(forming.nodes),
                      self.clock() - forming.started_at,
                      " (its mpirun ended)" if forming.failed else "")
            forming.kill()
            self._forming = None
            self._retry_spawns()
            if self._detached_at is not None:  # back off while generations fail
                self._detached_at = self.clock() + min(30.0, 2.0 ** self._fails)
        if self.leader is not None and self._forming is None and self.peers.relayed:
            self._form()

    def _gives_way(self, forming: Generation) -> bool:
        """A generation that tries a node again (one that did not come back before)
        gives way to one without it when another node needs a generation now."""
        return bool(self._retrying) and self.leader is not None and bool(self._waiting())

    def _waiting(self) -> list[str]:
        """The nodes that need a generation now: lost since the one being formed started
        (it would bring them back only if it formed), asked for by a job, or this node
        (its relay gone since); not those tried before, which wait their turn."""
        now, forming = self.clock(), self._forming
        waiting = sorted({n for n, when in self._respawn.items()
                          if when <= now and not self._tries.get(n)} | self._wanted)
        if self._detached_at is not None and now >= self._detached_at + DETACHED_S and \
                forming is not None and forming.started_at < self._detached_at:
            waiting.append(self.name)
        return waiting

    def _orphaned(self) -> bool:
        return (self.leader is None and self.peers.relayed and self._detached_at is not None
                and self.clock() - self._detached_at >= ORPHANED_S)

    def _lead_orphaned(self) -> None:
        """No generation took this node back since its relay was lost: lead, and form
        one over every node this service knows (a newer generation of another leader,
        if there is one, wins at each service, and this node then follows it)."""
        world = self.world
        first = self._of_hosts and self.peers.key[0] < 0  # a cluster's, never taken in
        if first:
            log.info("node %s: no generation of its hosts' world took it in: it leads "
                     "from epoch %d and forms one", self.name, world.epoch + 1)
        else:
            log.warning("node %s: no generation took it back within %.0f s of its relay's "
                        "loss (its leader %s may be gone too): it leads from epoch %d and "
                        "forms one", self.name, ORPHANED_S,
                        self.names.get(world.leader, "?"), world.epoch + 1)
        world.lead(self.peers.rank, world.epoch + 1)
        self.peers.leader = self.peers.rank
        self.leader = self._new_leader(self.peers)
        self._bring_back_the_lost()
        if first:  # its first generation: with all its hosts
            self._respawn = dict.fromkeys(self._respawn, self.clock())
        self._lead()  # `_form` then forms a generation over the members alive

    def next_deadline(self) -> float | None:
        ends = [self.world.next_deadline()] if self.peers.size > 1 else []
        if self._detached_at is not None and self.leader is None:
            ends.append(self._detached_at + ORPHANED_S)
        if self.leader is not None:  # (those tried before wait for the one forming)
            ends += [t for n, t in self._respawn.items()
                     if self._forming is None or not self._tries.get(n)]
            if self._wanted:
                ends.append(self.clock())
            if self._detached_at is not None:
                ends.append(self._detached_at + DETACHED_S)
            if self._forming is not None:
                ends.append(self._forming.started_at + 1.0)  # poll its mpirun
        return min(ends, default=None)

    def snapshot(self) -> dict:
        """The world as this daemon sees it, for status."""
        return {"size": self.peers.size, "leader": self.world.leader,
                "leader_node": self.names.get(self.world.leader, "?"),
                "epoch": self.world.epoch, "members": len(self.world.alive),
                "lost": list(self.lost_nodes), "generation": self.peers.key[0],
                "relay": self.peers.attached or not self.peers.relayed,
                "relay_pid": self.peers.relay_pid,
                # messages from other nodes refused (forged, replayed, malformed) and
                # dropped as another generation's
                "refused": self.peers.refused, "stale": self.peers.stale,
                "down": sorted(self.down),
                "forming": None if self._forming is None else self._forming.epoch}

    def _form(self) -> None:
        """The leader: form a generation with the nodes wanted and those due again, or
        any time this node's own relay is gone."""
        now = self.clock()
        present = [self.names[r] for r in sorted(self.world.alive)]
        back = [n for n in self._respawn if n in present]
        if back:  # heard again meanwhile (a link that came back): nothing to start
            for node in back:
                del self._respawn[node]
            self._tell_members()
        due = {n for n, when in self._respawn.items() if when <= now}
        # the nodes lost for the first time or asked for, and one node tried before (the
        # longest due): several that did not come back, tried together, would keep out
        # for ever the live ones among them behind one dead host
        fresh = {n for n in due if not self._tries.get(n)} | self._wanted
        again = sorted(due - fresh, key=lambda n: (self._respawn[n], n))[:1]
        new = sorted((fresh | set(again)) - set(present))
        detached = self._detached_at is not None and now >= self._detached_at + DETACHED_S
        self._wanted.clear()
        if not new and not detached:
            return
        for node in new:
            self._respawn.pop(node, None)
            self.down.discard(node)  # a job asked for it: one more try
            self._tries[node] = self._tries.get(node, 0) + 1
        self._spawning = new
        self._retrying = [n for n in new if self._tries[n] > 1]
        self._epoch = max(self._epoch, self.world.epoch) + 1
        log.info("forming generation %d of the world: %s%s", self._epoch,
                 ", ".join(present + new), f" (new: {', '.join(new)})" if new else "")
        self._forming = Generation(present + new, self._epoch, self.name, self.argv, now,
                                   self.log_path, self._secret, self.run_dir)

    def _retry_spawns(self) -> None:
        """The leader: the new nodes of a generation that did not form are due again,
        later: that was a try of theirs (a dead host never lets a generation form, and
        one not counted would be tried every few seconds for ever)."""
        if self.leader is not None:
            for node in self._spawning:
                self._respawn_later(node)
        self._spawning, self._retrying = [], []

    # --- leaders and losses -----------------------------------------------------------------
    def _apply(self, changes: Changes) -> None:
        world = self.world
        if changes.stalled_s:
            log.warning("daemon %d (node %s): its loop did not come round for %.1f s "
                        "(stopped, the machine stalled, or blocked): that gap does not "
                        "count towards its peers' %.0f s of silence", self.peers.rank,
                        self.name, changes.stalled_s, world.dead_after_s)
        if changes.stepped_down and self.leader is not None:
            log.warning("daemon %d follows daemon %d from epoch %d: no longer the leader",
                        self.peers.rank, world.leader, world.epoch)
            self._step_down()
        if changes.took_over:
            log.warning("the leader is lost: daemon %d (node %s) leads from epoch %d and "
                        "counts the jobs' nodes from what the %d members hold",
                        self.peers.rank, self.name, world.epoch, len(world.alive))
            self._step_down()
            self.leader = self._new_leader(self.peers)
            self._bring_back_the_lost()
            self._lead()
        if changes.follow is not None:
            self.peers.leader = changes.follow
            self.peers.send(changes.follow, ("hold", self._holdings()))
        elif not world.leads:
            self.peers.leader = world.leader
        for rank in changes.lost:
            node = self.names.get(rank, f"daemon {rank}")
            log.warning("daemon %d (node %s) is lost: silent for %.0f s; its jobs leave "
                        "that node", rank, node, world.dead_after_s)
            if self.leader is not None:
                self.leader.member_lost(rank)
                self._respawn_later(node)
        for rank in changes.back:
            log.warning("daemon %d (node %s) is back: taking in what it holds", rank,
                        self.names.get(rank, "?"))
            self._respawn.pop(self.names.get(rank, ""), None)
            self.peers.send(rank, ("lead", world.epoch))
        if (changes.lost or changes.back) and world.leads:
            self.peers.lost = set(world.lost)
            self._tell_members()
        for rank in changes.beat_to:
            self.peers.send(rank, ("beat", world.epoch, world.leader))
        for rank in changes.ask:
            self.peers.send(rank, ("prevote", world.epoch))
        if changes.objected is not None and not self._cut_off:
            self._cut_off = True  # said once a cut: it asks again every few seconds
            log.warning("daemon %d (node %s) cannot hear its leader (node %s), which "
                        "daemon %d still hears: it stays a member and serves on; its "
                        "jobs' modes wait for the link", self.peers.rank, self.name,
                        self.names.get(world.leader, "?"), changes.objected)

    def _bring_back_the_lost(self) -> None:
        """A new leader (a successor, or a member no generation took back): the nodes
        lost before it led and those its leader had yet to bring back (it said which)
        are due again; left out, nothing would ever take them back into this world."""
        lost = {self.names[r] for r in self.world.lost if r in self.names}
        for node in sorted((lost | set(self.lost_nodes)) - {self.name}):
            self._respawn_later(node)

    def _respawn_later(self, node: str) -> None:
        tries = self._tries.get(node, 0)
        if tries >= RESPAWN_TRIES:
            log.error("node %s is down: %d tries to start its service did not bring it "
                      "back; no more (a job that asks for it gives it one more)", node, tries)
            self.down.add(node)
            return
        self._respawn[node] = self.clock() + min(RESPAWN_MAX_S, RESPAWN_S * 2 ** tries)

    def _lead(self) -> None:
        """Lead: ask every member what it holds, and say who is in the world."""
        self.peers.lost = set(self.world.lost)
        self.peers.broadcast(("lead", self.world.epoch))
        self._tell_members()

    def _tell_members(self) -> None:
        """Say who is in the world, and which nodes are lost: those of this generation,
        and those still to be brought back (a successor brings them back too)."""
        lost = {self.names.get(r, f"daemon {r}") for r in self.world.lost}
        present = {self.names[r] for r in self.world.alive if r in self.names}
        self.lost_nodes = sorted((lost | set(self._respawn) | set(self._spawning)) - present)
        self.peers.broadcast(("members", sorted(self.world.alive), self.lost_nodes))
