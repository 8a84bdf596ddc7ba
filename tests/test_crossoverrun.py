"""crossoverrun: the plugin flag on unmodified Horovod scripts, job specs, flag errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap

import pytest

from crossover import trace
from crossover.launch import jobspec
from crossover.launch.cli import main
from tests.conftest import PY, REPO, assert_ran_together, held, wait_for

SCRIPT = str(REPO / "examples/horovod_torch_synthetic.py")
DDP_SCRIPT = str(REPO / "examples/ddp_tutorial.py")
CROSSOVERRUN = [PY, "-m", "crossover.launch.cli"]


def checksum(output: str) -> str:
    found = re.findall(r"weights checksum (-?[0-9.]+(?:e[-+]?[0-9]+)?)", output)
    assert len(found) == 1, output[-3000:]
    return found[0]


def run(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CROSSOVERRUN + args, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


@pytest.mark.mpi
def test_two_unmodified_scripts_run_under_crossover(runtime, tmp_path):
    # The unmodified script has no start barrier, so the second job is launched once the
    # first holds the devices (it trains), and the first trains long enough (about 20 s
    # alone) to outlast the second's start-up (about 10 s) and its loop. Started together,
    # a first job of 600 steps once finished before the second's loop began.
    steps = {1: "2500", 2: "60"}
    solo_runs = {seed: subprocess.Popen(
        CROSSOVERRUN + ["-np", "2", "-H", "localhost:2", PY, SCRIPT, "--seed", str(seed),
                        "--steps", steps[seed]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for seed in (1, 2)}
    solo = {seed: checksum(p.communicate(timeout=240)[0]) for seed, p in solo_runs.items()}
    assert not (runtime / "daemon.pid").exists(), "without --crossover no daemon starts"
    traces = tmp_path / "traces"
    # Always antiphase, so that the trace must show no overlapping holds (the default
    # policy, auto, may serve the device concurrently: tests/test_mpi_core.py).
    common = ["--crossover", "--crossover-policy", "crossover", "--crossover-trace",
              str(traces), "--crossover-idle-shutdown", "180"]
    # The first job starts the daemon; the second must find and reuse it.
    first = subprocess.Popen(CROSSOVERRUN + common + ["--crossover-job", "one", "-np", "2",
                             "-H", "localhost:2", PY, SCRIPT, "--seed", "1", "--steps",
                             steps[1]],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(held(runtime, "one"), 120, "job one to hold every device")
    except BaseException:
        first.kill()
        print(first.communicate()[1][-3000:])
        raise
    second = run(common + ["--crossover-job", "two", "-np", "2", "-H", "localhost:2", PY,
                           SCRIPT, "--seed", "2", "--steps", steps[2]])
    out1, err1 = first.communicate(timeout=240)
    assert first.returncode == 0, f"first job:\n{out1[-2000:]}\n{err1[-3000:]}"
    assert second.returncode == 0, f"second job:\n{second.stdout[-2000:]}\n{second.stderr[-3000:]}"
    assert checksum(out1) == solo[1]
    assert checksum(second.stdout) == solo[2]
    assert (traces / "one.trace.json").exists() and (traces / "two.trace.json").exists()
    events = trace.merge([traces / "one.trace.json", traces / "two.trace.json"],
                         tmp_path / "merged.json")
    holds = trace.holds_by_device(events)
    assert {s[2] for spans in holds.values() for s in spans} == {"one", "two"}
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    assert "built no Horovod DistributedOptimizer" not in err1
    # one daemon served both: the first started it, and the second found it
    starts = [err for err in (err1, second.stderr) if "started a crossover daemon" in err]
    assert len(starts) == 1, (err1[-2000:], second.stderr[-2000:])
    log = (runtime / "daemon.log").read_text()
    assert log.count("policy crossover, devices") == 1, log[-3000:]
    assert "job one rank 1 on node" in log and "job two rank 1 on node" in log


KERAS_SCRIPT = str(REPO / "examples/horovod_keras_synthetic.py")
# Deterministic TF on CPU (one thread each, deterministic ops) so solo and shared runs
# can be compared bit for bit; the script itself is left as Horovod's examples are.
TF_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_DETERMINISTIC_OPS": "1", "TF_NUM_INTRAOP_THREADS": "1",
          "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.mpi
def test_unmodified_keras_and_torch_scripts_together(runtime, tmp_path):
    # the Keras job may run alone (TF starts slowly): it must still show its releases
    env = {**os.environ, **TF_ENV, "CROSSOVER_KEEP_WHEN_ALONE": "0"}
    keras_cmd = ["-np", "2", "-H", "localhost:2", PY, KERAS_SCRIPT]
    solo = checksum(run(keras_cmd, env=env).stdout)
    traces = tmp_path / "traces"
    # Always antiphase, so that the trace must show no overlapping holds (the default
    # policy, auto, may serve the device concurrently: tests/test_mpi_core.py).
    common = ["--crossover", "--crossover-policy", "crossover", "--crossover-trace",
              str(traces), "--crossover-idle-shutdown", "180"]
    # The scripts have no start barrier and TensorFlow starts slowly: the torch job
    # trains long enough to be still training when the Keras job does (checked below).
    torch_job = subprocess.Popen(CROSSOVERRUN + common + ["--crossover-job", "torch", "-np",
                                 "2", "-H", "localhost:2", PY, SCRIPT, "--steps", "800"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=REPO)
    shared = run(common + ["--crossover-job", "keras", *keras_cmd], env=env)
    out, err = torch_job.communicate(timeout=240)
    assert torch_job.returncode == 0, err[-3000:]
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert checksum(shared.stdout) == solo
    events = trace.merge([traces / "torch.trace.json", traces / "keras.trace.json"],
                         tmp_path / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"torch", "keras"}
    # The injected Keras hook gives the slot up inside the compiled step: its ranks
    # spend time in "communicate" spans, which only the in-graph release starts.
    keras_pid = trace.job_pid("keras")
    communicate = [e for e in events if e.get("pid") == keras_pid
                   and e.get("name") == "communicate"]
    assert len(communicate) >= 2 * 20, len(communicate)


@pytest.mark.mpi
def test_jobs_file_runs_all_jobs_with_prefixed_output(runtime, tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(textwrap.dedent(f"""\
        jobs:
          - name: alpha
            command: [{PY!r}, {SCRIPT!r}, --steps, "20"]
            np: 2
            hosts: localhost:2
          - name: beta
            command: {PY} {SCRIPT} --steps 20 --seed 7
            np: 2
            priority: 2
            timeout: 200
          - name: gamma
            launcher: torchrun
            command: {PY} {DDP_SCRIPT} --steps 20
            np: 2
        """))
    res = run(["--crossover", "--crossover-idle-shutdown", "180", "--jobs", str(spec)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("alpha", "beta", "gamma"):
        assert re.search(rf"^\[{name}\] .*weights checksum", res.stdout, re.M), name
        assert f"job {name} exited 0" in res.stderr
    log = (runtime / "daemon.log").read_text()
    # a torchrun job is a job like the others to the daemon
    assert all(f"job {name} rank 1" in log for name in ("alpha", "beta", "gamma")), log


def test_a_process_that_builds_no_optimizer_says_so(runtime):
    env = dict(os.environ, CROSSOVER_INJECT="1",
               PYTHONPATH=str(REPO / "crossover/launch/inject"))
    res = subprocess.run([PY, "-c", "import horovod.torch as hvd; hvd.init()"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0
    assert "used horovod.torch but built no Horovod DistributedOptimizer" in res.stderr


FSDP_LIKE = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")  # a distributed job, but no DDP model (FSDP, say)
dist.destroy_process_group()
"""


