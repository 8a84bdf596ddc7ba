"""Schedules as tables, the validator's grid, and the simulator against closed forms."""

from __future__ import annotations

import pytest

from crossover.pipeline import (
    Action,
    Graph,
    Schedule,
    ScheduleError,
    Stage,
    gpipe,
    lower,
    make_plan,
    one_f_one_b,
    simulate,
    synthetic,
    validate,
)
from crossover.pipeline.profile import Link, Runtime
from crossover.pipeline.schedule import F, chain, depths, peak_in_flight


def rows(s: Schedule) -> list[str]:
    return [" ".join(map(str, r)) for r in s.actions]


@pytest.mark.parametrize("maker, expected", [
    (gpipe, ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2",
             "2F0 2F1 2F2 2B0 2B1 2B2"]),
    (one_f_one_b, ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1B0 1F2 1B1 1B2",
                   "2F0 2B0 2F1 2B1 2F2 2B2"]),
])
def test_chain_schedules(maker, expected):
    assert rows(maker(chain(3), 3)) == expected


def test_classic_1f1b_warmup_on_a_long_chain():
    s = one_f_one_b(chain(4), 8)
    assert rows(s)[0].startswith("0F0 0F1 0F2 0F3 0B0 0F4 0B1")
    assert peak_in_flight(s) == [4, 3, 2, 1]


def test_graph_1f1b_warms_up_by_depth_to_sink():
    # three towers (stages 0-2) feeding a head (3): towers sit at depth 2, not 4..2
    succs = [[3], [3], [3], []]
    assert depths(succs) == [2, 2, 2, 1]
    s = one_f_one_b(succs, 4)
    assert rows(s)[:3] == [f"{i}F0 {i}F1 {i}B0 {i}F2 {i}B1 {i}F3 {i}B2 {i}B3" for i in range(3)]
    assert peak_in_flight(s) == [2, 2, 2, 1]
    assert peak_in_flight(one_f_one_b(chain(4), 4)) == [4, 3, 2, 1]


@pytest.mark.parametrize("succs", [chain(2), chain(4), [[3], [3], [3], []],
                                   [[1, 2], [3], [3], []]])
@pytest.mark.parametrize("maker", [gpipe, one_f_one_b])
def test_generated_schedules_validate_lowered_and_not(succs, maker):
    s = maker(succs, 5)
    validate(s)
    low = lower(s)
    grid = validate(low)
    assert all(len(r) == len(grid[0]) for r in grid)
    first = rows(low)[0].split()
    assert first[:3] == ["0ACQ", "0F0", "0REL"]


def test_lowering_pairs_sends_and_receives():
    low = lower(one_f_one_b([[2], [2], []], 1))
    assert rows(low)[2].split()[:3] == ["2RF0<0", "2RF0<1", "2ACQ"]
    assert "0SF0>2" in rows(low)[0] and "0RB0<2" in rows(low)[0]


def test_validator_marks_a_deadlock():
    # stage 1 runs its backward before the forward it depends on
    bad = Schedule([[Action(F, 0, 0), Action("B", 0, 0)],
                    [Action("B", 1, 0), Action(F, 1, 0)]], chain(2), 1)
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    text = str(err.value)
    assert "deadlock" in text and "!1B0!" in text and "stage 1" in text


def test_validator_marks_a_missing_micro_batch_and_unmatched_receive():
    s = one_f_one_b(chain(2), 2)
    s.actions[1] = [a for a in s.actions[1] if not (a.kind == "B" and a.micro == 1)]
    with pytest.raises(ScheduleError, match=r"never runs B of micro-batches \[1\]"):
        validate(s)
    low = lower(one_f_one_b(chain(2), 1))
    low.actions[0] = [a for a in low.actions[0] if a.kind != "SF"]
    with pytest.raises(ScheduleError, match="receive without a matching send") as err:
        validate(low)
    assert "!1RF0<0!" in str(err.value)


def _uniform(n_stages: int, fwd: float, link: Link):
    ops = [(f"s{i}", lambda *xs: xs[0], ["x" if i == 0 else f"s{i - 1}"])
           for i in range(n_stages)]
    g = Graph.from_modules(["x"], ops)
    costs = synthetic(g, {f"s{i}": fwd for i in range(n_stages)}, act_per_sample=1000.0,
                      link=link)
    stages = [Stage(("x", "s0"))] + [Stage((f"s{i}",)) for i in range(1, n_stages)]
    return g, costs, stages


@pytest.mark.parametrize("n, m", [(2, 4), (4, 4), (4, 8), (3, 1)])
@pytest.mark.parametrize("maker", [gpipe, one_f_one_b])
def test_simulator_matches_the_closed_form_without_communication(n, m, maker):
    # equal stages, free links: iteration = (m + n - 1) * (f + b); bubble = (n-1)/(m+n-1)
    g, costs, stages = _uniform(n, 1e-3, Link(1e30, 0.0))
    plan = make_plan(g, stages, 1, m)
    r = simulate(g, costs, plan, maker(chain(n), m))
    assert r.iteration_s == pytest.approx((m + n - 1) * 3e-3)
    assert r.bubble == pytest.approx((n - 1) / (m + n - 1))
    assert r.samples_per_s == pytest.approx(m / r.iteration_s)


