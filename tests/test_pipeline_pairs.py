"""bench/pipeline/pairs.py: two plans of one model timed in one launch, in alternating
blocks, each on its own stage runners (what the pipeline benchmark's real rows use)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import PY, REPO, Proc, mpirun

CHAIN_CUT = [["x", "body_0", "body_1", "body_2", "body_3", "body_4", "body_5", "body_6",
              "body_7"],
             ["body_8", "body_9", "body_10", "body_11", "body_12", "body_13", "body_14",
              "body_15", "head"]]
LATER_CUT = [CHAIN_CUT[0] + CHAIN_CUT[1][:4], CHAIN_CUT[1][4:]]


@pytest.mark.mpi
def test_two_plans_take_turns_in_one_launch_and_each_reports_its_own_stages(tmp_path):
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    plans = {"early": {"kind": "graph", "stages": CHAIN_CUT},
             "late": {"kind": "sequential", "stages": LATER_CUT}}
    out = tmp_path / "pairs.json"
    Proc(mpirun(2, PY, str(REPO / "bench/pipeline/pairs.py"), "--model", "chain",
                "--plans", json.dumps(plans), "--warmup", "1", "--blocks", "3",
                "--block-iters", "2", "--out", str(out)),
         env, tmp_path / "pairs.log").wait(180)
    got = json.loads(out.read_text())
    assert got["order"] == ["early", "late", "late", "early", "early", "late"]
    for name, kind in (("early", "graph"), ("late", "sequential")):
        row = got["plans"][name]
        assert len(row["times"]) == 6 and all(t > 0 for t in row["times"])
        assert row["plan"].startswith(f"{kind} plan, 2 stages")
        assert row["stage_of_rank"] == [0, 1]
        # per rank, per timed iteration: the stage's compute and its messages
        assert [len(r) for r in row["spent"]] == [6, 6]
        assert all(it["F"] > 0 and it["B"] > 0 for r in row["spent"] for it in r)
        assert all(it["SF"] > 0 for it in row["spent"][0])
        assert all(it["RF"] > 0 for it in row["spent"][1])
    # the two cuts differ, and each plan's description says where
    assert "body_7 | 1:body_8" in got["plans"]["early"]["plan"]
    assert "body_11 | 1:body_12" in got["plans"]["late"]["plan"]
    # the same parameters and batch under both plans: the same loss (a plan that ran on
    # the other's stages, or on gradients the other left, would not give it)
    early, late = got["plans"]["early"]["loss"], got["plans"]["late"]["loss"]
    assert early > 0 and late == pytest.approx(early, rel=1e-6)


@pytest.mark.mpi
def test_a_plan_that_needs_other_ranks_is_named(tmp_path):
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    plans = {"two": {"kind": "graph", "stages": CHAIN_CUT},
             "one": {"kind": "graph", "stages": [CHAIN_CUT[0] + CHAIN_CUT[1]]}}
    out = tmp_path / "x.json"
    proc = Proc(mpirun(2, PY, str(REPO / "bench/pipeline/pairs.py"), "--model", "chain",
                       "--plans", json.dumps(plans), "--out", str(out)),
                env, tmp_path / "wrong.log")
    try:
        rc = proc.popen.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"a wrong plan hung:\n{proc.output()[-3000:]}")
    proc._out.close()
    assert rc != 0
    assert "plan 'one'" in proc.output() and "has 2" in proc.output(), proc.output()[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("f_scale, b_scale", [(1.0, 1.0), (2.0, 0.5), (0.7, 1.3)])
def test_simulating_with_the_measured_compute_reproduces_each_stage_f_and_b(f_scale, b_scale):
    """The validator's second figure: the simulator given each stage's compute as the run
    measured it (here: each stage's simulated F and B scaled), with the runner's own
    cost per action as calibrated; it must land on exactly those seconds."""
    from bench.pipeline.real import REAL_MICRO, with_measured_compute
    from crossover.pipeline import Graph, schedule_for, simulate
    from crossover.pipeline.models import build
    from crossover.pipeline.plan import Stage, make_plan
    from crossover.pipeline.profile import Runtime, synthetic

    graph = Graph.from_fx(build("chain").module)
    costs = synthetic(graph, {n: 1e-5 for n in graph.ops}, fixed=2e-5)
    costs.runtime = Runtime(action_s=3e-5, message_s=1e-5, cores=4)
    plan = make_plan(graph, [Stage(tuple(s)) for s in CHAIN_CUT], 8, REAL_MICRO)
    before = simulate(graph, costs, plan, schedule_for(plan))
    measured = {s: {"F": row["F"] * f_scale * (1 + s), "B": row["B"] * b_scale}
                for s, row in before.per_kind().items()}
    after = simulate(graph, with_measured_compute(costs, plan, measured, before), plan,
                     schedule_for(plan)).per_kind()
    for s, row in measured.items():
        assert after[s]["F"] == pytest.approx(row["F"], rel=1e-9)
        assert after[s]["B"] == pytest.approx(row["B"], rel=1e-9)
