"""The predicted mode decision: tables of step profiles (compute, gap) against the mode
the measured runs chose, and the controller acting on predictions without probing."""

from __future__ import annotations

import pytest

from crossover.client.profile import StepProfiler
from crossover.protocol import Mode
from crossover.scheduler import ModeController
from crossover.scheduler.predict import Profile, predict
from tests.test_mode import scaled, simulate
from tests.test_scheduler import FakeClock

A, C = Mode.ANTIPHASE, Mode.CONCURRENT


def ms(compute: float, gap: float) -> Profile:
    return Profile(compute / 1e3, gap / 1e3)


# Per-step profiles of benchmark rows (bench/results/colocation/crossover.json, and
# crossover_ddp.json as first measured: compute and communication per job step),
# with the mode that ran faster there: always antiphase against plain co-location. A row
# where the two ran within a few percent of each other is a close call: the controller
# measures.
TABLE = [
    # (row, profiles, verdict: the mode taken at once, None: measure)
    ("mlp, 500 Mbit/s: antiphase 1.12x plain", {"a": ms(70, 65), "b": ms(70, 65)}, A),
    ("mlp+cnn, 500 Mbit/s: antiphase 1.16x", {"a": ms(70, 65), "b": ms(86, 51)}, A),
    ("ddp-mlp, 500 Mbit/s: antiphase 1.22x", {"a": ms(61, 75), "b": ms(61, 75)}, A),
    ("mlp, 1000 Mbit/s: antiphase 1.12x, within the bench's noise", {"a": ms(81, 25),
                                                                      "b": ms(81, 25)}, None),
    ("mlp+cnn, 2000 Mbit/s: plain 1.02x", {"a": ms(71, 20), "b": ms(75, 20)}, None),
    ("compute-bound jobs: nothing to fill", {"a": ms(50, 0.5), "b": ms(60, 0.4)}, C),
    ("link-bound jobs: neither mode changes the link", {"a": ms(10, 100), "b": ms(10, 100)},
     None),
    ("a newcomer not yet profiled is taken to be like the others", {"a": ms(70, 65),
                                                                     "b": None}, A),
]


@pytest.mark.parametrize("row,profiles,verdict", TABLE, ids=[t[0] for t in TABLE])
def test_prediction_table(row, profiles, verdict):
    ctl = ModeController(FakeClock())
    for job, profile in profiles.items():
        if profile is not None:
            ctl._profiles.note(job, profile)
    ctl._steps = {j: 1 for j in profiles}
    mode, why = ctl._verdict()
    assert mode == verdict, why
    assert why.startswith("antiphase at most ") and "ms" in why


def test_round_lengths():
    pred = predict({"a": ms(30, 10), "b": ms(50, 20)}, handover_s=0.001)
    assert pred.antiphase_s == pytest.approx(0.082)  # max(80 + 2 x 1, 70 + 1) ms
    assert pred.concurrent_s == pytest.approx(0.100)  # 80 + the longer gap, 20
    assert pred.bound == pytest.approx(100 / 82)
    assert pred.figures == "a 30.0/10.0 ms, b 50.0/20.0 ms"
    # a gap longer than the others' compute: the job's own step bounds the round
    assert predict({"a": ms(30, 10), "b": ms(50, 40)}, 0.001).antiphase_s == \
        pytest.approx(0.091)
    assert predict({"a": None, "b": None}) is None
    assert predict({"a": ms(0, 0)}) is None


def joined_alone(ctl: ModeController, clock: FakeClock, profile: Profile, steps: int = 10
                 ) -> None:
    """Job a alone for `steps` steps of 0.1 s, reporting `profile`."""
    for s in range(1, steps + 1):
        clock.now += 0.1
        assert ctl.progress("a", s, profile=profile) == []
    assert ctl.state == "solo"


def test_a_clear_prediction_decides_the_arrival_without_a_probe():
    clock = FakeClock()
    ctl = ModeController(clock)
    joined_alone(ctl, clock, ms(40, 40))
    (switch,) = ctl.progress("b", 1)
    assert ctl.state == "hold" and switch.mode == A, switch
    assert switch.reason == ("job b joined: antiphase at most 1.48x concurrent "
                             "(a 40.0/40.0 ms, b 40.0/40.0 ms (like the others)): antiphase")
    # the hold check's reference is the predicted concurrent rate: one round of 120 ms
    assert ctl._concurrent == [{"a": pytest.approx(1 / 0.12), "b": pytest.approx(1 / 0.12)}]


