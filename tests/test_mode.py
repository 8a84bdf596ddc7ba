"""The mode decision (antiphase or concurrent), tested with synthetic step rates, and the
scheduler's mode switch, tested with tables and hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.protocol import Mode, Phase
from crossover.scheduler import ModeController, ModeSwitch, SchedulerError
from tests.test_scheduler import FakeClock, build, run

A, C = Mode.ANTIPHASE, Mode.CONCURRENT
M = Phase.COMMUNICATE


def simulate(ctl: ModeController, clock: FakeClock, rates: dict, until: float,
             steps: dict | None = None, profiles: dict | None = None
             ) -> list[tuple[float, str]]:
    """Jobs step at rates[job][mode] steps/s (the mode in force when a step starts; a
    number, or a function of the time) and report every step, with profiles[job] if
    given; returns [(time, mode switched to)]."""
    steps = steps if steps is not None else {}

    def rate(job: str) -> float:
        r = rates[job][ctl.mode]
        return r(clock.now) if callable(r) else r

    due = {j: clock.now + 1 / rate(j) for j in rates}
    out, ticked = [], None
    while True:
        job = min(due, key=due.get)
        deadline = ctl.next_deadline()
        if deadline is not None and deadline < due[job] and deadline <= until:
            assert deadline > clock.now or ticked != deadline, "a deadline that never passes"
            clock.now, ticked = max(clock.now, deadline), deadline
            out += [(clock.now, s.mode.value) for s in ctl.tick()]
            continue
        if due[job] > until:
            clock.now = until
            return out
        clock.now = due[job]
        steps[job] = steps.get(job, 0) + 1
        profile = (profiles or {}).get(job)
        out += [(clock.now, s.mode.value)
                for s in ctl.progress(job, steps[job], profile=profile)]
        due[job] = clock.now + 1 / rate(job)


def controller(**kw) -> tuple[ModeController, FakeClock]:
    """A controller that only probes (tests/test_predict.py has the predictions)."""
    clock = FakeClock()
    return ModeController(clock, **{"predict_clear": 0.0, **kw}), clock


# Steps per second of each job in each mode.
SHORT_COMM = {"a": {A: 6.0, C: 10.0}, "b": {A: 5.0, C: 8.0}}  # sharing cores: taking turns loses
LONG_COMM = {"a": {A: 13.0, C: 10.0}, "b": {A: 10.0, C: 8.0}}  # idle links: antiphase fills gaps
TIE = {"a": {A: 10.1, C: 10.0}, "b": {A: 8.0, C: 8.0}}  # within the margin: do no harm
GAIN = {"a": {A: 11.5, C: 10.0}, "b": {A: 9.2, C: 8.0}}  # a 15 % gain
EQUAL = {"a": {A: 10.0, C: 10.0}, "b": {A: 8.0, C: 8.0}}


def scaled(rates: dict, speed) -> dict:
    """`rates` with the host's speed, a function of the time, applied to every job."""
    return {j: {m: (lambda t, r=r: r * speed(t)) for m, r in by_mode.items()}
            for j, by_mode in rates.items()}


TABLE = [
    # (name, rates, mode decided, the switches in order); windows of 2 s from 0.1 s
    ("short communication -> concurrent", SHORT_COMM, C, ["concurrent", "antiphase", "concurrent"]),
    ("long idle communication -> antiphase", LONG_COMM, A,
     ["concurrent", "antiphase", "antiphase"]),
    # Close calls measure two more pairs, in reverse order (the first window of each
    # continues the mode just measured): C A | A C | C A.
    ("a gain within the margin -> three pairs, concurrent", TIE, C,
     ["concurrent", "antiphase", "antiphase", "concurrent", "concurrent", "antiphase",
      "concurrent"]),
    # A close call that leans antiphase takes it (the hold check guards it).
    ("a host that slowed in the first antiphase window -> two pairs, antiphase",
     scaled(GAIN, lambda t: 0.87 if 2.1 <= t < 4.1 else 1.0), A,
     ["concurrent", "antiphase", "antiphase", "concurrent", "antiphase"]),
    # A host that slows down 2 % a second disfavours the later window of a pair: measured
    # always concurrent first, no gain would look like 0.96x; the reversed pairs cancel.
    ("a steady drift of the host's speed -> no gain found, concurrent",
     scaled(EQUAL, lambda t: 1 - 0.02 * t), C,
     ["concurrent", "antiphase", "antiphase", "concurrent", "concurrent", "antiphase",
      "concurrent"]),
]


