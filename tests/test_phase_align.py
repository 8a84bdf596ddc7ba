"""Keeping the nodes' antiphase sequences in step: the scheduler's delayed hand-over,
the leader's decision from the ranks' allreduce waits (tables), and the plan the fast
path executes around a delay."""

from __future__ import annotations

import pytest

from crossover.protocol import Mode, Phase
from crossover.scheduler import SchedulerError
from crossover.scheduler.phase import Correction, PhaseAligner
from crossover.scheduler.preview import PlanCache, preview
from tests.test_scheduler import COMPUTE, TWO_JOBS, FakeClock, build, run

M = Phase.COMMUNICATE


def test_a_delayed_hand_over_leaves_the_device_free_that_long_once():
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d0"]})
    assert run(sched, clock, [("req", "A", 0), ("req", "B", 0)]) == [["A:0"], []]
    sched.delay_handover("d0", 0.04)
    # A releases: B waits, although the device is free and it is B's turn
    assert run(sched, clock, [("rel", "A", 0, M)]) == [[]]
    assert sched.next_deadline() == pytest.approx(0.04)
    assert run(sched, clock, [("req", "A", 0), ("tick", "A", 0, 0.03)]) == [[], []]
    assert run(sched, clock, [("tick", "A", 0, 0.01)]) == [["B:0"]]
    # once: the next hand-overs are at once again
    assert run(sched, clock, [("rel", "B", 0, M), ("req", "B", 0), ("rel", "A", 0, M)]) \
        == [["A:0"], [], ["B:0"]]
    assert sched.next_deadline() == pytest.approx(10.04)  # only B's lease


def test_the_delay_acts_at_the_next_hand_over_not_while_a_job_holds():
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d0"]})
    run(sched, clock, [("req", "A", 0)])
    sched.delay_handover("d0", 0.05)
    clock.now = 0.5  # A holds long after the delay was asked for: it still applies
    assert run(sched, clock, [("req", "B", 0), ("rel", "A", 0, M)]) == [[], []]
    assert run(sched, clock, [("tick", "A", 0, 0.05)]) == [["B:0"]]


def test_a_delay_holds_patience_off_and_a_peer_of_the_holder_still_joins():
    # a gang: A's two ranks share d0; the delay is for the next job only
    sched, clock = build("crossover", {"A": ["d0", "d0"], "B": ["d0"]})
    sched.delay_handover("d0", 0.2)
    assert run(sched, clock, [("req", "A", 0), ("req", "A", 1)]) == [[], []]
    assert run(sched, clock, [("tick", "A", 0, 0.2)]) == [["A:0", "A:1"]]


def test_a_mode_switch_drops_a_pending_delay():
    sched, clock = build("auto", {"A": ["d0"], "B": ["d0"]})
    sched.set_mode(Mode.ANTIPHASE)
    run(sched, clock, [("req", "A", 0), ("req", "B", 0)])
    sched.delay_handover("d0", 0.1)
    assert [g.job for g in sched.set_mode(Mode.CONCURRENT)] == ["B"]
    sched.set_mode(Mode.ANTIPHASE)
    # both held concurrently; once both release, the next hand-over is at once
    assert run(sched, clock, [("rel", "A", 0, COMPUTE), ("rel", "B", 0, M),
                              ("req", "A", 0)]) == [[], [], ["A:0"]]
    assert sched.next_deadline() == pytest.approx(10.0)  # A's lease, no closed device


@pytest.mark.parametrize("device, seconds, why", [
    ("d9", 0.1, "'d9' has no rank"),
    ("d0", 0.0, "must be in (0, patience 1.0 s], got 0.0"),
    ("d0", 1.5, "got 1.5"),
])
def test_a_bad_delay_names_the_problem(device, seconds, why):
    sched, _ = build("crossover", {"A": ["d0"], "B": ["d0"]})
    with pytest.raises(SchedulerError, match=why.replace("(", r"\(").replace("]", r"\]")):
        sched.delay_handover(device, seconds)


def test_the_plan_around_a_delay_wakes_the_daemon_and_is_not_cached():
    sched, clock = build("crossover", TWO_JOBS)
    run(sched, clock, [("req", "A", 0), ("req", "B", 0)])
    sched.delay_handover("d0", 0.05)
    plan = preview(sched, "d0")
    # A's release grants nothing (the device closes), and the daemon must hear of it
    assert plan.on_release[("A", 0)] == ()
    assert (("A", 0), "release") in plan.wakes
    assert plan.chain[0][2] == () and plan.chain[0][3]
    cache = PlanCache()
    cache.preview(sched, "d0")
    assert cache.hits == cache.misses == 0  # not remembered: a delay is short-lived
    assert sched._devices["d0"].handover_delay == 0.05  # the preview changed nothing


