"""What the operating system says about the daemon and its jobs' processes (psutil):
descriptors and memory for the daemon's own health, CPU and memory per job for
`crossover status`, and whether a rank that went quiet is stopped, gone or just slow.
"""

from __future__ import annotations

import time

import psutil


def daemon_figures(started: float) -> dict:
    """This process's pid, open descriptors, resident memory (MiB) and uptime (s)."""
    me = psutil.Process()
    return {"pid": me.pid, "fds": me.num_fds(),
            "rss_mb": round(me.memory_info().rss / 2**20, 1),
            "uptime_s": round(time.monotonic() - started, 1)}


def process_state(pid: int) -> str:
    """'stopped' (SIGSTOP, a debugger), 'gone', 'zombie', or 'running' (slow or busy)."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return "unknown"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "zombie"
    return "running"


class RankUsage:
    """CPU (percent of one core, since the last look) and memory of job ranks' processes
    on this node, keyed by pid; processes of ranks that left are forgotten."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def job_usage(self, pids_by_job: dict[str, list[int]]) -> dict[str, dict]:
        """{job: {"ranks": n, "cpu_pct": sum, "rss_mb": sum}} over the given pids."""
        live = {pid for pids in pids_by_job.values() for pid in pids}
        for pid in list(self._procs):
            if pid not in live:
                del self._procs[pid]
        out = {}
        for job, pids in pids_by_job.items():
            cpu = rss = 0.0
            for pid in pids:
                proc = self._procs.get(pid)
                try:
                    if proc is None:  # the first look sets the CPU baseline
                        proc = self._procs[pid] = psutil.Process(pid)
                    cpu += proc.cpu_percent(None)
                    rss += proc.memory_info().rss
                except psutil.Error:
                    self._procs.pop(pid, None)
            out[job] = {"ranks": len(pids), "cpu_pct": round(cpu, 1),
                        "rss_mb": round(rss / 2**20, 1)}
        return out

