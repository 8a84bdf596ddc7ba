"""`crossoverrun`: horovodrun with the crossover plugin flag.

    crossoverrun [plugin flags] <every horovodrun argument, unchanged>
    crossoverrun --crossover --jobs jobs.yaml

Without --crossover it is horovodrun (Horovod's own runner does all the work). With it,
the job's processes get the injection hook on their PYTHONPATH (an unmodified Horovod
script runs under crossover), and a daemon is found or started.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import os
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from crossover import environment as E
from crossover.backoff import Backoff, wait_until
from crossover.launch import jobspec
from crossover.launch.inject import INJECT_ENV, inject_dir
from crossover.probe import daemon_listens, daemon_status
from crossover.scheduler import POLICIES
from crossover.transport import runtime_dir as default_runtime_dir
from crossover.transport import socket_path

PLUGIN_FLAGS = {  # flag -> takes a value
    "--crossover": False, "--crossover-policy": True, "--crossover-priority": True,
    "--crossover-trace": True, "--crossover-daemon": True, "--crossover-job": True,
    "--crossover-idle-shutdown": True, "--jobs": True,
}


class UsageError(Exception):
    """A wrong flag or value; the message names it and the fix."""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate the plugin flags from horovodrun's arguments.

    Plugin flags are taken only before the training command (Horovod's parser tells
    where that starts), so a script's own `--jobs` flag is left alone.
    """
    from horovod.runner.launch import parse_args

    plugin, rest, i = [], [], 0
    command_start = _command_start(argv, parse_args)
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if i < command_start and name in PLUGIN_FLAGS:
            if PLUGIN_FLAGS[name] and "=" not in tok:
                if i + 1 >= len(argv):
                    raise UsageError(f"{name} needs a value")
                plugin += [tok, argv[i + 1]]
                i += 2
                continue
            plugin.append(tok)
        elif i < command_start and name.startswith("--crossover"):
            raise UsageError(f"unknown plugin flag {name}; the plugin flags are "
                             f"{', '.join(sorted(PLUGIN_FLAGS))}")
        else:
            rest.append(tok)
        i += 1
    return plugin, rest


def _command_start(argv: list[str], parse_args) -> int:
    """Index in argv where the training command begins (len(argv) if none)."""
    stripped, index_of = [], []
    i = 0
    while i < len(argv):  # drop plugin flags wherever they are, remember positions
        name = argv[i].split("=", 1)[0]
        if name in PLUGIN_FLAGS:
            i += 2 if PLUGIN_FLAGS[name] and "=" not in argv[i] else 1
            continue
        stripped.append(argv[i])
        index_of.append(i)
        i += 1
    saved = sys.argv
    sys.argv = ["horovodrun", *stripped]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # horovodrun reports it later
            command = parse_args().command
    except SystemExit:
        return len(argv)  # horovodrun will report the problem itself
    finally:
        sys.argv = saved
    if not command:
        return len(argv)
    return index_of[len(stripped) - len(command)]


def parse_plugin(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crossoverrun", add_help=False, allow_abbrev=False,
                                     exit_on_error=False)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--crossover-policy", choices=list(POLICIES), default=None)
    parser.add_argument("--crossover-priority", type=float, default=None)
    parser.add_argument("--crossover-trace", default=None)
    parser.add_argument("--crossover-daemon", default="auto")
    parser.add_argument("--crossover-job", default=None)
    parser.add_argument("--crossover-idle-shutdown", type=float, default=300.0)
    parser.add_argument("--jobs", default=None)
    try:
        args = parser.parse_args(flags)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise UsageError(str(exc)) from None
    if not args.crossover:
        given = [f.split("=")[0] for f in flags if f.startswith("--")]
        if given:
            raise UsageError(f"{given[0]} has no effect without --crossover; add --crossover")
    if args.crossover_priority is not None and not args.crossover_priority > 0:
        raise UsageError(f"--crossover-priority must be > 0, got {args.crossover_priority}")
    if args.crossover_job is not None and not args.crossover_job.replace("-", "").replace(
            "_", "").isalnum():
        raise UsageError(f"--crossover-job: use letters, digits, '-' or '_', "
                         f"got {args.crossover_job!r}")
    return args


# --- the daemon ----------------------------------------------------------------------
def _local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                    socket.getfqdn())


