"""Running what crossoverrun launches: Horovod's runner for one job, or every job of a
spec at once, with stop signals passed on to them, timeouts, exit codes and traces.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from crossover.backoff import Backoff, wait_until
from crossover.launch import jobspec
from crossover.launch.daemons import daemon_watch, ensure_daemon, hosts_in
from crossover.launch.local import terminate_group

#: A job that is stopped (its timeout, or crossoverrun stopped) gets SIGTERM, so that
#: its ranks write their traces, and SIGKILL this much later.
KILL_GRACE_S = 10.0
#: The signals that stop crossoverrun, passed on to what it runs.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Route SIGTERM, SIGINT and SIGHUP to `handler` while the block runs (in the main
    thread; elsewhere signals cannot be caught and the block runs as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def run_runner_child(cmd: list[str]) -> int:
    """A job's runner (Horovod's, which runs mpirun under a shell, or torchrun's agent)
    in a child process group of its own: we have work after (merging the traces). A stop
    signal is passed on to the whole group; whatever of it still runs KILL_GRACE_S later
    is killed, so no rank outlives us. Ranks that left the group (torchrun starts each in
    a session of its own) are found among the runner's descendants when the signal comes,
    and killed with the group."""
    proc = subprocess.Popen(cmd, process_group=0)
    deadline: list[float] = []  # set by the first stop signal
    strays: list[psutil.Process] = []  # descendants outside the group, seen at a signal

    def pass_on(signum: int, _frame: Any) -> None:
        deadline.append(time.monotonic() + KILL_GRACE_S)
        strays.extend(_descendants_outside_group(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    def ended() -> bool:
        return proc.poll() is not None or bool(deadline) and time.monotonic() > deadline[0]

    with signals_to(pass_on):
        while not ended():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        # the runner's shell may end before mpirun does (on a signal): wait for its group
        left = deadline[0] - time.monotonic() if deadline else KILL_GRACE_S
        if not wait_until(lambda: group_gone(proc.pid) and not _alive(strays),
                          max(left, 0.0), Backoff(0.05, 0.5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for stray in _alive(strays):
                with contextlib.suppress(psutil.Error):
                    stray.kill()
        return exit_code(proc.wait())


def _descendants_outside_group(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True)
                if os.getpgid(p.pid) != pid]
    except (psutil.Error, ProcessLookupError):
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal N is 128 + N
    (Popen gives -N, which `sys.exit` would turn into 256 - N)."""
    return 128 - returncode if returncode < 0 else returncode


def merge_traces(trace_dir: str, job: str) -> None:
    from crossover import trace

    files = sorted(Path(trace_dir).glob(f"{job}.rank*.json"))
    if files:
        out = Path(trace_dir) / f"{job}.trace.json"
        trace.merge(files, out)
        print(f"crossoverrun: trace of {job}: {out}", file=sys.stderr)


def run_jobs(args: argparse.Namespace, specs: list[jobspec.JobSpec]) -> int:
    """Run every job of a spec at once, each through crossoverrun (or crossover-torchrun),
    output prefixed."""
    hosts = sorted({h for s in specs for h in hosts_in(s.hosts or "localhost:1")})
    rdir = ensure_daemon(args.crossover_daemon, args.crossover_policy, hosts,
                         args.crossover_idle_shutdown)
    with daemon_watch(args, hosts):
        return _run_specs(args, specs, rdir)


def _run_specs(args: argparse.Namespace, specs: list[jobspec.JobSpec], rdir: Path) -> int:
    procs = []
    for spec in specs:
        launcher = "torchrun" if spec.launcher == "torchrun" else "cli"
        cmd = [sys.executable, "-m", f"crossover.launch.{launcher}", "--crossover",
               "--crossover-daemon", str(rdir), "--crossover-job", spec.name,
               "--crossover-priority", str(spec.priority)]
        if args.crossover_trace:
            cmd += ["--crossover-trace", args.crossover_trace]
        if spec.launcher == "torchrun":
            cmd += ["--standalone", "--nproc-per-node", str(spec.np), *spec.torchrun_args,
                    *spec.command]
        else:
            cmd += ["-np", str(spec.np), "-H", spec.hosts or f"localhost:{spec.np}",
                    *spec.horovodrun_args, *spec.command]
        p = subprocess.Popen(cmd, env={**os.environ, **spec.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        t = threading.Thread(target=_prefix, args=(spec.name, p.stdout), daemon=True)
        t.start()
        procs.append((spec, p, t))
    started, stopped_by = time.monotonic(), []

    def stop_all(signum: int, _frame: Any) -> None:
        stopped_by.append((signum, time.monotonic()))
        for _, p, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)

    worst, pending = 0, list(procs)
    with signals_to(stop_all):
        while pending:
            for spec, p, t in list(pending):
                rc = p.poll()
                if rc is None and stopped_by and \
                        time.monotonic() - stopped_by[0][1] > 2 * KILL_GRACE_S:
                    os.killpg(p.pid, signal.SIGKILL)  # its crossoverrun had its grace
                if rc is None and spec.timeout and time.monotonic() - started > spec.timeout:
                    # SIGTERM first: the job's ranks write their traces and its
                    # crossoverrun merges them; it kills what is left of the job after
                    # KILL_GRACE_S, and is killed itself if still there after twice that
                    terminate_group(p, 2 * KILL_GRACE_S)
                    print(f"crossoverrun: job {spec.name} stopped after its "
                          f"{spec.timeout:g} s timeout", file=sys.stderr)
                    rc = 124  # as timeout(1) reports a command it stopped
                if rc is None:
                    continue
                rc = exit_code(rc)
                t.join(timeout=5)
                print(f"crossoverrun: job {spec.name} exited {rc}", file=sys.stderr)
                worst = max(worst, rc)
                pending.remove((spec, p, t))
            time.sleep(0.05)
    return max(worst, 128 + stopped_by[0][0]) if stopped_by else worst


def _prefix(name: str, stream) -> None:
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


