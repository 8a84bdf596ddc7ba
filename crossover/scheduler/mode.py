"""Whether co-located jobs should take turns on their devices or compute at once.

Antiphase (exclusive grants in one global sequence) pays when a job's communication
leaves the device idle: the other job computes in that gap. When communication is
itself work on the same resource (shared-memory allreduce on the cores that compute,
on one host), taking turns only adds waiting, and plain co-location is faster. Nothing
tells the two apart in advance, so the controller measures.

Probing: when the set of co-located jobs changes, each mode gets a window; in a window
every job's step rate is measured from the progress its ranks report (after settling
steps, over at least `min_steps` steps and `probe_s` seconds). The first window, served
concurrently as plain co-location would, settles for `warmup_steps`: a job that has
just started (or whose neighbour has) runs its first steps slowly, and measuring them
once made a run choose antiphase on one host, where it loses. A pair of windows (one
per mode) gives each job's speedup under antiphase, its rate normalised by its own rate
under concurrent grants. Antiphase is chosen when the jobs' mean speedup is at least
1 + `margin`; otherwise concurrent, which is what plain co-location does (do no harm).

One pair is noisy on a busy host (on this project's 2-core VM a single pair of 2 s
windows chose concurrent in runs where antiphase was faster, and the pairs of one run
differed by up to 0.23x; bench/pair_noise.py), so a mean speedup closer to the margin
than `pair_noise` / sqrt(pairs) is measured again, by another pair in the reverse order
(C A, A C, C A: a steady drift of the host's speed biases the pairs in opposite
directions), up to `max_pairs`; the decision takes the mean over the pairs. A close
call costs little: the two modes are then nearly as fast.

Unless the close call leans antiphase (a mean speedup of at least 1 + `margin`): then
antiphase is taken at once, and the hold check (below) gives it up at its first watch
window if the hold's own rates fall below 1 - `keep_margin` of the probe's concurrent
ones. Measuring on would cost about as much (half of every pair runs in the mode that
may lose), and a probe of three pairs takes some 15 s, the whole of a short run: where
antiphase won, its gain came too late (measured without this rule on the emulated
hosts: mlp+cnn at 2000 Mbit/s, always antiphase 1.07x sequential, auto 0.93-0.97x,
probing to the end of every run). A close call that leans concurrent measures on: no
check would find the gain a concurrent hold gives up.

The decision holds for `hold_s`, doubled each time a re-probe confirms it (up to
`max_hold_s`); meanwhile longer windows in the held mode (`watch_s`) watch the rates,
and a job whose rate differs by more than `drift` from the first watch window after the
decision (its phase lengths changed) starts a re-probe at once. Short probe windows
are noisy on a busy host; watch windows compare like with like.

Antiphase must keep paying while it holds. A probe's antiphase window starts with the
nodes' turns aligned (a switch restarts them together), and across nodes only each
job's allreduce ties the nodes' timing, so over a long hold their turns can drift apart
and lose what the probe measured (docs/benchmarks.md, "The hosts' phases drift apart
in antiphase"; at 2000 Mbit/s pairs once read 1.04-1.16x where always antiphase ran
0.83-0.94x plain co-location end to end). So each watch window also compares the jobs'
rates over the whole hold so far with the probe's concurrent rates (the mean over its
pairs): when the mean speedup falls below 1 - `keep_margin`, the controller serves
concurrently for a hold (the safe mode: what plain co-location does). The hold's rate
accumulates, so its noise shrinks as the hold goes on. Concurrent is not checked
against the probe's antiphase rates the same way: those read high (above), so the check
would trade a mode measured over the long run for one measured in its best seconds.

Jobs whose ranks all share one host's CPU are not probed: their allreduce is memory
copying on the very cores the other job computes on, so there is no gap to fill, and a
probe in antiphase there cost one-host runs up to 2x (stragglers pinned while the rest
had moved on). They are served concurrently at once (`probe_local` probes them anyway).

Pure: time comes from an injected clock; every call returns the switches it decided (a
probe's decision is returned even when it keeps the mode), so the daemon only has to
apply and announce them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from crossover.protocol import Mode


@dataclass(frozen=True)
class ModeSwitch:
    """Serve devices in `mode` from now on, because of `reason` (for traces and status)."""

    mode: Mode
    reason: str


@dataclass
class _Window:
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


def _each(per_job: dict[str, float]) -> str:
    """Each job's figure, for a reason: "a 1.30x, b 1.25x"."""
    return ", ".join(f"{j} {s:.2f}x" for j, s in per_job.items())


