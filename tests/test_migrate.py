"""Live re-partitioning: parameters and optimizer state move between ranks bit-exactly,
and training across a re-partition equals one process that freezes the same layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from crossover.pipeline.graph import Graph
from crossover.pipeline.migrate import (
    Move,
    load_optimizer_state,
    optimizer_state,
    plan_moves,
    state_hash,
)
from crossover.pipeline.models import build
from crossover.pipeline.partition import parameter_costs
from crossover.trace import load
from tests.conftest import PY, Proc, mpirun
from tests.test_pipeline_train import assert_close, one_process_with_freezing

REPO = Path(__file__).resolve().parents[1]

PARAM_OPS = {"body_0", "body_2", "body_4", "body_6", "head"}  # the small chain's Linears
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}

SCHEDULERS = {"exp": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)}


class BatchNormChain(nn.Module):
    """The small chain's input and output with batch norm between: running statistics
    are state that is not trained but must move with its stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                    nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                    nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.mark.parametrize("old, new, moves", [
    # a stage's parameter changes rank
    ({"a": [0], "b": [1]}, {"a": [0], "b": [0]}, [Move("b", 1, 0)]),
    # nothing moves for a rank that keeps its parameter
    ({"a": [0]}, {"a": [0]}, []),
    # spreading onto two new ranks: the old replicas take turns sending
    ({"a": [0, 1]}, {"a": [2, 3]}, [Move("a", 0, 2), Move("a", 1, 3)]),
    # a replica that already holds it keeps it, the other new one receives
    ({"a": [1]}, {"a": [0, 1]}, [Move("a", 1, 0)]),
])
def test_plan_moves(old, new, moves):
    assert plan_moves(old, new) == moves


def test_a_parameter_nobody_holds_is_named():
    with pytest.raises(ValueError, match="parameter 'w' has no current owner"):
        plan_moves({}, {"w": [0]})


def _trained(name: str, steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    opt = OPTIMIZERS[name](list(model.parameters()))
    for s in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator()
                          .manual_seed(s))).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_by_name_moves_into_a_new_optimizer_exactly(name):
    """State taken by name and loaded into an optimizer that lists the parameters in
    another order continues exactly as the original (here: one more step each)."""
    model, opt = _trained(name)
    params = dict(model.named_parameters())
    state = optimizer_state(opt, params)
    assert set(state) == set(params) and all(state.values())
    # copies, as a transfer gives: the two optimizers must not share state tensors
    state = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for n, s in state.items()}
    twin, _ = _trained(name, steps=0)
    twin.load_state_dict(model.state_dict())
    twin_params = dict(twin.named_parameters())
    twin_opt = OPTIMIZERS[name](list(reversed(list(twin.parameters()))))
    load_optimizer_state(twin_opt, twin_params, state)
    assert state_hash(twin.state_dict(), optimizer_state(twin_opt, twin_params)) == \
        state_hash(model.state_dict(), state)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(torch.ones(5, 4, dtype=torch.float64)).square().mean().backward()
        o.step()
    assert state_hash(twin.state_dict()) == state_hash(model.state_dict())


def test_state_for_a_parameter_the_optimizer_does_not_train_is_refused():
    model, opt = _trained("sgd")
    params = dict(model.named_parameters())
    state = optimizer_state(opt, params)
    small = torch.optim.SGD([params["0.weight"]], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="optimizer state for '0.bias'"):
        load_optimizer_state(small, params, state)


def test_state_hash_sees_one_bit_and_not_the_order():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.zeros(1)}
    b = {"b": torch.zeros(1), "w": a["w"].clone()}
    assert state_hash(a) == state_hash(b)
    b["w"].view(torch.int64)[0] ^= 1  # the last bit of the mantissa
    assert state_hash(a) != state_hash(b)
    assert state_hash(a, {"w": {"step": 1}}) != state_hash(a, {"w": {"step": 2}})


def test_a_frozen_op_costs_a_sixth_and_keeps_one_copy_of_its_weights():
    graph = Graph.from_fx(build("chain", torch.float64, small=True).module)
    costs = parameter_costs(graph)
    frozen = costs.frozen(["body_0"])
    was, now = costs.of("body_0"), frozen.of("body_0")
    active = was.forward(8) + was.backward(8)
    assert now.forward(8) + now.backward(8) == pytest.approx(active / 6)
    assert now.backward(8) == 0.0
    assert now.param_bytes == was.param_bytes / costs.param_factor
    assert frozen.of("body_2") == costs.of("body_2")
    with pytest.raises(ValueError, match="frozen cost factor 0"):
        costs.frozen(["body_0"], 0)