@pytest.mark.parametrize("name,rates,mode,switches", TABLE, ids=[t[0] for t in TABLE])
def test_mode_decision(name, rates, mode, switches):
    ctl, clock = controller()
    got = simulate(ctl, clock, rates, until=20.0)
    assert ctl.mode == mode and ctl.state == "hold", ctl.snapshot()
    assert [m for _, m in got] == switches
    assert ctl.reason.endswith(mode.value)


def test_a_decision_says_how_long_it_took_since_it_was_due():
    """For the leader's histogram: a decision's time runs from the jobs' change (the
    second job's first step) or a held mode's drift to the hold, and a probe's own
    switches carry none."""
    ctl, clock = controller(hold_s=100.0)
    seen: list[tuple[float, object]] = []
    for name in ("progress", "tick"):
        call = getattr(ctl, name)
        setattr(ctl, name, lambda *a, call=call, **k: [
            seen.append((clock.now, s)) or s for s in call(*a, **k)])
    # the host slows to half at 12 s: a held mode's rates drift, and it is probed again
    simulate(ctl, clock, scaled(LONG_COMM, lambda t: 0.5 if t >= 12 else 1.0), until=40.0)
    probes = [(t, s) for t, s in seen if s.decided_after_s is None]
    decisions = [(t, s) for t, s in seen if s.decided_after_s is not None]
    assert len(decisions) == 2, seen
    (first_due, _), (first, d1), (second, d2) = probes[0], *decisions
    assert d1.decided_after_s == pytest.approx(first - first_due) and \
        d1.decided_after_s > 2 * ctl.probe_s, seen
    reprobe = min(t for t, s in probes if t > first)
    assert 12 <= reprobe < second and \
        d2.decided_after_s == pytest.approx(second - reprobe), seen


def test_one_pair_alone_is_fooled_by_a_slow_moment():
    """The trap the repeated pairs avoid: with one pair the slow window above decides."""
    ctl, clock = controller(max_pairs=1)
    simulate(ctl, clock, scaled(GAIN, lambda t: 0.87 if 2.1 <= t < 4.1 else 1.0), until=20.0)
    assert ctl.mode == C and len(ctl.snapshot()["pairs"]) == 1


def test_a_close_call_says_why_it_measures_again():
    ctl, clock = controller()
    steps: dict = {}
    got = simulate(ctl, clock, TIE, until=5.0, steps=steps)
    assert [m for _, m in got] == ["concurrent", "antiphase", "antiphase"]
    assert ctl.state == "probe" and ctl.reason == (
        "antiphase 1.00x concurrent after 1 pair, within the noise of 1.03x: probing "
        "again, antiphase"), ctl.reason
    simulate(ctl, clock, TIE, until=20.0, steps=steps)
    assert "over 3 pairs" in ctl.reason and ctl.reason.endswith(": concurrent"), ctl.reason


def test_a_close_call_that_leans_antiphase_takes_it_and_the_hold_check_guards_it():
    """Antiphase runs at 0.9x, but the host ran 20 % faster through the first antiphase
    window: the first pair reads 1.08x, within the noise, leaning antiphase. Antiphase
    is taken at once; over its first watch window the hold runs about 0.9x the probe's
    concurrent rates, and the check gives it up."""
    loses = {"a": {A: 9.0, C: 10.0}, "b": {A: 7.2, C: 8.0}}
    rates, steps = scaled(loses, lambda t: 1.2 if 2.1 <= t < 4.3 else 1.0), {}
    ctl, clock = controller(hold_s=100.0)
    got = simulate(ctl, clock, rates, until=5.0, steps=steps)
    assert [m for _, m in got] == ["concurrent", "antiphase", "antiphase"], got
    assert ctl.state == "hold" and ctl.reason.startswith("antiphase 1.08x concurrent (") \
        and ctl.reason.endswith("), within the noise of 1.03x after 1 pair: the hold check "
                                "watches it: antiphase"), ctl.reason
    got = simulate(ctl, clock, rates, until=30.0, steps=steps)
    assert [m for _, m in got] == ["concurrent"] and got[0][0] < 10.5, got
    assert ctl.reason.startswith("antiphase held ran 0.88x"), ctl.reason  # (settling)


