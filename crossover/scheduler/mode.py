"""Whether co-located jobs should take turns on their devices or compute at once.

Antiphase (exclusive grants in one global sequence) pays when a job's communication
leaves the device idle: the other job computes in that gap. When communication is
itself work on the same resource (shared-memory allreduce on the cores that compute,
on one host), taking turns only adds waiting, and plain co-location is faster.

Predicted first. Every job reports, with its steps, what a step is made of (compute
on the device, the gap of its communication: `crossover.scheduler.predict`). When the
jobs change, the controller bounds what antiphase can gain from the profiles the jobs
showed alone or in antiphase (a newcomer without one is taken to be like the others).
Below 1 + `margin`: concurrent at once, which is what plain co-location does. At or
above 1 + `predict_clear`: antiphase at once, the hold check (below) comparing the
hold's rates with the predicted concurrent ones. A newcomer's own profile updates the
prediction; the held mode changes only if it then says otherwise. Between the two: a
probe.

Probing: a pair of windows, one per mode, measures each job's step rate (after
settling steps, at least `min_steps` steps and `probe_s` seconds) and its speedup under
antiphase; a mean of 1 + `margin` or more takes antiphase (guarded by the hold check),
a lower one concurrent (do no harm). Below the margin by less than one pair's noise
(`pair_noise` / sqrt(pairs): bench/colocation/pair_noise.py), a pair in the reverse order follows
(C A, A C, C A: a drift of the host's speed cancels), up to `max_pairs`, and the mean
decides; where the jobs' profiles were too close to call, their lean decides within
that noise: antiphase, guarded (docs/design.md).

A decision holds for `hold_s`, doubled each time a re-probe confirms it (up to
`max_hold_s`); windows of `watch_s` watch the rates meanwhile, and a job whose rate
moves by more than `drift` from the hold's first watch window starts a re-probe.

The hold check: across nodes only each job's allreduce ties the nodes' timing, so over
a long hold their turns can drift apart and antiphase lose what the probe measured
(docs/design.md, the limits). Each watch window compares the jobs' rates over the whole
antiphase hold with the probe's (or the prediction's) concurrent rates: below 1 -
`keep_margin`, less a probe's noise (`pair_noise` / sqrt(2 x windows)), concurrent
(the safe mode); within that noise, one more pair, unless `max_pairs` were measured,
and the mean over all decides (the profiles' lean no longer counts). Concurrent is not
checked so: a probe's antiphase rates read high, in its best seconds.

Jobs whose ranks all share one host's CPU allreduce on the cores the other job computes
on: no gap to fill, concurrent at once, unprobed (`probe_local` probes them anyway).

Pure: time comes from an injected clock; every call returns the switches it decided
(news even where the mode stays), for the daemon to apply and announce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crossover.protocol import Mode
from crossover.scheduler.predict import Prediction, Profile, Profiles
from crossover.scheduler.window import RateWindow, each_job, mean_speedup, per_job


@dataclass(frozen=True)
class ModeSwitch:
    """Serve devices in `mode` from now on, because of `reason` (for traces and status).
    `decided_after_s`: on a decision, how long it took since it was due (the jobs
    changed, a held mode's rates drifted or its hold ended, or a doubt about it); None
    on a probe's switches."""

    mode: Mode
    reason: str
    decided_after_s: float | None = None


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
        keep_margin: an antiphase hold ends, for concurrent, once the jobs' mean rate over
            it falls this fraction below the concurrent rates (module doc).
        pair_noise: one pair's relative noise (module doc).
        max_pairs: a probe decides after this many pairs whatever they measured.
        cutoff: a probe window ends early, after `min_steps`, once every job runs slower
            than under the other mode by this fraction.
        probe_local: probe jobs that communicate inside one host's CPU too.
        predict_clear: antiphase is taken without a probe when the profiles say it can
            gain at least this fraction (module doc); 0 or less: always probe.
        handover_s: what one hand-over of a device costs in antiphase (prediction).
    """

    def __init__(self, clock: Callable[[], float], probe_s: float = 2.0, min_steps: int = 3,
                 settle_steps: int = 2, warmup_steps: int = 8, max_probe_s: float = 15.0,
                 hold_s: float = 30.0, watch_s: float = 5.0, max_hold_s: float = 240.0,
                 margin: float = 0.03, drift: float = 0.5, keep_margin: float = 0.03,
                 cutoff: float = 0.25, pair_noise: float = 0.1, max_pairs: int = 3,
                 probe_local: bool = False, predict_clear: float = 0.2,
                 handover_s: float = 0.0005) -> None:
        broken = [f"{rule} (got {got})" for rule, ok, got in (
            ("0 < probe_s <= max_probe_s", 0 < probe_s <= max_probe_s, (probe_s, max_probe_s)),
            ("min_steps >= 1", min_steps >= 1, min_steps),
            ("settle_steps >= 0", settle_steps >= 0, settle_steps),
            ("0 < hold_s <= max_hold_s", 0 < hold_s <= max_hold_s, (hold_s, max_hold_s)),
            ("margin >= 0", margin >= 0, margin), ("drift > 0", drift > 0, drift),
            ("0 <= keep_margin < 1", 0 <= keep_margin < 1, keep_margin),
            ("pair_noise >= 0", pair_noise >= 0, pair_noise),
            ("max_pairs >= 1", max_pairs >= 1, max_pairs)) if not ok]
        if broken:
            raise ValueError(f"mode controller: need {'; '.join(broken)}")
        self.clock = clock
        self.probe_s, self.min_steps, self.settle_steps = probe_s, min_steps, settle_steps
        self.warmup_steps = max(warmup_steps, settle_steps)
        self.max_probe_s, self.base_hold_s, self.max_hold_s = max_probe_s, hold_s, max_hold_s
        self.watch_s = max(watch_s, probe_s)
        self.margin, self.drift, self.cutoff = margin, drift, cutoff
        self.keep_margin, self.pair_noise, self.max_pairs = keep_margin, pair_noise, max_pairs
        self.probe_local = probe_local
        self.predict_clear, self.handover_s = predict_clear, handover_s
        self._profiles = Profiles()  # from steps alone or in antiphase
        self._prediction: Prediction | None = None  # the one the current hold came from
        self._lean = False  # this probe began as the jobs changed: the profiles may lean
        self._overruled = False  # the hold check gave a predicted antiphase up
        self._local: dict[str, bool] = {}  # job -> all its ranks on one host's CPU
        self.mode = Mode.ANTIPHASE
        self.state = "solo"  # solo (fewer than two jobs), fixed (local jobs), probe, hold
        self.reason = "fewer than two jobs"
        self._steps: dict[str, int] = {}  # each job's latest reported step count
        self._plan: list[Mode] = []  # the probe windows still to run in this pair
        self._order: list[Mode] = []  # the modes of this pair, in the order measured
        self._window: RateWindow | None = None
        self._rates: dict[Mode, dict[str, float]] = {}  # the latest window of each mode
        self._measured: dict[Mode, set[str]] = {}  # its jobs that made min_steps steps
        self._pairs: list[dict[str, float]] = []  # each job's speedup in each pair so far
        self._concurrent: list[dict[str, float]] = []  # the concurrent rates of those pairs
        self._held: RateWindow | None = None  # the whole hold so far, in antiphase
        self._hold_s = hold_s
        self._hold_until: float | None = None
        self._decided: Mode | None = None  # the last probe's decision
        self._watched: dict[str, float] = {}  # rates of the first watch window of a hold
        self._due_since: float | None = None  # when the pending decision fell due

    # --- events ---------------------------------------------------------------------
    def progress(self, job: str, steps: int, local: bool = False,
                 profile: Profile | None = None) -> list[ModeSwitch]:
        """A rank of `job` reports its `steps` so far (`local`: all the job's ranks compute
        on one host's CPU and allreduce in its memory; `profile`: its recent steps)."""
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
        if self._note_profile(job, steps, profile) and self._prediction is not None:
            return self._repredict(f"job {job}'s first profile") or self._advance()
        return self._advance()

    def leave(self, job: str) -> list[ModeSwitch]:
        """`job` has no rank left anywhere."""
        self._local.pop(job, None)
        self._profiles.forget(job)
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
                "pairs": [dict(p) for p in self._pairs], "profiles": self._profiles.snapshot()}

    # --- internals ------------------------------------------------------------------
    def _note_profile(self, job: str, steps: int, profile: Profile | None) -> bool:
        """Keep `job`'s profile if it shows its own step: alone, or in antiphase past the
        settling steps (concurrent steps are stretched by the others'); True if first."""
        w = self._window
        own = self.state == "solo" or (
            self.mode == Mode.ANTIPHASE and w is not None
            and steps >= w.base.get(job, steps) + w.settle)
        return profile is not None and own and self._profiles.note(job, profile)

    def _predicted(self) -> Prediction | None:
        """None with predicting off, or once the hold check overruled a prediction (until
        the jobs change: else the two could take turns deciding)."""
        return self._profiles.predict(self._steps, self.handover_s) \
            if self.predict_clear > 0 and not self._overruled else None

    def _verdict(self) -> tuple[Mode | None, str]:
        """The mode the profiles favour (None: too close to call, or no profile), why."""
        self._prediction = self._predicted()
        if self._prediction is None:
            return None, ""
        return self._prediction.favours(self.margin, self.predict_clear), \
            self._prediction.reason

    def _from_prediction(self, why: str) -> list[ModeSwitch] | None:
        """Hold the mode the profiles favour; None where they cannot tell."""
        mode, figures = self._verdict()
        if mode is None:
            return None
        switches = self._hold(mode, f"{why}: {figures}: {mode.value}")
        self._refer_to_prediction()  # (the prediction stays: a newcomer's profile updates it)
        return switches

    def _refer_to_prediction(self) -> None:
        """An antiphase hold on a prediction is checked against its concurrent rates."""
        pred = self._prediction
        self._concurrent = [{j: 1 / pred.concurrent_s for j in self._steps}] \
            if pred is not None and self.mode == Mode.ANTIPHASE else []

    def _repredict(self, why: str) -> list[ModeSwitch] | None:
        """A hold taken on a prediction, and a new profile: hold the other mode if the
        prediction now favours it, probe if it cannot tell."""
        held = self.mode
        mode, figures = self._verdict()
        if mode == held or self.state != "hold":
            self._refer_to_prediction()
            return None
        if mode is not None:
            return self._from_prediction(why)
        return self._probe([held.other, held], f"{why}: {figures}: probing", lean=True)

    def _restart(self, why: str) -> list[ModeSwitch]:
        self._rates, self._measured, self._pairs, self._concurrent = {}, {}, [], []
        self._hold_until, self._decided, self._held = None, None, None
        self._prediction, self._overruled = None, False
        self._due_since = None
        if len(self._steps) < 2:
            self.state, self.reason, self._plan, self._window = "solo", why, [], None
            return []
        if all(self._local.values()) and not self.probe_local:
            self.state, self._plan, self._window = "fixed", [], None
            self.mode = Mode.CONCURRENT
            self.reason = (f"{why}: every job allreduces in this host's memory, on the cores "
                           f"that compute: nothing to fill; concurrent")
            return [ModeSwitch(Mode.CONCURRENT, self.reason)]
        self._due_since = self.clock()
        predicted = self._from_prediction(why)
        if predicted is not None:
            return predicted
        unknown = self._prediction is None and self.predict_clear > 0  # (module doc)
        first = Mode.ANTIPHASE if unknown else Mode.CONCURRENT
        return self._probe([first, first.other], f"{why}: probing", self.warmup_steps, True)

    def _probe(self, plan: list[Mode], why: str, settle: int | None = None,
               lean: bool = False) -> list[ModeSwitch]:
        self._prediction, self._lean = None, lean
        if self._due_since is None:  # a re-probe of a held mode
            self._due_since = self.clock()
        self.state, self._order, self._plan, self._hold_until = "probe", plan, plan[1:], None
        self._watched, self._pairs, self._concurrent, self._held = {}, [], [], None
        self._open(plan[0], f"{why} {plan[0].value}", settle=settle)
        self.reason = f"{why} {plan[0].value}"
        return [ModeSwitch(plan[0], self.reason)]  # news even if kept (a node new to it)

    def _open(self, mode: Mode, why: str, min_s: float | None = None,
              settle: int | None = None) -> list[ModeSwitch]:
        self._window = RateWindow(mode, self.clock(), min_s or self.probe_s,
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
            if w.mode == Mode.ANTIPHASE and not self._pairs:  # the jobs' profiles are in
                predicted = self._from_prediction("profiled in antiphase")
                if predicted is not None:
                    return predicted
                self._prediction = None  # it could not tell: the pair decides, not it
            nxt = self._plan.pop(0)
            return self._open(nxt, f"probing {nxt.value}")
        return self._pair_done()

    def _window_done(self, w: RateWindow, now: float) -> bool:
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
        """Both modes measured once more: decide; within the noise of the margin antiphase
        if the mean speedup or the profiles lean so, else another pair (module doc)."""
        anti, conc = self._rates[Mode.ANTIPHASE], self._rates[Mode.CONCURRENT]
        # A job too slow to make min_steps steps in a window (max_probe_s ended it) has
        # a rate of one step or none, which says nothing: the others decide, if any.
        jobs = set(anti) & set(conc)
        jobs = (jobs & self._measured[Mode.ANTIPHASE] & self._measured[Mode.CONCURRENT]) or jobs
        self._pairs.append({j: anti[j] / conc[j] if conc[j] > 0 else
                            float("inf") if anti[j] > 0 else 1.0 for j in sorted(jobs)})
        self._concurrent.append({j: conc[j] for j in jobs})
        n = len(self._pairs)
        mean = mean_speedup(self._pairs)
        noise = self.pair_noise / n ** 0.5
        if mean >= 1 + self.margin:  # antiphase, and within the noise the hold check guards it
            close = n < self.max_pairs and mean - 1 - self.margin < noise
            return self._decide(f", within the noise of {1 + self.margin:.2f}x after {n} "
                                f"pair{'s' if n > 1 else ''}: the hold check watches it"
                                if close else "")
        if n >= self.max_pairs or 1 + self.margin - mean >= noise:
            return self._decide()
        lean = self._predicted() if self._lean else None
        if lean is not None and lean.bound >= 1 + self.margin:  # they lean antiphase (doc)
            return self._decide(f", within the noise of {1 + self.margin:.2f}x, and "
                                f"{lean.reason}: the hold check watches it", Mode.ANTIPHASE)
        return self._pair_again(f"antiphase {mean:.2f}x concurrent after {n} "
                                f"pair{'s' if n > 1 else ''}, within the noise of "
                                f"{1 + self.margin:.2f}x: probing again,")

    def _pair_again(self, why: str) -> list[ModeSwitch]:
        """One more pair, in the reverse order of the last (module doc)."""
        self._order = self._order[::-1]  # (a doubt follows a probe: it has an order)
        if self._due_since is None:  # a doubt about a held mode: decided again
            self._due_since = self.clock()
        self.state, self._plan, self._hold_until = "probe", self._order[1:], None
        self._held, self._watched, first = None, {}, self._order[0]
        self.reason = why = f"{why} {first.value}"
        self._open(first, why, settle=0 if first == self.mode else None)
        return [ModeSwitch(self.mode, why)]  # (news even if the mode does not change)

    def _decide(self, note: str = "", best: Mode | None = None) -> list[ModeSwitch]:
        mean, n = mean_speedup(self._pairs), len(self._pairs)
        best = best or (Mode.ANTIPHASE if mean >= 1 + self.margin else Mode.CONCURRENT)
        pairs = f" over {n} pairs" if n > 1 and not note else ""
        return self._hold(best, f"antiphase {mean:.2f}x concurrent{pairs} "
                                f"({each_job(per_job(self._pairs))}){note}: {best.value}")

    def _hold(self, mode: Mode, why: str) -> list[ModeSwitch]:
        # A re-probe that confirms the last decision holds it twice as long.
        self._hold_s = min(2 * self._hold_s, self.max_hold_s) if mode == self._decided \
            else self.base_hold_s
        self._decided, self.state = mode, "hold"
        self._watched = {}  # the new hold's first watch window is its reference
        self._hold_until = self.clock() + self._hold_s
        self._held = RateWindow(mode, self.clock(), 0.0, self.settle_steps, dict(self._steps)) \
            if mode == Mode.ANTIPHASE else None
        self._open(mode, why, self.watch_s)
        self.reason = why
        # (a hold given up or changed on a new profile is decided at once: 0 s)
        now = self.clock()
        took = now - (self._due_since if self._due_since is not None else now)
        self._due_since = None
        return [ModeSwitch(mode, why, took)]  # announced even if unchanged: the reason is news

    def _watch(self, rates: dict[str, float]) -> list[ModeSwitch]:
        for job, rate in sorted(rates.items()):
            ref = self._watched.get(job)
            if ref and abs(rate / ref - 1) > self.drift:
                return self._probe(
                    [self.mode.other, self.mode],
                    f"job {job}'s rate went from {ref:.2f} to {rate:.2f} steps/s: re-probing")
        self._watched = self._watched or rates  # the first watch window after a decision
        held = self._held.against(self._concurrent, self._steps, self.min_steps,
                                  self.clock()) if self._held is not None else None
        noise = 0.0 if self._prediction is not None or not self._concurrent else \
            self.pair_noise / (2 * len(self._concurrent)) ** 0.5  # (module doc)
        if held is not None and held[0] < 1 - self.keep_margin - noise:
            source = "the predicted" if self._prediction is not None else "the probe's"
            self._overruled = self._overruled or self._prediction is not None
            return self._hold(Mode.CONCURRENT,
                              f"antiphase held ran {held[0]:.2f}x {source} concurrent "
                              f"rates ({held[1]}): concurrent")
        if held is not None and held[0] < 1 - self.keep_margin and \
                len(self._pairs) < self.max_pairs:  # a doubt, within the probe's noise
            # The hold measured antiphase, which the profiles only bounded; a doubt does not
            # confirm the decision (no doubled hold); the rates it compared are a hold old.
            self._lean, self._decided, self._rates = False, None, {}
            return self._pair_again(f"antiphase held ran {held[0]:.2f}x the probe's "
                                    f"concurrent rates ({held[1]}), within its noise: "
                                    f"probing again,")
        return self._open(self.mode, self.reason, self.watch_s)  # the next watch window
