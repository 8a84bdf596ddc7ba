"""Start a daemon and run several jobs on this host: for crossoverrun, the demo and the
benchmarks. Every wait has a timeout; a failing run kills its whole process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crossover import environment as E
from crossover.backoff import Backoff, wait_until
from crossover.probe import daemon_listens


@dataclass
class Job:
    """One job to run: a command line (usually mpirun ...) and its environment."""

    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Finished:
    name: str
    returncode: int
    seconds: float
    output: str


def mpi_env() -> dict[str, str]:
    """Open MPI settings for a single host run as any user, oversubscribed if needed."""
    return {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    }


def mpirun(np: int, *cmd: str, hosts: str | None = None) -> list[str]:
    """An mpirun command line with the flags a shared host needs."""
    where = ["-H", hosts] if hosts else []
    return ["mpirun", "--bind-to", "none", *where, "-np", str(np), *cmd]


def terminate_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), then
    SIGKILL it if it is still running after `grace_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


class DaemonProcess:
    """A daemon started in the background for this host.

    Args:
        runtime_dir: socket directory to use (a fresh one isolates a run).
        policy, lease_s, idle_shutdown_s: passed to `crossover daemon`.
        log: file for the daemon's output.
        options: more arguments for `crossover daemon` (e.g. ["--no-core-shares"]).

    Raises:
        ValueError: a CROSSOVER_* value the daemon would refuse, one line each.
        RuntimeError: the daemon did not listen within `timeout_s`.
    """

    def __init__(self, runtime_dir: Path, policy: str = "auto", lease_s: float = 30.0,
                 idle_shutdown_s: float | None = None, log: Path | None = None,
                 timeout_s: float = 60.0, options: Sequence[str] = ()) -> None:
        self.runtime_dir = Path(runtime_dir)
        bad = E.check("daemon")  # the daemon would exit with them: say so, not "timed out"
        if bad:
            raise ValueError("\n".join(bad))
        cmd = [sys.executable, "-m", "crossover", "daemon", "--policy", policy,
               "--lease", str(lease_s), "--runtime-dir", str(self.runtime_dir), *options]
        if idle_shutdown_s is not None:
            cmd += ["--idle-shutdown", str(idle_shutdown_s)]
        self._log = open(log or os.devnull, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        started = wait_until(lambda: self.proc.poll() is not None
                             or daemon_listens(self.runtime_dir), timeout_s, Backoff(0.01, 0.2))
        if not started or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"crossover daemon did not start within {timeout_s:.0f} s"
                               f" (see {log or 'its output'})")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        terminate_group(self.proc)
        self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_together(jobs: Sequence[Job], timeout_s: float = 600.0,
                 log_dir: Path | None = None) -> list[Finished]:
    """Start all jobs at once and wait for all; each gets its own process group.

    Output goes to files (log_dir/<name>.log, or temporary ones), never to pipes, so a
    chatty job cannot block on a full pipe while another is waited for.

    Raises:
        TimeoutError: a job ran past `timeout_s` (all jobs are killed first).
    """
    running = []
    for job in jobs:
        log = open(Path(log_dir) / f"{job.name}.log", "w+") if log_dir \
            else tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
        p = subprocess.Popen(job.cmd, env={**os.environ, **mpi_env(), **job.env},
                             stdout=log, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        running.append((job, p, log, time.perf_counter()))
    ended: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(ended) < len(running):
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs {[j.name for j, *_ in running if j.name not in ended]}"
                                   f" ran past {timeout_s:.0f} s")
            for job, p, _, started in running:
                if job.name not in ended and p.poll() is not None:
                    ended[job.name] = time.perf_counter() - started
            time.sleep(0.02)
        results = []
        for job, p, log, _ in running:
            log.seek(0)
            results.append(Finished(job.name, p.returncode, ended[job.name], log.read()))
        return results
    finally:
        for _, p, log, _ in running:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            log.close()


def run_one_after_another(jobs: Sequence[Job], timeout_s: float = 600.0,
                          log_dir: Path | None = None) -> list[Finished]:
    """Run the jobs sequentially (the baseline crossover must beat)."""
    return [r for job in jobs for r in run_together([job], timeout_s, log_dir)]
