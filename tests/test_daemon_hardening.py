"""What a real node produces that once stopped the daemon, stalled every step, or
crashed a job: each case against a real daemon process (a fake only where noted)."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import threading
import time

import pytest

from crossover import protocol as P
from crossover.client import RankInfo, SlotClient
from crossover.daemon.relay.launch import relay_mca_flags
from crossover.protocol import Phase
from crossover.transport import recv_msg, runtime_dir
from tests.conftest import PY, REPO, Cluster, mpirun, wait_for
from tests.test_daemon import start_holder

pytestmark = pytest.mark.mpi  # real processes

SOLO = RankInfo(rank=0, size=1, local_rank=0, local_size=1)


def client(c: Cluster, job: str, info: RankInfo = SOLO, **kw) -> SlotClient:
    return SlotClient(job, info, runtime_dir=c.runtime, pin_cpu=False, **kw)


def raw(c: Cluster, *msgs: P.Message, timeout: float = 5.0) -> tuple[socket.socket, P.Message]:
    """A connection that sends `msgs` and reads the first answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(next(c.runtime.glob("node-*.sock"))))
    for msg in msgs:
        body = P.encode(msg)
        sock.sendall(len(body).to_bytes(4, "big") + body)
    return sock, recv_msg(sock)


def hello(job: str, rank: int = 0, size: int = 1, pid: int = 1, weight: float = 1.0,
          gpu: int | None = None, local_rank: int = 0) -> P.Hello:
    return P.Hello(job, rank, size, local_rank, size, pid, weight, gpu)


def round_trip(c: Cluster, job: str = "good") -> None:
    """A well-behaved rank is still served."""
    ok = client(c, job)
    try:
        ok.acquire()
        assert ok.coordinated, "the daemon must still grant to a good client"
        ok.release(Phase.IDLE)
    finally:
        ok.close()


@pytest.mark.parametrize("pid", [2**31, 2**62])
def test_a_pid_past_32_bits_is_refused_and_the_daemon_lives(cluster: Cluster, pid):
    with cluster.daemon() as daemon:
        sock, reply = raw(cluster, hello("bigpid", pid=pid))
        sock.close()
        assert isinstance(reply, P.Error) and "invalid pid" in reply.message, reply
        assert daemon.popen.poll() is None
        round_trip(cluster)


@pytest.mark.parametrize("batch_job", ["x" * 65, "42\n43"])
def test_a_batch_job_id_that_is_no_id_is_refused_and_the_daemon_lives(cluster: Cluster,
                                                                       batch_job):
    with cluster.daemon() as daemon:
        sock, reply = raw(cluster, P.Hello("batch", 0, 1, 0, 1, 1, batch_job=batch_job))
        sock.close()
        assert isinstance(reply, P.Error) and "invalid batch_job" in reply.message, reply
        assert daemon.popen.poll() is None
        round_trip(cluster)


def test_a_rank_in_another_batch_job_than_its_jobs_is_refused(cluster: Cluster):
    """A job's ranks on a node run in one batch job: a rank that says another (a second
    job under the same name, or a label borrowed) is refused by name."""
    with cluster.daemon() as daemon:
        first, reply = raw(cluster, P.Hello("twice", 0, 2, 0, 2, 1, batch_job="100"))
        try:
            assert isinstance(reply, P.Welcome), reply
            other, reply = raw(cluster, P.Hello("twice", 1, 2, 1, 2, 1, batch_job="200"))
            other.close()
            assert isinstance(reply, P.Error) and "batch job '200'" in reply.message \
                and "['100']" in reply.message, reply
        finally:
            first.close()
        assert daemon.popen.poll() is None


