"""The MPI stage runner: a pipelined step's gradients equal one process's (float64)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import numpy as np
import pytest
import torch

from crossover.pipeline import Graph, parameter_costs
from crossover.pipeline.models import build
from crossover.pipeline.partition import graph_frontier
from crossover.trace import load
from tests.conftest import PY, REPO, Proc, mpirun

pytestmark = pytest.mark.mpi


def reference(name: str, batch: int) -> tuple[dict[str, np.ndarray], float]:
    spec = build(name, torch.float64, small=True)
    feeds, target = spec.make_batch(batch, 1)
    loss = spec.loss(spec.module(**feeds), target)
    loss.backward()
    return {k: p.grad.numpy() for k, p in spec.module.named_parameters()}, float(loss.detach())


def run_pipeline(tmp_path, env, name, np_, *extra, batch=8, micro=4, timeout=120):
    out = tmp_path / f"{name}.pkl"
    cmd = mpirun(np_, PY, "-m", "crossover.pipeline", "--model", name, "--small",
                 "--dtype", "float64", "--batch", str(batch), "--micro", str(micro),
                 "--out", str(out), "--timeout", "30", *extra)
    Proc(cmd, env, tmp_path / f"{name}.log").wait(timeout)
    with open(out, "rb") as f:
        return pickle.load(f)


def branch_plan(name: str, devices: int, batch: int = 8, micro: int = 4) -> list[list[str]]:
    """The series-parallel DP's plan on `devices` stages (parameter-count costs, the
    CLI's), least `critical path + (M - 1) x bottleneck`: its stages' op lists."""
    g = Graph.from_fx(build(name, torch.float64, small=True).module)
    table = graph_frontier(g, parameter_costs(g), devices, batch // micro, micro,
                           replicate=False)
    plan = min((v for (d, _h), v in table.items() if d == devices),
               key=lambda v: v[1] + (micro - 1) * v[0])[2]
    return [list(st.ops) for st in plan.stages]


def assert_same_grads(got, name, batch=8):
    ref, loss = reference(name, batch)
    assert set(got["grads"]) == set(ref)
    for k, r in ref.items():
        err = np.abs(got["grads"][k] - r).max() / max(np.abs(r).max(), 1e-300)
        assert err < 1e-6, f"{k}: relative error {err}"
    assert got["loss"] == pytest.approx(loss, rel=1e-9)


@pytest.mark.parametrize("name, np_, partitioner, schedule, stages", [
    ("chain", 2, "graph", "1f1b", None),
    ("two_tower", 3, "graph", "1f1b", ["tokens", "patches", "cat"]),
    ("uno", 4, "graph", "1f1b", ["cell", "drug1", "drug2", "cat"]),
    ("uno", 4, "sequential", "gpipe", None),
])
def test_pipelined_gradients_equal_single_process(tmp_path, cluster, name, np_, partitioner,
                                                  schedule, stages):
    env = dict(cluster.env, CROSSOVER_ENABLE="0")
    # with branch stages named, run the series-parallel search's plan with each branch on
    # a rank of its own (the partitioner may prefer a chain plan for these costs)
    plan = ["--plan", json.dumps(branch_plan(name, np_))] if stages is not None else []
    got = run_pipeline(tmp_path, env, name, np_, "--partitioner", partitioner,
                       "--schedule", schedule, *plan)
    assert len(got["plan"]) == np_
    if stages is not None:  # the branches really ran on different ranks
        assert sorted(p[0] for p in got["plan"]) == sorted(stages)
    assert_same_grads(got, name)
    if schedule == "1f1b" and name == "chain":
        # 1F1B keeps at most (depth to the sink) micro-batches of activations on a stage,
        # the first stage included (it once kept all 4, having no gradient to send back)
        assert got["peak_live"] == [2, 1], got["peak_live"]


def test_pipeline_stages_take_slots_from_the_daemon(tmp_path, cluster):
    """Every forward and backward of every stage holds its device, granted by the daemon
    (KEEP_WHEN_ALONE=0: a lone job would otherwise keep its devices and never ask)."""
    traces = tmp_path / "traces"
    with cluster.daemon():
        env = dict(cluster.env, CROSSOVER_JOB="pipe", CROSSOVER_TRACE=str(traces),
                   CROSSOVER_KEEP_WHEN_ALONE="0")
        got = run_pipeline(tmp_path, env, "two_tower", 3, "--slots", "--iters", "2")
    log = (tmp_path / "two_tower.log").read_text()
    assert "uncoordinated" not in log, log[-2000:]
    daemon_log = (cluster.tmp / "daemon.log").read_text()
    assert all(f"job pipe rank {r} on node" in daemon_log for r in range(3)), daemon_log
    holds = [sum(e["ph"] == "X" and e["name"] == "hold"
                 for e in load(traces / f"pipe.rank{rank}.json")) for rank in range(3)]
    # 2 iterations x 4 micro-batches x (forward + backward), and the hold each iteration
    # ends with (the optimizer step's, as a Horovod step's): the first one merges with the
    # next iteration's first forward on the towers, while the head (rank 2) starts its
    # iteration with a receive and gives the device up before it
    assert holds == [17, 17, 18], holds
    assert_same_grads(got, "two_tower")


def test_a_missing_peer_times_out_with_a_message():
    """The one polling helper (runner and migration): a deadline, a message naming what
    was waited for, and cancelling leaves no request in flight."""
    code = (
        "from mpi4py import MPI\n"
        "import numpy as np\n"
        "from crossover.pipeline.waits import InFlight, wait_requests\n"
        "req = MPI.COMM_SELF.Irecv(np.empty(3), source=0, tag=5)\n"
        "try:\n"
        "    wait_requests([req], 0.5, 'stage 1 waited for x')\n"
        "except TimeoutError as e:\n"
        "    print('TIMEOUT', e)\n"
        "flight = InFlight()\n"
        "flight.add(req, None, 'x from stage 0')\n"
        "flight.add(MPI.COMM_SELF.Irecv(np.empty(3), source=0, tag=6), None, 'y')\n"
        "try:\n"
        "    flight.wait(0.2)\n"
        "except TimeoutError as e:\n"
        "    print('FLIGHT', e)\n"
        "flight.cancel()\n"
        "print('LEFT', len(flight), req.Test())\n"
    )
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert "TIMEOUT stage 1 waited for x: not done in 0.5 s" in out.stdout, out.stderr
    assert "FLIGHT x from stage 0: not done in 0.2 s" in out.stdout, out.stderr
    assert "LEFT 0 True" in out.stdout, out.stdout + out.stderr


# Rank 0 runs stage 0 of a 2-stage chain; rank 1 never runs stage 1. Rank 0's wait for
# the first gradient times out; it must leave no request in flight (a late message would
# land in freed memory, and freeing the communicator would strand it).
ABANDONED = """
import torch
from mpi4py import MPI
from crossover.pipeline.graph import Graph
from crossover.pipeline import Graph, parameter_costs
from crossover.pipeline.models import build
from crossover.pipeline.partition import graph_frontier
from crossover.pipeline.partition import plan_for
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import schedule_for

