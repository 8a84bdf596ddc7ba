"""The daemons a launcher uses: which hosts a job runs on, finding or starting the
daemon(s) for them, restarting a daemon that died under a job, and stopping them.

`crossoverrun` and `crossover stop` share these; the daemon itself is
`crossover.daemon`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
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
from crossover.daemon.logfile import LOG_FILE
from crossover.daemon.relay.launch import relay_mca_flags
from crossover.daemon.world.wire import KEY_ENV, KEY_FILE, make_key, world_key
from crossover.probe import daemon_listens, daemon_status, grow_world, stop_world
from crossover.transport import runtime_dir, socket_path, system_dir, system_service_in_use

#: How often crossoverrun checks that the daemon it started is still there.
WATCH_S = 2.0
#: How long a launcher waits for a daemon world to take in its job's nodes.
GROW_WAIT_S = 20.0
#: What a daemon started by a launcher writes its process id to (mpirun's, for several
#: hosts): `crossover stop` signals it.
PID_FILE = "daemon.pid"


class UsageError(Exception):
    """A wrong flag or value; the message names it and the fix."""


# --- hosts ---------------------------------------------------------------------------
@functools.cache
def _this_host() -> tuple[set[str], set[str]]:
    """This machine's names and interface addresses (looked up once: getfqdn may ask
    a resolver)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addresses = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                 for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return names, addresses


def is_local(host: str) -> bool:
    """Whether `host` names this machine: its names, a loopback address, or an address
    of one of its interfaces (an IP or an alias of this host is local too)."""
    names, addresses = _this_host()
    if host in names:
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False  # unresolvable: mpirun will say so
    for *_, addr in infos:
        ip = str(addr[0]).split("%")[0]
        if ip in addresses or ipaddress.ip_address(ip).is_loopback:
            return True
    return False


def hosts_in(spec: str) -> list[str]:
    """The host names of a horovodrun -H value (`host:slots,...`), as Horovod reads it.

    Raises:
        UsageError: a value Horovod cannot read (say an IPv6 address), with the form.
    """
    from horovod.runner.common.util.hosts import parse_hosts

    try:
        return [h.hostname for h in parse_hosts(spec)]
    except ValueError:
        raise UsageError(f"hosts {spec!r}: write host:slots[,host:slots...] (horovodrun "
                         f"takes host names or IPv4 addresses)") from None


def hosts_of(args: argparse.Namespace) -> list[str]:
    """The hosts of a job from horovodrun's parsed arguments: -H, else --hostfile, else
    this host (as horovodrun itself decides).

    Raises:
        UsageError: a host discovery script (elastic Horovod), whose hosts are not known
            before the job starts, so no daemon could be ready for them; or a hostfile
            that horovodrun could not read.
    """
    from horovod.runner.common.util.hosts import parse_host_files

    if args.host_discovery_script:
        raise UsageError("--host-discovery-script (elastic Horovod) is not supported with "
                         "--crossover: its hosts are not known before the job starts; give "
                         "them with -H or --hostfile")
    if args.hosts:
        return hosts_in(args.hosts)
    if args.hostfile:
        try:
            return hosts_in(parse_host_files(args.hostfile))
        except (OSError, IndexError, UsageError):
            raise UsageError(f"--hostfile {args.hostfile}: horovodrun cannot read it; write "
                             f"one `host slots=N` per line, with no blank or comment "
                             f"lines") from None
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
        rdir = Path(address).resolve()  # the jobs' ranks may start elsewhere
        if not rdir.is_dir():
            raise UsageError(f"--crossover-daemon {address}: no such directory; give auto "
                             f"(use this user's daemon, or start one) or the runtime "
                             f"directory of a running daemon")
        try:
            nodes = daemon_status(rdir)
        except ConnectionError as exc:
            raise UsageError(f"--crossover-daemon {address}: {exc}") from None
        _check_policy(nodes, policy, rdir)
        _check_hosts(nodes, hosts, rdir)
        return rdir
    if (shared := system_service_in_use()) is not None:
        return _use_system_service(shared, policy, quiet)
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
            _check_hosts(nodes, hosts, rdir)
        else:
            start_daemon(rdir, policy or "auto", hosts, idle_shutdown_s, quiet)
    return rdir


def _use_system_service(rdir: Path, policy: str | None, quiet: bool) -> Path:
    """The node service the system runs for every user: the job uses it as it is (its
    operator starts and restarts it; each host's serves that host's ranks)."""
    try:
        nodes = daemon_status(rdir, timeout_s=2.0)
    except ConnectionError as exc:
        print(f"crossoverrun: the crossover node service does not answer ({exc}); the "
              f"job trains uncoordinated until it is back", file=sys.stderr)
        return rdir
    _check_policy(nodes, policy, rdir)
    if not quiet:
        print(f"crossoverrun: using the crossover node service at {rdir}", file=sys.stderr)
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