def test_ranks_of_one_new_job_with_different_weights(cluster: Cluster):
    """Read in one pass, before their job has its order: one is refused by name, the
    daemon lives, and the refused rank can join again with the job's weight."""
    with cluster.daemon() as daemon:
        a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = str(next(cluster.runtime.glob("node-*.sock")))
        for sock, msg in ((a, hello("w", 0, 2, weight=1.0)), (b, hello("w", 1, 2, weight=2.0))):
            sock.settimeout(5)
            sock.connect(path)
            body = P.encode(msg)
            sock.sendall(len(body).to_bytes(4, "big") + body)
        first, second = recv_msg(a), recv_msg(b)
        assert isinstance(first, P.Welcome), first
        assert isinstance(second, P.Error) and "CROSSOVER_PRIORITY" in second.message
        b.close()
        assert daemon.popen.poll() is None
        again, reply = raw(cluster, hello("w", 1, 2, weight=1.0))
        assert isinstance(reply, P.Welcome), reply  # not "connected already"
        again.close()
        a.close()
        round_trip(cluster)


def test_a_rank_refused_at_registration_can_join_again(cluster: Cluster):
    """A rank the scheduler refuses when it registers leaves nothing behind: its
    (job, rank) is free for the next hello."""
    with cluster.daemon():
        first, reply = raw(cluster, hello("dup", 0, 1))
        assert isinstance(reply, P.Welcome)
        second, reply = raw(cluster, hello("dup", 0, 1))
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.DUPLICATE
        second.close()
        first.close()
        wait_for(lambda: "job dup rank 0 left" in cluster.procs[0].output(), 10, "the leave")
        third, reply = raw(cluster, hello("dup", 0, 1))
        assert isinstance(reply, P.Welcome), reply
        third.close()


@pytest.mark.parametrize("native", ["1", "0"])
def test_seventy_devices_through_a_company_change(cluster: Cluster, native):
    """70 GPUs on one node: past the table's 64 devices, and with the table off, a
    company change re-plans every device without a lookup that fails."""
    cluster.env["CROSSOVER_NATIVE"] = native
    with cluster.daemon() as daemon:
        alone = [client(cluster, f"a{i}", gpu=i) for i in range(70)]
        for c in alone:
            c.acquire()
            c.release(Phase.IDLE)
        # Company on the 70th device: the last job there and a newcomer take turns.
        late = client(cluster, "late", gpu=69)
        for c in (alone[69], late, alone[69], late):
            c.acquire()
            assert c.coordinated and c.device == "gpu69"
            c.release(Phase.IDLE)
        assert daemon.popen.poll() is None, daemon.output()
        for c in [*alone, late]:
            assert c.coordinated
            c.close()
        round_trip(cluster)
    assert "Traceback" not in cluster.procs[0].output()


@pytest.mark.parametrize("opening", [False, True])
def test_json_nested_past_the_parsers_stack_is_refused(cluster: Cluster, opening):
    with cluster.daemon() as daemon:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(str(next(cluster.runtime.glob("node-*.sock"))))
        if opening:
            body = P.encode(hello("deep"))
            sock.sendall(len(body).to_bytes(4, "big") + body)
            assert isinstance(recv_msg(sock), P.Welcome)
        body = b"[" * 60_000
        sock.sendall(len(body).to_bytes(4, "big") + body)
        replies = []
        while not replies or not isinstance(replies[-1], P.Error):
            replies.append(recv_msg(sock))
        assert "malformed crossover message" in replies[-1].message
        sock.close()
        assert daemon.popen.poll() is None, daemon.output()
        round_trip(cluster)


def test_a_ring_without_a_table_is_ignored(cluster: Cluster):
    """A doorbell from a rank of a daemon that has no slot table (CROSSOVER_NATIVE=0, or
    no compiled module) once made it look the device up in a table that is not there."""
    cluster.env["CROSSOVER_NATIVE"] = "0"
    with cluster.daemon() as daemon:
        sock, welcome = raw(cluster, hello("ringer"))
        assert isinstance(welcome, P.Welcome) and not welcome.table
        body = P.encode(P.Ring())
        sock.sendall(2 * (len(body).to_bytes(4, "big") + body))
        round_trip(cluster)
        sock.close()
        assert daemon.popen.poll() is None, daemon.output()


