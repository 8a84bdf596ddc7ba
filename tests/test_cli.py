"""The command line as a user meets it: help, versions, stopping a daemon, checking an
installation, and one clear line for every mistake a user can make."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import crossover
from crossover.client import RankInfo, SlotClient
from crossover.launch import cli
from crossover.launch.daemons import UsageError, hosts_of, is_local, start_daemon
from crossover.launch.running import exit_code
from crossover.probe import daemon_listens
from tests.conftest import PY, REPO, Cluster, wait_for

CROSSOVERRUN = [PY, "-m", "crossover.launch.cli"]
CROSSOVER = [PY, "-m", "crossover"]


def run(cmd: list[str], env: dict | None = None, timeout: float = 120,
        **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env, **kw)


# --- crossoverrun ----------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--crossover", "--help"],
                                  ["--crossover", "--crossover-policy", "auto", "-h"]])
def test_help_lists_the_plugin_flags_then_horovods_once_and_starts_nothing(argv, runtime):
    res = run(CROSSOVERRUN + argv, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in cli.PLUGIN_FLAGS:
        assert re.search(rf"^  {flag}\b", res.stdout, re.MULTILINE), flag
    assert res.stdout.count("usage: horovodrun") == 1, res.stdout
    assert not runtime.exists(), "help must not start a daemon"


def test_a_scripts_help_flag_is_the_scripts():
    assert cli.own_flag(["-np", "2", "python", "train.py", "--help"]) is None
    assert cli.own_flag(["-np", "2", "--version", "python", "train.py"]) == "--version"


def test_versions():
    res = run(CROSSOVERRUN + ["--version"])
    assert res.returncode == 0 and f"crossoverrun {crossover.__version__}" in res.stdout
    assert "Horovod 0.28.1" in res.stdout
    res = run(CROSSOVER + ["--version"])
    assert res.returncode == 0 and res.stdout.strip() == f"crossover {crossover.__version__}"
    res = run(CROSSOVERRUN + ["-v"])  # Horovod's own flag: its version, once
    assert res.returncode == 0 and res.stdout.split() == ["0.28.1"], res.stdout


def test_jobs_implies_crossover(tmp_path, runtime, capsys):
    assert cli.parse_plugin(["--jobs", "j.yaml"]).crossover
    spec = tmp_path / "jobs.yaml"
    spec.write_text("jobs:\n  - {name: a, np: 1}\n")
    assert cli.main(["--jobs", str(spec), "--crossover-policy", "off"]) == 2
    err = capsys.readouterr().err
    assert "job 'a': field 'command': missing" in err and "has no effect" not in err


@pytest.mark.parametrize("argv,message", [
    (["--crossover", "--crossover-daemon", "atuo", "-np", "1", "x.py"],
     "--crossover-daemon atuo: no such directory; give auto"),
    (["--crossover", "--crossover-daemon=", "-np", "1", "x.py"],
     "--crossover-daemon needs a value"),
    (["--crossover", "--crossover-idle-shutdown", "0", "-np", "1", "x.py"],
     "--crossover-idle-shutdown must be > 0 seconds"),
    (["--crossover", "--crossover-priority", "inf", "-np", "1", "x.py"],
     "--crossover-priority: give a number > 0, got inf"),
    (["--crossover", "--crossover-job", "j" * 201, "-np", "1", "x.py"],
     "--crossover-job: give 1-200 printable characters"),
    (["--crossover", "-np", "1", "--host-discovery-script", "d.sh", "x.py"],
     "--host-discovery-script (elastic Horovod) is not supported with --crossover"),
    (["--crossover", "-np", "1", "--hostfile", "/nonexistent/hosts", "x.py"],
     "--hostfile /nonexistent/hosts: horovodrun cannot read it"),
    (["--crossover", "-np", "2", "-H", "[::1]:2", "x.py"],
     "hosts '[::1]:2': write host:slots"),
])
def test_launch_errors_are_one_line_and_start_nothing(argv, message, runtime, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (runtime / "daemon.pid").exists()


def test_horovods_own_errors_come_before_anything_starts(runtime):
    res = run(CROSSOVERRUN + ["--crossover", "python", "t.py"], env=dict(os.environ))
    assert res.returncode != 0 and "-np" in res.stderr, res.stderr[-2000:]
    assert not runtime.exists(), "no daemon for a command horovodrun refuses"


def hosts(*argv: str) -> list[str]:
    parsed = cli.horovod_args(list(argv))
    assert parsed is not None, argv
    return hosts_of(parsed)


def test_hosts_are_the_ones_horovodrun_uses(tmp_path):
    assert hosts("-np", "2", "-H", "a:1,b:1", "python", "t.py") == ["a", "b"]
    assert hosts("--hosts=a:2", "-np", "2", "python", "t.py") == ["a"]
    assert hosts("-np", "2", "-H", "r:2", "-H", "localhost:2", "python", "t.py") == \
        ["localhost"], "the last -H, as horovodrun takes it"
    assert hosts("-np", "2", "python", "t.py", "--hosts", "x:2") == ["localhost"], \
        "a script's own flags are the script's"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    assert hosts("-np", "4", "--hostfile", str(hostfile), "python", "t.py") == \
        ["node1", "node2"]
    assert hosts("-np", "2", "python", "t.py") == ["localhost"]
    hostfile.write_text("# horovodrun fails on comments\nnode1 slots=2\n")
    with pytest.raises(UsageError, match="horovodrun cannot read it"):
        hosts("-np", "2", "--hostfile", str(hostfile), "python", "t.py")


def test_this_hosts_addresses_and_aliases_are_local():
    mine = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for host in ["localhost", "127.0.0.1", socket.gethostname(), *mine[:1]]:
        assert is_local(host), host
    assert not is_local("192.0.2.7")  # TEST-NET-1: never this host
    assert not is_local("no-such-host.invalid")


def test_hosts_are_matched_to_the_worlds_nodes_by_name_not_count(capsys, monkeypatch):
    """A job on two hosts against a world of two other nodes is not covered; the job is
    told once which of its hosts will train uncoordinated, and why."""
    from crossover.launch.daemons import _check_hosts, uncovered_hosts

    monkeypatch.delenv("CROSSOVER_FAKE_NODES", raising=False)
    monkeypatch.setenv("CROSSOVER_NODE", "nodeA")
    world = {"nodeA": {}, "nodeB.example": {}}
    assert uncovered_hosts(world, ["localhost", "nodeB"]) == []
    assert uncovered_hosts(world, ["nodeB.example", "localhost"]) == []
    assert uncovered_hosts(world, ["192.0.2.7", "192.0.2.8"]) == ["192.0.2.7", "192.0.2.8"]
    assert uncovered_hosts({"nodeB": {}}, ["localhost", "nodeB"]) == ["localhost"]
    _check_hosts(world, ["localhost", "192.0.2.7", "192.0.2.7"], Path("/run/x"))
    err = capsys.readouterr().err
    assert err.count("no node for 192.0.2.7 ") == 1, err
    assert "its nodes: nodeA, nodeB.example" in err and "train uncoordinated" in err
    _check_hosts(world, ["localhost"], Path("/run/x"))
    assert capsys.readouterr().err == ""


def test_exit_codes_of_signals_are_the_shells():
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(3) == 3


@pytest.mark.mpi
def test_a_jobs_file_exits_with_the_worst_code_and_a_timed_out_job_gets_sigterm(
        tmp_path, runtime):
    marker = tmp_path / "terminated"
    sleeper = textwrap.dedent(f"""
        import signal, sys, time
        def bye(*_):
            open({str(marker)!r}, "w").write("term")
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("sleeping", flush=True)
        time.sleep(120)
    """)
    (tmp_path / "sleeper.py").write_text(sleeper)
    spec = tmp_path / "jobs.yaml"
    spec.write_text(textwrap.dedent(f"""
        jobs:
          - {{name: fails, command: [{PY}, -c, "import sys; sys.exit(3)"], np: 1}}
          - {{name: ok, command: [{PY}, -c, "pass"], np: 1}}
          - {{name: slow, command: [{PY}, {tmp_path / 'sleeper.py'}], np: 1, timeout: 40}}
    """))
    res = run(CROSSOVERRUN + ["--jobs", str(spec), "--crossover-idle-shutdown", "30"],
              env=dict(os.environ), timeout=240)
    assert "job fails exited 3" in res.stderr, res.stderr[-3000:]
    assert "job ok exited 0" in res.stderr
    assert "job slow stopped after its 40 s timeout" in res.stderr
    assert "job slow exited 124" in res.stderr
    assert res.returncode == 124, "the worst job's code, not the first non-zero"
    assert marker.exists(), (  # the timeout counts from launch: daemon world and
        # mpirun start inside it, so it leaves the sleeper ample time to set its handler
        "a timed-out job is sent SIGTERM before SIGKILL\n" + res.stderr[-3000:])


def test_a_policy_mismatch_says_how_to_stop_the_daemon(cluster: Cluster, capsys):
    with cluster.daemon(policy="crossover"):
        argv = ["--crossover", "--crossover-daemon", str(cluster.runtime),
                "--crossover-policy", "priority", "-np", "1", "x.py"]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "runs policy crossover, not priority" in err
    assert f"`crossover stop --runtime-dir {cluster.runtime}`" in err


# --- crossover -------------------------------------------------------------------------
def test_a_second_daemon_is_one_line_not_a_traceback(cluster: Cluster):
    with cluster.daemon():
        res = run(CROSSOVER + ["daemon"], env=cluster.env, timeout=30)
    assert res.returncode == 3  # RUNNING_EXIT: a relay that started it waits for the other
    assert "already listens on" in res.stderr and "`crossover stop`" in res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_stop_refuses_while_a_job_uses_the_daemon_then_stops_it(cluster: Cluster):
    with cluster.daemon() as daemon:
        job = SlotClient("busy", RankInfo(0, 1, 0, 1), runtime_dir=cluster.runtime,
                         pin_cpu=False)
        res = run(CROSSOVER + ["stop"], env=cluster.env, timeout=60)
        assert res.returncode == 2 and "jobs busy still use this daemon" in res.stderr
        assert "add --force" in res.stderr and daemon_listens(cluster.runtime)
        job.close()
        wait_for(lambda: "busy" not in run(CROSSOVER + ["status", "--json"],
                                           env=cluster.env).stdout, 30, "the job to leave")
        res = run(CROSSOVER + ["stop"], env=cluster.env, timeout=60)
        assert res.returncode == 0 and "stopped the crossover daemon" in res.stdout, res.stderr
        assert daemon.popen.wait(timeout=30) == 0
    assert "nothing to stop" in run(CROSSOVER + ["stop"], env=cluster.env).stdout


def test_stop_ends_a_daemon_a_launcher_started(tmp_path, runtime):
    runtime.mkdir(mode=0o700)
    start_daemon(runtime, "auto", ["localhost"], 300, quiet=True)
    launched = psutil.Process(int((runtime / "daemon.pid").read_text()))
    res = run(CROSSOVER + ["stop"], env=dict(os.environ), timeout=60)
    assert res.returncode == 0 and f"process {launched.pid}" in res.stdout, res.stderr
    assert not launched.is_running() or launched.status() == psutil.STATUS_ZOMBIE
    assert not (runtime / "daemon.pid").exists()


@pytest.mark.parametrize("argv,message", [
    (["status", "--once", "--json"], "not allowed with argument"),
    (["status", "--interval", "0"], "--interval: give seconds >= 0.1, got 0"),
    (["status", "--interval", "-1"], "--interval: give seconds >= 0.1, got -1"),
    (["daemon", "--lease", "0"], "--lease: give seconds > 0, got 0"),
    (["daemon", "--lease", "nan"], "--lease: give seconds > 0, got nan"),
    (["trace", "plot", "/nonexistent.json", "-o", "x.png"],
     "/nonexistent.json: No such file or directory"),
    (["daemon", "--patience", "0"], "--patience: give seconds > 0, got 0"),
])
def test_command_errors_name_the_problem(argv, message):
    res = run(CROSSOVER + argv, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_trace_errors_for_a_bad_file_and_a_missing_matplotlib(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    res = run(CROSSOVER + ["trace", "merge", str(bad), "-o", str(tmp_path / "o.json")])
    assert res.returncode == 2 and "not a Chrome trace" in res.stderr, res.stderr
    good = tmp_path / "good.json"
    good.write_text('{"traceEvents": []}')
    hide = ("import sys; sys.modules['matplotlib'] = None; from crossover.__main__ import "
            f"main; sys.exit(main(['trace', 'plot', {str(good)!r}, '-o', 'x.png']))")
    res = run([PY, "-c", hide])
    assert res.returncode == 2 and "pip install matplotlib" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_check_passes_here_and_names_what_is_missing(tmp_path):
    res = run(CROSSOVER + ["check"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for part in ("MPI", "Horovod", "PyTorch", "TensorFlow", "native path", "runtime dir"):
        assert any(line.split()[1:2] == part.split()[:1] for line in
                   res.stdout.splitlines()[1:] if line.startswith("  ok")), part
    assert res.stdout.rstrip().endswith("ready: jobs can run under crossover")

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    hide_native = ("import sys; sys.modules['crossover._native'] = None; "
                   "from crossover import check; sys.exit(check.main())")
    res = run([PY, "-c", hide_native], env=dict(os.environ, CROSSOVER_RUNTIME_DIR=str(loose),
                                                CROSSOVER_PRIORITY="heavy"), timeout=180)
    assert res.returncode == 1, res.stdout
    lines = res.stdout.splitlines()
    assert any(line.startswith("  warn     native path") and "pip install" in line
               for line in lines), lines
    assert any(line.startswith("  MISSING  runtime dir") and "mode 0700" in line
               for line in lines), lines
    assert any(line.startswith("  MISSING  settings") and "CROSSOVER_PRIORITY" in line
               for line in lines), lines
    assert lines[-1] == "not ready: fix the MISSING lines above"


def test_the_module_entry_points_are_installed():
    bindir = os.path.dirname(sys.executable)
    for name in ("crossover", "crossoverrun"):
        assert os.access(os.path.join(bindir, name), os.X_OK), name


def processes_running(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds `marker` (zombies have ended)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(proc.info["cmdline"] or []) and \
                proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
            found.append(proc)
    return found


SYNTHETIC = str(REPO / "examples/horovod_torch_synthetic.py")


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["one job", "jobs file"])
def test_a_stopped_crossoverrun_leaves_no_rank_behind(how, tmp_path, runtime):
    """SIGTERM to crossoverrun reaches every rank (the runner runs mpirun under a shell
    in a process group of its own; a --jobs parent stops its jobs' crossoverruns)."""
    seed = str(900_000 + os.getpid() % 1000)  # marks this test's ranks
    job = [PY, SYNTHETIC, "--steps", "100000", "--seed", seed]
    if how == "one job":
        argv = ["--crossover", "--crossover-job", "stopme", "-np", "2", "-H", "localhost:2", *job]
    else:
        spec = tmp_path / "jobs.yaml"
        spec.write_text(f"jobs:\n  - {{name: stopme, np: 2, command: {job!r}}}\n")
        argv = ["--jobs", str(spec)]
    proc = subprocess.Popen(CROSSOVERRUN + argv, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (runtime / "daemon.log").exists() and "job stopme rank 1 on node"
                 in (runtime / "daemon.log").read_text(), 120, "the job to register")
        assert len(processes_running(seed)) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while processes_running(seed) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not processes_running(seed), "ranks outlived their crossoverrun"
    finally:
        if proc.poll() is None:
            proc.kill()
        for left in processes_running(seed):
            left.kill()


def test_a_stale_pid_file_never_stops_another_process(cluster: Cluster):
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with cluster.daemon() as daemon:
            (cluster.runtime / "daemon.pid").write_text(f"{bystander.pid}\n")
            res = run(CROSSOVER + ["stop"], env=cluster.env, timeout=60)
            assert res.returncode == 0, res.stderr
            assert daemon.popen.wait(timeout=30) == 0, "the daemon that answered is stopped"
        assert bystander.poll() is None, "a reused pid in daemon.pid was signalled"
    finally:
        bystander.kill()


TRACED_RANK = """
import os, signal, crossover
with crossover.step():
    pass
print("stepped", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_rank_stopped_by_sigterm_writes_its_trace_and_dies_of_it(tmp_path):
    env = dict(os.environ, CROSSOVER_TRACE=str(tmp_path), CROSSOVER_JOB="stopped",
               CROSSOVER_RUNTIME_DIR=str(tmp_path / "none"))
    res = run([PY, "-c", TRACED_RANK], env=env, timeout=60)
    assert "stepped" in res.stdout, res.stderr[-2000:]
    assert res.returncode == -signal.SIGTERM, "it still dies of the signal"
    assert (tmp_path / "stopped.rank0.json").exists(), "the trace was written"


LAUNCHER = """
import sys
from crossover.launch.daemons import ensure_daemon
from crossover.testing import start_barrier
start_barrier(sys.argv[1], int(sys.argv[2]), 0, 1, job=sys.argv[3])
print(ensure_daemon("auto", None, ["localhost"], 120))
"""


def test_launchers_at_the_same_moment_share_one_daemon(tmp_path, runtime):
    """Several `--crossover-daemon auto` launches at once: the launch lock lets one of
    them start the daemon, and the others find it."""
    n = 4
    procs = [subprocess.Popen([PY, "-c", LAUNCHER, str(tmp_path / "start"), str(n), f"l{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO)
             for i in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(runtime)}
    started = [err for _, err in outs if "started a crossover daemon" in err]
    assert len(started) == 1, [err[-500:] for _, err in outs]
    assert (runtime / "daemon.log").read_text().count("daemon 0/1 for node") == 1
