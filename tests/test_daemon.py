"""The daemon and the client as real processes talking over the Unix socket."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest

from crossover import protocol as P
from crossover.client import CrossoverVersionError, RankInfo, SlotClient
from crossover.placement import pin_process
from crossover.protocol import Mode, Phase
from crossover.trace import TraceRecorder, load
from crossover.transport import FrameBuffer, recv_msg
from tests.conftest import PY, REPO, Cluster, wait_for

SOLO = RankInfo(rank=0, size=1, local_rank=0, local_size=1)


def client(c: Cluster, job: str, **kw) -> SlotClient:
    return SlotClient(job, SOLO, runtime_dir=c.runtime, pin_cpu=False, **kw)


def wait_queued(c: Cluster, job: str, device: str = "cpu0") -> None:
    """Until the daemon's status shows `job` waiting for `device`: the daemon has read
    its request (and sent its company notices in the same pass)."""
    from crossover.probe import daemon_status

    def queued() -> bool:
        (node,) = daemon_status(c.runtime).values()
        return any(w.startswith(f"{job}:") for w in node["devices"][device]["waiting"])

    wait_for(queued, 30, f"{job} to be queued for {device}")


HOLDER = """
import sys, time
from crossover.client import RankInfo, SlotClient
c = SlotClient("holder", RankInfo(0, 1, 0, 1), runtime_dir=sys.argv[1], pin_cpu=False)
c.acquire()
print("held", flush=True)
time.sleep(600)  # hangs while holding
"""


def start_holder(c: Cluster) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-c", HOLDER, str(c.runtime)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, start_new_session=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_renewed_hold_outlives_its_lease(cluster: Cluster):
    """A step longer than the lease keeps its device while it renews (the hooks renew
    from gradient hooks); the hung holder below, which does not renew, loses it."""
    with cluster.daemon(lease=1.5):
        holder = client(cluster, "holder")
        holder.acquire()
        granted = threading.Event()

        def wait_for_the_device() -> None:
            waiter = client(cluster, "waiter", wait_s=60)
            waiter.acquire()
            if waiter.coordinated:
                granted.set()
            waiter.release(Phase.IDLE)
            waiter.close()

        thread = threading.Thread(target=wait_for_the_device, daemon=True)
        thread.start()
        wait_for(lambda: "job waiter rank 0 on node" in (cluster.tmp / "daemon.log").read_text(),
                 30, "the waiter to register")
        end = time.monotonic() + 3 * 1.5  # three leases
        while time.monotonic() < end:
            holder.renew()
            assert not granted.is_set(), "the device went to the waiter under a renewed hold"
            time.sleep(0.1)
        holder.release(Phase.IDLE)
        assert granted.wait(30), "the waiter was not granted after the release"
        thread.join(timeout=30)
        holder.close()
    assert "slot revoked" not in (cluster.tmp / "daemon.log").read_text()


@pytest.mark.parametrize("stopped", [False, True])
def test_hung_holder_loses_its_slot_after_the_lease(cluster: Cluster, stopped):
    with cluster.daemon(lease=2):
        holder = start_holder(cluster)
        if stopped:  # SIGSTOP (a debugger, a suspended job) rather than a busy hang
            os.killpg(holder.pid, signal.SIGSTOP)
        try:
            waiter = client(cluster, "waiter")
            start = time.monotonic()
            waiter.acquire()
            waited = time.monotonic() - start
            assert waiter.coordinated, "the grant must come from the daemon, not a timeout"
            assert waited < 15, waited  # the revocation is checked in the log below
            waiter.close()
        finally:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(10)
        state = "stopped" if stopped else "running"
        assert f"job holder rank 0 held cpu0 past its 2 s lease: slot revoked (its process " \
               f"is {state})" in cluster.procs[0].output()


def test_killed_holder_frees_the_slot_at_once(cluster: Cluster):
    with cluster.daemon(lease=60):
        holder = start_holder(cluster)
        waiter = client(cluster, "waiter")
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)
        start = time.monotonic()
        waiter.acquire()
        assert waiter.coordinated and time.monotonic() - start < 5
        waiter.close()


def test_crossover_handoff_and_trace(cluster: Cluster, tmp_path):
    with cluster.daemon():
        rec = TraceRecorder("a", 0, tmp_path / "a.json")
        a, b = client(cluster, "a", trace=rec), client(cluster, "b")
        a.acquire()
        assert a.device == "cpu0" and a.policy == "crossover"
        got = []

        t = threading.Thread(target=lambda: (b.acquire(), got.append(time.monotonic())))
        t.start()
        wait_queued(cluster, "b")
        assert not got, "b must wait while a holds"
        released = time.monotonic()
        a.release(Phase.COMMUNICATE)
        t.join(10)
        assert got and got[0] >= released
        a.close()
        b.close()
    names = [e["name"] for e in load(tmp_path / "a.json") if e["ph"] == "X"]
    assert names == ["slot wait", "hold", "communicate"]


def test_step_context_holds_inside_the_block(cluster: Cluster, monkeypatch):
    import crossover

    monkeypatch.setenv("CROSSOVER_RUNTIME_DIR", str(cluster.runtime))
    monkeypatch.setenv("CROSSOVER_JOB", "ctx")
    monkeypatch.setenv("CROSSOVER_PIN_CPU", "0")
    with cluster.daemon():
        other = client(cluster, "other")
        try:
            with crossover.step() as c:
                assert c.holding
                with crossover.communicate():
                    assert not c.holding
                    other.acquire()  # the device is free while ctx communicates
                    other.release(Phase.IDLE)
                assert c.holding
            assert not c.holding
        finally:
            crossover.shutdown()
            other.close()


def test_unreachable_daemon_warns_once_and_never_blocks(tmp_path, capsys):
    c = SlotClient("lonely", SOLO, runtime_dir=tmp_path / "nothing-here", pin_cpu=False)
    for _ in range(3):
        c.acquire()
        c.release()
    assert not c.coordinated
    err = capsys.readouterr().err
    assert err.count("cannot reach the crossover daemon") == 1
    assert "trains on uncoordinated" in err


def test_version_mismatch_is_refused_with_a_clear_message(cluster: Cluster, monkeypatch):
    with cluster.daemon():
        # a raw frame from a "newer" client
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(str(next(cluster.runtime.glob("node-*.sock"))))
        body = json.dumps({"v": 99, "kind": "hello", "job": "x"}).encode()
        sock.sendall(struct.pack("!I", len(body)) + body)
        reply = recv_msg(sock)
        assert isinstance(reply, P.Error) and "version mismatch: got 99" in reply.message
        assert reply.code == P.ErrorCode.VERSION
        sock.close()
        # the client side raises instead of silently going uncoordinated
        monkeypatch.setattr(P, "PROTOCOL_VERSION", 99)
        with pytest.raises(CrossoverVersionError, match="version mismatch"):
            client(cluster, "new")


def test_duplicate_rank_is_refused(cluster: Cluster):
    with cluster.daemon():
        # "version" in the job's name once made the client call this a version mismatch
        first = client(cluster, "version-dup")
        with pytest.raises(RuntimeError, match="rank 0 is connected already.*CROSSOVER_JOB "
                                               "or crossoverrun --crossover-job") as refused:
            client(cluster, "version-dup")
        assert not isinstance(refused.value, CrossoverVersionError)
        first.close()


def test_an_error_from_another_version_is_a_version_mismatch():
    """Version 1 sent no error code: an error frame of another version is read as a
    version mismatch, whatever its text; this version's errors carry their code."""
    old = json.dumps({"v": 1, "kind": "error", "message": "refused"}).encode()
    assert P.decode(old) == P.Error("refused", P.ErrorCode.VERSION.value)
    dup = P.Error("version-x rank 0 is connected already", P.ErrorCode.DUPLICATE.value)
    assert P.decode(P.encode(dup)) == dup