def test_an_arrival_leaves_a_group_in_its_mode_when_the_prediction_is_clear():
    clock = FakeClock()
    ctl = ModeController(clock)
    joined_alone(ctl, clock, ms(40, 40))
    ctl.progress("b", 1)
    for s in range(2, 6):  # b's own profile, in antiphase past the settling steps
        clock.now += 0.1
        ctl.progress("a", 10 + s, profile=ms(40, 40))
        ctl.progress("b", s, profile=ms(40, 40))
    assert ctl._profiles.known() == {"a", "b"}
    (switch,) = ctl.progress("c", 1)
    assert switch.mode == A and ctl.mode == A and ctl.state == "hold", switch
    assert switch.reason.startswith("job c joined: antiphase at most"), switch.reason
    assert ctl._window.mode == A, "no probe window was opened"


def test_a_newcomers_own_profile_can_call_for_a_probe():
    clock = FakeClock()
    ctl = ModeController(clock)
    joined_alone(ctl, clock, ms(40, 40))
    assert ctl.progress("b", 1)[0].mode == A  # taken to be like a
    got = []
    for s in range(2, 6):  # b computes 300 ms a step with no gap: 1.11x at most
        clock.now += 0.3
        got += ctl.progress("b", s, profile=ms(300, 1))
    assert ctl.state == "probe" and [s.mode for s in got] == [C], got
    assert got[0].reason.startswith("job b's first profile: antiphase at most 1.11x"), got


def test_a_predicted_antiphase_that_runs_slower_than_predicted_concurrent_is_given_up():
    clock = FakeClock()
    ctl = ModeController(clock, hold_s=100.0)
    joined_alone(ctl, clock, ms(40, 40))
    steps = {"a": 10, "b": 0}
    # the profiles promised 8.3 rounds a second concurrently; antiphase runs 5
    got = simulate(ctl, clock, {"a": {A: 5.0, C: 8.0}, "b": {A: 5.0, C: 8.0}},
                   until=clock.now + 15.0, steps=steps)
    # and no re-probe after: the concurrent hold's rates are its own reference, not the
    # antiphase hold's (they differ by 60 %, past the drift that re-probes)
    assert [m for _, m in got] == ["antiphase", "concurrent"], got
    assert ctl.mode == C and ctl.reason.startswith("antiphase held ran 0.6") \
        and "the predicted concurrent rates" in ctl.reason, ctl.reason


def test_compute_bound_jobs_go_concurrent_at_once():
    clock = FakeClock()
    ctl = ModeController(clock)
    joined_alone(ctl, clock, ms(50, 0.2))
    (switch,) = ctl.progress("b", 1)
    assert switch.mode == C and ctl.state == "hold", switch


def test_jobs_without_profiles_are_profiled_in_antiphase_first():
    """Two jobs start together: antiphase first, whose steps profile them; a clear
    prediction then ends the probe without a concurrent window."""
    ctl = ModeController(FakeClock())
    got = simulate(ctl, ctl.clock, {"a": {A: 8.0, C: 6.0}, "b": {A: 8.0, C: 6.0}}, until=10.0,
                   profiles={"a": ms(40, 40), "b": ms(45, 35)})
    assert [m for _, m in got] == ["antiphase", "antiphase"], got  # the probe, the decision
    assert ctl.state == "hold" and ctl.reason.startswith(
        "profiled in antiphase: antiphase at most 1.4"), ctl.reason
    assert got[1][0] < 3.5, "decided after one antiphase window (8 settling steps, 2 s)"


def test_a_close_profile_measures_the_other_mode_too():
    ctl = ModeController(FakeClock())
    got = simulate(ctl, ctl.clock, {"a": {A: 8.0, C: 7.0}, "b": {A: 8.0, C: 7.0}}, until=10.0,
                   profiles={"a": ms(81, 25), "b": ms(81, 25)})  # 1.15x at most
    assert [m for _, m in got] == ["antiphase", "concurrent", "antiphase"], got
    assert ctl.state == "hold" and ctl.reason.startswith("antiphase 1.14x concurrent"), \
        ctl.reason


