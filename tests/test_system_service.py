"""A node service for every user (`crossover daemon --system`), with real users made
here: two users' jobs on one device coordinated by one service, a user outside its
group refused (the job trains on plainly), every cross-user action refused or kept to
the caller's own jobs, and systemd's notify protocol and unit file.

The users run commands through `setpriv` with their own uid and groups, which is what
the service sees (SO_PEERCRED) and what the socket's mode is checked against. The
environment lives under /root (0700): their processes keep CAP_DAC_READ_SEARCH, which
reads and searches files but writes none, connects to no socket and signals no process,
so everything a user could do to another is left as it would be.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from crossover import trace
from tests.conftest import PY, REPO, Proc, assert_ran_together, same_weights, wait_for

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv")
                       or not shutil.which("useradd"),
                       reason="making users and acting as them needs root, useradd and "
                              "setpriv"),
]

GROUP, ALICE, BOB, CAROL = "xo-gpu", "xo-alice", "xo-bob", "xo-carol"
STEPS = 150


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    """Alice and Bob in the service's group, Carol outside it (made for these tests,
    removed after them)."""
    made = []
    if subprocess.run(["getent", "group", GROUP], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", GROUP], check=True)
        made.append(("groupdel", GROUP))
    for name, groups in ((ALICE, [GROUP]), (BOB, [GROUP]), (CAROL, [])):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", *(["-G", ",".join(groups)] if groups else []),
                            name], check=True)
            made.insert(0, ("userdel", name))
    yield
    for cmd in made:
        subprocess.run(list(cmd), capture_output=True)


def as_user(name: str, cmd: list[str]) -> list[str]:
    """`cmd` run with `name`'s uid, primary group and groups."""
    return ["setpriv", f"--reuid={name}", f"--regid={pwd.getpwnam(name).pw_gid}",
            "--init-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", *cmd]


def home(tmp: Path, name: str) -> Path:
    """A directory `name` may write (weights, traces, Open MPI's session files)."""
    d = tmp / name
    d.mkdir(exist_ok=True)
    os.chown(d, pwd.getpwnam(name).pw_uid, -1)
    return d