@pytest.mark.parametrize("max_pairs", [3, 1])
def test_a_hold_the_check_doubts_is_measured_again_not_kept_for_the_whole_hold(max_pairs):
    """Antiphase truly runs 0.93x, but the host ran 20 % faster through the first
    antiphase window: one pair reads 1.12x, within the noise, and antiphase is held. The
    hold then runs 0.93x the probe's concurrent rates: above the check's bar after one
    pair (0.90x), so it used to hold antiphase, losing 7 %, until the hold's end (a
    `make demo` run lost to both baselines so). Now the doubt measures more pairs (the
    reverse order, then the first again), and over three the mean serves concurrently.
    A probe allowed one pair (`max_pairs`) has no pair left to measure: the hold stays."""
    loses = {"a": {A: 9.3, C: 10.0}, "b": {A: 7.44, C: 8.0}}
    rates, steps = scaled(loses, lambda t: 1.2 if 2.1 <= t < 4.3 else 1.0), {}
    ctl, clock = controller(hold_s=100.0, max_pairs=max_pairs)
    simulate(ctl, clock, rates, until=8.0, steps=steps)
    assert ctl.mode == A and ctl.reason.startswith("antiphase 1.12x"), ctl.reason
    got = simulate(ctl, clock, rates, until=60.0, steps=steps)
    if max_pairs == 1:
        assert got == [] and len(ctl.snapshot()["pairs"]) == 1, got
        return
    assert [m for _, m in got] == ["antiphase", "concurrent", "concurrent", "antiphase",
                                   "concurrent"], got
    assert got[0][0] < 10.0 and got[-1][0] < 20.0, got
    assert ctl.reason.startswith("antiphase 0.99x concurrent over 3 pairs"), ctl.reason
    assert ctl.mode == C and ctl.state == "hold"


@pytest.mark.parametrize("pair_noise,given_up", [(0.1, False), (0.0, True)])
def test_the_hold_check_allows_for_the_noise_of_the_probes_concurrent_window(pair_noise,
                                                                            given_up):
    """The modes tie, but the host ran 6 % faster through the concurrent window and 25 %
    through the antiphase one: antiphase is taken (1.18x), and its hold then runs 0.94x
    the concurrent rates the probe read. That is within one window's noise
    (pair_noise / sqrt 2): the hold is not given up, a second pair is measured (even),
    and over both antiphase stays. Taking the probe's rates as exact (no noise), the
    check gives up a mode that was never slower."""
    rates = scaled(TIE, lambda t: 1.06 if t < 2.1 else 1.25 if t < 4.3 else 1.0)
    ctl, clock = controller(hold_s=100.0, pair_noise=pair_noise)
    got = simulate(ctl, clock, rates, until=30.0)
    assert [m for _, m in got][:3] == ["concurrent", "antiphase", "antiphase"], got
    assert ctl.reason.startswith("antiphase held ran 0.9") == given_up, ctl.reason
    assert (ctl.mode == C) == given_up, got
    assert len(ctl.snapshot()["pairs"]) == (1 if given_up else 2), ctl.reason
    if not given_up:  # a decision the check doubted is not confirmed: its hold is not doubled
        assert ctl._hold_until == pytest.approx(got[-1][0] + 100.0), got


def test_decision_reason_names_each_jobs_speedup():
    ctl, clock = controller()
    simulate(ctl, clock, LONG_COMM, until=10.0)
    assert "a 1.30x" in ctl.reason and "b 1.25x" in ctl.reason, ctl.reason
    assert ctl.snapshot()["rates"]["antiphase"]["a"] == pytest.approx(13.0)


