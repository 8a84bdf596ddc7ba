"""A node's service that dies is started again by its relay: once per death, in the same
generation of the world (a world of 2 fake-node daemons under mpirun)."""

from __future__ import annotations

import os
import re
import signal

import pytest

from crossover.probe import daemon_status
from tests.conftest import Cluster, wait_for

pytestmark = pytest.mark.mpi


def fake1(cluster: Cluster) -> dict | None:
    """fake1's part of the status that fake0's daemon gives, or None while it has none."""
    try:
        return daemon_status(cluster.runtime, "fake0", timeout_s=5.0).get("fake1")
    except ConnectionError:
        return None


def test_each_death_of_a_service_costs_one_restart_and_no_new_generation(cluster: Cluster):
    """SIGKILL fake1's service three times: each time its relay starts exactly one new
    service (a killed process closes its sockets one by one as it ends: a relay that
    connected to the dying one's listener spent a restart on it, and five restarts in a
    minute leave the node to a new generation), and the world keeps its generation."""
    with cluster.daemon(nodes=2):
        wait_for(lambda: fake1(cluster) is not None, 30, "fake1 in the world")
        first = fake1(cluster)
        now, killed = first, []
        for _ in range(3):
            os.kill(now["daemon"]["pid"], signal.SIGKILL)
            killed.append(now["daemon"]["pid"])
            seen: list[dict] = []

            def replaced(seen: list[dict] = seen) -> bool:
                snap = fake1(cluster)
                if snap is not None and snap["daemon"]["pid"] != killed[-1]:
                    seen.append(snap)
                return bool(seen)
            wait_for(replaced, 15, "a new service on fake1")
            now = seen[0]
        assert now["world"]["generation"] == first["world"]["generation"]
        assert now["world"]["relay_pid"] == first["world"]["relay_pid"]

        def restarts() -> list[tuple[str, str]]:
            return re.findall(r"relay of node fake1: its service \(process (\d+)\) died; "
                              r"starting another \((\d+) of",
                              (cluster.tmp / "daemon.log").read_text())
        wait_for(lambda: len(restarts()) >= 3, 10, "the relay's third restart in its log")
        assert restarts() == [(str(pid), str(n)) for n, pid in enumerate(killed, 1)], \
            (cluster.tmp / "daemon.log").read_text()


def test_a_relay_waits_for_a_service_that_another_relay_is_starting(tmp_path, monkeypatch):
    """A new generation's relay finds no service listening on its node, but another
    relay's service is starting there (it holds the node's lock): the service the relay
    starts exits (RUNNING_EXIT) and the relay connects to the other once it listens,
    rather than give its node up."""
    import fcntl
    import socket
    import threading
    import time

    from crossover.daemon.relay.launch import relay_path
    from crossover.daemon.relay.process import Relay

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("CROSSOVER_RUNTIME_DIR", str(runtime))
    lock = open(runtime / "node-fake7.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other service, starting
    relay = Relay(1, "fake7", ["fake7"], ["daemon"], str(runtime))
    started: list = []
    real_start = relay._start_service
    monkeypatch.setattr(relay, "_start_service",
                        lambda name: started.append(real_start(name)) or started[-1])

    def listen_late() -> None:  # once the relay's own service has exited
        wait_for(lambda: bool(started) and started[0].poll() is not None, 30,
                 "the relay's service to exit")
        time.sleep(0.5)
        server.bind(str(relay_path("fake7", runtime)))
        server.listen(1)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    thread = threading.Thread(target=listen_late, daemon=True)
    thread.start()
    try:
        sock = relay._find_service("fake7")
        assert started[0].returncode == 3 and len(started) == 1
        peer, _ = server.accept()
        assert peer.getsockname() == sock.getpeername()
        sock.close()
        peer.close()
    finally:
        thread.join(30)
        server.close()
        lock.close()
