"""The daemons a launcher uses: which hosts a job runs on, finding or starting the
daemon(s) for them, restarting a daemon that died under a job, and stopping them.

`crossoverrun` and `crossover stop` share these; the daemon itself is
`crossover.daemon`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil

from crossover import environment as E
from crossover.backoff import Backoff, wait_until
from crossover.probe import daemon_listens, daemon_status
from crossover.transport import runtime_dir, socket_path

#: How often crossoverrun checks that the daemon it started is still there.
WATCH_S = 2.0
#: What a daemon started by a launcher writes its process id to (mpirun's, for several
#: hosts): `crossover stop` signals it.
PID_FILE = "daemon.pid"


class UsageError(Exception):
    """A wrong flag or value; the message names it and the fix."""


# --- hosts ---------------------------------------------------------------------------
def _local_addresses() -> set[str]:
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}


def is_local(host: str) -> bool:
    """Whether `host` names this machine: its names, a loopback address, or an address
    of one of its interfaces (an IP or an alias of this host is local too)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False  # unresolvable: mpirun will say so
    mine = _local_addresses()
    for *_, addr in infos:
        ip = str(addr[0]).split("%")[0]
        if ip in mine or ipaddress.ip_address(ip).is_loopback:
            return True
    return False


def _read_hostfile(path: str) -> list[str]:
    """Host names of a horovodrun/mpirun hostfile (`host slots=N` per line)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"--hostfile {path}: cannot read it ({exc.strerror}); give an "
                         f"existing file with one `host slots=N` per line") from None
    hosts = [line.split("#", 1)[0].split()[0] for line in lines
             if line.split("#", 1)[0].strip()]
    if not hosts:
        raise UsageError(f"--hostfile {path}: no host in it; write one `host slots=N` "
                         f"per line")
    return hosts


def hosts_of(rest: list[str]) -> list[str]:
    """The hosts of horovodrun's arguments: -H/--hosts or --hostfile (default: this host).

    Raises:
        UsageError: a host discovery script (elastic Horovod), whose hosts are not known
            before the job starts, so no daemon could be ready for them.
    """
    for i, tok in enumerate(rest):
        name, _, value = tok.partition("=")
        if not value and i + 1 < len(rest):
            value = rest[i + 1]
        if name in ("-H", "--hosts") and value:
            return [h.split(":")[0] for h in value.split(",")]
        if name in ("-hostfile", "--hostfile") and value:
            return _read_hostfile(value)
        if name == "--host-discovery-script":
            raise UsageError("--host-discovery-script (elastic Horovod) is not supported "
                             "with --crossover: its hosts are not known before the job "
                             "starts; give them with -H or --hostfile")
    return ["localhost"]


# --- finding or starting ---------------------------------------------------------------
def ensure_daemon(address: str, policy: str | None, hosts: list[str],
                  idle_shutdown_s: float, quiet: bool = False) -> Path:
    """Find or start the daemon(s) the job will use; returns the runtime directory.

    Raises:
        UsageError: an ADDRESS that is not a directory or has no daemon, or a running
            daemon with another policy.
    """
    if address != "auto":
        rdir = Path(address)
        if not rdir.is_dir():
            raise UsageError(f"--crossover-daemon {address}: no such directory; give auto "
                             f"(use this user's daemon, or start one) or the runtime "
                             f"directory of a running daemon")
        try:
            nodes = daemon_status(rdir)
        except ConnectionError as exc:
            raise UsageError(f"--crossover-daemon {address}: {exc}") from None
        _check_policy(nodes, policy, rdir)
        return rdir
    rdir = runtime_dir(create=True)
    # Serialise check-and-start: jobs launched together must share one daemon.
    with open(rdir / "launch.lock", "w") as lock:
        if not wait_until(lambda: _try_lock(lock), 60, Backoff(0.01, 0.2)):
            raise UsageError(f"{rdir / 'launch.lock'} held for 60 s by another "
                             f"crossoverrun; is one stuck?")
        try:
            nodes = daemon_status(rdir, timeout_s=2.0)
        except ConnectionError:
            nodes = None
        if nodes is not None:
            _check_policy(nodes, policy, rdir)
        else:
            start_daemon(rdir, policy or "auto", hosts, idle_shutdown_s, quiet)
    return rdir


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _check_policy(nodes: dict, policy: str | None, rdir: Path) -> None:
    running = {snap["policy"] for snap in nodes.values()}
    if policy is not None and running != {policy}:
        raise UsageError(f"the daemon at {rdir} runs policy {', '.join(sorted(running))}, "
                         f"not {policy}: drop --crossover-policy, or stop that daemon "
                         f"(`crossover stop --runtime-dir {rdir}`) once its jobs end")


def start_daemon(rdir: Path, policy: str, hosts: list[str], idle_shutdown_s: float,
                 quiet: bool = False) -> None:
    """Start this host's daemon, or one per host under mpirun when some are remote;
    detached, so it outlives the job, and exits after `idle_shutdown_s` with no job."""
    args = [sys.executable, "-m", "crossover", "daemon", "--policy", policy,
            "--idle-shutdown", str(idle_shutdown_s), "--runtime-dir", str(rdir)]
    remote = sorted({h for h in hosts if not is_local(h)})
    if remote:
        everyone = sorted(set(hosts))
        cmd = ["mpirun", "--map-by", "ppr:1:node", "-H", ",".join(f"{h}:1" for h in everyone),
               "-np", str(len(everyone)), *args]
    else:
        cmd = args
    log = open(rdir / "daemon.log", "a")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    (rdir / PID_FILE).write_text(f"{proc.pid}\n")
    if not any(is_local(h) for h in hosts):
        return  # nothing local to wait for
    path = socket_path(E.node_name(), rdir)  # CROSSOVER_NODE / _FAKE_NODES name it too
    if not wait_until(lambda: daemon_listens(rdir), 60, Backoff(0.01, 0.2)):
        raise UsageError(f"started a crossover daemon but it did not listen on {path} "
                         f"within 60 s; see {rdir / 'daemon.log'}")
    if not quiet:
        print(f"crossoverrun: started a crossover daemon ({policy}; log "
              f"{rdir / 'daemon.log'})", file=sys.stderr)


# --- watching --------------------------------------------------------------------------
def watch_daemon(stop: threading.Event, policy: str | None, hosts: list[str],
                 idle_shutdown_s: float) -> None:
    """While a job runs with `--crossover-daemon auto`: if the daemon dies, start a new
    one (under the launch lock, so jobs that watch together start one daemon). The
    jobs' ranks reconnect to it by themselves (see `crossover.client`)."""
    rdir = runtime_dir(create=True)
    while not stop.wait(WATCH_S):
        if daemon_listens(rdir):
            continue
        try:
            ensure_daemon("auto", policy, hosts, idle_shutdown_s, quiet=True)
            print("crossoverrun: the crossover daemon was gone; started a new one, and "
                  "the job's ranks reconnect to it", file=sys.stderr, flush=True)
        except (UsageError, OSError) as exc:
            print(f"crossoverrun: the crossover daemon is gone and could not be restarted "
                  f"({exc}); the job trains on uncoordinated", file=sys.stderr, flush=True)