# A close prediction (the profiles bound antiphase's gain at 1.15x) and one pair: the
# pair decides concurrent only where antiphase reads below 1 + margin - pair_noise (0.93x).
LEAN = [
    # (row, antiphase rate, concurrent rate, the switches, the mode held)
    ("even: antiphase", 7.0, 7.0, ["antiphase", "concurrent", "antiphase"], A),
    ("antiphase 0.95x, within one pair's noise: antiphase", 6.65, 7.0,
     ["antiphase", "concurrent", "antiphase"], A),
    ("antiphase 0.86x, beyond it: concurrent", 6.0, 7.0, ["antiphase", "concurrent",
                                                          "concurrent"], C),
]


@pytest.mark.parametrize("row,anti,conc,switches,mode", LEAN, ids=[t[0] for t in LEAN])
def test_a_close_prediction_costs_one_pair_which_overrules_it_only_by_far(
        row, anti, conc, switches, mode):
    ctl = ModeController(FakeClock(), hold_s=100.0)
    got = simulate(ctl, ctl.clock, {"a": {A: anti, C: conc}, "b": {A: anti, C: conc}},
                   until=8.0, profiles={"a": ms(81, 25), "b": ms(81, 25)})  # (no watch yet)
    assert [m for _, m in got] == switches, got
    assert ctl.state == "hold" and ctl.mode == mode and len(ctl._pairs) == 1, ctl.reason
    if mode == A:  # the hold check, against the probe's concurrent rates, watches it
        assert ctl.reason.endswith(
            "), within the noise of 1.03x, and antiphase at most 1.15x concurrent (a "
            "81.0/25.0 ms, b 81.0/25.0 ms): the hold check watches it: antiphase"), ctl.reason


@pytest.mark.parametrize("anti,switches,mode", [
    (7.0, [], A),  # even: the hold runs 1.00x the probe's concurrent rates
    (6.65, ["concurrent", "antiphase", "concurrent"], C),  # 0.95x: a second pair decides
])
def test_a_hold_the_check_doubts_measures_another_pair(anti, switches, mode):
    """Antiphase held on one close pair and the lean of the profiles. Where the hold then
    runs below 1 - keep_margin of the probe's concurrent rates, but within the bar the
    probe's noise allows (0.90x after one pair), the check does not let the doubt stand
    for the rest of the hold: one more pair, in reverse order, and the mean decides (the
    profiles' lean no longer counts: the hold measured what they only bounded). The first
    pair ran A C, so the second runs C A."""
    ctl, steps = ModeController(FakeClock(), hold_s=100.0), {}
    rates, profiles = {"a": {A: anti, C: 7.0}, "b": {A: anti, C: 7.0}}, \
        {"a": ms(81, 25), "b": ms(81, 25)}
    simulate(ctl, ctl.clock, rates, until=8.0, steps=steps, profiles=profiles)
    assert ctl.mode == A and len(ctl._pairs) == 1, ctl.reason
    got = simulate(ctl, ctl.clock, rates, until=60.0, steps=steps, profiles=profiles)
    assert [m for _, m in got] == switches, got
    assert ctl.mode == mode and ctl.state == "hold", ctl.reason
    if switches:
        assert got[0][0] < 10.0, got  # at the end of the hold's first watch window
        assert ctl.reason.startswith("antiphase 0.95x concurrent over 2 pairs ("), ctl.reason


def test_a_close_prediction_at_an_arrival_costs_one_pair_too():
    """Job a ran alone (its profile: 1.15x at most), b arrives: the probe begins from the
    close prediction itself (concurrent first), and one even pair holds antiphase."""
    ctl, steps = ModeController(FakeClock(), hold_s=100.0), {}
    even, profiles = {A: 7.0, C: 7.0}, {"a": ms(81, 25), "b": ms(81, 25)}
    simulate(ctl, ctl.clock, {"a": even}, until=2.0, steps=steps, profiles=profiles)
    got = simulate(ctl, ctl.clock, {"a": even, "b": even}, until=20.0, steps=steps,
                   profiles=profiles)
    assert [m for _, m in got] == ["concurrent", "antiphase", "antiphase"], got
    assert ctl.mode == A and len(ctl._pairs) == 1 and "and antiphase at most 1.15x" in \
        ctl.reason, ctl.reason