class Service:
    """A node service for the group's users, and the environment that finds it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        (tmp / "sys").mkdir(mode=0o755)
        self.dir = tmp / "sys" / "crossover"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("CROSSOVER_RUNTIME_DIR", "XDG_RUNTIME_DIR")}
        self.env["CROSSOVER_SYSTEM_DIR"] = str(self.dir)
        self.log = tmp / "daemon.log"

    @contextmanager
    def running(self, *extra: str, env: dict | None = None,
                prefix: tuple[str, ...] = ()) -> Iterator[Proc]:
        proc = Proc([*prefix, PY, "-m", "crossover", "daemon", "--system", "--policy",
                     "crossover", "--allow-group", GROUP, *extra],
                    {**self.env, **(env or {})}, self.log)
        try:
            wait_for(lambda: any(self.dir.glob("node-*.sock")) or proc.popen.poll() is not None,
                     60, "the service's socket")
            assert proc.popen.poll() is None, proc.output()
            yield proc
        finally:
            if proc.popen.poll() is None:
                proc.kill(signal.SIGTERM)

    def run_as(self, name: str, cmd: list[str], **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(as_user(name, cmd), env={**self.env, "HOME": str(
            home(self.tmp, name)), **env}, capture_output=True, text=True, timeout=120,
            cwd=REPO)

    def sock(self) -> Path:
        return next(self.dir.glob("node-*.sock"))


@pytest.fixture
def service(tmp_path: Path, users) -> Service:
    return Service(tmp_path)


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict[str, Path]:
    """Each job's weights trained alone without crossover (whose they are does not
    change the math)."""
    tmp = tmp_path_factory.mktemp("solo")
    env = dict(os.environ, CROSSOVER_ENABLE="0")
    out = {}
    for name, seed, np in (("A", 1, 2), ("B", 2, 2), ("C", 3, 1)):
        out[name] = tmp / f"{name}.pt"
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np), PY,
               str(REPO / "examples/torch_mlp.py"), "--seed", str(seed), "--steps",
               str(STEPS), "--out", str(out[name])]
        Proc(cmd, env, tmp / f"{name}.log").wait(180)
    return out


def test_two_users_jobs_on_one_device_take_turns_and_keep_their_math(service, solo):
    barrier = service.tmp / "start"
    barrier.mkdir(mode=0o1777)
    barrier.chmod(0o1777)
    jobs = {}
    with service.running():
        for user, job, seed in ((ALICE, "A", 1), (BOB, "B", 2)):
            d = home(service.tmp, user)
            # (mpirun checks its executable with access(2), which ignores the
            # capability that reads the environment under /root; env executes it)
            cmd = as_user(user, ["mpirun", "--oversubscribe", "--bind-to", "none", "-np",
                                 "2", "/usr/bin/env", PY, str(REPO / "examples/torch_mlp.py"),
                                 "--seed",
                                 str(seed), "--steps", str(STEPS), "--out",
                                 str(d / f"{job}.pt"), "--start-barrier", str(barrier),
                                 "--start-jobs", "2"])
            env = {**service.env, "HOME": str(d), "CROSSOVER_JOB": job,
                   "CROSSOVER_TRACE": str(d / "traces")}
            jobs[job] = (Proc(cmd, env, service.tmp / f"{job}.log"), d / f"{job}.pt")
        for proc, _ in jobs.values():
            proc.wait(240)
    log = service.log.read_text()
    # each job is its owner's in the service
    assert re.search(rf"job {ALICE}/A rank 1 on node", log), log[-3000:]
    assert re.search(rf"job {BOB}/B rank 1 on node", log), log[-3000:]
    # one user's ranks are granted over their sockets: the table is the service's file
    for proc, _ in jobs.values():
        assert "native fast path off" not in proc.output()
    traces = sorted((service.tmp / ALICE / "traces").glob("*.json")) + \
        sorted((service.tmp / BOB / "traces").glob("*.json"))
    events = trace.merge(traces, service.tmp / "merged.json")
    assert_ran_together(events, min_handovers=STEPS // 2)
    assert trace.overlaps(events) == []
    for job, (_, weights) in jobs.items():
        assert same_weights(weights, solo[job]), job


def test_a_user_outside_the_group_is_refused_and_trains_on_plainly(service, solo):
    with service.running():
        out = home(service.tmp, CAROL) / "C.pt"
        res = service.run_as(CAROL, [PY, str(REPO / "examples/torch_mlp.py"), "--seed", "3",
                                     "--steps", str(STEPS), "--out", str(out)],
                             CROSSOVER_JOB="C")
    assert res.returncode == 0, res.stderr[-3000:]
    said = f"does not admit user {CAROL} (it admits group {GROUP} only)"
    assert res.stderr.count(said) == 1, res.stderr[-3000:]
    assert "CROSSOVER_RUNTIME_DIR" in res.stderr
    assert same_weights(out, solo["C"])


# A rank of a job, spoken by hand: hello, then what argv asks; prints what came back.
ACTOR = """
import json, os, sys
from crossover import protocol as P
from crossover.transport import connect, recv_msg, send_msg
sock = connect(sys.argv[1], 10)
what, arg = sys.argv[2], sys.argv[3]
def reply():
    while True:
        msg = recv_msg(sock)
        if not isinstance(msg, P.Company):
            return msg
if what == "squat":  # take the device and renew its lease, never releasing it
    import time
    send_msg(sock, P.Hello(arg, 0, 1, 0, 1, os.getpid()))
    print(type(reply()).__name__, flush=True)
    send_msg(sock, P.Acquire(1))
    print(type(reply()).__name__, flush=True)
    while True:
        send_msg(sock, P.Renew())
        time.sleep(0.2)
elif what == "wait":  # ask for the device and say how long the grant took
    import time
    send_msg(sock, P.Hello(arg, 0, 1, 0, 1, os.getpid()))
    reply()
    t0 = time.monotonic()
    send_msg(sock, P.Acquire(1))
    print(type(reply()).__name__, round(time.monotonic() - t0, 1), flush=True)
elif what == "hold":  # hello as job `arg`, take the device, and keep it until stdin ends
    send_msg(sock, P.Hello(arg, 0, 1, 0, 1, os.getpid()))
    print(type(reply()).__name__, flush=True)
    send_msg(sock, P.Acquire(1))
    print(type(reply()).__name__, flush=True)
    sys.stdin.read()
