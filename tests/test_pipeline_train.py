"""The pipeline training API: pipelined training equals one process, step by step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from crossover.pipeline.models import build
from tests.conftest import PY, Proc, mpirun

pytestmark = pytest.mark.mpi

# Every rank builds the same model and batches; each feeds only what its stage needs.
JOB = """
import json, sys
import torch
from crossover.pipeline.models import build
from crossover.pipeline.ties import tied_copies
from crossover.pipeline.train import PipelineTrainer

name, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
resume = (sys.argv[4] if len(sys.argv) > 4 else "") or None
momentum = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
torch.set_num_threads(1)
spec = build(name, torch.float64, small=True)
batches = [spec.make_batch(8, 100 + s) for s in range(steps)]
t = PipelineTrainer(spec.module, spec.loss, batch=8, num_micro=4, example=batches[0][0],
                    timeout=60)
if resume:
    t.load_state_dict(torch.load(resume))
opt = torch.optim.SGD(t.parameters(), lr=0.05, momentum=momentum)
losses = []
first = int(resume is not None) * 3
for x, y in batches[first:]:
    opt.zero_grad()
    losses.append(t.step(x if t.needs_inputs else None, y if t.needs_target else None))
    opt.step()
state = t.state_dict()
tied = tied_copies(t.graph, t.plan)
params = t.graph.parameters()
# each rank's copy of every tied parameter it holds: the copies must be equal
copies = t.comm.gather({n: params[n].detach().clone() for n, ranks in tied.items()
                        if t.comm.Get_rank() in ranks})
if t.comm.Get_rank() == 0:
    torch.save(state, out + ".pt")
    spread = {n: max(float((c[n] - params[n]).abs().max()) for c in copies if n in c)
              for n in tied}
    json.dump({"losses": losses, "stages": len(t.plan.stages), "tied": tied,
               "copy_spread": spread},
              open(out + ".json", "w"))
"""


def one_process(name: str, steps: int, momentum: float = 0.0):
    spec = build(name, torch.float64, small=True)
    opt = torch.optim.SGD(spec.module.parameters(), lr=0.05, momentum=momentum)
    losses = []
    for s in range(steps):
        x, y = spec.make_batch(8, 100 + s)
        opt.zero_grad()
        loss = spec.loss(spec.module(**x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, spec.module


def train(tmp_path, cluster, name, np_, steps, *extra, tag="run"):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / tag
    env = dict(cluster.env, CROSSOVER_ENABLE="0")
    proc = Proc(mpirun(np_, PY, str(script), name, str(steps), str(out), *extra), env,
                tmp_path / f"{tag}.log")
    cluster.procs.append(proc)  # killed at teardown whatever happens
    proc.wait(180)
    return json.loads(out.with_suffix(".json").read_text()), torch.load(out.with_suffix(".pt"))


def assert_close(state, module, rel=1e-12):
    ref = module.state_dict()
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        err = (state[k] - v).abs().max() / max(v.abs().max(), 1e-300)
        assert err <= rel, f"{k}: relative error {float(err)}"


@pytest.mark.parametrize("name, np_", [("chain", 2), ("two_tower", 3)])
def test_pipelined_training_equals_one_process_step_by_step(tmp_path, cluster, name, np_):
    got, state = train(tmp_path, cluster, name, np_, 5, "", "0.9")
    losses, module = one_process(name, 5, momentum=0.9)
    assert got["stages"] == np_
    assert got["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)  # the gathered checkpoint loads into the plain model
    module.load_state_dict(state)


@pytest.mark.parametrize("np_", [2, 3])
def test_tied_weights_across_stages_train_like_one_process(tmp_path, cluster, np_):
    """A language model whose head is tied to its embedding (`head.weight =
    embed.weight`), with plain SGD with momentum over `trainer.parameters()` on every
    rank: the embedding and the head land on the first and the last stage, each holds a
    copy, and the copies' summed gradients keep them bit-equal and equal to one
    process's weight (without the sum each copy would take only its own op's part)."""
    got, state = train(tmp_path, cluster, "tied_lm", np_, 5, "", "0.9")
    losses, module = one_process("tied_lm", 5, momentum=0.9)
    assert got["stages"] == np_
    assert got["tied"] == {"embed.weight": [0, np_ - 1]}
    assert got["copy_spread"] == {"embed.weight": 0.0}
    assert got["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(state, module)
    assert torch.equal(state["embed.weight"], state["head.weight"])  # one parameter


# 3 ranks for two Linears and a ReLU: the ReLU's stage holds no parameters
EMPTY_JOB = """
import json, sys, warnings
import torch
from torch import nn
from crossover.pipeline.train import PipelineTrainer

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g,
                                                                     dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = PipelineTrainer(model, nn.functional.mse_loss, batch=8, num_micro=4,
                        example={"input_1": x})