def test_probing_takes_few_steps_of_each_mode():
    """The probe ends once every job made settle + min_steps steps and probe_s passed."""
    ctl, clock = controller(probe_s=1.0, min_steps=3, settle_steps=1)
    got = simulate(ctl, clock, LONG_COMM, until=10.0)
    assert got[-1][0] < 2.6, got  # two windows of about 1 s each (b's 4th step at 0.5 s)


def test_a_probe_that_loses_by_far_ends_early():
    """On one host antiphase runs at a fraction of concurrent: its window stops after
    settling plus min_steps steps instead of running probe_s."""
    slow = {"a": {A: 2.5, C: 10.0}, "b": {A: 2.0, C: 8.0}}
    ctl, clock = controller(probe_s=3.0, min_steps=3, settle_steps=2)
    got = simulate(ctl, clock, slow, until=30.0)
    assert [m for _, m in got] == ["concurrent", "antiphase", "concurrent"]
    assert got[2][0] - got[1][0] < 2.8, got  # b: 5 steps at 2/s, not 3 s + ...
    assert ctl.mode == C


def test_slow_first_steps_are_not_measured():
    """Jobs start slowly (their neighbour still loads, caches are cold). Measured, that
    start made concurrent look slow and a run chose antiphase on one host, where it
    loses; the first window now settles for warmup_steps."""
    start = {j: {m: r / 10 for m, r in rates.items()} for j, rates in SHORT_COMM.items()}
    decided = {}
    for warmup in (1, 8):
        ctl, clock = controller(probe_s=1.0, settle_steps=1, warmup_steps=warmup)
        steps: dict = {}
        simulate(ctl, clock, start, until=4.0, steps=steps)
        simulate(ctl, clock, SHORT_COMM, until=20.0, steps=steps)
        decided[warmup] = ctl.mode
    assert decided == {1: A, 8: C}


def test_jobs_inside_one_hosts_cpu_are_served_concurrently_without_a_probe():
    ctl, clock = controller()
    assert ctl.progress("a", 1, local=True) == []
    (switch,) = ctl.progress("b", 1, local=True)
    assert switch.mode == C and "allreduces in this host's memory" in switch.reason
    assert ctl.state == "fixed" and ctl.tick() == [] and ctl.progress("a", 9, True) == []
    ctl.progress("c", 1, local=False)  # a job across hosts joined: the gap may pay now
    assert ctl.state == "probe" and ctl.mode == C  # (probing concurrent first)
    ctl, clock = controller(probe_local=True)
    ctl.progress("a", 1, local=True)
    ctl.progress("b", 1, local=True)
    assert ctl.state == "probe"


def test_one_job_is_never_probed():
    ctl, clock = controller()
    assert simulate(ctl, clock, {"a": {A: 5.0, C: 5.0}}, until=10.0) == []
    assert ctl.state == "solo"


def test_a_change_of_job_mix_re_probes():
    ctl, clock = controller()
    steps: dict = {}
    simulate(ctl, clock, LONG_COMM, until=10.0, steps=steps)
    assert ctl.mode == A
    three = {**LONG_COMM, "c": {A: 2.0, C: 4.0}}  # a newcomer that turns the balance
    got = simulate(ctl, clock, three, until=20.0, steps=steps)
    assert got[0] == (pytest.approx(10.5), "concurrent"), got  # c's first report
    assert ctl.mode == C, ctl.reason  # (1.3 + 1.25 + 0.5) / 3 < 1.03
    ctl.leave("c")
    assert ctl.state == "probe"  # and its leaving re-probes
    assert ctl.leave("b") == [] and ctl.state == "solo"


def test_a_hold_ends_in_a_re_probe_and_a_confirmation_holds_longer():
    ctl, clock = controller(hold_s=5.0)
    got = simulate(ctl, clock, LONG_COMM, until=80.0)
    modes = [m for _, m in got]
    # probe (C, A, decision A), hold 5 s, re-probe, hold 10 s, re-probe, hold 20 s, ...
    assert modes[:9] == ["concurrent", "antiphase", "antiphase"] * 3, got
    # Each round: the decision (its third switch), then the hold until the next probe.
    holds = [nxt[0] - decided[0] for decided, nxt in zip(got[2::3], got[3::3], strict=False)]
    assert holds[:3] == pytest.approx([5.0, 10.0, 20.0], abs=0.01), got