@contextlib.contextmanager
def daemon_watch(args: argparse.Namespace, hosts: list[str]) -> Iterator[None]:
    """Watch the daemon (`watch_daemon`) while the block runs, under --crossover-daemon
    auto; a daemon given by address is the user's to restart."""
    stop = threading.Event()
    if args.crossover_daemon == "auto":
        threading.Thread(target=watch_daemon, name="crossover-watch", daemon=True,
                         args=(stop, args.crossover_policy, hosts,
                               args.crossover_idle_shutdown)).start()
    try:
        yield
    finally:
        stop.set()


# --- stopping --------------------------------------------------------------------------
def _launched_by_us(pid_file: Path) -> psutil.Process | None:
    """The process a launcher started (the daemon, or the mpirun over every host's
    daemon), if it still runs and is one."""
    try:
        proc = psutil.Process(int(pid_file.read_text()))
        cmdline = proc.cmdline()
    except (OSError, ValueError, psutil.Error):
        return None
    return proc if "crossover" in cmdline and "daemon" in cmdline else None


def _ended(pid: int) -> bool:
    try:  # a zombie has ended: its parent (a launcher) has not yet read its status
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_daemons(directory: str | None, force: bool = False, timeout_s: float = 10.0) -> str:
    """Stop this node's daemon; when a launcher started it over several hosts, the
    mpirun over them all (which passes the signal on). Returns what was done.

    Raises:
        UsageError: jobs are still registered (without `force`), the daemon is one of
            several started by hand under mpirun, or it did not exit within `timeout_s`.
    """
    rdir = runtime_dir(directory, create=False)
    try:
        nodes = daemon_status(rdir)
    except ConnectionError as exc:
        return str(exc).split(";")[0] + "; nothing to stop"
    jobs = sorted({job for snap in nodes.values() for job in snap.get("job_usage", {})})
    if jobs and not force:
        raise UsageError(f"jobs {', '.join(jobs)} still use this daemon: their ranks would "
                         f"train on uncoordinated, and a crossoverrun watching it would "
                         f"start a new one; stop once they end, or add --force")
    launched = _launched_by_us(rdir / PID_FILE)
    here = nodes.get(E.node_name(), {}).get("daemon", {}).get("pid")
    if launched is not None:
        target = launched.pid
        # mpirun forwards SIGTERM to every host's daemon; one daemon runs its own group
        os.killpg(target, signal.SIGTERM)
    elif here is not None:
        target = int(here)
        if len(nodes) > 1:
            raise UsageError(f"this daemon is one of {len(nodes)} nodes' ({', '.join(nodes)})"
                             f" started by hand under mpirun: stop that mpirun")
        os.kill(target, signal.SIGTERM)
    else:
        raise UsageError(f"the daemon at {rdir} reported no process id; stop it with kill")
    if not wait_until(lambda: _ended(target), timeout_s, Backoff(0.02, 0.5)):
        raise UsageError(f"sent SIGTERM to process {target} but it still runs after "
                         f"{timeout_s:g} s; kill -9 {target}")
    (rdir / PID_FILE).unlink(missing_ok=True)
    return f"stopped the crossover daemon at {rdir} (process {target}, {len(nodes)} node" \
           f"{'s' if len(nodes) != 1 else ''})"