# --- the leader's decision -------------------------------------------------------------
# (reports as (time, job, node, median wait in ms), expected correction after each:
#  (node, delay in ms) or None)
ALIGN_TABLE = [
    ("aligned: equal waits", [
        (0.0, "A", 0, 20), (0.0, "A", 1, 21), (0.1, "B", 0, 20), (0.1, "B", 1, 22),
    ], [None, None, None, None]),
    ("node 0 ahead of node 1 for both jobs by about 40 ms", [
        (0.0, "A", 0, 60), (0.0, "A", 1, 20), (0.1, "B", 0, 65), (0.1, "B", 1, 22),
    ], [None, None, None, (0, 40)]),
    ("jobs disagree (each node leads one job): nobody is ahead of everything", [
        (0.0, "A", 0, 60), (0.0, "A", 1, 20), (0.1, "B", 0, 20), (0.1, "B", 1, 60),
    ], [None, None, None, None]),
    ("one job measured on both nodes, the other not yet: wait for it", [
        (0.0, "A", 0, 60), (0.0, "A", 1, 20), (0.1, "B", 0, 65),
    ], [None, None, None]),
    ("a lead over the cap is corrected in parts", [
        (0.0, "A", 0, 20), (0.0, "A", 1, 420),
    ], [None, (1, 250)]),
    ("after a correction the reports wait out settle_s, then count afresh", [
        (0.0, "A", 0, 60), (0.0, "A", 1, 20), (0.5, "A", 0, 60), (0.9, "A", 1, 20),
        (1.1, "A", 0, 60), (1.2, "A", 1, 20),
    ], [None, (0, 40), None, None, None, (0, 40)]),
    ("a stale report does not count", [
        (0.0, "A", 0, 60), (3.5, "A", 1, 20), (3.6, "A", 0, 60),
    ], [None, None, (0, 40)]),
    ("three nodes: the one ahead of the latest heard of, then quiet", [
        (0.0, "A", 0, 50), (0.0, "A", 1, 90), (0.0, "A", 2, 20),
    ], [None, (1, 40), None]),
    ("three nodes, B on two of them: the one furthest ahead first", [
        (0.0, "A", 0, 50), (0.0, "B", 0, 50), (0.0, "A", 2, 20), (0.0, "A", 1, 90),
        (0.1, "B", 2, 20),
    ], [None, None, None, (1, 70), None], {"A": {0, 1, 2}, "B": {0, 2}}),
    ("a job on one node only says nothing of the phases", [
        (0.0, "A", 0, 60), (0.0, "A", 1, 20), (0.0, "C", 0, 5),
    ], [None, (0, 40), None], {"A": {0, 1}, "C": {0}}),
]


@pytest.mark.parametrize("name, reports, expected, members",
                         [(*row, None)[:4] for row in ALIGN_TABLE],
                         ids=[row[0] for row in ALIGN_TABLE])
def test_the_leader_aligns_the_node_that_runs_ahead(name, reports, expected, members):
    # (by default every job of the row has ranks on every node of the row)
    nodes = {node for _, _, node, _ in reports}
    members = members or {job: nodes for _, job, _, _ in reports}
    clock = FakeClock()
    aligner = PhaseAligner(clock)
    got = []
    for t, job, node, wait_ms in reports:
        clock.now = t
        c = aligner.report(job, node, wait_ms / 1000, members)
        got.append(None if c is None else (c.node, round(c.delay_s * 1000)))
    assert got == expected
    assert len(aligner.corrections) == sum(e is not None for e in expected)


def test_a_reset_forgets_the_reports():
    clock = FakeClock()
    aligner = PhaseAligner(clock)
    members = {"A": {0, 1}}
    aligner.report("A", 0, 0.06, members)
    aligner.reset()
    assert aligner.report("A", 1, 0.02, members) is None
    assert aligner.report("A", 0, 0.06, members) == Correction(0, pytest.approx(0.04),
                                                      pytest.approx(0.04))


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="threshold_s=0.5, max_delay_s=0.25"):
        PhaseAligner(FakeClock(), threshold_s=0.5)
