"""An emulated cluster on one machine: network namespaces on a bridge, shaped links.

    with EmulatedCluster(mbit=1000) as c:      # as root; hosts=3 for three
        c.shape(500, delay_ms=0.5)               # re-shape without rebuilding
        subprocess.run(c.mpirun(["python", "job.py"]), env=..., timeout=300)
        c.cut(0, 1)                              # the faults networks make: a pair cut,
        c.cut(0, 2, both=False)                  # a cut one way, loss on a host's link
        c.lose(2, 0.2)
        c.heal()

Each emulated host is a network namespace pinned to one CPU core (one core plays one
accelerator), its link a veth pair to a bridge in a switch namespace of its own. Open MPI
reaches the hosts through a tiny remote-shell agent that runs the command inside the
host's namespace, pinned to its core, with CROSSOVER_NODE set to the host's name
(namespaces share one hostname, so the crossover daemons and clients need it). Cuts and
loss are iptables rules inside a host's namespace (this kernel has no netem or tc
classifiers): a cut drops what one host sends to another, silently, as a failed switch
port or route does; loss drops that fraction of the packets a host sends and receives.

Everything made here (namespaces, links, /etc/hosts lines, the agent, and the
Open MPI session directories a rank killed on a host leaves under the host's name) is
removed on every exit path: the context's end, an exception, Ctrl-C, SIGTERM,
interpreter exit. A run killed with SIGKILL leaves them behind; `cleanup_stale()`
(called on entry) removes those of earlier runs, recognised by the marker on their
hosts lines.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness.rank_launch import LINK, in_host

HOSTS_FILE = Path("/etc/hosts")
MARKER = "# crossover-bench"
#: The script that launches a job's ranks on the hosts (`rank_launch`).
RANK_LAUNCH = str(Path(__file__).resolve().parent / "rank_launch.py")
PREFIX = "xob"
#: the bridge in the switch namespace
BRIDGE = "xobridge"

AGENT = """#!/bin/sh
# Open MPI remote-shell agent for emulated hosts: [options] HOST command...
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "unknown emulated host $host" >&2; exit 1;;
esac
exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$1" &&
  CROSSOVER_NODE="$1" exec taskset -c "$2" /bin/sh -c "$3"' agent "$host" "$core" "$*"
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def cleanup_stale(hosts_file: Path = HOSTS_FILE) -> list[str]:
    """Remove namespaces, hosts lines and Open MPI session directories left by earlier runs
    that were SIGKILLed.

    Only names carrying this module's marker in `hosts_file` are touched, and only those
    whose owner process (the pid on the line) is gone: a cluster in use is left alone.

    Returns:
        The namespace names removed.
    """
    lines = hosts_file.read_text().splitlines(keepends=True)
    dead = [ln for ln in lines if MARKER in ln and len(ln.split()) > 1
            and not _owner_alive(ln)]
    for ln in dead:
        _ip("netns", "del", ln.split()[1], check=False)
        _ip("netns", "del", _switch_of(ln.split()[1]), check=False)
        _remove_session_dirs([ln.split()[1]])
    if dead:
        hosts_file.write_text("".join(ln for ln in lines if ln not in dead))
    return [ln.split()[1] for ln in dead]


def _switch_of(host: str) -> str:
    # the switch namespace of the cluster that host `host` (PREFIX + tag + "h" + i) is of
    return host.rsplit("h", 1)[0] + "sw"


def _session_dirs(hosts: list[str]) -> list[Path]:
    """Open MPI's session directories named after these emulated hosts (`ompi.HOST.UID`
    in the temporary directory): a rank or daemon killed on a host leaves its own."""
    tmp = Path(tempfile.gettempdir())
    # a name read back from the hosts file must not widen the pattern (*, ?, [ or /)
    return [d for host in hosts if re.fullmatch(r"[A-Za-z0-9-]+", host)
            for d in tmp.glob(f"ompi.{host}.*")]


def _remove_session_dirs(hosts: list[str]) -> None:
    for d in _session_dirs(hosts):
        shutil.rmtree(d, ignore_errors=True)