# --- under mpirun -------------------------------------------------------------------

# mode "migrate": train, force a re-partition to a given cut, hash the gathered state
# before and after, train on ("migrate_bn": the same with BatchNormChain). mode
# "freeze": freeze and re-partition automatically;
# "cache": the same, cutting the frozen front off and feeding the rest from its cache;
# "cache_heavy": the same with compute-bound costs (so re-plans use replicas);
# "cache_slots": "cache" taking device slots from a crossover daemon.
JOB = """
import json, os, sys
import torch
from crossover.pipeline.migrate import state_hash
from crossover.pipeline.models import build
from crossover.pipeline.plan import Stage, make_plan
from crossover.pipeline.ties import tied_copies
from crossover.pipeline.train import PipelineTrainer
from tests.test_migrate import OPTIMIZERS, SCHEDULERS, BatchNormChain

mode, opt_name, steps, out, replicas, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
    sys.argv[4], sys.argv[5], sys.argv[6]
torch.set_num_threads(1)
spec = build(os.environ.get("JOB_MODEL") or "chain", torch.float64, small=True)
x, y = spec.make_batch(8, 7)  # one batch again and again: gradients settle
reps = [int(r) for r in replicas.split(",")] if replicas else None
freeze = {}
module = spec.module
if mode == "migrate_bn":
    torch.manual_seed(0)
    module = BatchNormChain().double()
if not mode.startswith("migrate"):  # arg: every,threshold
    every, threshold = arg.split(",")
    freeze = dict(freeze_every=int(every), freeze_threshold=float(threshold),
                  freeze_patience=1, repartition=True, cache_frozen=mode != "freeze",
                  slots=mode == "cache_slots")
    if os.environ.get("JOB_SCHEDULER") in SCHEDULERS:
        freeze["scheduler"] = SCHEDULERS[os.environ["JOB_SCHEDULER"]]
    if os.environ.get("JOB_SIGNAL"):
        freeze["freeze_signal"] = os.environ["JOB_SIGNAL"]
if mode == "cache_heavy":  # compute-bound costs: replicas pay
    from crossover.pipeline.graph import Graph
    from crossover.pipeline.profile import synthetic
    graph = Graph.from_fx(spec.module)
    freeze["costs"] = synthetic(graph, {n: 1e-3 for n in graph.ops})
t = PipelineTrainer(module, spec.loss, batch=8, num_micro=4, example=x,
                    replicas=reps, optimizer=OPTIMIZERS[opt_name], **freeze)
rank = t.comm.Get_rank()
losses, hashes, tied = [], [], []

def ops_of(t):  # this rank's stage's ops (none on a spare rank)
    return list(t.plan.stages[t.stage].ops) if t.stage is not None else []
stages = [ops_of(t)]  # this rank's stage after each step
layouts = []  # replicas per stage after each step

def train(n):
    for _ in range(n):
        losses.append(t.step(x if t.needs_inputs else None, y if t.needs_target else None,
                             index=torch.arange(8)))
        stages.append(ops_of(t))
        layouts.append([s.replicas for s in t.plan.stages])

def gathered_hash():
    return state_hash(t.state_dict(), t.optimizer_state())

train(steps // 2)
if mode.startswith("migrate"):  # arg: the cuts of the forced plan
    cuts = [int(c) for c in arg.split(",")]
    ops = list(t.graph.ops)
    bounds = [0, *cuts, len(ops)]
    forced = make_plan(t.graph, [Stage(tuple(ops[a:b]), r) for a, b, r in
                                 zip(bounds, bounds[1:], reps or [1] * len(bounds))],
                       t.plan.micro_batch, t.plan.num_micro)
    hashes.append(gathered_hash())
    tied.append(tied_copies(t.graph, t.plan).get("embed.weight"))
    moved = t.repartition(forced)
    tied.append(tied_copies(t.graph, t.plan).get("embed.weight"))
    hashes.append(gathered_hash())
    assert moved
    stages.append(ops_of(t))
train(steps - steps // 2)
state = t.state_dict()
json.dump({"log": [[d.step, list(d.layers)] for d in t.freeze_log], "losses": losses,
           "hashes": hashes, "stages": stages, "repartitions": t.repartitions,
           "frozen_stages": sorted(t.runner.frozen_stages()) if t.runner else [],
           "layouts": layouts, "tied": tied,
           "cache": [t.prefix.hits, t.prefix.misses] if t.prefix else None},
          open(f"{out}.rank{rank}.json", "w"))
if rank == 0:
    torch.save(state, out + ".pt")
"""