HOLD_MUTEX = """
import ctypes, mmap, sys, time
from crossover import _native
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 0)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
mutex = ctypes.c_void_p(base + _native.DEVICE_OFFSET + int(sys.argv[2]) * _native.DEVICE_SIZE)
libc = ctypes.CDLL(None)
assert libc.pthread_mutex_lock(mutex) == 0
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
libc.pthread_mutex_unlock(mutex)
print("unlocked", flush=True)
time.sleep(600)
"""


def table_state(c: Cluster, check) -> bool:
    """`check` of this node's status report (its devices, its slot table's queues)."""
    from crossover.probe import daemon_status

    (node,) = daemon_status(c.runtime).values()
    return check(node)


def hold_mutex(c: Cluster, device: int, seconds: float) -> subprocess.Popen:
    """A process that holds a device's table mutex for `seconds`, as a rank stopped
    inside it would (then keeps living: the mutex is not left to a dead owner)."""
    table = next(c.runtime.glob("node-*.slots"))
    proc = subprocess.Popen([PY, "-c", HOLD_MUTEX, str(table), str(device), str(seconds)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_change_waits_for_a_busy_table_mutex(cluster: Cluster):
    """While a device's mutex is held, a socket request is not granted past the
    table's plan: after the mutex frees, the plan that let anyone in at once is gone,
    so a second job's request through the table waits for the first to release."""
    with cluster.daemon(policy="crossover") as daemon:
        a, b = client(cluster, "a"), client(cluster, "b")
        for c in (a, b):  # both known to the daemon, both idle: the plan admits either
            c.acquire()
            c.release(Phase.IDLE)
        wait_for(lambda: table_state(cluster, lambda node: node["devices"]["cpu0"]["holder"]
                                     is None and "cpu0" not in node["table"]["plans_pending"]),
                 10, "the plan for the idle device to be published")
        holder = hold_mutex(cluster, 0, 1.0)
        try:
            a.acquire()  # the table refuses after 0.5 s: asks over its socket
            assert a.coordinated
            assert holder.stdout.readline().strip() == "unlocked"
            got = threading.Event()
            thread = threading.Thread(target=lambda: (b.acquire(), got.set()))
            thread.start()
            assert not got.wait(1.0), "b was granted while a holds the device"
            a.release(Phase.IDLE)
            assert got.wait(10), "b was never granted"
            thread.join(10)
            b.release(Phase.IDLE)
        finally:
            holder.kill()
            holder.wait()
        assert daemon.popen.poll() is None
    assert "the fast path granted slots" not in cluster.procs[0].output()


def test_a_mutex_stuck_past_the_fence_sends_its_ranks_to_the_socket(cluster: Cluster):
    with cluster.daemon(policy="crossover") as daemon:
        a, b = client(cluster, "a"), client(cluster, "b")
        holder = hold_mutex(cluster, 0, 600)
        try:
            for _ in range(3):
                for c in (a, b):
                    c.acquire()
                    assert c.coordinated
                    c.release(Phase.IDLE)
            wait_for(lambda: "stayed busy" in daemon.output(), 15, "the fence")
            took = []
            for _ in range(5):  # fenced: the table refuses at once, the socket serves
                start = time.monotonic()
                a.acquire()
                took.append(time.monotonic() - start)
                a.release(Phase.IDLE)
            # (a wait for the busy table costs each acquire 0.5 s; a loaded host, a few)
            assert a.coordinated and statistics.median(took) < 0.4, took
        finally:
            holder.kill()
            holder.wait()
        assert daemon.popen.poll() is None
    out = cluster.procs[0].output()
    assert re.search(r"mutex of cpu0 stayed busy for \d+ s .*pids there: \[\d+, \d+\]", out)


def test_a_stopped_daemon_costs_one_grant_timeout_then_heals(cluster: Cluster, capsys):
    cluster.env["CROSSOVER_NATIVE"] = "0"  # every request waits for the daemon
    with cluster.daemon(lease=1.0) as daemon:  # grant timeout 2 x 1 + 5 = 7 s
        c = client(cluster, "job")
        c.acquire()
        c.release(Phase.IDLE)
        os.kill(daemon.popen.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            c.acquire()
            first = time.monotonic() - start
            assert not c.coordinated and 6 < first < 12, first
            c.release(Phase.IDLE)
            spent = 0.0
            for _ in range(20):  # uncoordinated: no step waits for the stopped daemon
                start = time.monotonic()
                c.acquire()
                c.release(Phase.IDLE)
                spent += time.monotonic() - start
                time.sleep(0.05)
            assert spent < 2.0, spent  # (a step that waited would take seconds)
        finally:
            os.kill(daemon.popen.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not c.coordinated and time.monotonic() < deadline:
            c.acquire()
            c.release(Phase.IDLE)
            time.sleep(0.1)
        assert c.coordinated and c.reconnects == 1
        c.close()
    err = capsys.readouterr().err
    assert err.count("the crossover daemon is stopped or stuck") == 1
    assert "is coordinated again" in err


def test_a_socket_above_descriptor_1024_does_not_crash_the_job(cluster: Cluster):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with cluster.daemon():
            other = client(cluster, "other")  # company: the rank releases at every phase
            c = client(cluster, "high")
            assert c._sock.fileno() >= 1024
            for _ in range(3):
                c.acquire()
                c.release(Phase.COMMUNICATE)  # reads the daemon's notices first
                c.acquire()
                c.release(Phase.IDLE)
            assert c.coordinated
            c.close()
            other.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_refused_hello_lets_the_job_train_on(cluster: Cluster, capsys):
    """Only another version and a duplicate rank stop a job; a job name over the limit
    (any other refusal) warns and trains on uncoordinated."""
    with cluster.daemon():
        c = client(cluster, "x" * 300)
        c.acquire()
        c.release(Phase.IDLE)
        assert not c.coordinated
        c.close()
    err = capsys.readouterr().err
    assert "crossover daemon refused job" in err and "invalid job" in err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1.0"])
def test_a_wait_report_that_is_no_duration_is_refused_at_decode(cluster: Cluster, value):
    body = f'{{"v": {P.PROTOCOL_VERSION}, "kind": "waited", "wait_s": {value}}}'.encode()
    with pytest.raises(P.ProtocolError, match="field wait_s"):
        P.decode(body)
    with cluster.daemon(extra=("--align-phases",)) as daemon:
        sock, welcome = raw(cluster, hello("w"))
        assert isinstance(welcome, P.Welcome)
        sock.sendall(len(body).to_bytes(4, "big") + body)
        replies = []
        while not replies or not isinstance(replies[-1], P.Error):
            replies.append(recv_msg(sock))
        assert "field wait_s" in replies[-1].message
        sock.close()
        assert daemon.popen.poll() is None
        round_trip(cluster)


def test_a_runtime_dir_that_is_a_symlink_is_refused(tmp_path):
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match="is a symbolic link.*CROSSOVER_RUNTIME_DIR"):
        runtime_dir(link, create=True)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        runtime_dir(link, create=False)


def test_a_runtime_dir_of_another_user_is_refused_by_name(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)  # (the tests run as root)
    with pytest.raises(PermissionError, match="uid 12345.*another user may have made it"):
        runtime_dir(d, create=True)


def test_the_session_runtime_dir_is_preferred(tmp_path, monkeypatch):
    monkeypatch.delenv("CROSSOVER_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir(create=True) == tmp_path / "crossover"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(runtime_dir(create=False)) == f"/tmp/crossover-{os.getuid()}"


def test_a_rank_that_leaves_before_its_job_has_an_order_is_forgotten(cluster: Cluster):
    """Two daemons: a rank of a new job says hello to the second and hangs up before
    the leader's order comes back. The leader must forget the job, or its idle
    shutdown never fires; then every node stops, and so does the world's mpirun."""
    env = dict(cluster.env, CROSSOVER_FAKE_NODES="2")
    log = cluster.tmp / "daemons.log"
    services = cluster.runtime / "daemon.log"

    def logs() -> str:
        return f"{log.read_text()}\n--- the services' log ---\n{services.read_text()}"
    with open(log, "w") as out:
        daemons = subprocess.Popen(
            mpirun(2, *relay_mca_flags(), PY, "-m", "crossover", "daemon", "--idle-shutdown",
                   "3"), env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        sock1 = cluster.runtime / "node-fake1.sock"
        wait_for(sock1.exists, 60, "the second daemon")
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock1))
            body = P.encode(hello("ghost"))
            s.sendall(len(body).to_bytes(4, "big") + body)
            s.close()  # before the order: the leader is a message away
        wait_for(lambda: "no job for 3 s: shutting down" in services.read_text(), 30,
                 "the leader's idle shutdown")
        wait_for(lambda: not any(cluster.runtime.glob("node-*.sock")), 30,
                 "every node's service to stop")
        assert daemons.wait(timeout=30) == 0, logs()
    finally:
        if daemons.poll() is None:
            daemons.kill()
    # the leader's stop reached the other node: both relays of the world ended on it
    # (a node never told takes the leader for lost and forms a world of its own); the
    # relays log to the runtime directory, beside their services
    relays = services.read_text()
    assert relays.count("(generation 0) ends: stop") == 2, logs()
    assert "did not return" not in relays, logs()


def test_a_busy_mutex_on_one_device_does_not_hold_the_leases_of_another(cluster: Cluster):
    """Nothing queued, one device's mutex stuck: a hung holder on another device still
    loses its slot, once the stuck device is fenced."""
    with cluster.daemon(lease=1.0) as daemon:
        other = client(cluster, "other", RankInfo(0, 1, 1, 1))  # cpu1: table device 0
        assert other.device == "cpu1"
        holder = start_holder(cluster)  # cpu0, hung while holding
        stuck = hold_mutex(cluster, 0, 600)
        try:
            waiter = client(cluster, "waiter")
            start = time.monotonic()
            waiter.acquire()
            took = time.monotonic() - start
            assert waiter.coordinated and took < 8, took  # lease 1 s + fence 2 s + slack
            waiter.close()
        finally:
            for proc in (stuck, holder):
                proc.kill()
                proc.wait()
        other.close()
        assert daemon.popen.poll() is None
    assert "job holder rank 0 held cpu0 past its 1 s lease" in cluster.procs[0].output()


def test_a_rank_registered_behind_a_busy_mutex_keeps_its_job(cluster: Cluster):
    """Its job's only registered rank leaves while its registration waits: the job is
    not forgotten under it, and it is welcomed once the mutex frees."""
    with cluster.daemon() as daemon:
        first, reply = raw(cluster, hello("j", 0, 2))
        assert isinstance(reply, P.Welcome)
        stuck = hold_mutex(cluster, 0, 1.0)
        try:
            second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            second.settimeout(10)
            second.connect(str(next(cluster.runtime.glob("node-*.sock"))))
            body = P.encode(hello("j", 1, 2))
            second.sendall(len(body).to_bytes(4, "big") + body)
            wait_for(lambda: table_state(cluster, lambda node: node["table"]["changes_waiting"]
                                         >= 1), 10, "the registration to wait for the mutex")
            first.close()
            reply = recv_msg(second)
            assert isinstance(reply, P.Welcome), reply
            second.close()
        finally:
            stuck.kill()
            stuck.wait()
        assert daemon.popen.poll() is None


def test_healing_never_connects_into_a_directory_it_would_refuse(tmp_path, capsys):
    run = tmp_path / "run"
    c = SlotClient("heal", SOLO, runtime_dir=run, pin_cpu=False)  # no directory: fail open
    assert not c.coordinated
    run.mkdir(mode=0o777)
    run.chmod(0o777)  # someone else's doing: anyone may put a socket here
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(c.path))
    listener.listen(8)
    listener.setblocking(False)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            c.acquire()
            c.release(Phase.IDLE)
            time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            listener.accept()  # never connected to
        assert not c.coordinated
    finally:
        listener.close()
        c.close()
    assert "not reconnecting" in capsys.readouterr().err
