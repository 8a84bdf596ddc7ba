"""Starting several jobs' training loops at the same moment, for tests and benchmarks.

Jobs launched together do not start training together: one framework imports or traces
for seconds longer than another, and a job that is alone on its devices keeps them. A
check that two jobs never held a device at once then passes because they never ran at
once, and a makespan holds one job's start-up inside another's loop. Every rank of every
job calls `start_barrier` after its set-up (after the crossover hooks are in, so the
daemon knows it) and before its first timed step; the loops then start within a few
milliseconds of each other.

    parser = argparse.ArgumentParser()
    add_start_barrier_flags(parser)
    args = parser.parse_args()
    ...  # set up, wrap the optimizer
    start_barrier(args.start_barrier, args.start_jobs, hvd.rank(), hvd.size())
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from crossover import environment as E
from crossover.backoff import Backoff, wait_until


def add_start_barrier_flags(parser: argparse.ArgumentParser) -> None:
    """--start-barrier DIR and --start-jobs N, as every job script of the tests takes them."""
    parser.add_argument("--start-barrier", type=Path, default=None,
                        help="a directory shared by the jobs launched together: every rank "
                             "waits there after its set-up until all --start-jobs jobs' "
                             "ranks are ready, so no job's start-up runs inside another's "
                             "training loop")
    parser.add_argument("--start-jobs", type=_positive, default=1,
                        help="how many jobs meet at --start-barrier")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give the number of jobs launched "
                                         f"together (>= 1)")
    return value


def start_barrier(barrier: Path | None, n_jobs: int, rank: int, size: int,
                  job: str | None = None, timeout_s: float = 120.0) -> None:
    """Mark this rank ready in `barrier`, then wait until every rank of `n_jobs` jobs is.
    Nothing to do without a barrier directory.

    A rank writes `<job>.<rank>.<size>`: the files say which jobs have arrived and how many
    ranks each has, so the launcher need not know the jobs' sizes.

    Args:
        job: the job's name (default: $CROSSOVER_JOB, else "job").

    Raises:
        RuntimeError: not all ranks arrived within `timeout_s` (which are there is said).
    """
    if barrier is None:
        return
    job = job or E.job_name() or "job"
    Path(barrier).mkdir(parents=True, exist_ok=True)
    (Path(barrier) / f"{job}.{rank}.{size}").touch()

    def all_ready() -> bool:
        ready: dict[str, list[int]] = {}  # job -> the sizes its ready ranks wrote
        for name in os.listdir(barrier):
            who, _rank, of = name.rsplit(".", 2)
            ready.setdefault(who, []).append(int(of))
        return len(ready) == n_jobs and all(set(v) == {len(v)} for v in ready.values())

    # short pauses: the jobs' loops should start within a few milliseconds of each other
    if not wait_until(all_ready, timeout_s, Backoff(5e-4, 2e-3)):
        raise RuntimeError(f"start barrier {barrier}: after {timeout_s:.0f} s the ranks "
                           f"ready are {sorted(os.listdir(barrier))}, not all ranks of "
                           f"{n_jobs} jobs; did every job get --start-jobs {n_jobs}?")