class Recording:  # the communicator, keeping every point-to-point request it starts
    def __init__(self, comm):
        self.comm, self.requests = comm, []
    def __getattr__(self, name):
        return getattr(self.comm, name)
    def Isend(self, *a, **k):
        self.requests.append(self.comm.Isend(*a, **k))
        return self.requests[-1]
    def Irecv(self, *a, **k):
        self.requests.append(self.comm.Irecv(*a, **k))
        return self.requests[-1]

world = MPI.COMM_WORLD
sub = world.Dup()
spec = build("chain", torch.float64, small=True)
graph = Graph.from_fx(spec.module)
plan = plan_for(graph, 2, 8, 4)
x, y = spec.make_batch(8, 1)
shapes = output_shapes(graph, {k: v[:2] for k, v in x.items()})
if world.Get_rank() == 0:
    rec = Recording(sub)
    runner = StageRunner(graph, plan, schedule_for(plan), 0, rec, shapes, timeout=1.0,
                         replica_comms={})
    try:
        runner.run(lambda m: {k: v[2 * m:2 * m + 2] for k, v in x.items()},
                   lambda m: y[2 * m:2 * m + 2], spec.loss)
    except TimeoutError as exc:
        print("TIMEOUT", exc, flush=True)
    print("REQUESTS", len(rec.requests), "ACTIVE", sum(not r.Test() for r in rec.requests),
          flush=True)
    sub.Free()