def test_a_distributed_torch_process_without_ddp_says_so_and_one_with_ddp_does_not(runtime):
    env = dict(os.environ, CROSSOVER_INJECT="1",
               PYTHONPATH=str(REPO / "crossover/launch/inject"))
    res = subprocess.run([PY, "-c", FSDP_LIKE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "used torch.distributed.distributed_c10d.init_process_group but built no" in \
        res.stderr and "FSDP and tensor parallelism are not served" in res.stderr
    ddp = FSDP_LIKE.replace("dist.destroy_process_group()",
                            "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
                            "dist.destroy_process_group()")
    res = subprocess.run([PY, "-c", ddp], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # (no daemon: it trains uncoordinated)
    assert res.returncode == 0 and "built no" not in res.stderr, res.stderr[-2000:]
    assert "uncoordinated" in res.stderr  # the DDP model was wrapped: it looked for one
    res = subprocess.run([PY, "-c", "import torch"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # torchrun's agent: torch, no process group
    assert res.returncode == 0 and "WARNING" not in res.stderr, res.stderr[-2000:]


def test_injection_wraps_the_optimizer_factory(runtime):
    env = dict(os.environ, CROSSOVER_INJECT="1", CROSSOVER_JOB="inj",
               PYTHONPATH=str(REPO / "crossover/launch/inject"))
    code = ("import horovod.torch as hvd, torch; hvd.init(); "
            "m = torch.nn.Linear(2, 2); "
            "o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)); "
            "print('hooked', o._crossover_hooks is not None)")
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert "hooked True" in res.stdout, res.stderr[-2000:]
    assert "cannot reach the crossover daemon" in res.stderr  # no daemon: fails open, loudly


@pytest.mark.parametrize("argv,message", [
    (["--crossover-policy", "off", "-np", "2", "x.py"],
     "--crossover-policy has no effect without --crossover; add --crossover"),
    (["--crossover", "--crossover-polcy", "off", "-np", "2", "x.py"],
     "unknown plugin flag --crossover-polcy"),
    (["--crossover", "--crossover-policy", "fifo", "-np", "2", "x.py"],
     "invalid choice: 'fifo'"),
    (["--crossover", "--crossover-priority", "0", "-np", "2", "x.py"],
     "--crossover-priority: give a number > 0, got 0.0"),
    (["--crossover", "--crossover-job", "a b", "-np", "2", "x.py"],
     "--crossover-job: use letters, digits"),
    (["--crossover", "--jobs", "j.yaml", "-np", "2", "x.py"],
     "--jobs runs the jobs of its file; drop the other arguments"),
    (["--crossover", "--crossover-daemon", "/nonexistent/crossover", "-np", "2", "x.py"],
     "--crossover-daemon /nonexistent/crossover: no such directory"),
])
def test_flag_errors_name_the_problem_and_the_fix(argv, message, runtime, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, "one clear line"
    assert not (runtime / "daemon.pid").exists(), "nothing may start"


def test_a_scripts_own_flags_are_left_alone(runtime):
    from crossover.launch.cli import split_argv

    plugin, rest = split_argv(["--crossover", "-np", "2", "python", "t.py", "--jobs", "4",
                               "--crossover-job", "x"])
    assert plugin == ["--crossover"]
    assert rest == ["-np", "2", "python", "t.py", "--jobs", "4", "--crossover-job", "x"]


SPEC_ERRORS = [
    ("jobs: []", "expected a mapping with one key, 'jobs'"),
    ("jobs:\n  - np: 2", "job #1: field 'command': missing"),
    ("jobs:\n  - {name: a, command: x, np: two}", "job 'a': field 'np': expected a positive "
                                                   "integer, got 'two'"),
    ("jobs:\n  - {name: a, command: x, np: 2, gpus: 1}", "job 'a': unknown field 'gpus'"),
    ("jobs:\n  - {name: a, command: x, np: 4, hosts: 'h1:1,h2:2'}",
     "job 'a': field 'np': 4 processes do not fit the 3 slots of hosts 'h1:1,h2:2'"),
    ("jobs:\n  - {name: a, command: x, np: 1, hosts: 'h1:x'}",
     "job 'a': field 'hosts': slots of 'h1' must be a positive integer"),
    ("jobs:\n  - {name: a, command: x, np: 1, priority: -1}",
     "job 'a': field 'priority': expected a number > 0"),
    ("jobs:\n  - {name: a, command: x, np: 1, env: [A]}", "job 'a': field 'env': expected a "
                                                          "mapping"),
    ("jobs:\n  - {name: a, command: x, np: 1}\n  - {name: a, command: y, np: 1}",
     "job 'a': field 'name': used by more than one job"),
    ("jobs:\n  - {name: a, command: [], np: 1}", "field 'command': expected a non-empty"),
    ("jobs: [", "cannot read the job spec"),
    ("jobs:\n  - {name: a, command: x, np: 1, launcher: mpirun}",
     "job 'a': field 'launcher': expected one of horovodrun, torchrun, got 'mpirun'"),
    ("jobs:\n  - {name: a, command: x, np: 1, launcher: torchrun, hosts: 'h1:1'}",
     "job 'a': field 'hosts': a torchrun job runs on this host"),
    ("jobs:\n  - {name: a, command: x, np: 1, launcher: torchrun, horovodrun_args: [--gloo]}",
     "job 'a': field 'horovodrun_args': not for a torchrun job; use 'torchrun_args'"),
    ("jobs:\n  - {name: a, command: x, np: 1, torchrun_args: [--max-restarts, '0']}",
     "job 'a': field 'torchrun_args': not for a horovodrun job; use 'horovodrun_args'"),
]


@pytest.mark.parametrize("text,message", SPEC_ERRORS)
def test_job_spec_errors(text, message, tmp_path, runtime, capsys):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(text)
    with pytest.raises(jobspec.JobSpecError, match=re.escape(message)):
        jobspec.load(spec)
    assert main(["--crossover", "--jobs", str(spec)]) == 2
    assert message in capsys.readouterr().err
    assert not (runtime / "daemon.pid").exists(), "nothing may start"


def test_a_torchrun_job_runs_its_script_with_torchruns_python():
    (job,) = jobspec.parse({"jobs": [{"name": "d", "command": "python3 train.py --lr 1",
                                       "np": 2, "launcher": "torchrun"}]})
    assert job.launcher == "torchrun" and job.command == ["train.py", "--lr", "1"]


def test_job_spec_reports_every_problem_at_once(tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text("jobs:\n  - {name: a, np: 0}\n  - {name: b, command: x, np: 1, bad: 1}\n")
    with pytest.raises(jobspec.JobSpecError) as err:
        jobspec.load(spec)
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert "job 'a': field 'command': missing" in lines[0]
    assert "job 'a': field 'np'" in lines[1]
    assert "job 'b': unknown field 'bad'" in lines[2]


@pytest.mark.mpi
def test_a_dead_daemon_is_restarted_and_the_job_reconnects(runtime):
    """Under --crossover-daemon auto, crossoverrun restarts a daemon that died under its
    job, and the job's ranks reconnect to the new one."""
    job = subprocess.Popen(CROSSOVERRUN + ["--crossover", "--crossover-job", "healer",
                                           "-np", "2", "-H", "localhost:2", PY, SCRIPT,
                                           "--steps", "2000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        log = runtime / "daemon.log"
        wait_for(lambda: log.exists() and "job healer rank 1 on node" in log.read_text(),
                 60, "the job to register")
        first = int((runtime / "daemon.pid").read_text())
        os.kill(first, signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    assert "the crossover daemon was gone; started a new one" in err
    assert err.count("is coordinated again") == 2, err[-3000:]  # both ranks
    assert int((runtime / "daemon.pid").read_text()) != first
    assert log.read_text().count("job healer rank 1 on node") == 2