opt = torch.optim.SGD(t.parameters(), lr=0.1) if t.has_parameters else None
for _ in range(3):
    if opt:
        opt.zero_grad()
    t.step({"input_1": x} if t.needs_inputs else None, y if t.needs_target else None)
    if opt:
        opt.step()
state = t.state_dict()
rank = t.comm.Get_rank()
json.dump({"warnings": [str(w.message) for w in caught], "has": t.has_parameters,
           "stage": t.stage}, open(f"{sys.argv[1]}.rank{rank}.json", "w"))
if rank == 0:
    torch.save(state, sys.argv[1] + ".pt")
"""


def test_a_stage_without_parameters_is_named_on_every_rank_and_trains_on(tmp_path, cluster):
    """Two Linears and a ReLU on 3 ranks: nothing else fits, so the ReLU gets a stage of
    its own; every rank is warned at construction (which stage, why, the fix), the
    optimizer is built where `has_parameters`, and training equals one process."""
    script = tmp_path / "job.py"
    script.write_text(EMPTY_JOB)
    out = tmp_path / "run"
    proc = Proc(mpirun(3, PY, str(script), str(out)), dict(cluster.env, CROSSOVER_ENABLE="0"),
                tmp_path / "empty.log")
    cluster.procs.append(proc)
    proc.wait(120)
    runs = [json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in range(3)]
    assert [r["has"] for r in runs] == [True, False, True]
    for r in runs:
        assert len(r["warnings"]) == 1, r
        assert "stage 1 (ranks [1]: _1) holds no parameters: the model has 2 ops with " \
               "parameters for 3 ranks" in r["warnings"][0]
        assert "build your optimizer only where trainer.has_parameters" in r["warnings"][0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 2)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 2, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert_close(torch.load(out.with_suffix(".pt")), model)


def test_a_checkpoint_resumes_training(tmp_path, cluster):
    train(tmp_path, cluster, "chain", 2, 3, tag="first")
    got, state = train(tmp_path, cluster, "chain", 2, 5, str(tmp_path / "first.pt"),
                       tag="second")
    losses, module = one_process("chain", 5)
    assert got["losses"] == pytest.approx(losses[3:], rel=1e-12)
    assert_close(state, module)


def test_the_digits_example_learns(tmp_path, cluster):
    png = tmp_path / "digits.png"
    proc = Proc(mpirun(2, PY, "examples/pipeline_digits.py", "--epochs", "5", "--plot",
                       str(png)), dict(cluster.env, CROSSOVER_ENABLE="0"),
                tmp_path / "digits.log")
    cluster.procs.append(proc)
    out = proc.wait(240)
    acc = float(out.split("final test accuracy ")[1].split(";")[0])
    assert acc > 0.85, out[-2000:]
    assert png.stat().st_size > 10_000


def test_the_digits_example_freezes_and_cuts_the_front_off(tmp_path, cluster):
    """The benchmark's path end to end: layers freeze, the frozen front is cut off and
    cached, the rest re-planned (here onto 2 replicas), and the head goes on learning."""
    history = tmp_path / "h.json"
    proc = Proc(mpirun(2, PY, "examples/pipeline_digits.py", "--epochs", "6", "--depth", "3",
                       "--width", "128", "--lr", "0.05", "--freeze-every", "10",
                       "--freeze-threshold", "0.5", "--repartition", "--cache", "--plot",
                       str(tmp_path / "d.png"), "--history", str(history)),
                dict(cluster.env, CROSSOVER_ENABLE="0"), tmp_path / "digits.log")
    cluster.procs.append(proc)
    out = proc.wait(240)
    last = json.loads(history.read_text())[-1]
    assert last["frozen"] == ["layers_0", "layers_2", "layers_4"], out[-2000:]
    assert last["repartitions"] == 1 and "0:layers_5+layers_6x2" in out, out[-2000:]
    assert last["accuracy"] > 0.6, last
    # when the cut took effect, on the wall clock (bench/freeze/neighbour.py's windows)
    rows = json.loads(history.read_text())
    cuts = [(t, r) for r in rows for t in r["repartition_walls"]]
    assert len(cuts) == 1, rows
    assert cuts[0][1]["wall_start"] < cuts[0][0] < cuts[0][1]["wall_end"], cuts


def _digits_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_digits",
                                                  "examples/pipeline_digits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pipeline_digits"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def body_cache(tmp_path_factory):
    """One cache for the fine-tuning tests: the body (about 40 s to make) is made by
    whichever runs first and read by the other."""
    return tmp_path_factory.mktemp("xdg-cache")


def test_the_pretrained_body_transfers_to_the_new_digits(body_cache, monkeypatch):
    """The fine-tuning workload's premise, in one process: the body pretrained on drawn
    stroke glyphs (made here into an empty cache, then read from it) with a new head
    learns the digits 5-9 faster than the same model from random weights."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(body_cache))
    ex = _digits_example()
    # MPI initialised in this process would make every later mpirun of the suite fail
    assert "mpi4py.MPI" not in sys.modules
    torch.set_num_threads(1)
    body = ex.pretrained_body(6, 256)  # narrower, deep bodies do not learn 1000 glyphs
    assert len(list((body_cache / "crossover").glob("strokes-mlp-6x256-*.pt"))) == 1
    again = ex.pretrained_body(6, 256)
    assert all(torch.equal(body[k], again[k]) for k in body)
    assert "layers.12.weight" not in body  # the glyphs' head is not part of the body
    glyphs, classes = ex.stroke_glyphs(50, 2)
    assert glyphs.shape == (100, 64) and 0 <= glyphs.min() and glyphs.max() <= 1
    assert torch.equal(classes[:50], classes[50:]) and torch.equal(glyphs,
                                                                   ex.stroke_glyphs(50, 2)[0])
    xs, ys, xt, yt = ex.digits_of(ex.FINETUNE)
    assert set(ys.tolist()) == set(ex.FINETUNE) and len(xs) + len(xt) > 800

    def accuracy_after_two_epochs(pretrained: bool) -> float:
        torch.manual_seed(0)
        model = ex.MLP(6, 256)
        fresh_head = model.layers[-1].weight.detach().clone()
        if pretrained:
            ex.with_new_head(model, body)
            assert torch.equal(model.layers[-1].weight, fresh_head)  # the head stays new
            assert torch.equal(model.layers[0].weight, body["layers.0.weight"])
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for epoch in range(2):
            ex.train_epoch(model, opt, xs, ys, seed=epoch)
        return ex.accuracy(model, xt, yt)

    tuned, untrained = accuracy_after_two_epochs(True), accuracy_after_two_epochs(False)
    assert tuned > untrained + 0.2, (tuned, untrained)