def test_a_newcomers_close_profile_costs_one_pair():
    """A clear prediction held antiphase; the newcomer's own profile makes it close
    (`_repredict`): one even pair keeps antiphase."""
    clock = FakeClock()
    ctl, steps = ModeController(clock, hold_s=100.0), {}
    joined_alone(ctl, clock, ms(50, 25))
    steps["a"] = 10

    class Late(dict):  # b's profile reaches the controller from 3 s on
        def get(self, job, default=None):
            return None if job == "b" and clock.now < 3.0 else dict.get(self, job, default)

    got = simulate(ctl, clock, {"a": {A: 7.0, C: 7.0}, "b": {A: 7.0, C: 7.0}}, until=30.0,
                   steps=steps, profiles=Late(a=ms(50, 25), b=ms(150, 5)))
    assert [m for _, m in got] == ["antiphase", "concurrent", "antiphase", "antiphase"], got
    assert got[1][0] > 3.0 and ctl.mode == A and len(ctl._pairs) == 1, ctl.reason
    assert "and antiphase at most" in ctl.reason, ctl.reason


def test_a_doubted_hold_no_longer_leans_on_the_profiles():
    """The profiles lean antiphase (1.15x at most), which truly runs 0.95x; the host ran
    10 % faster through the first antiphase window, so the first pair reads 1.05x and
    antiphase is held. The hold check doubts it; the second pair (0.95x) puts the mean
    at 1.00x, within the noise of the margin, where the profiles' lean would take
    antiphase again. The hold measured it, so a third pair decides: concurrent."""
    ctl = ModeController(FakeClock(), hold_s=100.0)
    rates = scaled({"a": {A: 6.65, C: 7.0}, "b": {A: 6.65, C: 7.0}},
                   lambda t: 1.1 if t < 2.2 else 1.0)
    got = simulate(ctl, ctl.clock, rates, until=60.0,
                   profiles={"a": ms(81, 25), "b": ms(81, 25)})
    assert [m for _, m in got] == ["antiphase", "concurrent", "antiphase", "concurrent",
                                   "antiphase", "antiphase", "concurrent", "concurrent"], got
    assert ctl.mode == C and ctl.reason.startswith("antiphase 0.98x concurrent over 3 pairs"), \
        ctl.reason


@pytest.mark.parametrize("from_s,slow,switches,why", [
    # 0.57x from 6 s: the hold's first watch window already reads below the bar
    (6.0, 4.0, ["concurrent"], "antiphase held ran 0.6"),
    # 0.79x from 12 s: the whole hold's mean passes through the doubt first: one more pair
    (12.0, 5.5, ["concurrent", "antiphase", "concurrent"], "antiphase 0.89x concurrent over 2"),
])
def test_a_one_pair_antiphase_that_stops_paying_is_given_up_by_the_hold_check(
        from_s, slow, switches, why):
    """The lean held antiphase on an even pair; then antiphase runs slower than the
    probe's concurrent rates, and the hold check gives it up (below its bar, 0.90x after
    one pair, at once), long before the hold's end."""
    ctl = ModeController(FakeClock(), hold_s=100.0)

    def anti(now: float) -> float:
        return 7.0 if now < from_s else slow

    got = simulate(ctl, ctl.clock, {"a": {A: anti, C: 7.0}, "b": {A: anti, C: 7.0}},
                   until=40.0, profiles={"a": ms(81, 25), "b": ms(81, 25)})
    assert [m for _, m in got] == ["antiphase", "concurrent", "antiphase"] + switches, got
    assert ctl.mode == C and got[-1][0] < 25.0 and ctl.reason.startswith(why), ctl.reason


