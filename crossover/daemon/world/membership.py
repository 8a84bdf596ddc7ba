"""Who is in the daemons' world, who leads it, and who is gone: heartbeats, a leader's
succession, and a member's return.

Open MPI 4.1 (started with `--mca orte_enable_recovery 1`) keeps a world running when one
of its processes dies, but tells the others nothing: no call fails, messages to the dead
simply go nowhere. So the daemons watch each other. Every member beats to the leader and
the leader to every member, every `beat_s`; any message counts as a beat. The rules:

- **A member silent for `dead_after_s`** is lost to the leader, which takes its jobs'
  presence away (as if each had left that node) and says so in status. Its node's ranks
  fail open on their own (their daemon is gone) and the other nodes serve on.
- **A leader silent for `dead_after_s`** is lost to every member; the lowest live rank
  of the last member list the leader sent succeeds it. First it asks the others
  (`prevote`): one that still hears the leader objects, and the successor stays a
  member (a cut between two nodes that both reach the rest must not depose a leader the
  others hear: without this, 1 led, 2 followed it and deposed 0, 0 could not hear 1 and
  led again, for ever). With no objection within `ask_s` it raises the epoch, says
  `lead` to every live member, and each answers with the jobs it holds. After an
  objection it asks again `ask_s` later, while the leader stays silent. If the
  successor is silent too, the next in line follows after another `dead_after_s`.
  An objection counts only what the member heard from the leader itself: told by a
  peer to follow a leader it had found silent, a member gives that leader a new
  allowance, but must not object for it (it did, to every prevote, while no one led).
- **Epochs settle disputes.** Only the leader a member follows is obeyed; a leader that
  hears of a higher epoch (a stopped leader resumed after its succession) steps down and
  follows the newer one. Beats carry the sender's epoch and leader: a leader's beat of a
  newer epoch is its `lead` (one lost on the way is made good), and two leaders that
  hear each other's beats settle it by their `lead`s.
- **A lost member that speaks again** (stopped, then resumed) is taken back: the leader
  says `lead` to it alone, and its holdings are merged like a successor's. So that a
  healed link is found from both ends, a leader beats to its lost members, and a
  member to the leader it found silent, every `dead_after_s` (two leaders that lost
  each other meet again, and the older steps down).
- **Silence this daemon slept through is no sign of death.** Its serve loop comes round
  at most every half second; a gap of over `dead_after_s / 2` between ticks means it did
  not run (it was stopped, the whole machine stalled, or its loop was blocked), and its
  peers' beats may be unread or not yet sent. Each peer's silence is then counted
  without the gap, once per silence: a loop that stays slow still finds a dead peer,
  one gap later.

Pure: time comes from an injected clock; the calls return what the daemon must do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Changes:
    """What one call found, for the daemon to act on.

    Attributes:
        lost: ranks the leader just lost (this daemon leads).
        back: lost ranks heard from again (this daemon leads): ask their holdings.
        took_over: this daemon just became the leader (epoch raised): ask every member.
        follow: this daemon now follows another leader: tell it what this node holds.
        stepped_down: this daemon led and now follows a newer leader.
        beat_to: ranks to send a heartbeat to now.
        stalled_s: this daemon's loop did not come round for this long (0 if it did):
            the peers' silence is counted without it.
        ask: ranks to ask whether they still hear the leader (this daemon is next).
        objected: a peer still hears the leader: this daemon stays a member for now.
    """

    lost: list[int] = field(default_factory=list)
    back: list[int] = field(default_factory=list)
    took_over: bool = False
    follow: int | None = None
    stepped_down: bool = False
    beat_to: list[int] = field(default_factory=list)
    stalled_s: float = 0.0
    ask: list[int] = field(default_factory=list)
    objected: int | None = None


class Membership:
    """One daemon's view of the world.

    Args:
        rank: this daemon's rank.
        size: the world's size.
        clock: monotonic clock.
        beat_s: how often to beat.
        dead_after_s: silence after which a peer counts as lost.
        leader, epoch: who leads, from which epoch (a re-formed world's).

    Raises:
        ValueError: a timing out of range, naming it.
    """

    def __init__(self, rank: int, size: int, clock: Callable[[], float],
                 beat_s: float = 1.0, dead_after_s: float = 4.0, leader: int = 0,
                 epoch: int = 0) -> None:
        if not 0 < beat_s < dead_after_s:
            raise ValueError(f"membership: need 0 < beat_s < dead_after_s, got beat_s="
                             f"{beat_s}, dead_after_s={dead_after_s}")
        self.rank, self.size, self.clock = rank, size, clock
        self.beat_s, self.dead_after_s = beat_s, dead_after_s
        self.leader, self.epoch = leader, epoch
        now = clock()
        self.alive: set[int] = set(range(size))  # as the leader last said, or found
        self._heard: dict[int, float] = dict.fromkeys(range(size), now)  # allowances
        self._spoke: dict[int, float] = dict.fromkeys(range(size), now)  # its own messages
        self._next_beat = now
        self._ticked = now
        self._forgiven: set[int] = set()  # peers whose silence a stall already shortened
        # Next in line after a silent leader: it takes over at `_asking` unless a peer
        # objects, and after an objection asks again at `_ask_again`.
        self.ask_s = 2 * beat_s
        self._asking: float | None = None
        self._ask_again: float | None = None
        # The leader this member found silent, beaten to until a leader claims the lead:
        # a cut between them only (the successor still hears it) may heal, and that
        # leader takes this member back on hearing it.
        self._silent_leader: int | None = None
        self._next_probe = now

    @property
    def leads(self) -> bool:
        return self.leader == self.rank

    @property
    def lost(self) -> list[int]:
        return sorted(set(range(self.size)) - self.alive)

    def heard(self, source: int) -> Changes:
        """Any message from `source` is a sign of life."""
        out = Changes()
        if not 0 <= source < self.size:
            return out  # not of this world (a test's stand-in peer)
        now = self.clock()
        self._fresh(source, now)
        self._spoke[source] = now
        if source == self._silent_leader:
            # the leader found silent speaks again, and no one claimed a newer epoch
            # since (a claim clears it): follow it again, no succession
            self.leader, self._silent_leader = source, None
        if source == self.leader:
            self._asking = self._ask_again = None
        if source not in self.alive and source != self.rank:
            self.alive.add(source)
            if self.leads:
                out.back.append(source)
        return out

    def members(self, source: int, alive: list[int]) -> bool:
        """The leader's member list; False (ignored) unless `source` is the leader."""
        if source != self.leader:
            return False
        now = self.clock()
        for r in set(alive) - self.alive:
            self._fresh(r, now)  # a peer back in the list gets a fresh allowance
        self.alive = set(alive) | {self.rank}
        return True

    def lead(self, source: int, epoch: int) -> Changes:
        """`source` says it leads from `epoch` on."""
        if epoch < self.epoch or (
                (epoch, -source) <= (self.epoch, -self.leader) and source != self.leader):
            # an older claim (even from the successor this daemon awaits: an epoch never
            # goes back): the answer (`epoch`) sets it right
            return Changes()
        return self._follow(source, epoch)

    def _follow(self, source: int, epoch: int) -> Changes:
        """Follow `source` at `epoch` (stepping down if this daemon led)."""
        out = Changes()
        out.stepped_down = self.leads and source != self.rank
        self.leader, self.epoch = source, epoch
        self._asking = self._ask_again = self._silent_leader = None
        self.alive.add(source)
        self._fresh(source, self.clock())
        out.follow = source
        return out

    def newer(self, epoch: int, leader: int, source: int | None = None) -> Changes:
        """Peer `source` says it follows `leader` at `epoch`: follow that leader if its
        epoch is newer than this daemon's (a leader behind steps down), or if `source`
        is the daemon this one follows and names another at the same epoch (it stepped
        down for a leader this daemon never heard claim). No one else's word at the
        same epoch: a peer may name the successor it awaits, which claimed nothing (two
        leaders of one epoch settle it by their own `lead`s)."""
        if epoch == self.epoch and source == self.leader != leader != self.rank \
                and not self.leads:
            return self._follow(leader, epoch)  # whichever rank it is
        if epoch <= self.epoch:
            return Changes()
        return self.lead(leader, epoch)

    def tick(self) -> Changes:
        """Beats due, and peers whose silence ran past `dead_after_s`."""
        out = Changes()
        now = self.clock()
        if now - self._ticked > self.dead_after_s / 2:
            out.stalled_s = now - self._ticked
            for r in self._heard.keys() - self._forgiven:
                self._heard[r] = min(now, self._heard[r] + out.stalled_s)
            self._forgiven |= self._heard.keys()
        self._ticked = now
        if now >= self._next_beat:
            self._next_beat = now + self.beat_s
            out.beat_to = sorted(self.alive - {self.rank}) if self.leads else \
                [self.leader] if self.leader != self.rank else []
        probed = self._probed()
        if probed and now >= self._next_probe:
            self._next_probe = now + self.dead_after_s
            out.beat_to = sorted(set(out.beat_to) | probed)
        silent = {r for r in self.alive - {self.rank}
                  if now - self._heard.get(r, now) > self.dead_after_s}
        if self.leads:
            out.lost = sorted(silent)
            self.alive -= silent
        elif self.leader in silent:
            self.alive.discard(self.leader)
            if self._silent_leader is None:
                self._silent_leader = self.leader
            successor = min(self.alive)  # this rank is always alive: never empty
            if successor == self.rank:
                self._ask(now, out)
            else:  # it gets a full allowance from now to claim the lead
                self.leader = successor
                self._fresh(successor, now)
        elif self._asking is not None and now >= self._asking:
            self._take_over(now, out)
        elif self._ask_again is not None and now >= self._ask_again:
            self._ask(now, out)
        return out

    def _probed(self) -> set[int]:
        """Who is beaten to every `dead_after_s` though silent: the leader's lost
        members, or the leader this member found silent. A link that heals is found
        from either end (two leaders that lost each other meet again), at one small
        message per peer per `dead_after_s`."""
        silent = set(range(self.size)) - self.alive if self.leads else {self._silent_leader}
        return silent - {self.rank, None}

    def _ask(self, now: float, out: Changes) -> None:
        """Next in line: ask the others whether they still hear the leader."""
        self._ask_again = None
        out.ask = sorted(self.alive - {self.rank})
        if out.ask:
            self._asking = now + self.ask_s
        else:
            self._take_over(now, out)

    def _take_over(self, now: float, out: Changes) -> None:
        self._asking = self._silent_leader = None
        self.leader = self.rank
        self.epoch += 1
        out.took_over = True
        # members beat to the old leader until they hear of this one
        for r in self.alive:
            self._fresh(r, now)
        out.beat_to = sorted(self.alive - {self.rank})
        self._next_beat = now + self.beat_s

    def objects(self, candidate: int, epoch: int) -> bool:
        """Whether this daemon objects to `candidate` succeeding the leader of `epoch`:
        it knows a newer epoch, or leads that one, or heard its leader of that epoch
        within `dead_after_s`. (A candidate of a newer epoch than this daemon's is not
        objected to: this daemon's leader is the older.)"""
        if epoch != self.epoch:
            return epoch < self.epoch
        if self.leads:
            return True
        if self.leader == candidate:
            return False  # it is this daemon's successor too
        heard = self._spoke.get(self.leader)
        return self.leader in self.alive and heard is not None and \
            self.clock() - heard <= self.dead_after_s

    def objection(self, source: int, epoch: int, leader: int) -> Changes:
        """`source` objects: it follows `leader` from `epoch`. A newer leader is
        followed; else this daemon stays a member (of a leader it cannot hear) and asks
        again `ask_s` later, unless it hears the leader meanwhile."""
        changes = self.newer(epoch, leader, source)
        if changes.follow is not None or self._asking is None:
            return changes
        now = self.clock()
        self._asking, self._ask_again = None, now + self.ask_s
        changes.objected = source
        return changes

    def _fresh(self, peer: int, now: float) -> None:
        """`peer`'s silence starts again at `now` (a later stall may shorten it again)."""
        self._heard[peer] = now
        self._forgiven.discard(peer)

    def next_deadline(self) -> float:
        """When `tick` may next have something to do."""
        watched = self.alive - {self.rank} if self.leads else {self.leader} - {self.rank}
        ends = [self._heard.get(r, self._next_beat) + self.dead_after_s for r in watched]
        ends += [t for t in (self._asking, self._ask_again) if t is not None]
        if self._probed():
            ends.append(self._next_probe)
        return min([self._next_beat, *ends])

    def snapshot(self) -> dict:
        """For status: the leader, the epoch, the members alive and lost (ranks)."""
        return {"leader": self.leader, "epoch": self.epoch, "alive": sorted(self.alive),
                "lost": self.lost}