def test_the_glyph_task_is_new_glyphs_with_a_large_test_set():
    """The glyph fine-tuning task: 50 classes, 100 images of each to train on and 100
    others to test (a test image is 0.02 points), none of them a pretraining glyph."""
    ex = _digits_example()
    xs, ys, xt, yt = ex.new_glyphs()
    assert xs.shape == xt.shape == (5000, 64)
    assert torch.bincount(ys).tolist() == torch.bincount(yt).tolist() == [100] * 50
    assert not torch.equal(xs[:50], xt[:50])  # other turns, scales, moves and noise
    # no glyph class is drawn as one of the pretraining classes is
    new = ex.glyph_drawings(ex.GLYPH_CLASSES, torch.Generator().manual_seed(ex.GLYPH_SEED))
    old = ex.glyph_drawings(ex.PRETRAIN_CLASSES,
                            torch.Generator().manual_seed(ex.PRETRAIN_SEED))
    assert torch.cdist(new.view(-1, 64), old.view(-1, 64)).min() > 0.5


# the bare flag fine-tunes on the digits 5-9, as the freezing benchmarks run it; the
# glyphs take two epochs: after one, accuracy sits at the floor and moves with the CPU's
# vector instructions (0.682 on a Zen 3 without AVX-512; 0.809 after two)
@pytest.mark.parametrize("task,epochs,floor", [([], 3, 0.85), (["glyphs"], 2, 0.7)])
def test_the_digits_example_fine_tunes(tmp_path, body_cache, cluster, task, epochs, floor):
    proc = Proc(mpirun(2, PY, "examples/pipeline_digits.py", "--finetune", *task, "--depth",
                       "6", "--lr", "0.05", "--epochs", str(epochs), "--plot",
                       str(tmp_path / "f.png")),
                dict(cluster.env, CROSSOVER_ENABLE="0", XDG_CACHE_HOME=str(body_cache)),
                tmp_path / "finetune.log")
    cluster.procs.append(proc)
    out = proc.wait(240)
    assert float(out.split("final test accuracy ")[1].split(";")[0]) > floor, out[-2000:]
    assert list((body_cache / "crossover").glob("strokes-mlp-6x256-pretrained-*.pt"))


