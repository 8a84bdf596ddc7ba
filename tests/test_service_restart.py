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
        killed = []
        for _ in range(3):
            pid = fake1(cluster)["daemon"]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_for(lambda pid=pid: (fake1(cluster) or {}).get("daemon", {}).get(
                "pid", pid) != pid, 15, "a new service on fake1")
        now = fake1(cluster)
        assert now["world"]["generation"] == first["world"]["generation"]
        assert now["world"]["relay_pid"] == first["world"]["relay_pid"]
        log = (cluster.tmp / "daemon.log").read_text()
        restarts = re.findall(r"relay of node fake1: its service \(process (\d+)\) died; "
                              r"starting another \((\d+) of", log)
        assert restarts == [(str(pid), str(n)) for n, pid in enumerate(killed, 1)], log