def test_status_reports_holders_and_queues(cluster: Cluster):
    with cluster.daemon():
        a, b = client(cluster, "a"), client(cluster, "b")
        a.acquire()
        b._send(P.Acquire(1))  # queue b without blocking this test
        wait_queued(cluster, "b")
        out = subprocess.run([PY, "-m", "crossover", "status", "--json", "--runtime-dir",
                              str(cluster.runtime)], capture_output=True, text=True,
                             timeout=30, cwd=REPO, check=True).stdout
        (node,) = json.loads(out).values()
        assert node["devices"]["cpu0"]["holder"] == "a"
        assert node["devices"]["cpu0"]["waiting"] == ["b:0"]
        # psutil's figures: the daemon's own health, and what each job uses here
        assert node["daemon"]["fds"] > 3 and node["daemon"]["rss_mb"] > 1
        assert node["daemon"]["connections"] >= 3  # a, b and the status request
        assert node["job_usage"]["a"]["ranks"] == 1 and node["job_usage"]["a"]["rss_mb"] > 1
        a.close()
        b.close()


def test_status_table_shows_holder_queue_and_shares(cluster: Cluster):
    with cluster.daemon():
        a, b = client(cluster, "a"), client(cluster, "b")
        a.acquire()
        b._send(P.Acquire(1))
        wait_queued(cluster, "b")
        out = subprocess.run([PY, "-m", "crossover", "status", "--once", "--runtime-dir",
                              str(cluster.runtime)], capture_output=True, text=True,
                             timeout=30, cwd=REPO, check=True).stdout
        assert re.search(r"daemon pid \d+: \d+ fds, \d+ MiB, \d+ connections; a 1 ranks", out)
        row = next(line for line in out.splitlines() if " cpu0 " in line)
        assert " a " in row and "b:0" in row
        hold_a = float(row.split("a: ")[1].split("%")[0])
        assert hold_a > 50, row  # a has held cpu0 since it joined
        a.close()
        b.close()