def test_phase_lengths_that_change_re_probe_at_once():
    ctl, clock = controller(hold_s=100.0)
    steps: dict = {}
    simulate(ctl, clock, LONG_COMM, until=10.0, steps=steps)
    assert ctl.mode == A
    slower = {"a": {A: 5.0, C: 9.0}, "b": {A: 10.0, C: 8.0}}  # a's communication got short
    got = simulate(ctl, clock, slower, until=30.0, steps=steps)
    # 5 s watch windows from the decision at about 2.5 s; the first one is the reference,
    # the first one wholly after the change re-probes
    assert got and got[0][1] == "concurrent" and got[0][0] < 19.0, got
    assert ctl.mode == C and "concurrent" in ctl.reason  # (5/9 + 10/8) / 2 < 1.03


def by_mode_and_time(fast: dict, slow: dict, until: float) -> dict:
    """Rates that are `fast` before `until` seconds and `slow` after, per job and mode."""
    return {j: {m: (lambda t, f=fast[j][m], s=slow[j][m]: f if t < until else s)
                for m in fast[j]} for j in fast}


def test_antiphase_that_stops_paying_in_its_hold_gives_way_to_concurrent():
    """The probe measured aligned turns (1.3x); from 5 s on the nodes drifted apart and
    antiphase ran at 0.8x the probe's concurrent rates (0.88x over the hold so far): the
    first watch window ends the hold, without waiting for the re-probe."""
    drifted = {"a": {A: 8.0, C: 10.0}, "b": {A: 6.4, C: 8.0}}
    ctl, clock = controller(hold_s=100.0)
    got = simulate(ctl, clock, by_mode_and_time(LONG_COMM, drifted, 5.0), until=30.0)
    assert [m for _, m in got] == ["concurrent", "antiphase", "antiphase", "concurrent"], got
    assert 9.0 < got[3][0] < 10.5, got  # the first 5 s watch window after the decision
    assert ctl.state == "hold" and ctl.mode == C
    assert ctl.reason.startswith("antiphase held ran 0.88x") and "a 0.88x" in ctl.reason \
        and ctl.reason.endswith(": concurrent"), ctl.reason


def test_the_hold_check_counts_the_whole_hold_not_one_window():
    """A 15 % gain with one slow spell (0.9x for a 5 s watch window) keeps antiphase:
    over the hold so far the jobs still run faster than the probe's concurrent rates."""
    spell = scaled(GAIN, lambda t: 0.9 / 1.15 if 20.0 <= t < 26.0 else 1.0)
    ctl, clock = controller(hold_s=100.0)
    got = simulate(ctl, clock, spell, until=40.0)
    assert [m for _, m in got] == ["concurrent", "antiphase", "antiphase"], got
    assert ctl.mode == A and ctl.state == "hold"


def test_a_concurrent_hold_is_not_checked_against_the_probes_antiphase_rates():
    """The probe's antiphase windows read high (aligned turns), so a concurrent hold
    that runs below them does not switch: only the re-probe may."""
    slower = {"a": {A: 6.0, C: 7.0}, "b": {A: 5.0, C: 6.0}}
    ctl, clock = controller(hold_s=100.0)
    got = simulate(ctl, clock, by_mode_and_time(SHORT_COMM, slower, 5.0), until=40.0)
    assert [m for _, m in got] == ["concurrent", "antiphase", "concurrent"], got
    assert ctl.mode == C and ctl.state == "hold"


