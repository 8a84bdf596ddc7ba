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
            # the relay logs through mpirun, a moment behind the services' own lines
            return re.findall(r"relay of node fake1: its service \(process (\d+)\) died; "
                              r"starting another \((\d+) of",
                              (cluster.tmp / "daemon.log").read_text())
        wait_for(lambda: len(restarts()) >= 3, 10, "the relay's third restart in its log")
        assert restarts() == [(str(pid), str(n)) for n, pid in enumerate(killed, 1)], \
            (cluster.tmp / "daemon.log").read_text()