elif what == "hello":
    send_msg(sock, P.Hello(arg, 0, 1, 0, 1, os.getpid()))
    msg = reply()
    print(type(msg).__name__, getattr(msg, "message", ""))
    if len(sys.argv) > 4:  # then release a slot it does not hold
        send_msg(sock, P.Release("compute"))
        send_msg(sock, P.Status())
        print(json.dumps(reply().nodes))
else:
    send_msg(sock, P.StopWorld() if what == "stop" else P.Grow([arg]))
    msg = reply()
    print(type(msg).__name__, getattr(msg, "message", ""))
"""


def status_as(service: Service, user: str) -> str:
    res = service.run_as(user, [PY, "-m", "crossover", "status", "--json"])
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_every_cross_user_action_is_refused_or_kept_to_the_users_own_jobs(service):
    with service.running():
        sock = str(service.sock())
        # Alice holds the device as job A (a marker on her command line)
        marker = "alice-secret-flag"
        holder = subprocess.Popen(as_user(ALICE, [PY, "-c", ACTOR, sock, "hold", "A",
                                                  marker]),
                                  env=service.env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert holder.stdout.readline().strip() == "Welcome"
            assert holder.stdout.readline().strip() == "Grant"

            def act(user: str, *args: str) -> str:
                res = service.run_as(user, [PY, "-c", ACTOR, sock, *args])
                assert res.returncode == 0, res.stderr[-2000:]
                return res.stdout

            # impersonation: Bob's job A, and even "xo-alice/A", are Bob's own jobs
            assert act(BOB, "hello", "A").startswith("Welcome")
            assert act(BOB, "hello", f"{ALICE}/A").startswith("Welcome")
            # the same user's second rank 0 of A is refused: the check can fail
            assert act(ALICE, "hello", "A").startswith("Error")
            # release: Bob's release frees only what Bob holds; Alice still holds
            nodes = json.loads(act(BOB, "hello", "A", "release").splitlines()[1])
            holding = [d["holding"] for node in nodes.values()
                       for d in node["devices"].values()]
            assert [f"{ALICE}/A:0"] in holding, holding
            # stop and grow: the service's operator's, not a user's
            for what in ("stop", "grow"):
                out = act(BOB, what, "elsewhere")
                assert out.startswith("Error") and "its operator does" in out, out
            res = service.run_as(BOB, [PY, "-m", "crossover", "stop"])
            assert res.returncode == 2 and "its operator stops it" in res.stderr, res.stderr
            # status: Alice's job by name and owner, not her command line
            seen = status_as(service, BOB)
            assert f"{ALICE}/A" in seen and marker not in seen
        finally:
            holder.stdin.close()
            holder.wait(30)
        assert service.sock().exists()  # the service serves on
    log = service.log.read_text()
    for what in ("stop_world", "grow"):
        assert re.search(rf"refused {what} of process \d+: user {BOB} may not", log), log


def test_the_service_tells_systemd_when_it_is_ready_and_when_it_stops(service):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(service.tmp / "notify"))
    listener.settimeout(60)
    with service.running(env={"NOTIFY_SOCKET": str(service.tmp / "notify")}) as proc:
        ready = listener.recv(4096).decode()
        assert ready.startswith("READY=1\n") and "STATUS=serving node" in ready, ready
        sock = service.sock()
        assert sock.exists()  # it said ready once ranks could find it
        mode = sock.stat().st_mode & 0o777
        assert (mode, grp.getgrgid(sock.stat().st_gid).gr_name) == (0o660, GROUP)
        proc.popen.send_signal(signal.SIGTERM)
        assert listener.recv(4096) == b"STOPPING=1\n"
        assert proc.popen.wait(30) == 0
    assert not sock.exists()


UNIT = REPO / "deploy" / "systemd" / "crossover.service"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_the_unit_file_is_valid(tmp_path):
    # the unit as installed: ExecStart names this environment's crossover
    text = UNIT.read_text()
    start = re.search(r"^ExecStart=(\S+)", text, re.M)
    assert start, "the unit has an ExecStart"
    unit = tmp_path / "crossover.service"
    unit.write_text(text.replace(start.group(1), str(Path(sys.executable).parent / "crossover")))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr.strip()) == (0, ""), res.stderr
    assert re.search(r"^Type=notify$", text, re.M) and "--system" in text
    # the check can fail: a misspelt setting is reported
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notifyy"))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                         capture_output=True, text=True, timeout=60)
    assert "notifyy" in res.stderr


# Hostile input from a user of the group: hypothesis's cases of every kind
# (bench/robustness/fuzz_cases.py), 15 of each.
FUZZER = """
import sys
from hypothesis import HealthCheck, given, seed, settings
from bench.robustness.fuzz_cases import CASES, exchange
tried = 0
for name, strategy in CASES.items():
    @seed(7)
    @settings(max_examples=15, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        global tried
        opening, payload, _bad = case
        exchange(sys.argv[1], payload, opening)
        tried += 1
    run()
print(tried)
"""


def test_a_user_fuzzing_the_service_stops_neither_it_nor_another_users_job(service):
    with service.running() as proc:
        sock = str(service.sock())
        holder = subprocess.Popen(as_user(ALICE, [PY, "-c", ACTOR, sock, "hold", "A"]),
                                  env=service.env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert holder.stdout.readline().strip() == "Welcome"
            assert holder.stdout.readline().strip() == "Grant"
            res = service.run_as(BOB, [PY, "-c", FUZZER, sock])
            assert res.returncode == 0, res.stderr[-3000:]
            assert int(res.stdout.split()[-1]) >= 15 * 5, res.stdout
            assert proc.popen.poll() is None, proc.output()[-3000:]
            assert f'"{ALICE}/A:0"' in status_as(service, ALICE)  # she holds it still
        finally:
            holder.stdin.close()
            holder.wait(30)


# A user who asks for status twice on one connection without reading, then opens more
# connections than one user may hold.
FLOOD = """
import socket, sys, time
from crossover import protocol as P
from crossover.transport import connect, frame, recv_msg
sock = connect(sys.argv[1], 10)
sock.sendall(frame(P.Status()) * 2)
try:
    while True:
        got = recv_msg(sock)
        if isinstance(got, P.Error):
            print("error:", got.message)
except (ConnectionError, OSError):
    print("closed")
held, refused = [], None
for _ in range(200):
    s = connect(sys.argv[1], 10)
    held.append(s)
    s.settimeout(0.5)
    try:
        msg = recv_msg(s)
        refused = msg.message
        break
    except (TimeoutError, OSError):
        pass
print(len(held), refused)
"""


def test_a_user_can_neither_stall_the_service_nor_take_every_connection(service):
    # 200 descriptors: 136 connections, at most 17 of them one user's
    with service.running(prefix=("prlimit", "--nofile=200")):
        sock = str(service.sock())
        res = service.run_as(BOB, [PY, "-c", FLOOD, sock])
        assert res.returncode == 0, res.stderr[-2000:]
        lines = res.stdout.splitlines()
        assert "error: a status request before the answer to the last one" in lines, lines
        held, refused = lines[-1].split(" ", 1)
        assert f"user {BOB} has" in refused and "the most one user may" in refused, lines
        assert int(held) == 17 + 1, lines  # the one refused included
        # another user still gets in and is answered
        assert json.loads(status_as(service, ALICE))


def test_a_user_who_renews_without_releasing_keeps_the_device_at_most_two_leases(service):
    with service.running("--lease", "1"):
        sock = str(service.sock())
        squatter = subprocess.Popen(as_user(BOB, [PY, "-c", ACTOR, sock, "squat", "S"]),
                                    env=service.env, stdout=subprocess.PIPE, text=True,
                                    cwd=REPO)
        try:
            assert squatter.stdout.readline().strip() == "Welcome"
            assert squatter.stdout.readline().strip() == "Grant"
            res = service.run_as(ALICE, [PY, "-c", ACTOR, sock, "wait", "W"])
            kind, took = res.stdout.split()
            assert kind == "Grant" and float(took) <= 2.5, res.stdout  # two leases, and 0.5
        finally:
            squatter.kill()
            squatter.wait(30)
    assert re.search(rf"job {BOB}/S rank 0 held cpu\d+ past its 1 s lease", service.log.read_text())
