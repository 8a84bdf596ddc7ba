"""Which of a host's cores each co-located CPU job may run on.

On one host, CPU jobs that allreduce in the host's memory gain nothing from taking turns
(there is no idle gap to fill), so `auto` serves them concurrently. Left to the kernel,
their ranks then share every core: a rank is often descheduled while its peer waits for
it in a collective, and MPI waits by polling, so the waiting burns the time the other
job needed. Two 2-rank MLP jobs on 2 cores took 7.2-9.4 s together (median 8.15 s over 5
runs) against 6.6-6.9 s one after the other. Given a core each by hand (taskset), each
job's ranks share only their own core, where a waiting rank yields to its own peer:
6.8-7.1 s (median 6.81 s). Under the daemon: the one-host rows of
bench/results/colocation/crossover.json (docs/benchmarks.md).

The daemon calls `partition` (pure) whenever the jobs on its host change and tells each
rank its job's cores (`protocol.Company.cores`); the rank applies them with `pin_process`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def partition(cores: Sequence[int], jobs: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    """Split `cores` into disjoint contiguous shares, one per job, in proportion to its
    ranks on this host.

    Args:
        cores: the host's cores, in order.
        jobs: (job, its ranks on this host) in the jobs' global order; every rank count
            is at least 1.

    Returns:
        job -> its cores. Empty (no placement: every job runs where its launcher put it)
        when fewer than two jobs share the host, or when there are fewer cores than
        jobs, since a shared core would bring back the waiting the shares avoid.
    """
    if len(jobs) < 2 or len(cores) < len(jobs):
        return {}
    if any(ranks < 1 for _, ranks in jobs):
        raise ValueError(f"placement: every job needs at least one rank here, got {list(jobs)}")
    total = sum(ranks for _, ranks in jobs)
    # Largest remainder over what is left after one core each, so no share is empty.
    spare = len(cores) - len(jobs)
    exact = [spare * ranks / total for _, ranks in jobs]
    sizes = [1 + int(x) for x in exact]
    by_remainder = sorted(range(len(jobs)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[:len(cores) - sum(sizes)]:
        sizes[i] += 1
    out, start = {}, 0
    for (job, _), size in zip(jobs, sizes, strict=True):
        out[job] = list(cores[start:start + size])
        start += size
    return out


def pin_process(cores: Sequence[int]) -> None:
    """Put every thread of this process (Horovod's, MPI's, torch's) on `cores`; threads
    made later inherit it from the thread that makes them.

    Raises:
        OSError: no /proc, or `cores` are outside the launcher's cpuset.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
