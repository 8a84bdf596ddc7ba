"""The runner's own costs: the calibration probe under mpirun, the time it spends in
each action kind, and the partitioners pricing those costs alike."""

from __future__ import annotations

import json
import subprocess

import pytest

from crossover.pipeline import Graph, sequential_partition
from crossover.pipeline.calibrate import load
from crossover.pipeline.models import build
from crossover.pipeline.pricing import evaluate
from crossover.pipeline.profile import Link, Runtime
from tests.conftest import PY, REPO, Proc, mpirun
from tests.test_pipeline_partition import model_costs


@pytest.mark.mpi
def test_calibration_measures_messages_actions_and_the_wire(tmp_path, cluster):
    out = tmp_path / "runtime.json"
    Proc(mpirun(2, PY, "-m", "crossover.pipeline.calibrate", "--out", str(out)),
         cluster.env, tmp_path / "calibrate.log").wait(120)
    got = json.loads(out.read_text())
    runtime, link = load(str(out))
    assert runtime.message_s > 0 and runtime.action_s >= 0 and runtime.cores >= 1
    assert link.bandwidth > 0 and link.latency >= 0
    msgs = got["messages"]
    # a larger message takes longer one way, and posting a send returns before that
    assert msgs["one_way_large_s"] > msgs["one_way_small_s"] > msgs["send_s"]
    assert len(got["action_s_per_rank"]) == 2


def test_calibration_on_one_rank_says_how_to_run_it(tmp_path, cluster):
    proc = subprocess.run([PY, "-m", "crossover.pipeline.calibrate", "--out",
                           str(tmp_path / "r.json")], cwd=REPO, env=cluster.env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs 2 ranks: mpirun -np 2" in proc.stderr


@pytest.mark.mpi
def test_the_runner_reports_its_time_by_action_kind(tmp_path, cluster):
    out = tmp_path / "t.json"
    env = dict(cluster.env, CROSSOVER_ENABLE="0")
    Proc(mpirun(2, PY, "-m", "crossover.pipeline", "--model", "chain", "--small",
                "--batch", "8", "--micro", "4", "--iters", "3", "--out", str(out)),
         env, tmp_path / "run.log").wait(120)
    got = json.loads(out.read_text())
    assert sorted(got["stage_of_rank"]) == [0, 1]
    for rank, iterations in enumerate(got["spent"]):
        assert len(iterations) == 3
        for it in iterations:
            assert it["F"] > 0 and it["B"] > 0, (rank, it)
            # the first stage receives gradients, the last receives activations
            assert ("RB" in it) != ("RF" in it), (rank, it)
            assert sum(it.values()) <= max(got["times"]) * 1.5


@pytest.mark.parametrize("name", ["chain", "dlrm", "uno"])
def test_the_chain_search_prices_the_runtime_as_the_pricer_does(name):
    """With the runner's costs set, the sequential search's estimate of its own plan is
    what a fresh evaluation of that plan gives (the vectorised chain DP and
    `StagePricer` agree on the action and message terms)."""
    g = Graph.from_fx(build(name, small=True).module)
    costs = model_costs(g, 0.35)
    costs.runtime = Runtime(action_s=3e-4, message_s=4e-5)
    costs.link = Link(3e9, 2e-5)
    plan = sequential_partition(g, costs, 4, 256)
    bn, cr = evaluate(g, costs, plan)
    assert plan.estimate == pytest.approx(cr + (plan.num_micro - 1) * bn, rel=1e-9)
