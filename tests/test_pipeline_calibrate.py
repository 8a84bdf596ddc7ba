"""The runner's own costs: the calibration probe under mpirun, the time it spends in
each action kind, and the partitioners pricing those costs alike."""

from __future__ import annotations

import importlib
import json
import subprocess
import time

import pytest
import torch

from crossover.pipeline import Graph, sequential_partition
from crossover.pipeline.calibrate import PROBES, load, machine, stale
from crossover.pipeline.models import build
from crossover.pipeline.pricing import evaluate
from crossover.pipeline.profile import Link, OpCost, Runtime, _scaled_to_whole, _whole, profile
from tests.conftest import PY, REPO, Proc, mpirun
from tests.test_pipeline_partition import model_costs

# the module (the package's `profile` is its function)
profile_module = importlib.import_module("crossover.pipeline.profile")


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
    # a larger message takes longer one way (a polled small one takes a few us, as long
    # as posting a send: their order is not fixed)
    assert msgs["one_way_large_s"] > msgs["one_way_small_s"] > 0 and msgs["send_s"] > 0
    # a receive whose message came 2 ms late was timed polled and sleeping
    assert msgs["late_polled_s"] > 0 and msgs["late_slept_s"] > 0
    assert runtime.sleep_wake_s == max(msgs["late_slept_s"] - msgs["late_polled_s"], 0.0)
    # each side's cost in a run is the runner's own send and receive, both sides alike;
    # the wire is what a one-way message takes beyond the bare MPI calls
    assert msgs["runner_send_s"] > 0 and msgs["runner_receive_s"] > 0
    assert runtime.message_s == pytest.approx((msgs["runner_send_s"]
                                               + msgs["runner_receive_s"]) / 2)
    assert link.latency == pytest.approx(
        max(msgs["one_way_small_s"] - msgs["send_s"] - msgs["receive_s"], 0.0))
    assert len(got["action_s_per_rank"]) == 2
    assert stale(got) is None  # made here, now: what this machine's runs are priced with


HERE = {"host": "node7", "cores": 16, "torch": "2.13.0+cpu"}
CACHED = {**HERE, "probes": PROBES}


@pytest.mark.parametrize("cached, why", [
    (CACHED, None),
    ({**CACHED, "ranks": 2, "runtime": {}}, None),  # other figures do not matter
    ({**CACHED, "host": "node8"}, "host 'node8' where this machine has 'node7'"),
    ({**CACHED, "cores": 2}, "cores 2 where this machine has 16"),
    ({**CACHED, "torch": "2.11.0+cu130"},
     "torch '2.11.0+cu130' where this machine has '2.13.0+cpu'"),
    ({"cores": 16, "torch": "2.13.0+cpu", "probes": PROBES},
     "host None where this machine has 'node7'"),
    (HERE, f"probes version None, where this one is {PROBES}"),
    ({**HERE, "probes": PROBES - 1}, f"probes version {PROBES - 1}, where this one is {PROBES}"),
])
def test_a_cached_calibration_is_measured_again_where_it_was_not_made(cached, why):
    assert stale(cached, HERE) == why


def test_this_machine_is_named_by_host_cores_and_torch():
    here = machine()
    assert set(here) == {"host", "cores", "torch"} and here["torch"] == torch.__version__


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


def test_the_whole_model_is_timed_long_enough_each_backward_after_the_next_forward(
        monkeypatch):
    """The sums that set every op's level: warm-up runs first, then timed runs until
    both `repeats` and `WHOLE_MIN_S` are reached; each backward runs after the next
    micro-batch's forward, as a pipeline stage runs it (never right after its own)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    events = []

    class Logged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            events.append(f"B{ctx.k}")
            return g, None

    def node(x):
        k = sum(e.startswith("F") for e in events)
        events.append(f"F{k}")
        return Logged.apply(lin(x), k)

    graph = Graph.from_modules(["x"], [("a", node, ["x"])], root=lin)
    monkeypatch.setattr(profile_module, "WHOLE_MIN_S", 0.0)
    fwd, bwd = _whole(graph, {"x": torch.randn(2, 4)}, repeats=5)
    runs = profile_module.WHOLE_WARMUP + 5
    # forward k+1, then backward k; the last forward needs no backward
    assert events == ["F0"] + [e for k in range(1, runs) for e in (f"F{k}", f"B{k - 1}")]
    assert fwd > 0 and bwd > 0
    events.clear()
    monkeypatch.setattr(profile_module, "WHOLE_MIN_S", 0.05)
    monkeypatch.setattr(profile_module, "WHOLE_MAX_RUNS", 10**6)
    t0 = time.perf_counter()
    _whole(graph, {"x": torch.randn(2, 4)}, repeats=1)
    assert time.perf_counter() - t0 >= 0.05
    assert sum(e.startswith("F") for e in events) > runs


def test_op_costs_are_scaled_to_the_whole_model():
    """Timed one by one, ops pay a call each; the scaled costs add up to the whole
    model's forward and backward at both profiled sizes, fixed and per-sample parts
    each with their own factor, kept within bounds."""
    ops = {"a": OpCost(fwd=1e-4, fwd_per_sample=1e-5, bwd=3e-4, bwd_per_sample=2e-5),
           "b": OpCost(fwd=1e-4, fwd_per_sample=3e-5, bwd=1e-4, bwd_per_sample=4e-5)}
    whole = {2: (2.5e-4, 2.0e-4), 8: (6.1e-4, 5.6e-4)}  # (forward, backward) seconds
    got = _scaled_to_whole(ops, whole, 2, 8)
    for b, (fwd, bwd) in whole.items():
        assert sum(c.forward(b) for c in got.values()) == pytest.approx(fwd, rel=1e-12)
        assert sum(c.backward(b) for c in got.values()) == pytest.approx(bwd, rel=1e-12)
    # relative shares within a part are kept
    assert got["b"].fwd_per_sample / got["a"].fwd_per_sample == pytest.approx(3.0)
    # a whole run far slower than any factor allows is capped, not extrapolated
    capped = _scaled_to_whole(ops, {2: (1.0, 1.0), 8: (1.0, 1.0)}, 2, 8)
    assert capped["a"].fwd == pytest.approx(20 * 1e-4)


def test_profile_gives_every_op_with_work_a_cost():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    g = Graph.from_fx(model)
    name = g.inputs[0]  # what fx calls the Sequential's argument
    costs = profile(g, lambda b: {name: torch.randn(b, 16)}, sizes=(2, 16), repeats=3)
    linears = [n for n, op in g.ops.items() if op.params]
    assert len(linears) == 2
    for n in linears:
        c = costs.of(n)
        assert c.forward(16) > 0 and c.backward(16) > 0 and c.param_bytes > 0
        assert c.act_per_sample > 0