def _owner_alive(hosts_line: str) -> bool:
    """Whether the process that wrote this hosts line (`... pid=N`) still runs."""
    pid = re.search(r"pid=(\d+)", hosts_line)
    if pid is None:  # a line from before owners were recorded
        return False
    try:
        os.kill(int(pid.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedCluster:
    """Emulated hosts joined by shaped links to one bridge.

    Args:
        mbit: each host's link rate in Mbit/s, each direction (token bucket on its end).
        delay_ms: one-way delay added on each host's end (netem), 0 for none.
        cores: the CPU core of each host (default: the available cores in turn).
        subnet_octet: the third octet of the private 10.231.X.0/24 used (default: chosen
            from the pid, so concurrent runs do not collide).
        hosts: how many hosts (2 to 16).

    Raises:
        PermissionError: not root (namespaces need CAP_NET_ADMIN).
        ValueError: a number of hosts outside 2-16.
    """

    def __init__(self, mbit: float = 1000.0, delay_ms: float = 0.0,
                 cores: tuple[int, ...] | None = None, subnet_octet: int | None = None,
                 hosts: int = 2) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the emulated cluster needs root (ip netns); run as root")
        if not 2 <= hosts <= 16:
            raise ValueError(f"an emulated cluster has 2 to 16 hosts, not {hosts}")
        # the whole pid (up to 7 digits): a cut one could name a live cluster's twin, and
        # "xob" + 7 digits + "v15" still fits an interface name's 15 characters
        tag = f"{PREFIX}{os.getpid()}"
        self.hosts = [f"{tag}h{i}" for i in range(hosts)]
        self.switch = _switch_of(self.hosts[0])
        self.ifaces = [f"{tag}v{i}" for i in range(hosts)]  # each host's end, before its move
        self.ports = [f"{tag}p{i}" for i in range(hosts)]  # the bridge's ends
        octet = subnet_octet if subnet_octet is not None else 16 + os.getpid() % 200
        self.subnet = f"10.231.{octet}.0/24"
        self.addrs = [f"10.231.{octet}.{i + 1}" for i in range(hosts)]
        avail = sorted(os.sched_getaffinity(0))
        self.cores = tuple(cores or (avail[i % len(avail)] for i in range(hosts)))
        self.mbit, self.delay_ms = mbit, delay_ms
        self._tmp: Path | None = None
        self._up = False
        self._old_handlers: dict[int, object] = {}

    # --- life cycle ---------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        atexit.register(self.down)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, the bridge, the links, the addresses, the hosts lines and
        the agent."""
        cleanup_stale()
        self._up = True  # from here on, down() has something to undo
        self._tmp = Path(tempfile.mkdtemp(prefix="crossover-cluster-"))
        with HOSTS_FILE.open("a") as f:
            for host, addr in zip(self.hosts, self.addrs, strict=True):
                f.write(f"{addr} {host} {MARKER} pid={os.getpid()}\n")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "name", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for host, iface, port, addr in zip(self.hosts, self.ifaces, self.ports, self.addrs,
                                           strict=True):
            _ip("netns", "add", host)
            _ip("link", "add", iface, "type", "veth", "peer", "name", port)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("link", "set", iface, "netns", host)
            # One name on every host, so per-host settings such as HOROVOD_GLOO_IFACE
            # can be passed once for the whole job.
            _ip("-n", host, "link", "set", iface, "name", LINK)
            _ip("-n", host, "addr", "add", f"{addr}/24", "dev", LINK)
            _ip("-n", host, "link", "set", LINK, "up")
            _ip("-n", host, "link", "set", "lo", "up")
        self.shape(self.mbit, self.delay_ms)
        cases = "\n".join(f"  {h}) core={c};;" for h, c in zip(self.hosts, self.cores,
                                                               strict=True))
        agent = self._tmp / "netns-agent"
        agent.write_text(AGENT.format(cases=cases))
        agent.chmod(0o755)
        self.agent = agent

    def down(self) -> None:
        """Remove everything `up` made; safe to call twice and after a partial `up`."""
        if self._up:
            self._up = False
            for ns in (*self.hosts, self.switch):
                _ip("netns", "del", ns, check=False)  # takes its veth ends with it
            for iface in self.ifaces:  # a pair whose move never happened
                _ip("link", "del", iface, check=False)
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
            HOSTS_FILE.write_text("".join(ln for ln in lines
                                          if not any(f" {h} {MARKER}" in ln for h in self.hosts)))
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
            _remove_session_dirs(self.hosts)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        atexit.unregister(self.down)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (namespaces, links, hosts lines, Open MPI
        session directories): [] when clean."""
        left = []
        names = _ip("netns", "list").stdout
        left += [h for h in (*self.hosts, self.switch) if re.search(rf"^{h}\b", names, re.M)]
        links = _ip("link", "show").stdout
        left += [i for i in (*self.ifaces, *self.ports) if re.search(rf"\b{i}\b", links)]
        hosts = HOSTS_FILE.read_text()
        left += [f"/etc/hosts:{h}" for h in self.hosts if h in hosts]
        left += [str(d) for d in _session_dirs(self.hosts)]
        return left

    # --- faults -------------------------------------------------------------------------
    def cut(self, a: int, b: int, both: bool = True) -> None:
        """Drop everything host `a` sends to host `b` (and `b` to `a` if `both`)."""
        for src, dst in ((a, b), (b, a)) if both else ((a, b),):
            self._iptables(src, "-A", "OUTPUT", "-d", self.addrs[dst], "-j", "DROP")

    def lose(self, host: int, fraction: float) -> None:
        """Drop `fraction` (0-1) of the packets host `host` sends and receives, at random."""
        rule = ["-m", "statistic", "--mode", "random", "--probability", f"{fraction:g}",
                "-j", "DROP"]
        self._iptables(host, "-A", "OUTPUT", "-o", LINK, *rule)
        self._iptables(host, "-A", "INPUT", "-i", LINK, *rule)

    def heal(self, host: int | None = None) -> None:
        """Undo the cuts and loss made on host `host` (default: on every host)."""
        for h in range(len(self.hosts)) if host is None else (host,):
            self._iptables(h, "-F", "OUTPUT")
            self._iptables(h, "-F", "INPUT")

    def _iptables(self, host: int, *rule: str) -> None:
        res = _ip("netns", "exec", self.hosts[host], "iptables", "-w", *rule, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(rule)} on {self.hosts[host]} failed: "
                               f"{res.stderr.strip()} (Debian: apt-get install iptables)")

    # --- the link -----------------------------------------------------------------------
    def shape(self, mbit: float, delay_ms: float = 0.0) -> None:
        """Set the link's rate (each direction) and one-way delay on both ends."""
        self.mbit, self.delay_ms = mbit, delay_ms
        # The bucket holds ~2 ms of traffic: enough for the timer's granularity at high
        # rates, small enough that bursts do not beat the rate.
        burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.002))
        for host in self.hosts:
            iface = LINK
            _ip("netns", "exec", host, "tc", "qdisc", "del", "dev", iface, "root", check=False)
            tbf = ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
            tc = ["netns", "exec", host, "tc", "qdisc", "add", "dev", iface]
            if delay_ms > 0:
                res = _ip(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms",
                          check=False)
                if res.returncode != 0:
                    raise RuntimeError(f"cannot add link delay: tc netem failed "
                                       f"({res.stderr.strip()}); this kernel may lack "
                                       f"sch_netem: use delay_ms=0")
                _ip(*tc, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _ip(*tc, "root", *tbf)

    def exec_in(self, host: int, argv: list[str]) -> list[str]:
        """A command line running `argv` on emulated host `host` (its namespace and core)."""
        return in_host(self.hosts[host], self.cores[host], argv)

    def mpirun(self, argv: list[str], per_host: int = 1) -> list[str]:
        """An mpirun line placing `per_host` ranks of `argv` on each emulated host.

        MPI's own traffic (TCP transport and runtime) goes over the shaped link only;
        `mpi_yield_when_idle` keeps a rank that waits on the network from spinning its
        host's only core (see emulated-cluster.md).
        """
        hosts = ",".join(f"{h}:{per_host}" for h in self.hosts)
        return self.exec_in(0, [
            "mpirun", "--allow-run-as-root", "--bind-to", "none", "-H", hosts,
            "-np", str(per_host * len(self.hosts)),
            "--mca", "plm_rsh_agent", str(self.agent), "--mca", "plm_rsh_no_tree_spawn", "1",
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.subnet,
            "--mca", "oob_tcp_if_include", self.subnet, "--mca", "mpi_yield_when_idle", "1",
            *argv])

    def gloo_run(self, argv: list[str], timeout_s: float = 600.0) -> list[str]:
        """A command line running `argv` as a Horovod Gloo job, one rank per emulated host.

        Gloo waits for the network in the kernel (epoll, condition variables) where Open
        MPI's TCP transport polls: on a host whose only core another job computes on,
        polling steals that job's compute time (see docs/benchmarks.md). The launcher
        (`python -m bench.harness.rank_launch gloo-run`, run in host 0's namespace) serves Horovod's
        rendezvous there and starts each rank with `exec_in`.
        """
        spec = json.dumps({"hosts": self.hosts, "addrs": self.addrs,
                           "cores": list(self.cores), "timeout_s": timeout_s})
        return self.exec_in(0, [sys.executable, RANK_LAUNCH, "gloo-run", spec, *argv])

    def torchrun(self, argv: list[str], timeout_s: float = 600.0,
                 launcher: list[str] | None = None) -> list[str]:
        """A command line running `argv` (a whole command: `python script.py ...`) as a
        torchrun job, one rank per emulated host.

        torchrun runs on each host (`--nnodes 2 --node-rank i`) and meets the others at a
        static rendezvous on host 0's address, as on a real two-node cluster; gloo's
        traffic goes over the shaped link (GLOO_SOCKET_IFNAME). `launcher`: the Python
        arguments that run torchrun on each host (default `-m torch.distributed.run`;
        `-m crossover.launch.torchrun --crossover ...` for crossover-torchrun).
        """
        spec = json.dumps({"hosts": self.hosts, "addrs": self.addrs,
                           "cores": list(self.cores), "timeout_s": timeout_s,
                           "launcher": launcher or ["-m", "torch.distributed.run"]})
        return self.exec_in(0, [sys.executable, RANK_LAUNCH, "torchrun", spec, *argv])

    def measure_mbit(self, nbytes: int = 4 << 20, timeout_s: float = 60.0) -> float:
        """Send `nbytes` over TCP from host 0 to host 1 and return the rate in Mbit/s.

        Raises:
            RuntimeError: the transfer failed or took longer than `timeout_s`.
        """
        port = 29000 + os.getpid() % 1000
        server = subprocess.Popen(
            self.exec_in(1, [sys.executable, "-c", _SINK, self.addrs[1], str(port)]),
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            ready = server.stdout.readline().strip() if server.stdout else ""
            if ready != "ready":
                raise RuntimeError(f"the sink on {self.hosts[1]} did not start")
            out = subprocess.run(
                self.exec_in(0, [sys.executable, "-c", _SOURCE, self.addrs[1], str(port),
                                 str(nbytes)]),
                capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"transfer across the link failed: {out.stderr.strip()}")
            return float(out.stdout.strip())
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"transfer took more than {timeout_s:.0f} s") from None
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def _raise_exit(signum: int, _frame: object) -> None:
    # Turn SIGTERM/SIGHUP into an exception so `finally` and __exit__ tear down.
    raise SystemExit(128 + signum)


_SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(60)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(60)
while c.recv(1 << 20):
    pass
"""

_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
n = int(sys.argv[3]); buf = b"x" * (1 << 16); t = time.perf_counter(); sent = 0
while sent < n:
    sent += s.send(buf[: n - sent])
s.shutdown(socket.SHUT_WR); s.recv(1)
print(8 * n / (time.perf_counter() - t) / 1e6)
"""

__all__ = ["LINK", "EmulatedCluster", "cleanup_stale"]