def two_ranks(tmp_path, cluster, name: str, code: str) -> tuple[str, str]:
    """`code` as a script on 2 ranks under mpirun (crossover off), within 120 s; what
    its `say(text)` calls wrote (rank 0's lines, then rank 1's) and the run's output.
    Each rank says into its own file: mpirun forwards the ranks' stdout as it reads it,
    so two ranks' prints can interleave mid-line."""
    script = tmp_path / f"{name}.py"
    said = tmp_path / f"{name}.said"
    script.write_text(
        "import os\n"
        f"_said = open({str(said)!r} + os.environ['OMPI_COMM_WORLD_RANK'], 'w')\n"
        "def say(text):\n"
        "    _said.write(text + '\\n')\n"
        "    _said.flush()\n" + code)
    proc = Proc(mpirun(2, PY, str(script)), dict(cluster.env, CROSSOVER_ENABLE="0"),
                tmp_path / f"{name}.log")
    cluster.procs.append(proc)
    out = proc.wait(120)
    return "".join(Path(f"{said}{rank}").read_text() for rank in range(2)), out


def test_a_planning_error_on_rank_0_reaches_every_rank(tmp_path, cluster):
    """Rank 0 plans; if it fails (here: inputs named unlike the model's forward), every
    rank raises the reason instead of waiting for a plan that never comes."""
    said, out = two_ranks(tmp_path, cluster, "bad",
        "import sys, torch\n"
        "from crossover.pipeline.models import build\n"
        "from crossover.pipeline.train import PipelineTrainer\n"
        "spec = build('chain', torch.float64, small=True)\n"
        "x, y = spec.make_batch(8, 1)\n"
        "try:\n"
        "    PipelineTrainer(spec.module, spec.loss, batch=8, example={'pixels': x['x']})\n"
        "except ValueError as exc:\n"
        "    say(f'refused: {exc}')\n")
    assert said.count("planning on rank 0 failed: the inputs are named ['pixels'] but the "
                      "model's traced forward takes ['x']: name them so") == 2, said + out


def test_a_bug_in_rank_0s_planning_ends_every_rank(tmp_path, cluster):
    """An error rank 0's planning was not written to expect (here an AttributeError)
    is raised there with its traceback, and the other ranks raise it by name instead
    of waiting in the broadcast for ever."""
    said, out = two_ranks(tmp_path, cluster, "bug",
        "from mpi4py import MPI\n"
        "from crossover.pipeline.waits import from_rank_0\n"
        "try:\n"
        "    from_rank_0(MPI.COMM_WORLD, 'planning', lambda: None.kind)\n"
        "except AttributeError as exc:\n"
        "    say(f'rank 0 raised {exc}')\n"
        "except ValueError as exc:\n"
        "    say(f'told: {exc}')\n")
    assert said == ("rank 0 raised 'NoneType' object has no attribute 'kind'\n"
                    "told: planning on rank 0 failed: AttributeError: 'NoneType' object "
                    "has no attribute 'kind'\n"), said + out


