"""Launchers of a job's ranks on the emulated hosts (`cluster.EmulatedCluster`) or on
this host, run as a script inside host 0's namespace:

    python -m bench.harness.rank_launch gloo-run SPEC_JSON command...   # a Horovod Gloo job
    python -m bench.harness.rank_launch torchrun SPEC_JSON command...   # torchrun on each host

`EmulatedCluster.gloo_run` and `.torchrun` (and `local_gloo_run`, for one host) write
these command lines. Each launcher starts every rank, and the first failure or the
timeout kills them all.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: The link's interface name inside every emulated host.
LINK = "xolink"


def local_gloo_run(np: int, argv: list[str], timeout_s: float = 600.0) -> list[str]:
    """A command line running `argv` as an `np`-rank Horovod Gloo job on this host.

    The same launcher as `cluster.EmulatedCluster.gloo_run`, without namespaces: for machines
    where the job's ranks share one host (a single-GPU machine), and where Horovod's own
    `horovodrun` is not at hand.
    """
    spec = json.dumps({"local": np, "timeout_s": timeout_s})
    return [sys.executable, str(Path(__file__).resolve()), "gloo-run", spec, *argv]


def _rank_launches(spec: dict, argv: list[str]) -> tuple[str, list]:
    """The rendezvous address and, per rank, (slot, environment, command line)."""
    from horovod.runner.common.util.hosts import SlotInfo

    if "local" in spec:  # every rank on this host, over loopback
        n = spec["local"]
        return "127.0.0.1", [
            (SlotInfo(hostname="localhost", rank=i, local_rank=i, cross_rank=0, size=n,
                      local_size=n, cross_size=1), {"HOROVOD_GLOO_IFACE": "lo"}, argv)
            for i in range(n)]
    hosts, n = spec["hosts"], len(spec["hosts"])
    return spec["addrs"][0], [
        (SlotInfo(hostname=h, rank=i, local_rank=0, cross_rank=i, size=n, local_size=1,
                  cross_size=n), {"HOROVOD_GLOO_IFACE": LINK, "CROSSOVER_NODE": h},
         in_host(h, spec["cores"][i], argv))
        for i, h in enumerate(hosts)]


def _gloo_run(spec: dict, argv: list[str]) -> int:
    """Serve Horovod's Gloo rendezvous and run the job's ranks (one per emulated host, or
    all on this host); the first failure or the timeout kills every rank. Returns the
    first non-zero exit status, else 0."""
    from horovod.runner.http.http_server import RendezvousServer

    addr, launches = _rank_launches(spec, argv)
    server = RendezvousServer()
    port = server.start()
    server.init([slot for slot, _, _ in launches])
    procs = []
    for slot, extra, cmd in launches:
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
               "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": slot.hostname,
               "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
               "HOROVOD_LOCAL_RANK": str(slot.local_rank),
               "HOROVOD_LOCAL_SIZE": str(slot.local_size),
               "HOROVOD_CROSS_RANK": str(slot.cross_rank),
               "HOROVOD_CROSS_SIZE": str(slot.cross_size), **extra}
        procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True))
    try:
        return _wait_all(procs, spec["timeout_s"])
    finally:
        server.stop()


def _torchrun(spec: dict, argv: list[str]) -> int:
    """Run torchrun on each emulated host (one rank each, node rank = host index) with
    its static rendezvous at host 0, which this process runs in; the first failure or the
    timeout kills every host's torchrun. Returns as `_gloo_run`."""
    hosts, addr = spec["hosts"], spec["addrs"][0]
    with socket.socket() as probe:  # a free port on host 0's address for the store
        probe.bind((addr, 0))
        port = probe.getsockname()[1]
    procs = []
    for i, host in enumerate(hosts):
        cmd = [sys.executable, *spec["launcher"], "--nnodes", str(len(hosts)),
               "--nproc-per-node", "1", "--node-rank", str(i), "--master-addr", addr,
               "--master-port", str(port), "--no-python", *argv]
        procs.append(subprocess.Popen(in_host(host, spec["cores"][i], cmd),
                                      env={**os.environ, "GLOO_SOCKET_IFNAME": LINK},
                                      start_new_session=True))
    return _wait_all(procs, spec["timeout_s"])


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> int:
    """Wait for every process; at the first failure or after `timeout_s`, SIGKILL the
    rest (their process groups). Returns the first non-zero exit status (124 on the
    timeout), else 0."""
    deadline = time.monotonic() + timeout_s
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rc = failed[0] if failed else 124
                break
            time.sleep(0.05)
        return rc or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def in_host(host: str, core: int, argv: list[str]) -> list[str]:
    """`argv` run on emulated host `host`: in its network namespace, pinned to `core`."""
    # Its own UTS namespace too: network namespaces share the hostname, and Horovod's Gloo
    # resolves the hostname for its process-set contexts (the shared one is 127.0.0.1).
    return ["ip", "netns", "exec", host, "unshare", "--uts", "/bin/sh", "-c",
            'hostname "$0" && core=$1 && shift && '
            'exec env CROSSOVER_NODE="$0" taskset -c "$core" "$@"', host,
            str(core), *argv]


if __name__ == "__main__":
    runners = {"gloo-run": _gloo_run, "torchrun": _torchrun}
    if len(sys.argv) < 4 or sys.argv[1] not in runners:
        sys.exit("usage: rank_launch.py gloo-run|torchrun SPEC_JSON command... (see "
                 "EmulatedCluster.gloo_run and .torchrun)")
    sys.exit(runners[sys.argv[1]](json.loads(sys.argv[2]), sys.argv[3:]))
