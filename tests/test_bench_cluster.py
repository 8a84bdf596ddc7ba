"""Smoke test of the emulated cluster (bench/harness/cluster.py): build, talk across, tear down.

Needs root and network namespaces; skipped elsewhere. No timing is asserted.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from bench.harness.cluster import HOSTS_FILE, MARKER, EmulatedCluster, cleanup_stale
from bench.harness.jobs import Daemons, run_jobs
from crossover import trace
from tests.conftest import TORCH_EXIT_ABORT, assert_shared_in_turns

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the emulated cluster needs root, ip and tc")

ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(30)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(30)
c.sendall(c.recv(64).upper())
"""

ASK = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
s.sendall(b"across the link")
print(s.recv(64).decode())
"""


def test_two_hosts_talk_over_the_shaped_link_and_leave_nothing():
    with EmulatedCluster(mbit=100) as c:
        # each host sees only its own end of the link
        for i, addr in enumerate(c.addrs):
            out = subprocess.run(c.exec_in(i, ["ip", "-4", "-o", "addr"]), capture_output=True,
                                 text=True, timeout=30, check=True).stdout
            assert addr in out and c.addrs[1 - i] not in out
        qdisc = subprocess.run(["ip", "netns", "exec", c.hosts[1], "tc", "qdisc", "show"],
                               capture_output=True, text=True, timeout=30).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        server = subprocess.Popen(c.exec_in(1, [sys.executable, "-c", ECHO, c.addrs[1], "29517"]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            reply = subprocess.run(c.exec_in(0, [sys.executable, "-c", ASK, c.addrs[1], "29517"]),
                                   capture_output=True, text=True, timeout=60)
            assert reply.stdout.strip() == "ACROSS THE LINK", reply.stderr
        finally:
            server.kill()
            server.wait(timeout=10)
        # shaped: near its 100 Mbit/s (an unshaped pair of veths carries gigabits)
        rate = c.measure_mbit(nbytes=2 << 20)
        assert 60 <= rate <= 110, f"{rate:.0f} Mbit/s over a link shaped to 100"
        # the hosts resolve by name, and their processes carry their own node name
        out = subprocess.run(c.exec_in(1, ["sh", "-c", "echo $CROSSOVER_NODE $(hostname)"]),
                             capture_output=True, text=True, timeout=30).stdout.split()
        assert out == [c.hosts[1], c.hosts[1]]
        assert all(h in HOSTS_FILE.read_text() for h in c.hosts)
    assert c.leftovers() == []
    assert not any(h in HOSTS_FILE.read_text() for h in c.hosts)


SERVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 29601))
s.settimeout(60)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hi")
    c.close()
"""

REACH = """
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], 29601), timeout=1.5).recv(2).decode())
except OSError:
    print("no")
"""


@pytest.mark.skipif(not shutil.which("iptables"), reason="cuts and loss need iptables")
def test_three_hosts_on_a_bridge_cut_one_way_or_both_and_heal():
    with EmulatedCluster(mbit=1000, hosts=3) as c:
        servers = [subprocess.Popen(c.exec_in(i, [sys.executable, "-c", SERVE, c.addrs[i]]),
                                    stdout=subprocess.PIPE, text=True) for i in range(3)]
        try:
            assert [s.stdout.readline().strip() for s in servers] == ["ready"] * 3

            def reached() -> set[tuple[int, int]]:
                return {(a, b) for a in range(3) for b in range(3) if a != b and subprocess.run(
                    c.exec_in(a, [sys.executable, "-c", REACH, c.addrs[b]]),
                    capture_output=True, text=True, timeout=30).stdout.strip() == "hi"}
            every = {(a, b) for a in range(3) for b in range(3) if a != b}
            assert reached() == every
            c.cut(0, 1)
            assert reached() == every - {(0, 1), (1, 0)}
            c.heal()
            # one way: what 0 sends 2 is dropped, so no TCP connection forms either way
            c.cut(0, 2, both=False)
            assert reached() == every - {(0, 2), (2, 0)}
            c.heal()
            assert reached() == every
            c.lose(1, 1.0)  # all of host 1's packets lost
            assert reached() == every - {(0, 1), (1, 0), (1, 2), (2, 1)}
        finally:
            for s in servers:
                s.kill()
                s.wait(timeout=30)
    assert c.leftovers() == []