def run_job(tmp_path, cluster, np_, *args, timeout=240, env=None):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "run"
    proc = Proc(mpirun(np_, PY, str(script), args[0], args[1], args[2], str(out), *args[3:]),
                # the job imports this file's optimizers: the repository on its path
                {**cluster.env, "CROSSOVER_ENABLE": "0", "PYTHONPATH": str(REPO), **(env or {})},
                tmp_path / "job.log")
    cluster.procs.append(proc)  # killed at teardown whatever happens
    proc.wait(timeout)
    runs = [json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in range(np_)]
    return runs, torch.load(out.with_suffix(".pt"))


def one_process(opt_name: str, steps: int, log: list, scheduler: str | None = None):
    """The same training in one process, with the same freezes and optimizer."""
    return one_process_with_freezing("chain", steps, log, OPTIMIZERS[opt_name],
                                     SCHEDULERS.get(scheduler))


@pytest.mark.mpi
@pytest.mark.parametrize("opt_name, np_, replicas, cuts", [
    ("adam", 2, "", "3"),   # planned x..body_3 | body_4..head: body_2 goes to rank 1
    ("sgd", 3, "", "3,7"),  # x..body_2 | body_3 | body_4..head: body_2 and body_4 to rank 1
])
def test_a_migration_moves_parameters_and_optimizer_state_bit_exactly(
        tmp_path, cluster, opt_name, np_, replicas, cuts):
    """The whole model's parameters and optimizer state (gathered from their owners)
    hash the same before and after the stages moved, every rank agrees, and training
    goes on to the weights of one uninterrupted process."""
    runs, state = run_job(tmp_path, cluster, np_, "migrate", opt_name, "6", replicas, cuts)
    before, after = runs[0]["hashes"]
    assert before == after
    assert all(r["hashes"] == [before, after] for r in runs)
    half = 3  # after the first 3 steps, before and after the forced move
    assert any(r["stages"][half] != r["stages"][half + 1] for r in runs), "nothing moved"
    losses, module = one_process(opt_name, 6, [])
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)


@pytest.mark.mpi
@pytest.mark.parametrize("opt_name, np_, cuts, before, after", [
    # tokens..mix_1_0 | mix_1_1..head, then tokens..mix_2_0 | mix_2_1 + head
    ("sgd", 2, "7", [0, 1], [0, 1]),
    # tokens..mix_0_1 | mix_1_0 | mix_1_1..head, then tokens | embed..mix_0_1 | mix_1_0..
    # head: rank 1 holds a copy of the tied weight it never trained, rank 0 none
    ("adam", 3, "1,4", [0, 2], [1, 2]),
])
def test_a_migration_keeps_tied_copies_equal(tmp_path, cluster, opt_name, np_, cuts,
                                             before, after):
    """A language model whose head is tied to its embedding, on different stages: a
    forced re-partition moves the stages (and with them the ranks holding a copy);
    the copies and their optimizer state stay the same (hashes before and after on
    every rank), and training goes on to the weights of one uninterrupted process."""
    runs, state = run_job(tmp_path, cluster, np_, "migrate", opt_name, "6", "", cuts,
                          env={"JOB_MODEL": "tied_lm"})
    assert runs[0]["tied"] == [before, after]
    first, second = runs[0]["hashes"]
    assert first == second and all(r["hashes"] == [first, second] for r in runs)
    losses, module = one_process_with_freezing("tied_lm", 6, [], OPTIMIZERS[opt_name])
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)
    assert torch.equal(state["embed.weight"], state["head.weight"])


