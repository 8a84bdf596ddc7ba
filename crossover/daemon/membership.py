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
  of the last member list the leader sent succeeds it: it raises the epoch, says `lead`
  to every live member, and each answers with what it holds (the jobs' orders, the jobs
  present, the joins that wait), from which the successor rebuilds the order. If the
  successor is silent too, the next in line follows after another `dead_after_s`.
- **Epochs settle disputes.** A leader's messages carry no epoch, but only the leader a
  member follows is obeyed; a leader that hears of a higher epoch (a stopped leader
  resumed after its succession) steps down and follows the newer one.
- **A lost member that speaks again** (stopped, then resumed) is taken back: the leader
  says `lead` to it alone, and its holdings are merged like a successor's.
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
    """

    lost: list[int] = field(default_factory=list)
    back: list[int] = field(default_factory=list)
    took_over: bool = False
    follow: int | None = None
    stepped_down: bool = False
    beat_to: list[int] = field(default_factory=list)
    stalled_s: float = 0.0


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
        self._heard: dict[int, float] = dict.fromkeys(range(size), now)
        self._next_beat = now
        self._ticked = now
        self._forgiven: set[int] = set()  # peers whose silence a stall already shortened

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
        self._fresh(source, self.clock())
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
        out = Changes()
        if (epoch, -source) <= (self.epoch, -self.leader) and source != self.leader:
            return out  # an older claim: the answer (`epoch_of`) sets it right
        out.stepped_down = self.leads and source != self.rank
        self.leader, self.epoch = source, epoch
        self.alive.add(source)
        self._fresh(source, self.clock())
        out.follow = source
        return out

    def newer(self, epoch: int, leader: int) -> Changes:
        """A peer says it follows `leader` at `epoch`: follow that leader if its claim is
        newer than the one this daemon follows (a leader behind steps down). At the same
        epoch a leader this daemon has found lost is not followed: its claim is from
        before the succession that this daemon awaits."""
        if (epoch, -leader) <= (self.epoch, -self.leader) or (
                epoch == self.epoch and leader not in self.alive):
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
        silent = {r for r in self.alive - {self.rank}
                  if now - self._heard.get(r, now) > self.dead_after_s}
        if self.leads:
            out.lost = sorted(silent)
            self.alive -= silent
        elif self.leader in silent:
            self.alive.discard(self.leader)
            self.leader = min(self.alive)  # this rank is always alive: never empty
            # the successor gets a full allowance from now to claim the lead
            self._fresh(self.leader, now)
            if self.leads:
                self.epoch += 1
                out.took_over = True
                # members beat to the old leader until they hear of this one
                for r in self.alive:
                    self._fresh(r, now)
                out.beat_to = sorted(self.alive - {self.rank})
                self._next_beat = now + self.beat_s
        return out

    def _fresh(self, peer: int, now: float) -> None:
        """`peer`'s silence starts again at `now` (a later stall may shorten it again)."""
        self._heard[peer] = now
        self._forgiven.discard(peer)

    def next_deadline(self) -> float:
        """When `tick` may next have something to do."""
        watched = self.alive - {self.rank} if self.leads else {self.leader} - {self.rank}
        ends = [self._heard.get(r, self._next_beat) + self.dead_after_s for r in watched]
        return min([self._next_beat, *ends])

    def snapshot(self) -> dict:
        """For status: the leader, the epoch, the members alive and lost (ranks)."""
        return {"leader": self.leader, "epoch": self.epoch, "alive": sorted(self.alive),
                "lost": self.lost}