def hosts_of(rest: list[str]) -> list[str]:
    """Host names from horovodrun's -H/--hosts (default: this host)."""
    for i, tok in enumerate(rest):
        if tok in ("-H", "--hosts") and i + 1 < len(rest):
            return [h.split(":")[0] for h in rest[i + 1].split(",")]
        if tok.startswith("--hosts="):
            return [h.split(":")[0] for h in tok.split("=", 1)[1].split(",")]
    return ["localhost"]


def ensure_daemon(address: str, policy: str | None, hosts: list[str],
                  idle_shutdown_s: float, quiet: bool = False) -> Path:
    """Find or start the daemon(s) the job will use; returns the runtime directory.

    Raises:
        UsageError: an ADDRESS with no daemon, or a running daemon with another policy.
    """
    if address != "auto":
        rdir = Path(address)
        try:
            nodes = daemon_status(rdir)
        except ConnectionError as exc:
            raise UsageError(f"--crossover-daemon {address}: {exc}") from None
        _check_policy(nodes, policy, address)
        return rdir
    rdir = default_runtime_dir(create=True)
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
            _check_policy(nodes, policy, str(rdir))
        else:
            _start_daemon(rdir, policy or "auto", hosts, idle_shutdown_s, quiet)
    return rdir


#: How often crossoverrun checks that the daemon it started is still there.
WATCH_S = 2.0


def watch_daemon(stop: threading.Event, policy: str | None, hosts: list[str],
                 idle_shutdown_s: float) -> None:
    """While a job runs with `--crossover-daemon auto`: if the daemon dies, start a new
    one (under the launch lock, so jobs that watch together start one daemon). The
    jobs' ranks reconnect to it by themselves (see `crossover.client`)."""
    rdir = default_runtime_dir(create=True)
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


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _check_policy(nodes: dict, policy: str | None, where: str) -> None:
    running = {snap["policy"] for snap in nodes.values()}
    if policy is not None and running != {policy}:
        raise UsageError(f"the daemon at {where} runs policy {', '.join(sorted(running))}, "
                         f"not {policy}: stop it (it exits when idle) or drop "
                         f"--crossover-policy")


def _start_daemon(rdir: Path, policy: str, hosts: list[str], idle_shutdown_s: float,
                  quiet: bool = False) -> None:
    args = [sys.executable, "-m", "crossover", "daemon", "--policy", policy,
            "--idle-shutdown", str(idle_shutdown_s), "--runtime-dir", str(rdir)]
    remote = sorted({h for h in hosts if not _local(h)})
    if remote:
        everyone = sorted(set(hosts))
        cmd = ["mpirun", "--map-by", "ppr:1:node", "-H", ",".join(f"{h}:1" for h in everyone),
               "-np", str(len(everyone)), *args]
    else:
        cmd = args
    log = open(rdir / "daemon.log", "a")  # noqa: SIM115 - handed to the daemon
    # Detached: the daemon outlives this job and exits after idle_shutdown_s.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    (rdir / "daemon.pid").write_text(f"{proc.pid}\n")  # `kill $(cat daemon.pid)` stops it
    if not any(_local(h) for h in hosts):
        return  # nothing local to wait for
    path = socket_path(E.node_name(), rdir)  # CROSSOVER_NODE / _FAKE_NODES name it too
    if not wait_until(lambda: daemon_listens(rdir), 60, Backoff(0.01, 0.2)):
        raise UsageError(f"started a crossover daemon but it did not listen on {path} "
                         f"within 60 s; see {rdir / 'daemon.log'}")
    if not quiet:
        print(f"crossoverrun: started a crossover daemon ({policy}; log "
              f"{rdir / 'daemon.log'})", file=sys.stderr)


# --- running -------------------------------------------------------------------------
def job_env(args: argparse.Namespace, rdir: Path, job: str) -> dict[str, str]:
    """The environment that puts a job's processes under crossover."""
    env = {
        INJECT_ENV: "1", "CROSSOVER_ENABLE": "1", "CROSSOVER_JOB": job,
        "CROSSOVER_RUNTIME_DIR": str(rdir),
        "PYTHONPATH": os.pathsep.join(
            p for p in (inject_dir(), os.environ.get("PYTHONPATH", "")) if p),
    }
    if args.crossover_priority is not None:
        env["CROSSOVER_PRIORITY"] = str(args.crossover_priority)
    if args.crossover_trace:
        env["CROSSOVER_TRACE"] = str(Path(args.crossover_trace).resolve())
    return env