def uncovered_hosts(nodes: dict, hosts: list[str]) -> list[str]:
    """The job's hosts that have no node in a daemon world's status `nodes`, matched by
    name (as given, short, or fully qualified; this host by the name its daemon takes),
    never by count."""
    names = set(nodes)
    short = {n.split(".")[0] for n in names}
    missing = []
    for host in dict.fromkeys(hosts):
        if is_local(host):
            covered = E.node_name() in names
        else:
            fqdn = socket.getfqdn(host)
            covered = bool({host, fqdn} & names) or {host.split(".")[0],
                                                     fqdn.split(".")[0]} & short
        if not covered:
            missing.append(host)
    return missing


def _check_hosts(nodes: dict, hosts: list[str], rdir: Path) -> None:
    """Bring the job's hosts that the running daemon world has no node for into it (its
    leader starts their daemons), waiting at most GROW_WAIT_S; say once, naming them,
    which are still missing and why: the job's ranks there find no daemon and train
    uncoordinated (the job runs all the same: crossover never stops a job)."""
    missing = uncovered_hosts(nodes, hosts)
    if not missing:
        return
    why = "this host is not in it, so it cannot be asked to grow"
    if E.node_name() in nodes:
        try:
            grow_world(missing, rdir)
            seen: dict = nodes

            def covered() -> bool:
                nonlocal seen
                with contextlib.suppress(ConnectionError):
                    seen = daemon_status(rdir, timeout_s=2.0)
                return not uncovered_hosts(seen, hosts)
            if wait_until(covered, GROW_WAIT_S, Backoff(0.2, 1.0)):
                print(f"crossoverrun: the daemon world at {rdir} took in "
                      f"{', '.join(missing)}", file=sys.stderr, flush=True)
                return
            missing, nodes = uncovered_hosts(seen, hosts), seen
            why = (f"their daemons did not join within {GROW_WAIT_S:g} s (see "
                   f"{rdir / LOG_FILE} on the leader's node)")
        except ConnectionError as exc:
            why = f"the daemon here did not answer ({exc})"
    print(f"crossoverrun: the daemon world at {rdir} has no node for "
          f"{', '.join(missing)} (its nodes: {', '.join(sorted(nodes))}; {why}): the "
          f"job's ranks there train uncoordinated", file=sys.stderr, flush=True)


def start_daemon(rdir: Path, policy: str, hosts: list[str], idle_shutdown_s: float,
                 quiet: bool = False) -> None:
    """Start this host's daemon, or one per host under mpirun when some are remote;
    detached, so it outlives the job, and exits after `idle_shutdown_s` with no job."""
    args = [sys.executable, "-m", "crossover", "daemon", "--policy", policy,
            "--idle-shutdown", str(idle_shutdown_s), "--runtime-dir", str(rdir)]
    try:  # as flags: the environment does not reach the other hosts' daemons
        metrics = E.metrics_at()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if metrics is not None:
        args += ["--metrics-address", metrics[0], "--metrics-port", str(metrics[1])]
    remote = sorted({h for h in hosts if not is_local(h)})
    if remote:
        # this machine once, however many of its names the job gave
        everyone = remote + (["localhost"] if len(remote) < len(set(hosts)) else [])
        # one daemon's death does not end the others (`crossover.daemon.world.membership`
        # finds it and the world serves on)
        # a new world, a new key (made here, in the 0700 runtime directory): it goes to
        # every relay in the environment, never on a command line; their services sign
        # with it, and what was recorded of an earlier world is not heard in this one
        make_key(rdir / KEY_FILE)
        env = {**os.environ, KEY_ENV: world_key(rdir).hex()}
        cmd = ["mpirun", *relay_mca_flags(), "-x", KEY_ENV, "--map-by", "ppr:1:node",
               "-H", ",".join(f"{h}:1" for h in everyone), "-np", str(len(everyone)), *args]
    else:
        cmd, env = args, None
    log = open(rdir / LOG_FILE, "a")  # noqa: SIM115 - handed to the daemon
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:  # no mpirun on PATH, say
        raise UsageError(f"cannot start the crossover daemon ({cmd[0]}: {exc.strerror}); "
                         f"is Open MPI installed and on PATH?") from None
    finally:
        log.close()
    (rdir / PID_FILE).write_text(f"{proc.pid}\n")
    if not any(is_local(h) for h in hosts):
        return  # nothing local to wait for
    path = socket_path(E.node_name(), rdir)  # CROSSOVER_NODE / _FAKE_NODES name it too
    listens = wait_until(lambda: proc.poll() is not None or daemon_listens(rdir), 60,
                         Backoff(0.01, 0.2))
    if not listens or proc.poll() is not None:
        tail = (rdir / LOG_FILE).read_text(errors="replace").strip().splitlines()[-1:]
        raise UsageError(f"started a crossover daemon but it "
                         f"{'exited' if proc.poll() is not None else 'did not listen'} on "
                         f"{path} ({' '.join(tail) or 'no output'}); see "
                         f"{rdir / LOG_FILE}")
    if not quiet:
        print(f"crossoverrun: started a crossover daemon ({policy}; log "
              f"{rdir / LOG_FILE})", file=sys.stderr)