@pytest.mark.mpi
@pytest.mark.parametrize("opt_name, np_, replicas, every_threshold, scheduler, signal", [
    ("sgd", 2, "", "2,0.02", None, ""),     # freezes body_0, then body_2, then body_4 + body_6
    ("adam", 3, "2,1", "3,0.3", None, ""),  # on this data: body_0, body_2 + body_4, body_6
    ("sgd", 2, "", "2,0.02", "exp", ""),    # the learning rate decays by 0.9 a step
    # the weights' move judges (it grows on this data: one decision, body_0 + body_2)
    ("sgd", 2, "", "2,0.0025", None, "weight-drift"),
])
def test_training_across_a_repartition_equals_one_process_with_the_same_freezes(
        tmp_path, cluster, opt_name, np_, replicas, every_threshold, scheduler, signal):
    """Freeze decisions and re-plans are the same on every rank (with stage 0 on two
    replicas, its ranks see different halves of each micro-batch); a re-plan moves a
    layer that still trains (so its optimizer state moves); and the weights equal one
    process that froze the same layers after the same steps (with an LR schedule:
    a re-plan's new optimizer goes on at the decayed rate, not the factory's)."""
    steps = 20
    runs, state = run_job(tmp_path, cluster, np_, "freeze", opt_name, str(steps), replicas,
                          every_threshold, env={"JOB_SCHEDULER": scheduler or "",
                                                "JOB_SIGNAL": signal})
    log, replans = runs[0]["log"], runs[0]["repartitions"]
    assert len(log) >= (1 if signal else 2), f"froze in too few decisions, {log}"
    assert replans, "no re-partition happened: the test would prove nothing"
    assert all(r["log"] == log and r["repartitions"] == replans for r in runs), \
        [(r["log"], r["repartitions"]) for r in runs]
    moved_training = []
    for k, _plan in replans:  # re-planned at the end of step k (1-based)
        frozen = {n for step, layers in log if step <= k - 1 for n in layers}
        for r in runs:
            came = set(r["stages"][k]) - set(r["stages"][k - 1])
            moved_training += [n for n in came if n in PARAM_OPS and n not in frozen]
    assert moved_training, "no re-plan moved a layer that still trains"
    losses, module = one_process(opt_name, steps, log, scheduler)
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)


@pytest.mark.mpi
@pytest.mark.parametrize("mode, opt_name, np_, replicas, every_threshold, layout", [
    ("cache", "sgd", 2, "", "2,0.02", [1]),  # the rest is too small to share: 1 spare
    ("cache_heavy", "sgd", 2, "", "2,0.02", [2]),  # both ranks replicate the rest
    ("cache", "adam", 3, "2,1", "3,0.3", [1]),
    ("cache_heavy", "adam", 3, "2,1", "3,0.3", [2]),  # 2 replicas divide micro-batches of 2
])
def test_a_cut_off_frozen_front_fed_from_its_cache_equals_one_process(
        tmp_path, cluster, mode, opt_name, np_, replicas, every_threshold, layout):
    """With cache_frozen the frozen front stops running: the rest is re-planned over
    the ranks (onto data-parallel replicas the start did not have where compute
    dominates; leaving ranks spare where it is too small to share), fed from the
    per-sample cache, and the weights still equal one process that froze the same
    layers after the same steps; the cache was filled once, then only read."""
    steps = 20
    runs, state = run_job(tmp_path, cluster, np_, mode, opt_name, str(steps), replicas,
                          every_threshold)
    log, replans = runs[0]["log"], runs[0]["repartitions"]
    assert len(log) >= 2, f"froze in fewer than two decisions, {log}: too little to prove"
    assert replans, "no re-partition happened: the test would prove nothing"
    assert all(r["log"] == log and r["repartitions"] == replans for r in runs)
    assert runs[0]["layouts"][-1] == layout, runs[0]["layouts"]
    spare = [r for r in range(np_) if not runs[r]["stages"][-1]]
    assert spare == list(range(sum(layout), np_)), spare
    feeders = [r["cache"] for r in runs if r["cache"] and r["cache"][0]]
    assert feeders, [r["cache"] for r in runs]
    last_cut = replans[-1][0]  # each cut starts a new cache: count the last one's
    for hits, misses in feeders:  # 8 samples, computed in the first step, then read
        assert (hits, misses) == (8 * (steps - last_cut - 1), 8), (hits, misses, last_cut)
    losses, module = one_process(opt_name, steps, log)
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)


@pytest.mark.mpi
def test_a_rank_the_cut_leaves_out_takes_no_device_slot(tmp_path, cluster):
    """With slots, the rank that the re-plan after the cut leaves out holds its device
    no more (the daemon can give it to other jobs), the other rank holds for the rest
    of the steps, and the weights still equal one process."""
    steps, traces = 20, tmp_path / "traces"
    with cluster.daemon():
        runs, state = run_job(tmp_path, cluster, 2, "cache_slots", "sgd", str(steps), "",
                              "2,0.02", env={"CROSSOVER_ENABLE": "1", "CROSSOVER_JOB": "fz",
                                             "CROSSOVER_TRACE": str(traces),
                                             "CROSSOVER_KEEP_WHEN_ALONE": "0"})
    layouts = runs[0]["layouts"]
    assert layouts[-1] == [1], layouts
    cut = next(i for i, lay in enumerate(layouts) if lay == [1]) + 1  # after that step
    spans = [[e["name"] for e in load(traces / f"fz.rank{r}.json") if e["ph"] == "X"]
             for r in range(2)]
    holds = [names.count("hold") for names in spans]
    assert spans[1][-1] != "hold", "the spare rank kept its device after the cut"
    # a step holds each device once per forward and once per backward of each of
    # its 4 micro-batches, and once at its end (the optimizer step), at most
    assert 0 < holds[1] <= 9 * cut, (holds, cut)
    assert holds[0] >= 4 * (steps - cut), (holds, cut)
    losses, module = one_process("sgd", steps, runs[0]["log"])
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)