class ModeController:
    """Chooses the mode for a group of co-located jobs from their measured progress.

    Args:
        clock: monotonic seconds.
        probe_s: shortest measurement window.
        min_steps: steps every job must make in a window (after settling).
        settle_steps: steps ignored after a switch (the pipeline drains and refills).
        warmup_steps: steps ignored at the start of a probe after the job mix changed.
        max_probe_s: a window closes after this long even if a job is slower.
        hold_s: how long a decision holds before it is probed again.
        watch_s: the length of the windows that watch the rates during a hold.
        max_hold_s: the longest hold, after repeated confirmations.
        margin: antiphase must beat concurrent by this fraction to be chosen.
        drift: relative change of a job's rate, in the held mode, that re-probes.
        keep_margin: a hold in antiphase ends, for concurrent, once the jobs' mean rate
            over the hold falls this fraction below the probe's concurrent rates.
        pair_noise: the relative noise of one pair's speedup: a probe whose mean speedup
            is below 1 + margin decides once it is this far below, divided by
            sqrt(pairs); one at or above decides at once.
        max_pairs: a probe decides after this many pairs whatever they measured.
        cutoff: a probe window ends early, after `min_steps`, once every job runs slower
            than under the other mode by this fraction.
        probe_local: probe jobs that communicate inside one host's CPU too.
    """

    def __init__(self, clock: Callable[[], float], probe_s: float = 2.0, min_steps: int = 3,
                 settle_steps: int = 2, warmup_steps: int = 8, max_probe_s: float = 15.0,
                 hold_s: float = 30.0,
                 watch_s: float = 5.0, max_hold_s: float = 240.0, margin: float = 0.03,
                 drift: float = 0.5, keep_margin: float = 0.03, cutoff: float = 0.25,
                 pair_noise: float = 0.1, max_pairs: int = 3,
                 probe_local: bool = False) -> None:
        if not (0 < probe_s <= max_probe_s and min_steps >= 1 and settle_steps >= 0
                and 0 < hold_s <= max_hold_s and margin >= 0 and drift > 0
                and 0 <= keep_margin < 1 and pair_noise >= 0 and max_pairs >= 1):
            raise ValueError(
                f"mode controller: need 0 < probe_s <= max_probe_s, min_steps >= 1, "
                f"settle_steps >= 0, 0 < hold_s <= max_hold_s, margin >= 0, drift > 0, "
                f"0 <= keep_margin < 1, pair_noise >= 0, max_pairs >= 1; "
                f"got probe_s={probe_s}, max_probe_s={max_probe_s}, min_steps={min_steps}, "
                f"settle_steps={settle_steps}, hold_s={hold_s}, max_hold_s={max_hold_s}, "
                f"margin={margin}, drift={drift}, keep_margin={keep_margin}, "
                f"pair_noise={pair_noise}, max_pairs={max_pairs}")
        self.clock = clock
        self.probe_s, self.min_steps, self.settle_steps = probe_s, min_steps, settle_steps
        self.warmup_steps = max(warmup_steps, settle_steps)
        self.max_probe_s, self.base_hold_s, self.max_hold_s = max_probe_s, hold_s, max_hold_s
        self.watch_s = max(watch_s, probe_s)
        self.margin, self.drift, self.cutoff = margin, drift, cutoff
        self.keep_margin = keep_margin
        self.pair_noise, self.max_pairs = pair_noise, max_pairs
        self.probe_local = probe_local
        self._local: dict[str, bool] = {}  # job -> all its ranks on one host's CPU
        self.mode = Mode.ANTIPHASE
        self.state = "solo"  # solo (fewer than two jobs), fixed (local jobs), probe, hold
        self.reason = "fewer than two jobs"
        self._steps: dict[str, int] = {}  # each job's latest reported step count
        self._plan: list[Mode] = []  # the probe windows still to run in this pair
        self._order: list[Mode] = []  # the modes of this pair, in the order measured
        self._window: _Window | None = None
        self._rates: dict[Mode, dict[str, float]] = {}  # the latest window of each mode
        self._measured: dict[Mode, set[str]] = {}  # its jobs that made min_steps steps
        self._pairs: list[dict[str, float]] = []  # each job's speedup in each pair so far
        self._concurrent: list[dict[str, float]] = []  # the concurrent rates of those pairs
        self._held: _Window | None = None  # the whole hold so far, in antiphase
        self._hold_s = hold_s
        self._hold_until: float | None = None
        self._decided: Mode | None = None  # the last probe's decision
        self._watched: dict[str, float] = {}  # rates of the first watch window of a hold

    # --- events ---------------------------------------------------------------------
    def progress(self, job: str, steps: int, local: bool = False) -> list[ModeSwitch]:
        """A rank of `job` reports that the job has made `steps` steps (`local`: all the
        job's ranks compute on one host's CPU and allreduce in its memory)."""
        if job not in self._steps:
            self._steps[job], self._local[job] = steps, local
            return self._restart(f"job {job} joined")
        if steps <= self._steps[job]:
            return []  # another rank of the job, or a report out of date
        self._steps[job] = steps
        now = self.clock()
        for w in (self._window, self._held):
            if w is not None:
                w.note(job, steps, now)
        return self._advance()

    def leave(self, job: str) -> list[ModeSwitch]:
        """`job` has no rank left anywhere."""
        self._local.pop(job, None)
        if self._steps.pop(job, None) is None:
            return []
        return self._restart(f"job {job} left")

    def tick(self) -> list[ModeSwitch]:
        """Let time-based limits act (window timeouts, the end of a hold)."""
        return self._advance()

    def next_deadline(self) -> float | None:
        """When `tick` may next decide something."""
        ends = [self._hold_until] if self._hold_until is not None else []
        if self._window is not None:
            ends.append(self._window.start + self.max_probe_s)
        return min(ends, default=None)

    def snapshot(self) -> dict:
        """The current mode, state and measurements, JSON-ready (for status)."""
        return {"mode": self.mode.value, "state": self.state, "reason": self.reason,
                "rates": {m.value: dict(r) for m, r in self._rates.items()},
                "pairs": [dict(p) for p in self._pairs]}

    # --- internals ------------------------------------------------------------------
    def _restart(self, why: str) -> list[ModeSwitch]:
        self._rates, self._measured, self._pairs, self._concurrent = {}, {}, [], []
        self._hold_until, self._decided, self._held = None, None, None
        if len(self._steps) < 2:
            self.state, self.reason, self._plan, self._window = "solo", why, [], None
            return []
        if all(self._local.values()) and not self.probe_local:
            self.state, self._plan, self._window = "fixed", [], None
            self.mode = Mode.CONCURRENT
            self.reason = (f"{why}: every job allreduces in this host's memory, on the cores "
                           f"that compute: nothing to fill; concurrent")
            return [ModeSwitch(Mode.CONCURRENT, self.reason)]
        # Concurrent first: a newcomer computes at once instead of waiting for a turn.
        return self._probe([Mode.CONCURRENT, Mode.ANTIPHASE], f"{why}: probing",
                           self.warmup_steps)

    def _probe(self, plan: list[Mode], why: str, settle: int | None = None) -> list[ModeSwitch]:
        self.state, self._order, self._plan, self._hold_until = "probe", plan, plan[1:], None
        self._watched, self._pairs, self._concurrent, self._held = {}, [], [], None
        return self._open(plan[0], f"{why} {plan[0].value}", settle=settle)

    def _open(self, mode: Mode, why: str, min_s: float | None = None,
              settle: int | None = None) -> list[ModeSwitch]:
        self._window = _Window(mode, self.clock(), min_s or self.probe_s,
                               self.settle_steps if settle is None else settle,
                               dict(self._steps))
        if mode == self.mode:
            return []
        self.mode, self.reason = mode, why
        return [ModeSwitch(mode, why)]

    def _advance(self) -> list[ModeSwitch]:
        if self.state in ("solo", "fixed"):
            return []
        now = self.clock()
        w = self._window
        assert w is not None, "probe and hold always keep a window open"
        if self.state == "hold" and self._hold_until is not None and now >= self._hold_until:
            return self._probe([self.mode.other, self.mode], "re-probing after the hold:")
        if not self._window_done(w, now):
            return []
        rates = {job: w.rate(job, now) for job in w.base if job in self._steps}
        if self.state == "hold":
            return self._watch(rates)
        self._rates[w.mode] = rates
        self._measured[w.mode] = {job for job in rates if w.measured(job, self.min_steps)}
        if self._plan:
            nxt = self._plan.pop(0)
            return self._open(nxt, f"probing {nxt.value}")
        return self._pair_done()

    def _window_done(self, w: _Window, now: float) -> bool:
        if now - w.start >= self.max_probe_s:
            return True
        jobs = [job for job in w.base if job in self._steps]
        if not all(w.measured(job, self.min_steps) for job in jobs):
            return False
        if now - w.start >= w.min_s:
            return True
        # A probe that is losing by far need not run its full length: every step of it
        # is a step slower than the other mode (on one host antiphase runs at 0.2-0.7x).
        other = self._rates.get(w.mode.other)
        if self.state != "probe" or not other:
            return False
        ratios = [w.rate(job, now) / other[job] for job in jobs if other.get(job)]
        return bool(ratios) and max(ratios) < 1 - self.cutoff

    def _pair_done(self) -> list[ModeSwitch]:
        """Both modes measured once more: decide; within the noise of the margin, take
        antiphase if the mean speedup leans that way, else measure another pair (module
        doc)."""
        anti, conc = self._rates[Mode.ANTIPHASE], self._rates[Mode.CONCURRENT]
        # A job too slow to make min_steps steps in a window (max_probe_s ended it) has
        # a rate of one step or none, which says nothing: the others decide, if any.
        jobs = set(anti) & set(conc)
        jobs = (jobs & self._measured[Mode.ANTIPHASE] & self._measured[Mode.CONCURRENT]) or jobs
        self._pairs.append({j: anti[j] / conc[j] if conc[j] > 0 else
                            float("inf") if anti[j] > 0 else 1.0 for j in sorted(jobs)})
        self._concurrent.append({j: conc[j] for j in jobs})
        n = len(self._pairs)
        mean = self._mean_speedup()
        noise = self.pair_noise / n ** 0.5
        if mean >= 1 + self.margin:  # antiphase, and within the noise the hold check guards it
            close = n < self.max_pairs and mean - 1 - self.margin < noise
            return self._decide(f", within the noise of {1 + self.margin:.2f}x after {n} "
                                f"pair{'s' if n > 1 else ''}: the hold check watches it"
                                if close else "")
        if n >= self.max_pairs or 1 + self.margin - mean >= noise:
            return self._decide()
        # The reverse order: the first window continues the mode just measured.
        self._order = self._order[::-1]
        self._plan = self._order[1:]
        why = (f"antiphase {mean:.2f}x concurrent after {n} pair{'s' if n > 1 else ''}, "
               f"within the noise of {1 + self.margin:.2f}x: probing again, "
               f"{self._order[0].value}")
        self._open(self._order[0], why, settle=0)
        self.reason = why
        return [ModeSwitch(self.mode, why)]  # (the mode does not change: this is news)

    def _mean_speedup(self) -> float:
        """The jobs' mean speedup under antiphase, each job's averaged over the pairs."""
        per_job = self._per_job()
        return sum(per_job.values()) / max(len(per_job), 1)

    def _per_job(self) -> dict[str, float]:
        jobs = set.intersection(*(set(p) for p in self._pairs)) if self._pairs else set()
        return {j: sum(p[j] for p in self._pairs) / len(self._pairs) for j in sorted(jobs)}

    def _decide(self, note: str = "") -> list[ModeSwitch]:
        mean, n = self._mean_speedup(), len(self._pairs)
        best = Mode.ANTIPHASE if mean >= 1 + self.margin else Mode.CONCURRENT
        pairs = f" over {n} pairs" if n > 1 and not note else ""
        return self._hold(best, f"antiphase {mean:.2f}x concurrent{pairs} "
                                f"({_each(self._per_job())}){note}: {best.value}")

    def _hold(self, mode: Mode, why: str) -> list[ModeSwitch]:
        # A re-probe that confirms the last decision holds it twice as long.
        self._hold_s = min(2 * self._hold_s, self.max_hold_s) if mode == self._decided \
            else self.base_hold_s
        self._decided, self.state = mode, "hold"
        self._hold_until = self.clock() + self._hold_s
        self._held = _Window(mode, self.clock(), 0.0, self.settle_steps, dict(self._steps)) \
            if mode == Mode.ANTIPHASE else None
        self._open(mode, why, self.watch_s)
        self.reason = why
        return [ModeSwitch(mode, why)]  # announced even if unchanged: the reason is news

    def _held_speedup(self, now: float) -> tuple[float, str] | None:
        """The jobs' mean rate over the antiphase hold so far against the probe's mean
        concurrent rates, and each job's figure; None before every job is measured."""
        held, pairs = self._held, self._concurrent
        if held is None or not pairs:
            return None
        jobs = [j for j in set.intersection(*(set(p) for p in pairs)) if j in self._steps]
        if not jobs or not all(held.measured(j, self.min_steps) for j in jobs):
            return None
        per_job = {j: held.rate(j, now) * len(pairs) / sum(p[j] for p in pairs)
                   for j in sorted(jobs) if all(p[j] > 0 for p in pairs)}
        if not per_job:
            return None
        return sum(per_job.values()) / len(per_job), _each(per_job)

    def _watch(self, rates: dict[str, float]) -> list[ModeSwitch]:
        for job, rate in sorted(rates.items()):
            ref = self._watched.get(job)
            if ref and abs(rate / ref - 1) > self.drift:
                return self._probe(
                    [self.mode.other, self.mode],
                    f"job {job}'s rate went from {ref:.2f} to {rate:.2f} steps/s: re-probing")
        self._watched = self._watched or rates  # the first watch window after a decision
        held = self._held_speedup(self.clock())
        if held is not None and held[0] < 1 - self.keep_margin:
            return self._hold(Mode.CONCURRENT,
                              f"antiphase held ran {held[0]:.2f}x the probe's concurrent "
                              f"rates ({held[1]}): concurrent")
        return self._open(self.mode, self.reason, self.watch_s)  # the next watch window