def run_horovod_child(rest: list[str]) -> int:
    """Horovod's runner in a child process: it execs mpirun, and we have work after."""
    proc = subprocess.Popen([sys.executable, "-m", "horovod.runner.launch", *rest])
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child got the same SIGINT; give it time to stop
        return proc.wait(timeout=30)


def run_horovod(rest: list[str]) -> int:
    """Hand the arguments to Horovod's own runner, in this process, as horovodrun."""
    from horovod.runner.launch import run_commandline

    saved = sys.argv
    sys.argv = ["horovodrun", *rest]
    try:
        run_commandline()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except RuntimeError as exc:
        print(f"crossoverrun: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def merge_traces(trace_dir: str, job: str) -> None:
    from crossover import trace

    files = sorted(Path(trace_dir).glob(f"{job}.rank*.json"))
    if files:
        out = Path(trace_dir) / f"{job}.trace.json"
        trace.merge(files, out)
        print(f"crossoverrun: trace of {job}: {out}", file=sys.stderr)


def run_jobs(args: argparse.Namespace, specs: list[jobspec.JobSpec]) -> int:
    """Run every job of a spec at once, each through crossoverrun, output prefixed."""
    hosts = sorted({h for s in specs for h in hosts_of(["-H", s.hosts or "localhost"])})
    rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                         args.crossover_idle_shutdown)
    with daemon_watch(args, hosts):
        return _run_specs(args, specs, rdir)


def _run_specs(args: argparse.Namespace, specs: list[jobspec.JobSpec], rdir: Path) -> int:
    procs = []
    for spec in specs:
        cmd = [sys.executable, "-m", "crossover.launch.cli", "--crossover",
               "--crossover-daemon", str(rdir), "--crossover-job", spec.name,
               "--crossover-priority", str(spec.priority)]
        if args.crossover_trace:
            cmd += ["--crossover-trace", args.crossover_trace]
        cmd += ["-np", str(spec.np), "-H", spec.hosts or f"localhost:{spec.np}",
                *spec.horovodrun_args, *spec.command]
        p = subprocess.Popen(cmd, env={**os.environ, **spec.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        t = threading.Thread(target=_prefix, args=(spec.name, p.stdout), daemon=True)
        t.start()
        procs.append((spec, p, t))
    worst = 0
    for spec, p, t in procs:
        try:
            rc = p.wait(timeout=spec.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait(timeout=30)
            print(f"crossoverrun: job {spec.name} killed after its {spec.timeout:g} s timeout",
                  file=sys.stderr)
        t.join(timeout=5)
        print(f"crossoverrun: job {spec.name} exited {rc}", file=sys.stderr)
        worst = worst or rc
    return worst


def _prefix(name: str, stream) -> None:
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `crossoverrun`."""
    argv = sys.argv[1:] if argv is None else argv
    # Every CROSSOVER_* value, before anything starts: the jobs, the daemon and this
    # launcher all inherit them, and a job would only warn and go on with a default.
    bad = E.check()
    if bad:
        for line in bad:
            print(f"crossoverrun: error: {line}", file=sys.stderr)
        return 2
    try:
        flags, rest = split_argv(argv)
        args = parse_plugin(flags)
        if args.jobs:
            if rest:
                raise UsageError(f"--jobs runs the jobs of its file; drop the other "
                                 f"arguments ({shlex.join(rest)}) or put them in the file")
            specs = jobspec.load(args.jobs)
            return run_jobs(args, specs)
        if not args.crossover:
            return run_horovod(rest)
        job = args.crossover_job or f"{_script_name(rest)}-{os.getpid()}"
        rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts_of(rest),
                             args.crossover_idle_shutdown)
    except (UsageError, jobspec.JobSpecError) as exc:
        print(f"crossoverrun: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(job_env(args, rdir, job))
    with daemon_watch(args, hosts_of(rest)):
        rc = run_horovod_child(rest)
    if args.crossover_trace:
        merge_traces(args.crossover_trace, job)
    return rc


def _script_name(rest: list[str]) -> str:
    scripts = [Path(t).stem for t in rest if t.endswith(".py")]
    return (scripts[-1] if scripts else "job").replace(".", "_")


if __name__ == "__main__":
    sys.exit(main())