# --- watching --------------------------------------------------------------------------
def watch_daemon(stop: threading.Event, policy: str | None, hosts: list[str],
                 idle_shutdown_s: float) -> None:
    """While a job runs with `--crossover-daemon auto`: if the daemon dies, start a new
    one (under the launch lock, so jobs that watch together start one daemon). The
    jobs' ranks reconnect to it by themselves (see `crossover.client`)."""
    rdir = runtime_dir(create=True)
    if rdir == system_dir():
        return  # the system's node service: systemd (or a prolog) restarts it
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
    auto when the job has ranks on this host."""
    stop = threading.Event()
    # a daemon world over remote hosts only is the user's (it cannot be watched from
    # here: no local socket), as is a daemon given by address
    if args.crossover_daemon == "auto" and any(map(is_local, hosts)):
        threading.Thread(target=watch_daemon, name="crossover-watch", daemon=True,
                         args=(stop, args.crossover_policy, hosts,
                               args.crossover_idle_shutdown)).start()
    try:
        yield
    finally:
        stop.set()


# --- stopping --------------------------------------------------------------------------
def _daemon_process(pid: int | str, rdir: Path | None = None) -> psutil.Process | None:
    """The process `pid` if it is a crossover daemon (of `rdir`, if given: a launcher
    names it on the command line; or the mpirun over such daemons) and still runs. A
    stale pid file may name a reused pid."""
    try:
        proc = psutil.Process(int(pid))
        cmdline = proc.cmdline()
    except (OSError, ValueError, psutil.Error):
        return None
    ours = "crossover" in cmdline and "daemon" in cmdline and (
        rdir is None or str(rdir) in cmdline)
    return proc if ours and proc.status() != psutil.STATUS_ZOMBIE else None


def _ended(pid: int) -> bool:
    try:  # a zombie has ended: its parent (a launcher) has not yet read its status
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_daemons(directory: str | None, force: bool = False, timeout_s: float = 10.0) -> str:
    """Stop this node's daemon; in a world of several nodes, every node's (the world's
    leader tells them), and the mpirun a launcher started. Returns what was done.

    Raises:
        UsageError: jobs are still registered (without `force`), the daemon's process is
            not found here, or it did not exit within `timeout_s`.
    """
    rdir = runtime_dir(directory, create=False)
    if rdir == system_dir() and os.getuid() not in (0, rdir.stat().st_uid):
        raise UsageError(f"the crossover node service at {rdir} is the system's: its "
                         f"operator stops it (systemctl stop crossover); to stop a daemon "
                         f"of your own, give --runtime-dir or set CROSSOVER_RUNTIME_DIR")
    try:
        nodes = daemon_status(rdir)
    except ConnectionError as exc:
        return str(exc).split(";")[0] + "; nothing to stop"
    jobs = sorted({job for snap in nodes.values() for job in snap.get("job_usage", {})})
    if jobs and not force:
        raise UsageError(f"jobs {', '.join(jobs)} still use this daemon: their ranks would "
                         f"train on uncoordinated, and a crossoverrun watching it would "
                         f"start a new one; stop once they end, or add --force")
    pid_file = rdir / PID_FILE
    launched = _daemon_process(pid_file.read_text(), rdir) if pid_file.exists() else None
    here = nodes.get(E.node_name(), {}).get("daemon", {}).get("pid")
    targets = list(dict.fromkeys(
        p.pid for p in (launched, _daemon_process(here) if here else None) if p))
    if not targets:
        raise UsageError(f"the daemon at {rdir} answers but its process is not found "
                         f"here (another PID namespace?); stop it where it runs")
    if len(nodes) > 1:
        # the world's leader tells every node's service to stop (a launcher's mpirun
        # ends with the relays it started)
        with contextlib.suppress(ConnectionError):
            stop_world(rdir)
    for target in targets:
        with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
            if target == getattr(launched, "pid", None) and os.getpgid(target) == target:
                os.killpg(target, signal.SIGTERM)
            elif len(nodes) == 1:
                os.kill(target, signal.SIGTERM)
    if not wait_until(lambda: all(map(_ended, targets)), timeout_s, Backoff(0.02, 0.5)):
        left = [t for t in targets if not _ended(t)]
        raise UsageError(f"asked the crossover daemon at {rdir} to stop but process "
                         f"{left[0]} still runs after {timeout_s:g} s; kill -9 {left[0]}")
    target = targets[0]
    (rdir / PID_FILE).unlink(missing_ok=True)
    return f"stopped the crossover daemon at {rdir} (process {target}, {len(nodes)} node" \
           f"{'s' if len(nodes) != 1 else ''})"