FREEZE_JOB = """
import json, sys
import torch
from crossover.pipeline.models import build
from crossover.pipeline.train import PipelineTrainer

name, steps, out, replicas = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
signal, gate = (sys.argv[5], float(sys.argv[6])) if len(sys.argv) > 5 else ("gradient", None)
torch.set_num_threads(1)
spec = build(name, torch.float64, small=True)
x, y = spec.make_batch(8, 7)  # one batch again and again: gradients settle
t = PipelineTrainer(spec.module, spec.loss, batch=8, num_micro=4, example=x,
                    replicas=[int(r) for r in replicas.split(",")] if replicas else None,
                    freeze_every=2, freeze_threshold=0.3, freeze_patience=1,
                    freeze_signal=signal, freeze_loss_gate=gate)
opt = torch.optim.SGD(t.parameters(), lr=0.05, momentum=0.9)
losses = []
for _ in range(steps):
    opt.zero_grad()
    losses.append(t.step(x if t.needs_inputs else None, y if t.needs_target else None))
    opt.step()
state = t.state_dict()
rank = t.comm.Get_rank()
log = [[d.step, list(d.layers)] for d in t.freeze_log]
json.dump({"log": log, "losses": losses, "frozen_stages": sorted(t.runner.frozen_stages())},
          open(f"{out}.rank{rank}.json", "w"))
if rank == 0:
    torch.save(state, out + ".pt")
"""


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def one_process_with_freezing(name: str, steps: int, log: list, optimizer=sgd,
                              scheduler=None):
    """The same training in one process, freezing the same layers after the same steps
    (a frozen layer's gradient is dropped before that step's update), the scheduler
    (a factory) stepped after every update."""
    from crossover.pipeline.graph import Graph

    spec = build(name, torch.float64, small=True)
    graph = Graph.from_fx(spec.module)
    opt = optimizer(list(spec.module.parameters()))
    sched = scheduler(opt) if scheduler else None
    x, y = spec.make_batch(8, 7)
    freezes = {step: layers for step, layers in log}
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = spec.loss(spec.module(**x), y)
        loss.backward()
        for layer in freezes.get(s, []):
            for p in graph.ops[layer].params.values():
                p.requires_grad_(False)
                p.grad = None
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses, spec.module


@pytest.mark.parametrize("np_, replicas, signal", [
    (2, "", ()), (3, "2,1", ()),
    # the weights' drift, held back by a loss gate (checked below)
    (2, "", ("weight-drift", "0.9")), (3, "2,1", ("weight-drift", "0.9")),
])
def test_training_with_freezing_equals_one_process_with_the_same_freezes(
        tmp_path, cluster, np_, replicas, signal):
    """Freezing decisions are the same on every rank (with stage 0 on 2 replicas, its
    ranks see different halves of each micro-batch), and the pipelined run equals one
    process that freezes the same layers after the same steps, to 1e-12."""
    script = tmp_path / "freeze.py"
    script.write_text(FREEZE_JOB)
    out = tmp_path / "f"
    proc = Proc(mpirun(np_, PY, str(script), "chain", "16", str(out), replicas, *signal),
                dict(cluster.env, CROSSOVER_ENABLE="0"), tmp_path / "freeze.log")
    cluster.procs.append(proc)
    proc.wait(180)
    runs = [json.loads((tmp_path / f"f.rank{r}.json").read_text()) for r in range(np_)]
    log = runs[0]["log"]
    assert log, "nothing froze: the test would prove nothing"
    assert all(run["log"] == log for run in runs), [run["log"] for run in runs]
    # the first stage froze whole: from then on it ran no backward and was sent no
    # gradients, and the numbers did not change
    assert all(run["frozen_stages"] == [0] for run in runs), [r["frozen_stages"] for r in runs]
    losses, module = one_process_with_freezing("chain", 16, log)
    assert runs[0]["losses"] == pytest.approx(losses, rel=1e-12)
    assert_close(torch.load(out.with_suffix(".pt")), module)
    if signal:  # nothing froze before an interval's mean loss fell to 0.9 of the first's
        means = [sum(runs[0]["losses"][i:i + 2]) / 2 for i in range(0, 16, 2)]
        opened = next(2 * k + 1 for k, m in enumerate(means) if m <= 0.9 * means[0])
        assert log[0][0] >= opened, (log, means)