def test_without_a_prediction_a_close_pair_that_leans_concurrent_measures_on():
    """The same even rates with prediction off: up to three pairs, then concurrent."""
    ctl = ModeController(FakeClock(), hold_s=100.0, predict_clear=0)
    simulate(ctl, ctl.clock, {"a": {A: 7.0, C: 7.0}, "b": {A: 7.0, C: 7.0}}, until=30.0,
             profiles={"a": ms(81, 25), "b": ms(81, 25)})
    assert ctl.mode == C and len(ctl._pairs) == 3, ctl.reason


def test_a_re_probe_after_a_hold_is_not_leaning_on_the_profiles():
    """The lean is the probe's that began from the close prediction; the probe at the end
    of the hold measures its pairs, as without one."""
    ctl = ModeController(FakeClock(), hold_s=10.0)
    simulate(ctl, ctl.clock, {"a": {A: 7.0, C: 7.0}, "b": {A: 7.0, C: 7.0}}, until=50.0,
             profiles={"a": ms(81, 25), "b": ms(81, 25)})
    assert ctl.mode == C and ctl.reason.startswith("antiphase 1.00x concurrent over 3 pairs"), \
        ctl.reason


def test_a_close_profile_that_a_probe_decided_is_checked_against_the_probes_rates():
    """The prediction that could not tell is not the one the hold is held to: the hold
    check names the probe's rates, and the prediction does not count as overruled."""
    ctl = ModeController(FakeClock(), hold_s=100.0)

    def anti(now: float) -> float:  # 8 steps/s while probed, 5 once held
        return 8.0 if now < 8.0 else 5.0

    got = simulate(ctl, ctl.clock, {"a": {A: anti, C: 7.0}, "b": {A: anti, C: 7.0}},
                   until=20.0, profiles={"a": ms(81, 25), "b": ms(81, 25)})  # 1.15x at most
    assert [m for _, m in got] == ["antiphase", "concurrent", "antiphase", "concurrent"], got
    assert ctl.reason.startswith("antiphase held ran 0.") \
        and "the probe's concurrent rates" in ctl.reason, ctl.reason
    assert not ctl._overruled


def test_with_prediction_off_the_controller_probes_concurrent_first():
    clock = FakeClock()
    ctl = ModeController(clock, predict_clear=0)
    joined_alone(ctl, clock, ms(40, 40))
    (switch,) = ctl.progress("b", 1)
    assert ctl.state == "probe" and switch.reason == "job b joined: probing concurrent"


def test_concurrent_steps_do_not_make_a_profile():
    clock = FakeClock()
    ctl = ModeController(clock)
    joined_alone(ctl, clock, ms(81, 25))  # a close call: probing, concurrent first
    assert ctl.progress("b", 1)[0].mode == C
    for s in range(11, 30):
        clock.now += 0.1
        ctl.progress("a", s, profile=ms(500, 1))
    assert ctl._profiles.snapshot()["a"] == pytest.approx([0.081, 0.025])


def test_a_prediction_the_hold_check_overruled_decides_no_more_until_the_jobs_change():
    clock = FakeClock()
    ctl = ModeController(clock, hold_s=10.0)
    joined_alone(ctl, clock, ms(40, 40))
    simulate(ctl, clock, {"a": {A: 5.0, C: 8.0}, "b": {A: 5.0, C: 8.0}},
             until=clock.now + 30.0, steps={"a": 10, "b": 0},
             profiles={"a": ms(40, 40), "b": ms(40, 40)})
    # overruled at its first watch window, then the re-probe after the hold measured both
    assert ctl.mode == C and ctl.reason.startswith("antiphase 0.63x concurrent"), ctl.reason


def test_step_profiler_splits_a_step():
    clock = FakeClock()
    prof = StepProfiler(clock, skip=1)
    for _ in range(3):  # compute 30 ms, release, gap 20 ms, wait 5 ms for the grant
        prof.step()
        clock.now += 0.030
        prof.communicating()
        clock.now += 0.020
        prof.computing()
        prof.waited(0.005)
        clock.now += 0.005
    prof.step()
    compute, gap = prof.take()
    assert compute == pytest.approx(0.030) and gap == pytest.approx(0.020)
    assert prof.take() == (0.0, 0.0)