def test_stale_cleanup_spares_a_live_cluster_and_removes_a_dead_ones():
    """Only clusters whose owner died are stale: a second run must not break a first."""
    with EmulatedCluster(mbit=50) as live:
        gone = subprocess.Popen(["true"])
        gone.wait(timeout=30)
        subprocess.run(["ip", "netns", "add", "xobdeadh0"], check=True, timeout=30)
        subprocess.run(["ip", "netns", "add", "xobdeadsw"], check=True, timeout=30)  # its bridge
        with HOSTS_FILE.open("a") as f:
            f.write(f"10.231.250.1 xobdeadh0 {MARKER} pid={gone.pid}\n")
        # what a rank killed on each host leaves: Open MPI's session directory
        dead_session = Path(tempfile.gettempdir()) / "ompi.xobdeadh0.0"
        live_session = Path(tempfile.gettempdir()) / f"ompi.{live.hosts[0]}.0"
        # and a live cluster whose name the dead one's is a prefix of
        live_longer = Path(tempfile.gettempdir()) / "ompi.xobdeadh01.0"
        try:
            for d in (dead_session, live_session, live_longer):
                (d / "pid.1").mkdir(parents=True, exist_ok=True)
            removed = cleanup_stale()
            assert "xobdeadh0" in removed
            assert not dead_session.exists() and live_session.exists()
            assert live_longer.exists()
            assert str(live_session) in live.leftovers()
        finally:
            shutil.rmtree(dead_session, ignore_errors=True)
            shutil.rmtree(live_longer, ignore_errors=True)
        assert live.leftovers() != [] and not any(h in removed for h in live.hosts)
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               timeout=30).stdout
        assert "xobdeadh0" not in names and "xobdeadh0" not in HOSTS_FILE.read_text()
        assert "xobdeadsw" not in names
    assert live.leftovers() == [] and not live_session.exists()


def test_an_exception_inside_tears_everything_down():
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(mbit=50) as c:
        assert c.leftovers() != []
        raise RuntimeError("boom")
    assert c.leftovers() == []