def test_a_job_slower_than_the_window_is_measured_at_the_timeout():
    ctl, clock = controller(max_probe_s=4.0)
    rates = {"a": {A: 10.0, C: 10.0}, "b": {A: 0.3, C: 0.4}}  # b: 3 s steps
    simulate(ctl, clock, rates, until=30.0)  # (a close call: three pairs of 4 s windows)
    assert ctl.state == "hold" and ctl.mode == C, ctl.snapshot()
    # b made a step in some windows and none in others: it is not measured, a decides
    assert all(set(p) == {"a"} for p in ctl.snapshot()["pairs"]), ctl.snapshot()


def test_reports_out_of_order_are_ignored():
    ctl, clock = controller()
    ctl.progress("a", 5)
    assert ctl.progress("b", 5) == [ModeSwitch(C, "job b joined: probing concurrent")]
    assert ctl.progress("a", 4) == [] and ctl.progress("a", 5) == []


def test_bad_settings_are_named():
    """Each broken rule is named with the values given, and only the broken ones."""
    with pytest.raises(ValueError, match=r"need 0 < probe_s <= max_probe_s \(got \(0, 15.0\)\)$"):
        ModeController(FakeClock(), probe_s=0)
    with pytest.raises(ValueError, match=r"need max_pairs >= 1 \(got 0\)$"):
        ModeController(FakeClock(), max_pairs=0)
    with pytest.raises(ValueError, match=r"need drift > 0 \(got 0\); 0 <= keep_margin < 1 "
                                         r"\(got 1\)$"):
        ModeController(FakeClock(), keep_margin=1, drift=0)


# --- the scheduler's switch ---------------------------------------------------------
TWO = {"A": ["d0"], "B": ["d0"]}
SWITCHES = [
    # (name, events, grants per event); ("mode", "-", 0, Mode) switches
    ("concurrent grants everyone waiting", TWO,
     [("req", "A", 0), ("req", "B", 0), ("mode", "-", 0, C)], [["A:0"], [], ["B:0"]]),
    ("antiphase waits until the jobs holding drain", TWO,
     [("mode", "-", 0, C), ("req", "A", 0), ("req", "B", 0), ("mode", "-", 0, A),
      ("rel", "A", 0, M), ("req", "A", 0), ("rel", "B", 0, M)],
     [[], ["A:0"], ["B:0"], [], [], [], ["A:0"]]),
    ("antiphase starts with equal turns: a job that stepped less does not take them all",
     TWO,
     [("mode", "-", 0, C), ("req", "A", 0), ("rel", "A", 0, M), ("req", "A", 0),
      ("rel", "A", 0, M), ("req", "B", 0), ("rel", "B", 0, M), ("mode", "-", 0, A),
      ("req", "B", 0), ("req", "A", 0), ("rel", "A", 0, M)],
     [[], ["A:0"], [], ["A:0"], [], ["B:0"], [], [], [], ["A:0"], ["B:0"]]),
    ("the last job holding owns the turn: its peers join it", {"A": ["d0", "d0"], "B": ["d0"]},
     [("mode", "-", 0, C), ("req", "A", 0), ("req", "B", 0), ("mode", "-", 0, A),
      ("rel", "B", 0, M), ("req", "B", 0), ("req", "A", 1)],
     [[], ["A:0"], ["B:0"], [], [], [], ["A:1"]]),
    # A hold kept over from concurrent mode (its rank has not learned of the switch and
    # keeps through its allreduce, which may wait for a peer that waits behind the other
    # job's kept-over hold on another device) is waited out for patience only.
    ("a hold kept over from concurrent mode excludes another job for patience only", TWO,
     [("mode", "-", 0, C), ("req", "A", 0), ("mode", "-", 0, A), ("req", "B", 0),
      ("tick", "-", 0, 0.6), ("tick", "-", 0, 0.6), ("rel", "B", 0, M), ("req", "B", 0),
      ("rel", "A", 0, M), ("req", "A", 0), ("tick", "-", 0, 1.5)],
     [[], ["A:0"], [], [], [], ["B:0"], [], ["B:0"], [], [], []]),
    ("a hold since the switch excludes as ever", TWO,
     [("mode", "-", 0, C), ("req", "A", 0), ("mode", "-", 0, A), ("rel", "A", 0, M),
      ("req", "A", 0), ("req", "B", 0), ("tick", "-", 0, 1.5)],
     [[], ["A:0"], [], [], ["A:0"], [], []]),
]