world.Barrier()
"""


def test_a_timed_out_runner_leaves_no_request_in_flight(tmp_path):
    script = tmp_path / "abandoned.py"
    script.write_text(ABANDONED)
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    out = Proc(mpirun(2, PY, str(script)), env, tmp_path / "abandoned.log").wait(120)
    assert "ACTIVE 0" in out, out[-3000:]  # the gradient's receive was cancelled
    assert "TIMEOUT stage 0 receiving the gradient" in out, out[-3000:]


# --- replicated (data-parallel) stages ------------------------------------------------------
CHAIN_REPLICATED = ("chain", 3, ("--replicas", "2,1"))


@pytest.fixture(scope="module")
def replicated_chain(tmp_path_factory):
    """One run of a 2-stage chain with stage 0 on 2 replicas (ranks 0, 1), stage 1 on rank 2."""
    tmp = tmp_path_factory.mktemp("replicated_chain")
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp / "run"))
    name, np_, extra = CHAIN_REPLICATED
    return run_pipeline(tmp, env, name, np_, *extra, timeout=240)


def test_a_replicated_chain_stage_gives_single_process_gradients(replicated_chain):
    got = replicated_chain
    assert got["replicas"] == [2, 1] and got["devices"] == [[0, 1], [2]]
    assert_same_grads(got, "chain")


def shard_own_grads(name: str, batch: int, micro: int, replicas: int, replica: int,
                    params: list[str]) -> dict[str, np.ndarray]:
    """What one replica holds before the replicas' allreduce: the gradient of its rows
    of every micro-batch, weighted by their share of the batch (mean losses)."""
    spec = build(name, torch.float64, small=True)
    feeds, target = spec.make_batch(batch, 1)
    b, share = batch // micro, batch // micro // replicas
    idx = torch.tensor([m * b + replica * share + i for m in range(micro) for i in range(share)])
    out = spec.module(**{k: v[idx] for k, v in feeds.items()})
    (spec.loss(out, target[idx]) * (len(idx) / batch)).backward()
    named = dict(spec.module.named_parameters())
    return {k: named[k].grad.numpy() for k in params}


def test_replicas_sum_their_gradients_over_their_communicator(replicated_chain):
    ranks = replicated_chain["rank_grads"]
    stage0 = sorted(ranks[0])
    assert stage0 and sorted(ranks[1]) == stage0 and not set(ranks[2]) & set(stage0)
    ref, _ = reference("chain", 8)
    own = [shard_own_grads("chain", 8, 4, 2, r, stage0) for r in (0, 1)]
    for k in stage0:
        scale = np.abs(ref[k]).max()
        # the shards' own gradients are parts of the whole (this checks the test's maths)
        assert np.abs(own[0][k] + own[1][k] - ref[k]).max() < 1e-9 * scale
        # both replicas end with the same gradient: the whole batch's, not their own
        assert np.array_equal(ranks[0][k], ranks[1][k]), k
        assert np.abs(ranks[0][k] - ref[k]).max() < 1e-6 * scale, k
        for r in (0, 1):
            assert np.abs(ranks[r][k] - own[r][k]).max() > 1e-3 * scale, (k, r)


@pytest.mark.parametrize("name, np_, plan, replicas, extra, batch", [
    # a replicated branch (int token inputs split too) gathered by a plain join stage
    ("two_tower", 4, [["tokens", "embed", "text_0", "mean"],
                      ["patches", "patch", "image_0", "mean_1"],
                      ["cat", "head_0", "head_1", "head_2"]], "2,1,1", (), 8),
    # three towers scatter into the replicated stage that holds the loss
    ("uno", 5, [["cell", "towers_0_0", "towers_0_1", "towers_0_2", "towers_0_3"],
                ["drug1", "towers_1_0", "towers_1_1", "towers_1_2", "towers_1_3"],
                ["drug2", "towers_2_0", "towers_2_1", "towers_2_2", "towers_2_3"],
                ["cat", "top_0", "top_1", "top_2", "top_3", "top_4"]], "1,1,1,2", (), 16),
    # replicated into replicated (two process sets), GPipe schedule
    ("chain", 4, None, "2,2", ("--schedule", "gpipe"), 16),
])
def test_replicated_stages_in_multi_branch_plans_give_single_process_gradients(
        tmp_path, name, np_, plan, replicas, extra, batch):
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    args = ["--replicas", replicas, *extra] + (["--plan", json.dumps(plan)] if plan else [])
    got = run_pipeline(tmp_path, env, name, np_, *args, batch=batch, timeout=240)
    reps = [int(r) for r in replicas.split(",")]
    assert sum(got["replicas"]) == np_ and sorted(got["replicas"]) == sorted(reps)
    if plan is not None:
        assert sorted(p[0] for p in got["plan"]) == sorted(p[0] for p in plan)
    assert_same_grads(got, name, batch)
    ranks = got["rank_grads"]
    for devs in got["devices"]:  # every replica of a stage holds the same gradient
        for r in devs[1:]:
            assert sorted(ranks[r]) == sorted(ranks[devs[0]])
            for k in ranks[r]:
                assert np.array_equal(ranks[r][k], ranks[devs[0]][k]), (devs, k)


def test_a_plan_launched_on_the_wrong_number_of_ranks_fails_fast(tmp_path):
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    cmd = mpirun(2, PY, "-m", "crossover.pipeline", "--model", "chain", "--small",
                 "--replicas", "2,1", "--out", str(tmp_path / "x.pkl"), "--timeout", "200")
    proc = Proc(cmd, env, tmp_path / "wrong.log")
    try:
        rc = proc.popen.wait(timeout=120)  # far below the runner's 200 s receive deadline
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"a wrong rank count hung:\n{proc.output()[-3000:]}")
    proc._out.close()
    assert rc != 0
    assert "the plan needs 3 ranks" in proc.output() and "has 2" in proc.output(), \
        proc.output()[-3000:]
    assert not (tmp_path / "x.pkl").exists()


class _FakeComm:
    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank


def test_the_runner_refuses_a_communicator_of_the_wrong_size():
    from crossover.pipeline import Graph, plan_for, schedule_for
    from crossover.pipeline.placement import with_replicas
    from crossover.pipeline.runner import StageRunner

    spec = build("chain", torch.float64, small=True)
    g = Graph.from_fx(spec.module)
    plan = with_replicas(plan_for(g, 2, 8, 4), [2, 1])
    for size in (2, 4):
        with pytest.raises(ValueError, match=f"needs 3 ranks .* has {size}: launch mpirun -np 3"):
            StageRunner(g, plan, schedule_for(plan), 0, _FakeComm(size), {})


def test_replica_links_exchange_the_overlapping_rows():
    from crossover.pipeline import Plan, Stage
    from crossover.pipeline.placement import links, shard_rows, stage_of_rank

    plan = Plan([Stage(("a",), 2), Stage(("b",), 3), Stage(("c",))],
                {(0, 1): ("a",), (1, 2): ("b",)}, micro_batch=6, num_micro=1)
    assert [stage_of_rank(plan, r) for r in range(6)] == \
        [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert shard_rows(6, 3, 1) == (2, 4)
    # replica 0 of stage 0 holds rows 0..2: rows 0-1 go to rank 2, row 2 to rank 3
    assert links(plan, 0, 0, 1) == [(2, 0, slice(0, 2)), (3, 1, slice(2, 3))]
    # replica 1 of stage 1 holds rows 2..3: row 2 from rank 0, row 3 from rank 1
    assert links(plan, 1, 1, 0) == [(0, 0, slice(0, 1)), (1, 1, slice(1, 2))]
    # the plain last stage gathers all three shards into its whole micro-batch
    assert links(plan, 2, 0, 1) == [(2, 0, slice(0, 2)), (3, 1, slice(2, 4)),
                                    (4, 2, slice(4, 6))]
    assert links(plan, 1, 2, 2) == [(5, 0, slice(0, 2))]


def test_the_partitioner_may_replicate_stages_when_asked(tmp_path):
    """--replicate: the plan for 2 ranks may replicate (with parameter costs and no
    memory limit, the chain runs as one stage on 2 data-parallel replicas)."""
    env = dict(os.environ, CROSSOVER_ENABLE="0", CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    got = run_pipeline(tmp_path, env, "chain", 2, "--replicate", timeout=240)
    assert got["replicas"] == [2] and got["devices"] == [[0, 1]]
    assert_same_grads(got, "chain")


def test_message_tags_stay_small_on_large_graphs():
    """Tags come from the tensors that cross stage edges, not from op indices: a chain of
    20000 ops cut in 4 stages has 3 crossing tensors (it once needed tags past 32767, the
    bound the MPI standard guarantees)."""
    from crossover.pipeline import Plan, Stage
    from crossover.pipeline.tags import check_tags, edge_tensor_ids, message_tag

    ops = [f"op{i}" for i in range(20000)]
    plan = Plan([Stage(tuple(ops[i:i + 5000])) for i in range(0, 20000, 5000)],
                {(0, 1): ("op4999",), (1, 2): ("op9999",), (2, 3): ("op14999",)},
                micro_batch=1, num_micro=8)
    ids = edge_tensor_ids(plan)
    assert ids == {"op14999": 0, "op4999": 1, "op9999": 2}
    tags = {message_tag(t, bw, m, 8) for t in ids.values() for bw in (False, True)
            for m in range(8)}
    assert len(tags) == 3 * 2 * 8 and max(tags) == 47  # unique and small
    check_tags(3, 8, 32767)
    with pytest.raises(ValueError, match="need MPI tags up to 39999, above this MPI's bound "
                                         "32767: use fewer micro-batches"):
        check_tags(1, 20000, 32767)