def test_simulator_memory_gpipe_holds_all_micro_batches_1f1b_fewer():
    g, costs, stages = _uniform(4, 1e-3, Link(1e30, 0.0))
    plan = make_plan(g, stages, 2, 8)
    rg = simulate(g, costs, plan, gpipe(chain(4), 8))
    r1 = simulate(g, costs, plan, one_f_one_b(chain(4), 8))
    assert rg.peak_in_flight == [8, 8, 8, 8] and r1.peak_in_flight == [4, 3, 2, 1]
    assert r1.peak_memory[0] == pytest.approx(rg.peak_memory[0] / 2)
    assert rg.iteration_s == pytest.approx(r1.iteration_s)


def test_simulator_charges_links():
    link = Link(bandwidth=1e6, latency=1e-4)
    g, costs, stages = _uniform(2, 1e-3, link)
    plan = make_plan(g, stages, 1, 1)
    r = simulate(g, costs, plan, one_f_one_b(chain(2), 1))
    # F0, send s0 (1000 B), F1, B1, send grad back, B0
    hop = 1e-4 + 1000 / 1e6
    assert r.iteration_s == pytest.approx(6e-3 + 2 * hop)


def test_simulator_charges_the_runners_own_costs():
    """`Runtime`: each forward and backward pays `action_s`; each tensor of a send pays
    latency and its sender's `message_s`, each received tensor its receiver's."""
    link = Link(bandwidth=1e6, latency=1e-4)
    g, costs, stages = _uniform(2, 1e-3, link)
    costs.runtime = Runtime(action_s=2e-4, message_s=5e-5)
    plan = make_plan(g, stages, 1, 4)
    r = simulate(g, costs, plan, one_f_one_b(chain(2), 4))
    kinds = r.per_kind()
    assert kinds[0]["F"] == pytest.approx(4 * (1e-3 + 2e-4))
    assert kinds[1]["B"] == pytest.approx(4 * (2e-3 + 2e-4))
    assert kinds[0]["SF"] == pytest.approx(4 * (1e-4 + 5e-5 + 1000 / 1e6))
    assert kinds[1]["RF"] >= 4 * 5e-5
    # one micro-batch: F0, send, receive, F1, B1, send back, receive, B0
    one = simulate(g, costs, make_plan(g, stages, 1, 1), one_f_one_b(chain(2), 1))
    hop = 1e-4 + 2 * 5e-5 + 1000 / 1e6
    assert one.iteration_s == pytest.approx(6e-3 + 4 * 2e-4 + 2 * hop)


def test_simulator_sends_one_message_per_tensor():
    """An edge carrying two tensors costs two latencies (the runner sends each)."""
    g = Graph.from_modules(["x"], [("a", lambda x: x, ["x"]), ("b", lambda x: x, ["x"]),
                                   ("c", lambda a, b: a, ["a", "b"])])
    costs = synthetic(g, {"a": 1e-3, "b": 1e-3, "c": 1e-3}, act_per_sample=0.0,
                      link=Link(1e30, 1e-4))
    plan = make_plan(g, [Stage(("x", "a", "b")), Stage(("c",))], 1, 1)
    assert plan.edges[(0, 1)] == ("a", "b")
    r = simulate(g, costs, plan, one_f_one_b(chain(2), 1))
    assert r.per_kind()[0]["SF"] == pytest.approx(2e-4)


def test_more_ranks_than_cores_stretch_the_cpu_work():
    g, costs, stages = _uniform(4, 1e-3, Link(1e30, 0.0))
    plan = make_plan(g, stages, 1, 4)
    alone = simulate(g, costs, plan, one_f_one_b(chain(4), 4)).iteration_s
    costs.runtime = Runtime(cores=2)
    shared = simulate(g, costs, plan, one_f_one_b(chain(4), 4)).iteration_s
    assert Runtime(cores=2).stretch(4) == 2.0 and Runtime().stretch(64) == 1.0
    assert shared == pytest.approx(2 * alone)


def test_a_receive_that_waited_pays_the_sleeping_waits_overshoot():
    """With more ranks than cores, waits sleep between polls: a receive whose message
    came while it waited ends `sleep_wake_s` after the arrival; one whose message was
    already there does not pay it, nor does any receive while each rank has a core."""
    assert [Runtime(cores=2, sleep_wake_s=1e-4).wake(r) for r in (1, 2, 3)] == [0, 0, 1e-4]
    assert Runtime(cores=0, sleep_wake_s=1e-4).wake(64) == 0.0
    g, costs, stages = _uniform(2, 1e-3, Link(1e30, 0.0))
    plan = make_plan(g, stages, 1, 1)
    costs.runtime = Runtime(cores=1)
    base = simulate(g, costs, plan, one_f_one_b(chain(2), 1))
    costs.runtime = Runtime(cores=1, sleep_wake_s=1e-4)
    woken = simulate(g, costs, plan, one_f_one_b(chain(2), 1))
    # F0 -> stage 1 waits for it; B1 -> stage 0 waits for it: two waited receives
    assert woken.iteration_s == pytest.approx(base.iteration_s + 2e-4)
    assert woken.per_kind()[1]["RF"] == pytest.approx(base.per_kind()[1]["RF"] + 1e-4)
    costs.runtime = Runtime(cores=2, sleep_wake_s=1e-4)
    assert simulate(g, costs, plan, one_f_one_b(chain(2), 1)).iteration_s == \
        pytest.approx(base.iteration_s / 2)