SAMPLED_READS = """
import json, sys
import torch
from crossover.freeze import GradientTracker
from crossover.pipeline.models import build
from crossover.pipeline.train import PipelineTrainer

reads = []
accumulate = GradientTracker.accumulate
def counted(self):
    reads.append(t.steps)
    accumulate(self)
GradientTracker.accumulate = counted
spec = build("chain", torch.float64, small=True)
x, y = spec.make_batch(8, 7)
sample = None if sys.argv[2] == "default" else int(sys.argv[2])
t = PipelineTrainer(spec.module, spec.loss, batch=8, num_micro=4, example=x,
                    freeze_every=6, freeze_threshold=1e-12, freeze_sample_every=sample)
for _ in range(12):
    t.step(x if t.needs_inputs else None, y if t.needs_target else None)
json.dump(reads, open(f"{sys.argv[1]}.rank{t.comm.Get_rank()}.json", "w"))
"""


@pytest.mark.parametrize("sample, reads", [("3", [3, 6, 9, 12]), ("4", [4, 6, 10, 12]),
                                           ("default", list(range(1, 13)))])
def test_the_tracker_reads_the_sampled_steps_on_every_rank(tmp_path, cluster, sample, reads):
    script = tmp_path / "reads.py"
    script.write_text(SAMPLED_READS)
    out = tmp_path / "reads"
    proc = Proc(mpirun(2, PY, str(script), str(out), sample),
                dict(cluster.env, CROSSOVER_ENABLE="0"), tmp_path / "reads.log")
    cluster.procs.append(proc)
    proc.wait(120)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"reads.rank{rank}.json").read_text()) == reads


@pytest.mark.parametrize("kw, words", [
    ({"freeze_every": 0}, "freeze_every=0: give 1 or more steps"),
    ({"freeze_every": 10, "freeze_sample_every": 0}, "freeze_sample_every=0: give 1"),
    ({"freeze_every": 10, "freeze_sample_every": True}, "freeze_sample_every=True: give"),
    ({"freeze_every": 10, "freeze_sample_every": 2.5}, "freeze_sample_every=2.5: give"),
    ({"freeze_sample_every": 4}, "freeze_sample_every=4 samples .* pass freeze_every too"),
    ({"freeze_every": 5, "freeze_sample_every": 8},
     "freeze_sample_every=8 exceeds freeze_every=5: .* give at most 5"),
    ({"freeze_every": 5, "freeze_signal": "weights"},
     "freeze_signal='weights': give one of gradient, weight-drift"),
    ({"freeze_signal": "weight-drift"}, "freeze_signal='weight-drift' sets .* freeze_every"),
    ({"freeze_loss_gate": 0.2}, "freeze_loss_gate=0.2 sets the freezing .* freeze_every"),
    ({"freeze_every": 5, "freeze_loss_gate": "0.2"}, "freeze loss gate '0.2': give a share"),
    ({"freeze_every": 5, "freeze_loss_gate": 2}, r"freeze loss gate 2: .* \(0, 1\]"),
])
def test_bad_freezing_intervals_are_named_before_planning(kw, words):
    from crossover.pipeline.train import PipelineTrainer

    with pytest.raises(ValueError, match=words):
        PipelineTrainer(torch.nn.Linear(2, 2), torch.nn.functional.mse_loss, batch=4,
                        comm="unused", **kw)