@pytest.mark.parametrize("name,jobs,events,expected", SWITCHES, ids=[t[0] for t in SWITCHES])
def test_mode_switch_table(name, jobs, events, expected):
    sched, clock = build("auto", jobs)
    got = []
    for ev in events:
        if ev[0] == "mode":
            got.append(sorted(f"{g.job}:{g.rank}" for g in sched.set_mode(ev[3])))
        else:
            got += run(sched, clock, [ev])
    assert got == expected


def test_off_cannot_be_antiphase():
    sched, _ = build("off", TWO)
    with pytest.raises(SchedulerError, match="'off' cannot serve in antiphase"):
        sched.set_mode(A)


JOBS3 = {"A": ["d0", "d1"], "B": ["d0", "d1"], "C": ["d0", "d0"]}
event = st.tuples(st.sampled_from(["req", "rel", "tick", "mode"]), st.sampled_from(list(JOBS3)),
                  st.integers(0, 1), st.sampled_from([M, Phase.IDLE, Phase.COMPUTE, A, C]),
                  st.floats(0.1, 2.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=80))
def test_switching_modes_keeps_antiphase_exclusive_and_loses_no_request(events):
    """In antiphase no job is granted a device another job holds, across any switches,
    except beside a hold kept over from concurrent mode after patience; and once holders
    let go, every waiting rank is granted."""
    sched, clock = build("auto", JOBS3, lease_s=100.0)
    kept_over: set = set()  # holds granted concurrently, held since the switch

    def held():
        return {(j, r, d) for d in ("d0", "d1") for j, r in sched.holders(d)}

    def check(grants, before):
        for g in grants:
            if sched.mode == A and (g.job, g.rank, g.device) not in before:
                others = {j for j, r in sched.holders(g.device)
                          if (j, r, g.device) not in kept_over} - {g.job}
                assert not others, f"{g} granted in antiphase while {others} hold"

    for op, job, rank, arg, dt in events:
        before = held()  # a rank that holds already is granted again (idempotent)
        if op == "req":
            check(sched.request(job, rank), before)
        elif op == "rel" and isinstance(arg, Phase):
            check(sched.release(job, rank, arg), before)
        elif op == "tick":
            clock.now += dt
            check(sched.expire()[1], before)
        elif op == "mode" and isinstance(arg, Mode):
            if arg == A and sched.mode != A:
                kept_over = set(before)
            check(sched.set_mode(arg), before)
        kept_over &= held()  # a release ends it (a grant after that is a new hold)
    waiting = {k for d in ("d0", "d1") for k in sched.waiting(d)}
    granted = set()
    for _ in range(50):  # holders communicate; the patience limit passes over the rest
        for d in ("d0", "d1"):
            for job, rank in sorted(sched.holders(d)):
                granted.add((job, rank))
                check(sched.release(job, rank, M), held())
        clock.now += 1.0
        grants = sched.expire()[1]
        check(grants, held())
        granted |= {(g.job, g.rank) for g in grants}
    assert waiting <= granted, f"never granted: {waiting - granted}"


def test_the_benchmarks_reading_of_the_decisions_recovers_each_pairs_speedup():
    """bench/colocation/pair_noise.py reads each pair's speedup back from the daemon's logged
    reasons (running means); it must agree with what the controller measured."""

    from bench.colocation.pair_noise import pairs_of

    reasons: list[str] = []

    class Logged(ModeController):
        def progress(self, job, steps, local=False, profile=None):
            out = super().progress(job, steps, local, profile)
            reasons.extend(s.reason for s in out)
            return out

        def tick(self):
            out = super().tick()
            reasons.extend(s.reason for s in out)
            return out

    clock = FakeClock()
    ctl = Logged(clock)
    simulate(ctl, clock, TIE, until=20.0)
    measured = [sum(p.values()) / len(p) for p in ctl.snapshot()["pairs"]]
    assert len(measured) == 3
    assert pairs_of(reasons) == pytest.approx(measured, abs=0.03 * len(measured))
