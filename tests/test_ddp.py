"""PyTorch DDP jobs under torchrun (gloo), 2 ranks each, share one daemon: each trains
the same weights as alone (CROSSOVER_ENABLE=0), with DDP's options and a Horovod job
beside it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from crossover import trace
from crossover.__main__ import status_table
from crossover.probe import daemon_status
from tests.conftest import (
    PY,
    REPO,
    TORCH_EXIT_ABORT,
    Cluster,
    Proc,
    assert_ran_together,
    held,
    same_weights,
    wait_for,
)

pytestmark = pytest.mark.mpi  # real processes

STEPS = 40
SCRIPT = str(REPO / "examples/ddp_mlp.py")
CASES = {
    "plain": (),
    "no_sync": ("--accumulate", "2"),
    "fp16_hook": ("--fp16-hook",),
    "find_unused": ("--find-unused",),
    "static_bucket_view": ("--static-graph", "--bucket-view"),
}


def ddp_job(c: Cluster, name: str, seed: int, extra: tuple[str, ...] = (),
            crossover: bool = True, script: str = SCRIPT) -> Proc:
    # every release shows in the trace, even while the job is alone on its devices
    env = dict(c.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(c.traces),
               CROSSOVER_KEEP_WHEN_ALONE="0", OMP_NUM_THREADS="1")
    if not crossover:
        env["CROSSOVER_ENABLE"] = "0"
    out = c.tmp / f"{name}.pt"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           script, "--seed", str(seed), "--steps", str(STEPS), "--out", str(out), *extra]
    proc = Proc(cmd, env, c.tmp / f"{name}.log", reference=not crossover)
    proc.weights = out
    c.procs.append(proc)
    return proc


def communicate_spans(c: Cluster, job: str, rank: int) -> int:
    return sum(1 for e in trace.load(c.traces / f"{job}.rank{rank}.json")
               if e.get("ph") == "X" and e["name"] == "communicate")


@pytest.mark.parametrize("case", CASES)
def test_two_ddp_jobs_share_devices_and_keep_their_math(tmp_path: Path, case: str):
    extra = CASES[case]
    c = Cluster(tmp_path)
    try:
        solo = [ddp_job(c, f"solo{seed}", seed, extra, crossover=False) for seed in (1, 2)]
        for proc in solo:  # side by side: without crossover they do not meet
            proc.wait(180)
        with c.daemon():
            together = c.start_args(2)
            jobs = [ddp_job(c, name, seed, (*extra, *together))
                    for name, seed in (("A", 1), ("B", 2))]
            for proc in jobs:
                proc.wait(180)
    finally:
        c.cleanup()
    for proc, alone in zip(jobs, solo, strict=True):
        assert same_weights(proc.weights, alone.weights), f"{case}: weights differ from solo"
        assert "uncoordinated" not in proc.output()
    # no rank ever waited on a collective while holding its device: that stalls the
    # other job until the lease takes the device back
    assert "lease" not in (tmp_path / "daemon.log").read_text()
    events = trace.merge(sorted(c.traces.glob("*.json")), tmp_path / "merged.json")
    assert len(trace.holds_by_device(events)) == 2, "expected two CPU devices"
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    for job in ("A", "B"):
        for rank in (0, 1):
            # one release per optimizer step, when its last bucket is handed over (no_sync
            # passes hand over none and keep the slot), and one before each of the first
            # two forwards (DDP may rebuild its buckets there, a collective)
            assert communicate_spans(c, job, rank) == STEPS + 2, (case, job, rank)


def test_lightning_ddp_jobs_share_devices_and_keep_their_math(tmp_path: Path):
    """Trainer(strategy="ddp") under torchrun with crossover's Lightning callback."""
    script = str(REPO / "examples/lightning_ddp_mlp.py")
    c = Cluster(tmp_path)
    try:
        solo = [ddp_job(c, f"solo{seed}", seed, crossover=False, script=script)
                for seed in (1, 2)]
        for proc in solo:
            proc.wait(240)
        with c.daemon():
            together = c.start_args(2)
            jobs = [ddp_job(c, name, seed, together, script=script)
                    for name, seed in (("A", 1), ("B", 2))]
            for proc in jobs:
                proc.wait(240)
    finally:
        c.cleanup()
    for proc, alone in zip(jobs, solo, strict=True):
        assert same_weights(proc.weights, alone.weights), "weights differ from solo"
    events = trace.merge(sorted(c.traces.glob("*.json")), tmp_path / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    for job in ("A", "B"):
        for rank in (0, 1):
            assert communicate_spans(c, job, rank) == STEPS + 2, (job, rank)


def test_a_ddp_job_and_a_horovod_job_share_one_daemon(tmp_path: Path):
    """One daemon, one device set, one global order: a torchrun DDP job beside an mpirun
    Horovod job."""
    c = Cluster(tmp_path)
    try:
        solo = ddp_job(c, "soloD", 1, crossover=False)
        solo_h = c.job("soloH", 2, STEPS, crossover=False)
        solo.wait(180)
        solo_h.wait(180)
        with c.daemon():
            together = c.start_args(2)
            ddp = ddp_job(c, "D", 1, together)
            hvd = c.job("H", 2, STEPS, extra=together)
            # `crossover status` shows both kinds alike: each job's ranks on each device
            seen: list[dict] = []

            def both_listed() -> bool:
                seen[:] = [daemon_status(c.runtime)]
                (snap,) = seen[0].values()
                ranks = {job: u["ranks"] for job, u in snap.get("job_usage", {}).items()}
                return ranks == {"D": 2, "H": 2} and len(snap["devices"]) == 2 and all(
                    set(dev["usage"]) == {"D", "H"} for dev in snap["devices"].values())

            wait_for(both_listed, 120, "both jobs in the daemon's status")
            table = status_table(seen[0])
            ddp.wait(180)
            hvd.wait(180)
            log = (tmp_path / "daemon.log").read_text()
    finally:
        c.cleanup()
    assert "D 2 ranks" in table and "H 2 ranks" in table, table
    assert same_weights(ddp.weights, solo.weights)
    assert same_weights(hvd.weights, solo_h.weights)
    # one daemon registered both (each in its place: its start and name)
    starts = dict(re.findall(r"job (\w+) rank \d on node \S+ -> \S+ \(started (\d+)\)", log))
    assert set(starts) == {"D", "H"}, log[-2000:]
    events = trace.merge(sorted(c.traces.glob("*.json")), tmp_path / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []


def test_wrap_refuses_what_it_cannot_serve():
    import torch

    import crossover.hooks.ddp as crossover_ddp

    with pytest.raises(TypeError, match="wrap DDP"):
        crossover_ddp.wrap(torch.nn.Linear(2, 2))


#: One rank, three models: which way each one's last bucket is found (stdout: JSON).
HOOK_PATHS = """
import json, os, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
import crossover.hooks.ddp as crossover_ddp
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0,
                        world_size=1)
def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
own = crossover_ddp.wrap(DDP(net()))
unused = crossover_ddp.wrap(DDP(net(), find_unused_parameters=True))
scripts = crossover_ddp.wrap(DDP(net()))
scripts.register_comm_hook(None, default_hooks.fp16_compress_hook)
for model in (own, unused, scripts):
    model(torch.randn(3, 4)).sum().backward()
print(json.dumps([[len(m._comm_hooks), m._crossover_hooks.counted is not None]
                  for m in (own, unused, scripts)]))
# torch's gloo group left to exit-time destructors aborts the process now and then
# ("terminate called without an active exception", 2 in 80 plain runs, no crossover)
dist.destroy_process_group()
"""


def test_without_a_hook_of_its_own_ddp_keeps_its_own_reduction(tmp_path: Path):
    """DDP folds the 1/world-size scaling into its copy of each gradient into its bucket
    only when no communication hook is registered: crossover registers none unless the
    script brings one or some gradients may never arrive (find_unused_parameters)."""
    env = {**os.environ, "STORE": str(tmp_path / "store"),
           "CROSSOVER_RUNTIME_DIR": str(tmp_path / "no-daemon")}
    res = subprocess.run([PY, "-c", HOOK_PATHS], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    own, unused, scripts = json.loads(res.stdout.splitlines()[-1])
    assert own == [0, True]  # counts gradient arrivals, DDP reduces
    assert unused == [1, False] and scripts == [1, False]  # a hook marks the last bucket


TUTORIAL = str(REPO / "examples/ddp_tutorial.py")
LAUNCHER = [PY, "-m", "crossover.launch.torchrun"]


def checksum(output: str) -> str:
    found = re.findall(r"weights checksum (\S+)", output)
    assert len(found) == 1, output[-3000:]
    return found[0]


def test_an_unmodified_ddp_script_runs_under_crossover_torchrun(runtime, tmp_path: Path):
    """The tutorial's script, no edit: crossover-torchrun injects the DDP adapter; two
    launches at once share one daemon. Each matches plain torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = ["--standalone", "--nproc-per-node", "2", TUTORIAL]
    # No start barrier in an unmodified script: both train several times longer than
    # their start-ups differ (the trace shows that they took turns).
    steps = {1: "2000", 2: "2000"}
    solo = {seed: checksum(subprocess.run(
        LAUNCHER + torchrun + ["--seed", str(seed), "--steps", steps[seed]], env=env,
        capture_output=True, text=True, timeout=240, cwd=REPO).stdout) for seed in (1, 2)}
    assert not (runtime / "daemon.pid").exists(), "without --crossover no daemon starts"
    traces = tmp_path / "traces"
    common = ["--crossover", "--crossover-policy", "crossover", "--crossover-trace",
              str(traces), "--crossover-idle-shutdown", "180"]
    procs = [subprocess.Popen(LAUNCHER + common + ["--crossover-job", name, *torchrun,
                                                   "--seed", str(seed), "--steps", steps[seed]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO)
             for name, seed in (("one", 1), ("two", 2))]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
        assert "uncoordinated" not in err
    assert sum("started a crossover daemon" in err for _, err in outs) == 1
    assert [checksum(out) for out, _ in outs] == [solo[1], solo[2]]
    assert sum("started a crossover daemon" in err for _, err in outs) == 1
    events = trace.merge([traces / "one.trace.json", traces / "two.trace.json"],
                         tmp_path / "merged.json")
    assert {s[2] for spans in trace.holds_by_device(events).values() for s in spans} == \
        {"one", "two"}
    assert_ran_together(events)
    assert trace.overlaps(events) == []


def test_crossover_torchrun_refuses_what_it_cannot_serve(runtime):
    res = subprocess.run(LAUNCHER + ["--crossover", "--nnodes", "2", "--rdzv-endpoint",
                                     "localhost:29400", TUTORIAL], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "--nnodes 2" in res.stderr, res.stderr
    assert "daemon world" in res.stderr and not (runtime / "daemon.pid").exists()
    res = subprocess.run(LAUNCHER + ["--crossover", "--jobs", "x.yaml"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "crossoverrun --jobs" in res.stderr, res.stderr
    res = subprocess.run(LAUNCHER + ["--help"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert res.returncode == 0 and "--crossover-policy" in res.stdout
    assert "--nproc-per-node" in res.stdout and not (runtime / "daemon.pid").exists()


def registered(c: Cluster, job: str):
    log = c.tmp / "daemon.log"
    return lambda: log.exists() and len(re.findall(rf"job {job} rank \d+ on node",
                                                   log.read_text())) >= 2


def test_a_killed_ddp_job_frees_its_slots_and_the_other_finishes(tmp_path: Path):
    long = ("--steps", "600")
    c = Cluster(tmp_path)
    try:
        solo = ddp_job(c, "soloB", 2, long, crossover=False)
        solo.wait(180)
        with c.daemon():
            doomed = ddp_job(c, "A", 1, ("--steps", "100000"))
            wait_for(registered(c, "A"), 120, "job A to register")
            survivor = ddp_job(c, "B", 2, long)
            wait_for(held(c.runtime, "B"), 120, "job B to hold a device")
            doomed.kill(signal.SIGKILL)
            # freed when A's sockets closed (at once), not when its 30 s lease ran out
            wait_for(lambda: "job A rank 0 left node" in (tmp_path / "daemon.log").read_text(),
                     10, "the daemon to see job A's rank 0 leave")
            survivor.wait(180)
            log = (tmp_path / "daemon.log").read_text()
    finally:
        c.cleanup()
    assert not re.search(r"job A rank \d held \S+ past its", log), log[-3000:]
    assert same_weights(survivor.weights, solo.weights)


def test_ddp_ranks_train_on_without_the_daemon_and_come_back_to_a_new_one(tmp_path: Path):
    long = ("--steps", "2500")  # outlasts a daemon restart
    c = Cluster(tmp_path)
    try:
        solo = ddp_job(c, "soloB", 2, long, crossover=False)
        solo.wait(180)
        with c.daemon() as daemon:
            together = c.start_args(2)
            a = ddp_job(c, "A", 1, ("--steps", "100000", *together))
            b = ddp_job(c, "B", 2, (*long, *together))
            for job in ("A", "B"):
                wait_for(registered(c, job), 120, f"job {job} to register")
            daemon.kill(signal.SIGKILL)
        with c.daemon():  # a fresh daemon on the same runtime directory
            for job in ("A", "B"):
                wait_for(registered(c, job), 60, f"job {job} to re-register")
            out_b = b.wait(180)
            a.kill()
    finally:
        c.cleanup()
    assert "trains on uncoordinated; it reconnects when the daemon is back" in out_b
    assert out_b.count("is coordinated again") == 2, out_b[-3000:]  # both of B's ranks
    assert same_weights(b.weights, solo.weights)


def test_a_stopped_crossover_torchrun_leaves_no_rank(runtime):
    """SIGTERM to the launcher reaches torchrun and its ranks (each in a session of its
    own): none outlives it."""
    from tests.test_cli import processes_running

    marker = "--seed 4177"
    proc = subprocess.Popen(LAUNCHER + ["--crossover", "--crossover-job", "stopme",
                                        "--crossover-idle-shutdown", "60", "--standalone",
                                        "--nproc-per-node", "2", TUTORIAL, "--steps",
                                        "100000000", *marker.split()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        log = runtime / "daemon.log"
        wait_for(lambda: log.exists() and "job stopme rank 1 on node" in log.read_text(),
                 120, "the job to register")
        assert len(processes_running(marker)) >= 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        wait_for(lambda: not processes_running(marker), 30, "the ranks to end")
    finally:
        if proc.poll() is None:
            proc.kill()
        for left in processes_running(marker):
            left.kill()


@pytest.mark.parametrize("reference, output, passes", [
    (True, TORCH_EXIT_ABORT, True),  # a reference run is read for its result only
    (False, TORCH_EXIT_ABORT, False),  # a run under crossover must exit cleanly
    (True, "Segmentation fault", False),  # any other failure fails the reference too
])
def test_only_torchs_exit_abort_of_a_reference_run_passes(tmp_path: Path, reference: bool,
                                                           output: str, passes: bool):
    proc = Proc(["sh", "-c", f"echo '{output}'; exit 134"], dict(os.environ),
                tmp_path / "p.log", reference=reference)
    if passes:
        assert output in proc.wait(30)
    else:
        with pytest.raises(AssertionError, match="exited 134"):
            proc.wait(30)


FREED_SCRIPT = """
import gc, os, sys, weakref, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import crossover.hooks.ddp as crossover_ddp
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = DDP(torch.nn.Linear(4, 2), find_unused_parameters=sys.argv[1] == "unused")
crossover_ddp.wrap(model)
for _ in range(3):
    model(torch.randn(3, 4)).sum().backward()
freed = weakref.ref(model)
del model
gc.collect()  # DDP's own Python cycles go here, as without crossover
print("freed", freed() is None, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["own_reduction", "unused"])
def test_a_wrapped_model_is_freed_when_the_script_drops_it(mode, tmp_path):
    """Crossover's hooks hold the DDP model weakly from C++ (gradient accumulators, the
    reducer's comm hook): a model they kept alive took its gloo process group to
    interpreter exit, where gloo can abort a finished script (SIGABRT, 'terminate called
    without an active exception'). Dropped and collected, the model goes, as it does
    without crossover."""
    env = {**os.environ, "CROSSOVER_RUNTIME_DIR": str(tmp_path / "no-daemon")}
    res = subprocess.run([PY, "-c", FREED_SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "freed True" in res.stdout, res.stdout + res.stderr[-2000:]


AT_EXIT_SCRIPT = """
import gc, sys, weakref, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import crossover.hooks.ddp as crossover_ddp
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
gc.disable()  # no collector pass before exit but crossover's
def train():
    model = DDP(torch.nn.Linear(4, 2))
    crossover_ddp.wrap(model)
    model(torch.randn(3, 4)).sum().backward()
    return weakref.ref(model, lambda _: print("freed while finalizing", sys.is_finalizing(),
                                              flush=True))
ref = train()
dist.destroy_process_group()
"""


def test_a_dropped_model_is_collected_before_the_interpreter_is_torn_down(tmp_path):
    """DDP's modules form Python cycles: a model the script dropped is collected by
    crossover's exit hook, while the interpreter is whole, not during finalization."""
    env = {**os.environ, "CROSSOVER_RUNTIME_DIR": str(tmp_path / "no-daemon")}
    res = subprocess.run([PY, "-c", AT_EXIT_SCRIPT], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "freed while finalizing False" in res.stdout, res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("argv, env, name", [
    (["--rdzv-id", "exp/42", "train.py"], {}, "train-exp_42"),
    (["--nnodes", "2", "train.py"], {"SLURM_JOB_ID": "7731", "SLURM_STEP_ID": "0"},
     "train-7731.0"),
    (["--rdzv-id", "r1", "my.train.py"], {"SLURM_JOB_ID": "7731"}, "my_train-r1"),
    (["train.py"], {}, f"train-{os.getpid()}"),
])
def test_a_torchrun_job_has_one_name_on_every_node(monkeypatch, argv, env, name):
    from crossover.launch.torchrun import job_name, torchrun_args

    for var in ("SLURM_JOB_ID", "SLURM_STEP_ID", "PET_RDZV_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert job_name(torchrun_args(argv)) == name