# Ctrl-C as in a terminal: a shell that ran the suite in the background leaves SIGINT
# ignored, and an ignored signal stays ignored in children (then this test hung 60 s).
HOLD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
from bench.harness.cluster import EmulatedCluster
with EmulatedCluster(mbit=50) as c:
    print(" ".join(c.hosts), flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_tears_everything_down(sig):
    import signal

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    proc = subprocess.Popen([sys.executable, "-c", HOLD, bench], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        hosts = proc.stdout.readline().split()
        assert len(hosts) == 2
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           timeout=30).stdout
    assert not any(h in names for h in hosts)
    assert not any(h in HOSTS_FILE.read_text() for h in hosts)


HOROVOD_JOB = ["--model", "mlp", "--width", "64", "--layers", "2", "--batch", "32"]
DDP_JOB = ["--framework", "ddp", *HOROVOD_JOB]


@pytest.mark.timeout(600)
def test_a_ddp_job_under_torchrun_across_the_hosts_shares_them_with_a_horovod_job(tmp_path):
    """The benchmark's DDP jobs: torchrun on each emulated host, meeting at host 0. The
    job trains what its Horovod twin trains, and beside a Horovod job under the hosts'
    daemons each job keeps its weights while the two take turns on both hosts."""
    plain = {"CROSSOVER_ENABLE": "0"}
    with EmulatedCluster(mbit=1000) as cluster:
        def solo(name: str, workload: list[str], seed: int) -> dict:
            return run_jobs(cluster, [name], workload, 20, plain, tmp_path, 180,
                            first_seed=seed, reference=True)[0]

        horovod_a, ddp_a, ddp_b = (solo("hvdA", HOROVOD_JOB, 1), solo("ddpA", DDP_JOB, 1),
                                   solo("ddpB", DDP_JOB, 2))
        assert (horovod_a["framework"], ddp_a["framework"]) == ("horovod", "ddp")
        # the same model, data and seed: DDP's mean gradient is Horovod's average
        assert ddp_a["weights_sha256"] == horovod_a["weights_sha256"]
        assert ddp_b["weights_sha256"] != ddp_a["weights_sha256"]
        traces = tmp_path / "traces"
        daemons = Daemons(cluster, tmp_path / "run", "crossover", tmp_path / "daemons.log")
        try:
            both = run_jobs(cluster, ["hvdX", "ddpX"], HOROVOD_JOB, 20,
                            {"CROSSOVER_RUNTIME_DIR": str(daemons.runtime),
                             "CROSSOVER_TRACE": str(traces)}, tmp_path, 180,
                            workloads=[HOROVOD_JOB, DDP_JOB], start_together=True)
        finally:
            daemons.stop()
    assert [r["weights_sha256"] for r in both] == [horovod_a["weights_sha256"],
                                                   ddp_b["weights_sha256"]]
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    # one rank of each job on each host: the device of each host, shared by both jobs
    assert_shared_in_turns(events, {"hvdX", "ddpX"}, devices=2)


TUTORIAL = str(Path(__file__).resolve().parents[1] / "examples/ddp_tutorial.py")
CROSSOVER_TORCHRUN = ["-m", "crossover.launch.torchrun"]


def _text(data: bytes | str | None) -> str:
    """What a timed-out `communicate` has read so far (bytes, even in text mode)."""
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _kill_tree(proc: subprocess.Popen) -> None:
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.kill()
    proc.wait(timeout=30)
    # not communicate(): a process of the run that outlived its parent (its children
    # could not be listed then) may hold the pipes open; what was read is the caller's
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _checksum(proc: subprocess.Popen, reference: bool = False) -> str:
    """The weights checksum a run of examples/ddp_tutorial.py printed."""
    # A reference run (plain torchrun, no crossover) is only read for its result:
    # torch's gloo teardown over the shaped link aborts a rank now and then after the
    # script has finished (SIGABRT after destroy_process_group; its agent reports
    # exitcode -6), crossover or not, and the other host's torchrun agent then waits
    # out its exit barrier (300 s). Such a run is stopped once it has printed its
    # result and aborted. Runs under crossover must exit cleanly.
    deadline = time.monotonic() + 300
    while True:
        try:
            out, err = proc.communicate(timeout=5)
            break
        except subprocess.TimeoutExpired as exc:
            out, err = (_text(exc.stdout), _text(exc.stderr))
            if reference and len(re.findall(r"weights checksum (\S+)", out)) == 1 \
                    and (TORCH_EXIT_ABORT in err or "(exitcode: -6)" in err):
                _kill_tree(proc)
                break
            if time.monotonic() > deadline:
                _kill_tree(proc)
                pytest.fail(f"still running after 300 s:\n{out[-2000:]}\n{err[-3000:]}")
    found = re.findall(r"weights checksum (\S+)", out)
    if not (reference and len(found) == 1):
        assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    assert "uncoordinated" not in err, err[-3000:]
    (found,) = found
    return found


@pytest.mark.timeout(600)
def test_crossover_torchrun_across_hosts_with_a_daemon_world_started_by_hand(tmp_path):
    """Across nodes, crossover-torchrun joins a daemon world started by hand
    (--crossover-daemon DIR): two unmodified DDP scripts, torchrun on each emulated host,
    train what they train alone while taking turns on both hosts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(cluster: EmulatedCluster, seed: int, flags: list[str]) -> subprocess.Popen:
        cmd = cluster.torchrun([sys.executable, TUTORIAL, "--seed", str(seed), "--steps",
                                "1500"], launcher=[*CROSSOVER_TORCHRUN, *flags])
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    traces = tmp_path / "traces"
    with EmulatedCluster(mbit=1000) as cluster:
        solo = {seed: _checksum(launch(cluster, seed, []), reference=True) for seed in (1, 2)}
        daemons = Daemons(cluster, tmp_path / "run", "crossover", tmp_path / "daemons.log")
        env["CROSSOVER_TRACE"] = str(traces)  # (--crossover-trace: each node would merge)
        try:
            procs = [launch(cluster, seed, ["--crossover", "--crossover-daemon",
                                            str(daemons.runtime), "--crossover-job", name])
                     for name, seed in (("one", 1), ("two", 2))]
            together = [_checksum(p) for p in procs]
        finally:
            daemons.stop()
    assert together == [solo[1], solo[2]]
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    assert_shared_in_turns(events, {"one", "two"}, devices=2)  # each host's device


def test_a_reference_run_that_printed_its_result_and_aborted_is_read_and_stopped():
    """A reference run whose rank aborted at exit after printing its result (while the
    other host's torchrun agent waits out its exit barrier) gives that result at once,
    and nothing of it keeps running."""
    script = ("import sys, time; print('weights checksum -3.25', flush=True); "
              "sys.stderr.write('terminate called without an active exception\\n'); "
              "sys.stderr.flush(); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    assert _checksum(proc, reference=True) == "-3.25"
    assert time.monotonic() - t0 < 60 and proc.poll() is not None


def test_a_reference_run_whose_left_over_process_holds_its_pipes_is_still_read():
    """The run's top process exited (after its result and the abort) while a process it
    left behind still holds stdout and stderr open: the result is read at once."""
    script = ("import subprocess, sys; "
              "left = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print('weights checksum -3.25', 'left', left.pid, flush=True); "
              "sys.stderr.write('terminate called without an active exception\\n'); "
              "sys.exit(1)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    try:
        assert _checksum(proc, reference=True) == "-3.25"
        assert time.monotonic() - t0 < 60 and proc.poll() is not None
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if "time.sleep(600)" in " ".join(p.info["cmdline"] or []) and \
                    p.pid != os.getpid():
                with contextlib.suppress(psutil.Error):
                    p.kill()



def _stop_world(daemons: Daemons, runtime: Path, host: str) -> None:
    """Stop a test's daemon world through `host`'s service, then whatever of it (services
    and generations outlive their mpirun) still names its runtime directory."""
    from crossover.probe import stop_world

    with contextlib.suppress(ConnectionError):
        stop_world(runtime, host)
    daemons.stop()
    for proc in psutil.process_iter(["cmdline"]):
        if str(runtime) in (proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_a_cut_link_costs_each_host_only_its_messages_and_the_world_heals(tmp_path):
    """Two emulated hosts' daemons; host 1's link goes down for 12 s. Each host's service
    answers status all along (with itself, past the 5 s silence: no hang, no stop), and
    once the link is back the world is one again: both nodes under one leader, none
    lost, the same services."""
    from crossover.probe import daemon_status

    runtime = tmp_path / "run"
    with EmulatedCluster(mbit=1000) as cluster:
        daemons = Daemons(cluster, runtime, "crossover", tmp_path / "daemons.log")
        hosts = cluster.hosts
        link = ["ip", "-n", hosts[1], "link", "set", "xolink"]
        try:
            pids = {h: daemon_status(runtime, h)[h]["daemon"]["pid"] for h in hosts}
            subprocess.run([*link, "down"], check=True, timeout=30)
            try:
                time.sleep(12)  # past the 5 s silence: each side has lost the other
                for host in hosts:
                    nodes = daemon_status(runtime, host, timeout_s=5.0)
                    assert list(nodes) == [host]
                    assert nodes[host]["daemon"]["pid"] == pids[host]
            finally:
                subprocess.run([*link, "up"], check=True, timeout=30)

            def whole() -> bool:
                try:
                    nodes = daemon_status(runtime, hosts[0], timeout_s=5.0)
                except ConnectionError:
                    return False
                leaders = {s["world"]["leader_node"] for s in nodes.values()}
                return sorted(nodes) == sorted(hosts) and len(leaders) == 1 and all(
                    not s["world"]["lost"] and s["world"]["relay"] for s in nodes.values())
            deadline = time.monotonic() + 120
            while not whole():
                assert time.monotonic() < deadline, (tmp_path / "daemons.log").read_text()
                time.sleep(1.0)
            assert {h: daemon_status(runtime, h)[h]["daemon"]["pid"] for h in hosts} == pids
        finally:
            _stop_world(daemons, runtime, hosts[0])


def test_a_killed_hosts_node_is_taken_back_by_a_generation_across_the_hosts(tmp_path):
    """Host 1's node service and relay are SIGKILLed: the leader on host 0 starts a new
    generation, an mpirun from its own namespace to host 1's over the remote-shell agent
    (its MCA settings inherited from the first world's), which starts a new service
    there; the world is whole again, host 0's service the same."""
    from crossover.probe import daemon_status

    runtime = tmp_path / "run"
    with EmulatedCluster(mbit=1000) as cluster:
        daemons = Daemons(cluster, runtime, "crossover", tmp_path / "daemons.log")
        hosts = cluster.hosts
        try:
            before = {h: daemon_status(runtime, h)[h] for h in hosts}
            for pid in (before[hosts[1]]["daemon"]["pid"],
                        before[hosts[1]]["world"]["relay_pid"]):
                os.kill(pid, signal.SIGKILL)

            def whole() -> dict | None:
                try:
                    nodes = daemon_status(runtime, hosts[0], timeout_s=5.0)
                except ConnectionError:
                    return None
                leaders = {s["world"]["leader_node"] for s in nodes.values()}
                ok = sorted(nodes) == sorted(hosts) and len(leaders) == 1 and all(
                    not s["world"]["lost"] and s["world"]["relay"] for s in nodes.values())
                return nodes if ok else None
            deadline = time.monotonic() + 90
            time.sleep(2.0)  # the kill is seen
            while (nodes := whole()) is None:
                assert time.monotonic() < deadline, (tmp_path / "daemons.log").read_text()
                time.sleep(1.0)
            assert nodes[hosts[0]]["daemon"]["pid"] == before[hosts[0]]["daemon"]["pid"]
            assert nodes[hosts[1]]["daemon"]["pid"] != before[hosts[1]]["daemon"]["pid"]
            assert nodes[hosts[1]]["world"]["generation"] > before[hosts[1]]["world"][
                "generation"]
        finally:
            _stop_world(daemons, runtime, hosts[0])


def test_a_member_whose_relay_and_leader_are_gone_leads_and_the_world_comes_back(tmp_path):
    """Host 1's relay is killed, then host 0's whole node (the leader) before it formed
    a new generation: host 1's service is left with no relay and no leader. Within
    ORPHANED_S it leads and forms a generation that starts a service on host 0."""
    from crossover.daemon.world.member import ORPHANED_S
    from crossover.probe import daemon_status

    runtime = tmp_path / "run"
    with EmulatedCluster(mbit=1000) as cluster:
        daemons = Daemons(cluster, runtime, "crossover", tmp_path / "daemons.log")
        h0, h1 = cluster.hosts
        try:
            before = {h: daemon_status(runtime, h)[h] for h in (h0, h1)}
            os.kill(before[h1]["world"]["relay_pid"], signal.SIGKILL)
            time.sleep(6.0)  # the leader has lost host 1, and forms a generation 2 s on
            for pid in (before[h0]["world"]["relay_pid"], before[h0]["daemon"]["pid"]):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + ORPHANED_S + 60
            while True:
                try:
                    nodes = daemon_status(runtime, h1, timeout_s=5.0)
                except ConnectionError:
                    nodes = {}
                if sorted(nodes) == sorted((h0, h1)) and all(
                        s["world"]["leader_node"] == h1 and s["world"]["relay"]
                        for s in nodes.values()):
                    break
                assert time.monotonic() < deadline, (tmp_path / "daemons.log").read_text()
                time.sleep(1.0)
            assert nodes[h1]["daemon"]["pid"] == before[h1]["daemon"]["pid"]
        finally:
            _stop_world(daemons, runtime, h1)


@pytest.mark.timeout(600)
def test_crossover_torchrun_across_hosts_uses_each_hosts_node_service(tmp_path):
    """With the node service for every user running on each host (`crossover daemon
    --system`, as systemd starts it), crossover-torchrun across nodes needs no world
    started by hand: each host's service serves its ranks, the job has one name on both
    (--crossover-job here; --rdzv-id or SLURM_JOB_ID where there is one), and two DDP
    jobs take turns on both hosts and train what they train alone."""
    system = tmp_path / "sys" / "crossover"
    system.parent.mkdir(mode=0o755)
    traces = tmp_path / "traces"
    env = {k: v for k, v in os.environ.items()
           if k not in ("CROSSOVER_RUNTIME_DIR", "XDG_RUNTIME_DIR")}
    env.update(OMP_NUM_THREADS="1", CROSSOVER_SYSTEM_DIR=str(system))

    def launch(cluster: EmulatedCluster, seed: int, flags: list[str],
               extra: dict | None = None) -> subprocess.Popen:
        cmd = cluster.torchrun([sys.executable, TUTORIAL, "--seed", str(seed), "--steps",
                                "1500"], launcher=[*CROSSOVER_TORCHRUN, *flags])
        return subprocess.Popen(cmd, env={**env, **(extra or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    with EmulatedCluster(mbit=1000) as cluster:
        solo = {seed: _checksum(launch(cluster, seed, []), reference=True) for seed in (1, 2)}
        log = open(tmp_path / "services.log", "w")  # noqa: SIM115 - closed below
        services = [subprocess.Popen(cluster.exec_in(i, [
            sys.executable, "-m", "crossover", "daemon", "--system", "--policy", "crossover"]),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for i in range(len(cluster.hosts))]
        try:
            deadline = time.monotonic() + 60
            while len(list(system.glob("node-*.sock"))) < len(cluster.hosts):
                assert time.monotonic() < deadline and all(s.poll() is None for s in services), \
                    (tmp_path / "services.log").read_text()
                time.sleep(0.1)
            procs = [launch(cluster, seed, ["--crossover", "--crossover-job", name],
                            {"CROSSOVER_TRACE": str(traces)})
                     for name, seed in (("one", 1), ("two", 2))]
            together = [_checksum(p) for p in procs]
        finally:
            for s in services:
                os.killpg(s.pid, signal.SIGTERM)
            for s in services:
                s.wait(timeout=30)
            log.close()
    assert together == [solo[1], solo[2]]
    said = (tmp_path / "services.log").read_text()
    user = pwd.getpwuid(os.getuid()).pw_name
    for host in cluster.hosts:  # each job on each host's service, as its owner's
        for name in ("one", "two"):
            assert re.search(rf"job {user}/{name} rank \d on node {host} ", said), said[-3000:]
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    assert_shared_in_turns(events, {"one", "two"}, devices=2)  # each host's device