def one_process_micro_batches(steps: int, micro: int = 4):
    """BatchNormChain trained in one process the way a pipeline computes it: batch
    norm sees one micro-batch at a time (statistics and running averages per
    micro-batch, in order), gradients accumulate over the micro-batches."""
    torch.manual_seed(0)
    model = BatchNormChain().double()
    spec = build("chain", torch.float64, small=True)
    x, y = spec.make_batch(8, 7)
    opt = OPTIMIZERS["sgd"](list(model.parameters()))
    rows, losses = 8 // micro, []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            part = slice(m * rows, (m + 1) * rows)
            loss = spec.loss(model(x["x"][part]), y[part]) / micro
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model


@pytest.mark.mpi
def test_running_statistics_move_with_their_stage(tmp_path, cluster):
    """A forced re-partition moves a batch norm layer to the other rank: its running
    mean and variance go with it (the gathered state, buffers included, hashes the
    same before and after), and training goes on to the parameters and running
    statistics of one process that runs the same micro-batches."""
    runs, state = run_job(tmp_path, cluster, 2, "migrate_bn", "sgd", "6", "", "6")
    before, after = runs[0]["hashes"]
    assert before == after and all(r["hashes"] == [before, after] for r in runs)
    assert any(r["stages"][3] != r["stages"][4] for r in runs), "nothing moved"
    moved = {o for r in runs for o in set(r["stages"][4]) - set(r["stages"][3])}
    assert moved & {"layers_1", "layers_4"}, f"no batch norm moved: {moved}"
    losses, module = one_process_micro_batches(6)
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert not torch.equal(state["layers.4.running_mean"], torch.zeros(32, dtype=torch.float64))
    assert_close(state, module)


# One rank cannot migrate (a sparse tensor to send), or one rank never comes: every rank
# that migrates ends with the same error, none waits for ever.
FAILING = """
import sys, torch
from mpi4py import MPI
from crossover.pipeline.migrate import migrate

comm, case = MPI.COMM_WORLD, sys.argv[1]
rank = comm.Get_rank()
if case == "sparse":  # rank 0 sends w (sparse), rank 1 sends v
    params = {"w": torch.zeros(3, dtype=torch.float64).to_sparse(), "v": torch.ones(2)}
    try:
        migrate(params, {}, {"w": [0], "v": [1]}, {"w": [1], "v": [0]}, comm, timeout=30)
    except ValueError as exc:
        print(f"rank {rank} refused: {exc}", flush=True)
    comm.Barrier()  # the ranks go on together: the failure left MPI usable
    print(f"rank {rank} went on", flush=True)
elif rank == 0:  # "absent": rank 1 never migrates
    try:
        migrate({"w": torch.ones(2)}, {}, {"w": [1]}, {"w": [0]}, comm, timeout=1)
    except TimeoutError as exc:
        print(f"rank {rank} timed out: {exc}", flush=True)
"""


def run_failing(tmp_path, cluster, how: str) -> str:
    """FAILING under mpirun on 2 ranks, failing `how`; returns its output."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    proc = Proc(mpirun(2, PY, str(script), how), {**cluster.env, "CROSSOVER_ENABLE": "0"},
                tmp_path / f"{how}.log")
    cluster.procs.append(proc)
    return proc.wait(90)


@pytest.mark.mpi
def test_a_migration_one_rank_cannot_send_fails_on_every_rank(tmp_path, cluster):
    out = run_failing(tmp_path, cluster, "sparse")
    for rank in (0, 1):
        assert f"rank {rank} refused: migrating stage parameters failed on rank 0: " \
               "ValueError: a sparse tensor cannot be migrated byte for byte" in out, out
        assert f"rank {rank} went on" in out, out


@pytest.mark.mpi
def test_a_migration_a_rank_never_joins_times_out_naming_the_wait(tmp_path, cluster):
    out = run_failing(tmp_path, cluster, "absent")
    assert "rank 0 timed out: migrating stage parameters: every rank's ok or error: " \
           "not done in 1 s" in out, out