def test_status_without_daemon_names_the_fix(tmp_path):
    res = subprocess.run([PY, "-m", "crossover", "status", "--runtime-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert res.returncode == 2 and "start one with `crossover daemon`" in res.stderr


def test_second_daemon_on_one_socket_is_refused(cluster: Cluster):
    with cluster.daemon():
        res = subprocess.run([PY, "-m", "crossover", "daemon"], env=cluster.env,
                             capture_output=True, text=True, timeout=30, cwd=REPO)
        assert res.returncode != 0 and "already listens on" in res.stderr


def test_idle_daemon_shuts_down(cluster: Cluster):
    proc = subprocess.run([PY, "-m", "crossover", "daemon", "--idle-shutdown", "1"],
                          env=cluster.env, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 0 and "no job for 1 s: shutting down" in proc.stderr
    assert not list(cluster.runtime.glob("*.sock")), "socket must be removed"


def test_frames_roundtrip_in_pieces():
    msgs = [P.Hello("j", 0, 2, 0, 2, 123), P.Acquire(5, True), P.Release("communicate")]
    data = b"".join(struct.pack("!I", len(P.encode(m))) + P.encode(m) for m in msgs)
    buf, got = FrameBuffer(), []
    for i in range(0, len(data), 7):  # arbitrary split points
        got += buf.feed(data[i:i + 7])
    assert got == msgs


@pytest.mark.parametrize("raw,match", [
    (b"not json", "malformed"),
    (json.dumps({"v": P.PROTOCOL_VERSION, "kind": "nope"}).encode(),
     "unknown crossover message kind"),
    (json.dumps({"v": P.PROTOCOL_VERSION, "kind": "acquire", "seq": 1, "bogus": 2}).encode(),
     "unexpected fields"),
])
def test_bad_messages_are_named(raw, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(raw)


def test_policy_off_shows_overlaps(cluster: Cluster):
    """The overlap check in the MPI tests can fail: without coordination it does."""
    from crossover import trace

    with cluster.daemon(policy="off"):
        a, b = cluster.jobs_together(("A", 1, 400), ("B", 2, 400))
        a.wait(180)
        b.wait(180)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    spans = [s for dev in trace.holds_by_device(events).values() for s in dev]
    windows = {job: (min(s[0] for s in spans if s[2] == job), max(s[1] for s in spans
                                                                  if s[2] == job))
               for job in {s[2] for s in spans}}
    (a0, a1), (b0, b1) = windows.values()
    assert a0 < b1 and b0 < a1, f"the jobs did not run at the same time: {windows}"
    assert trace.overlaps(events)


def test_crossover_node_names_the_daemon_and_its_clients(tmp_path, monkeypatch):
    """CROSSOVER_NODE overrides hostname and fake nodes on both sides (emulated hosts)."""
    from crossover.daemon.node.ranks import node_identity
    from crossover.environment import node_name

    monkeypatch.setenv("CROSSOVER_NODE", "hostB")
    monkeypatch.setenv("CROSSOVER_FAKE_NODES", "2")
    name, cores = node_identity()
    assert name == "hostB" and cores == sorted(os.sched_getaffinity(0))
    assert node_name() == "hostB"
    run = tmp_path / "run"
    daemon = subprocess.Popen([PY, "-m", "crossover", "daemon", "--runtime-dir", str(run)],
                              cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "node-hostB.sock").exists():
            assert daemon.poll() is None, "daemon exited"
            assert time.monotonic() < deadline, "daemon socket did not appear"
            time.sleep(0.05)
        c = SlotClient("j", RankInfo(rank=1, size=2, local_rank=0, local_size=1),
                       runtime_dir=run, pin_cpu=False)
        assert c.coordinated and c.label is not None and c.label.startswith("hostB/")
        c.close()
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=10)


def test_a_job_alone_keeps_its_device_until_another_arrives(cluster: Cluster):
    """A rank with no other job on its device skips releases (no round trips); a newcomer
    is announced and served at the holder's next release point."""
    with cluster.daemon():
        a = client(cluster, "a")
        a.acquire()  # reads the daemon's notice: alone on cpu0
        a.release(Phase.COMMUNICATE)
        assert a.holding, "alone: the device is kept through communication"
        b = client(cluster, "b")
        b._seq = 1
        b._send(P.Acquire(1))
        wait_queued(cluster, "b")  # and a's company notice is on its way
        a.release(Phase.COMMUNICATE)  # sees the company now: really releases
        assert not a.holding
        b._await_grant()
        assert b.coordinated and not b._warned
        b.release(Phase.COMMUNICATE)  # b shares cpu0 with a: releases too
        assert not b.holding
        b.close()  # a is alone again, once the daemon has seen b leave
        wait_for(a._keep_alone, 30, "the daemon to tell a it is alone again")
        a.acquire()
        a.release(Phase.COMMUNICATE)
        assert a.holding
        a.close()


def test_only_a_jobs_rank_0_reports_progress(cluster: Cluster):
    """Every rank of a job steps together: one report per step (with the job's request
    points) is enough, and each costs CPU on the cores the jobs compute on. (Policy
    crossover: under auto the daemon would give these in-process clients a share of the
    cores, pinning pytest.)"""
    with cluster.daemon():
        # both on cpu0, with b: neither is alone on its device
        ranks = [SlotClient("a", RankInfo(r, 2, 0, 2), runtime_dir=cluster.runtime,
                            pin_cpu=False) for r in range(2)]
        b = client(cluster, "b")
        sent: dict[int, list] = {0: [], 1: []}
        for r, rank in enumerate(ranks):
            rank._send = sent[r].append
            wait_for(lambda rank=rank: rank._keep_alone() is not None and not rank._alone,
                     30, "the daemon to tell job a of its company")
            rank._pass_point()  # (as at a request or a point passed holding)
            rank._count_step()
        # with its request points: a switch to antiphase restarts the turns from them
        assert sent[0] == [P.Progress(steps=1, points=1)] and sent[1] == []
        assert ranks[1].steps == 1, "every rank counts its steps"
        for c in (*ranks, b):
            c.close()


def test_a_yield_passed_holding_counts_one_point_like_the_request_it_skips(cluster: Cluster):
    """A hand-marked loop under `priority` (acquire, release to communicate, yield at the
    step boundary) asks once a step with company: at the yield. Alone it keeps its device
    at the release and the yield, and must count one point a step too, or its turns run
    ahead of its peers' (scheduler.core). It counted two: the kept release and the kept
    yield."""
    with cluster.daemon(policy="priority"):
        a = client(cluster, "a")
        a.acquire()
        start = a._points
        for _ in range(3):
            a.acquire()
            a.release(Phase.COMMUNICATE)
            assert a.holding, "alone: the device is kept through communication"
            a.yield_slot()
        a.acquire()
        assert a._points - start == 3
        a.close()


def test_wakeups_never_block_when_the_pipe_is_full(tmp_path):
    """The peer thread and the signal handler wake the daemon through a pipe; with the
    pipe full (nobody draining it) a wake-up must return, not block."""
    from crossover.daemon import Daemon

    daemon = Daemon(runtime_dir=tmp_path / "run")
    done = threading.Event()

    def flood() -> None:
        for _ in range(200_000):  # far more bytes than a pipe holds
            daemon._wakeup()
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(60), "a full wake-up pipe blocked the writer"


def test_a_runtime_dir_with_the_wrong_mode_warns_and_trains_on(tmp_path, capsys):
    """A client never crashes its job: a 0755 runtime directory once raised AttributeError
    from the warning itself. Now one warning names the directory, mode, owner and fix."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    c = SlotClient("job", SOLO, runtime_dir=run, pin_cpu=False)
    c.acquire()  # uncoordinated: returns at once
    c.release()
    assert not c.coordinated and c.holding is False
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1, err
    assert str(run) in err and "mode 0o755" in err and f"uid {os.getuid()}" in err, err
    assert "remove it, or set CROSSOVER_RUNTIME_DIR" in err and "trains on uncoordinated" in err
    c.close()


def test_launchers_wait_for_the_socket_the_daemon_names(tmp_path, monkeypatch):
    """With CROSSOVER_NODE set, crossoverrun and the local runner used to wait for
    node-<hostname>.sock while the daemon listened on node-<CROSSOVER_NODE>.sock."""
    from crossover.launch.daemons import start_daemon
    from crossover.launch.local import DaemonProcess

    monkeypatch.setenv("CROSSOVER_NODE", "emulated-host")
    daemon = DaemonProcess(tmp_path / "local", timeout_s=20)
    try:
        assert (tmp_path / "local" / "node-emulated-host.sock").exists()
    finally:
        daemon.stop()
    rdir = tmp_path / "cli"
    rdir.mkdir(mode=0o700)
    try:
        start_daemon(rdir, "auto", ["localhost"], 30)
        assert (rdir / "node-emulated-host.sock").exists()
    finally:
        pid = int((rdir / "daemon.pid").read_text())
        os.killpg(pid, signal.SIGTERM)


PINNED = """
import os, sys
from crossover.client import RankInfo, SlotClient
c = SlotClient("pinned", RankInfo(0, 1, 0, 1), runtime_dir=sys.argv[1], pin_cpu=True)
c.acquire()
print("pinned", sorted(os.sched_getaffinity(0)), flush=True)
sys.stdin.readline()  # the test kills the daemon meanwhile
c.release()
c.acquire()  # finds the daemon gone: fails open
print("after", sorted(os.sched_getaffinity(0)), c.coordinated, flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 cores")
def test_a_rank_that_loses_its_daemon_is_unpinned(cluster: Cluster):
    """Uncoordinated, a rank is plain co-located: pinned to one core with the other
    job's rank and spinning in its allreduce, two jobs once ran 100x slower after their
    daemon died."""
    with cluster.daemon(policy="crossover") as daemon:
        proc = subprocess.Popen([PY, "-c", PINNED, str(cluster.runtime)], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline().split(" ", 1)
        daemon.kill(signal.SIGKILL)
        out, _ = proc.communicate("\n", timeout=30)
    everywhere = sorted(os.sched_getaffinity(0))
    assert first[0] == "pinned" and json.loads(first[1]) != everywhere
    assert out.strip() == f"after {everywhere} False"


@pytest.mark.parametrize("native", ["1", "0"], ids=["table", "socket"])
def test_a_dormant_job_is_no_company_until_it_asks_again(cluster: Cluster, native):
    """A job idle for --patience is dormant: the job beside it keeps its device through
    communication instead of handing it to nobody. The dormant job's request reaches the
    daemon at once (through the table too), the holder is told, and hands over at its
    next release point."""
    cluster.env["CROSSOVER_NATIVE"] = native
    with cluster.daemon(extra=("--patience", "2")):
        a, b = client(cluster, "a"), client(cluster, "b")
        b.acquire()
        b.release(Phase.IDLE)
        a.acquire()
        a.release(Phase.COMMUNICATE)
        assert not a.holding, "b idled a moment ago: it is still company"
        wait_for(a._keep_alone, 30, "the daemon to tell a that b is dormant")
        out = subprocess.run([PY, "-m", "crossover", "status", "--once", "--runtime-dir",
                              str(cluster.runtime)], capture_output=True, text=True,
                             timeout=30, cwd=REPO, check=True).stdout
        assert "b (dormant): " in out and "a (dormant)" not in out, out
        a.acquire()
        a.release(Phase.COMMUNICATE)
        assert a.holding, "b is dormant: a keeps the device"
        asked = threading.Thread(target=b.acquire)
        asked.start()
        deadline = time.monotonic() + 10  # the lease (30 s) would end it otherwise
        while a.holding and time.monotonic() < deadline:
            a.release(Phase.COMMUNICATE)  # a's release points, one per "step"
            time.sleep(0.01)
        assert not a.holding, "a was not told that b asked"
        asked.join(10)
        assert b.holding and not b._warned
        a.close()
        b.close()


def test_the_leader_tells_the_node_that_runs_ahead_to_hand_over_later(tmp_path):
    """`--align-phases`: ranks' allreduce waits reach the leader, which sends a delay to
    the node whose turns run ahead; that node delays its shared devices' hand-over."""
    from crossover.daemon import Daemon

    daemon = Daemon(runtime_dir=tmp_path / "run", policy="crossover", align_phases=True)
    sent = []
    daemon.peers.send = lambda dest, obj: sent.append((dest, obj))
    daemon.peers.broadcast = lambda obj: sent.extend((d, obj) for d in (0, 1))
    for node in (0, 1):
        for job in ("A", "B"):
            daemon.peers.inbox.put((node, ("join", job), None))
    # node 0's ranks wait 40 ms longer for both jobs' allreduces: its turns run ahead
    for node, job, wait_s in [(0, "A", 0.06), (1, "A", 0.02), (0, "B", 0.065),
                              (1, "B", 0.02)]:
        daemon.peers.inbox.put((node, ("waited", job, wait_s), None))
    daemon._handle_peers()
    wait_for(lambda: daemon.leader.handled >= 8, 10, "the leader's thread to handle them")
    delays = [(dest, msg) for dest, msg in sent if msg[0] == "delay"]
    assert delays == [(0, ("delay", pytest.approx(0.04), pytest.approx(0.04)))]
    # this node, told so, delays the next hand-over of a device two jobs share
    for job in ("A", "B"):
        daemon.sched.register(job, 0, "cpu0", (0, job))
    daemon.sched.register("C", 0, "cpu1", (0, "C"))
    daemon.peers.inbox.put((0, ("delay", 0.04, 0.04), None))
    daemon._handle_peers()
    assert daemon.handovers_delayed == 1
    assert daemon.sched._devices["cpu0"].handover_delay == 0.04
    assert daemon.sched._devices["cpu1"].handover_delay == 0.0  # no company there


def test_without_align_phases_waits_are_not_forwarded(tmp_path):
    from crossover.daemon import Daemon

    daemon = Daemon(runtime_dir=tmp_path / "run", policy="crossover")
    assert daemon.leader.aligner is None
    sent = []
    daemon.peers.send = lambda dest, obj: sent.append((dest, obj))
    daemon.peers.inbox.put((1, ("waited", "A", 0.5), None))
    daemon.peers.inbox.put((1, ("join", "A"), None))  # a marker: handled after the wait
    daemon._handle_peers()
    wait_for(lambda: daemon.leader.handled >= 2, 10, "the leader's thread to handle both")
    assert sent == []  # nothing for the wait (nor the join: the job carries its order)


@pytest.mark.parametrize("align", [False, True])
def test_ranks_report_their_waits_only_to_daemons_that_align(cluster: Cluster, align):
    """`Waited` reports serve `--align-phases` alone: without it the Welcome tells the
    ranks not to send them (each would cost CPU on the cores the jobs compute on)."""
    with cluster.daemon(extra=("--align-phases",) if align else ()):
        a, b = client(cluster, "a"), client(cluster, "b")  # both on cpu0: company
        wait_for(lambda: a._keep_alone() is not None and not a._alone, 30,
                 "the daemon to tell job a of its company")
        sent: list = []
        a._send = sent.append
        for _ in range(4):
            a.note_wait(0.02)
            time.sleep(0.2)
        assert [type(m) for m in sent] == ([P.Waited] if align else []), sent
        a.close()
        b.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
@pytest.mark.parametrize("shares", [True, False])
def test_concurrent_cpu_jobs_get_core_shares_unless_switched_off(cluster: Cluster, shares):
    """Policy auto serves two CPU jobs of this host concurrently; each is told a share of
    the host's cores, or none with `--no-core-shares`."""
    host = sorted(os.sched_getaffinity(0))  # a share pins this process: give it back after
    with cluster.daemon(policy="auto", extra=() if shares else ("--no-core-shares",)):
        a, b = client(cluster, "a"), client(cluster, "b")
        try:
            def told() -> bool:  # both have heard of the other, in concurrent mode
                for c in (a, b):
                    c.acquire()
                    c.release(Phase.COMMUNICATE)
                return all(not c._alone and c._mode is Mode.CONCURRENT for c in (a, b))

            wait_for(told, 30, "the company notices")
            got = [a._pinning.share, b._pinning.share]
            if shares:
                assert all(got) and not set(got[0]) & set(got[1]), got
            else:
                assert got == [[], []]
        finally:
            a.close()
            b.close()
            pin_process(host)  # every thread, as the share was applied
