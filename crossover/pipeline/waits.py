"""How ranks wait on each other without hanging: MPI requests polled with a deadline,
cancelled when a wait fails, and decisions every rank reaches together.

Every wait in the stage runner and in stage migration goes through `wait_requests`,
polled with `crossover.backoff.Backoff` pauses; no wait is unbounded, and a timeout
names what was waited for. The runner's own waits first poll back to back (yielding
the core between polls) where every rank of the host has a core of its own.

A wait that fails must not leave requests behind: a receive still posted would write a
late message into memory Python has freed, and a communicator freed under it strands it.
`InFlight` holds the requests with their buffers and, on a failure, cancels and
completes them, keeping alive forever the few MPI cannot cancel.

A rank that fails alone before a collective leaves the others blocked in it, so a step
every rank takes together first exchanges every rank's ok or error (`agree`, with a
deadline) and then every rank raises the same error, or none does.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crossover.backoff import Backoff, wait_until
from crossover.client.info import RankInfo

# Requests MPI could not cancel or complete, with their buffers: never collected, so
# MPI never writes into or reads from freed memory. Only failed waits add to it.
_ABANDONED: list[tuple[Any, Any]] = []
_MESSAGE_BYTES = 2048  # an error message's room in `agree`; longer ones are cut


def _backoff() -> Backoff:
    # MPI messages between stages take microseconds: start short. A stage often waits
    # milliseconds for its peer's compute, and a wait ends only at its next poll, so the
    # cap bounds what each wait overshoots: 100 us (a capped 1 ms cost the pipeline up
    # to a millisecond a message, a third of a 2-rank step on the benchmark's models).
    return Backoff(1e-5, 1e-4)


# How long a wait polls back to back before it sleeps between polls. A wait ends only at
# a poll, and a sleep lasts at least tens of microseconds: with pauses alone, a receive
# overshot its message by 100-190 us at the median on a 2-core VM, polled back to back by
# about 20 us. A stage's waits are pipeline bubbles of up to a few milliseconds, each on
# the critical path; one longer than this is a stall, where sleeping costs little.
SPIN_S = 0.05


def spin_budget(local_ranks: int, cores: int) -> float:
    """How long a wait polls back to back: `SPIN_S` where each of the host's `local_ranks`
    has one of its `cores`, else 0 (the poll would take a core from a rank computing)."""
    return SPIN_S if 0 < local_ranks <= cores else 0.0


def host_spin_budget(world_size: int) -> float:
    """`spin_budget` for this process: its host's ranks as its launcher tells them
    (`RankInfo`; else all `world_size` ranks) against the CPUs it may run on
    (`usable_cores`)."""
    info = RankInfo.from_env()
    local = info.local_size if info.size > 1 else world_size
    return spin_budget(local, usable_cores())


def usable_cores() -> int:
    """CPUs this process may run on: its affinity set, capped by a cgroup CPU quota (a
    container's `--cpus`), where polling would spend the quota its peers compute with.
    A rank pinned to one core counts one core: whether its peers share it is unknown,
    so its waits sleep."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return min(cores, max(1, int(quota))) if quota else cores


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup's CPU quota in CPUs (cgroup v2 `cpu.max`, else v1), None when unset."""
    try:
        quota, period = (root / "cpu.max").read_text().split()  # "max 100000": none
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # -1: none
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def wait_requests(requests: Sequence[Any], timeout: float, what: str,
                  spin_s: float = 0.0) -> None:
    """Poll MPI requests until all complete or `timeout` passes.

    Args:
        requests: mpi4py requests (completed ones, and MPI.REQUEST_NULL, test done).
        timeout: seconds to wait in all.
        what: what is waited for, for the message.
        spin_s: seconds to poll back to back, yielding the core between polls, before
            pausing between polls (`host_spin_budget`).

    Raises:
        TimeoutError: "`what`: not done in `timeout` s; ..." with the usual causes.
    """
    left = list(requests)

    def done() -> bool:
        left[:] = [r for r in left if not r.Test()]
        return not left

    start = time.monotonic()
    spin_until = start + min(spin_s, timeout)
    while not done():
        if time.monotonic() >= spin_until:
            break
        os.sched_yield()
    else:
        return
    if not wait_until(done, max(timeout - (time.monotonic() - start), 0.0), _backoff()):
        raise TimeoutError(f"{what}: not done in {timeout:.3g} s; is that rank alive and "
                           f"running the same schedule (or re-partitioning too)?")


class InFlight:
    """Point-to-point requests in flight, with the buffers they read or write and what
    each is for (what a timeout names)."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, Any, str]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request: Any, buf: Any, what: str) -> None:
        """Track `request`; `buf` (its memory) is kept alive until it completes."""
        self._items.append((request, buf, what))

    def prune(self) -> None:
        """Forget completed requests (and so free their buffers)."""
        self._items = [it for it in self._items if not it[0].Test()]

    def wait(self, timeout: float, spin_s: float = 0.0) -> None:
        """Wait for every request to complete (`spin_s`: as for `wait_requests`).

        Raises:
            TimeoutError: naming the first request still in flight.
        """
        deadline = time.monotonic() + timeout
        while self._items:
            req, _buf, what = self._items[0]
            wait_requests([req], max(deadline - time.monotonic(), 0.0), what, spin_s)
            self._items.pop(0)

    def cancel(self, grace: float = 1.0) -> None:
        """Cancel and complete every request still in flight (after a failed wait, before
        the communicator is freed or the buffers dropped). A receive cancels at once; a
        send MPI cannot take back (Open MPI cannot cancel one a peer began to match) is
        given `grace` seconds to finish, then abandoned (`abandon`)."""
        for req, _buf, _what in self._items:
            try:
                req.Cancel()
            except Exception:  # MPI refused (mpi4py raises MPI.Exception): waited for below
                pass
        deadline = time.monotonic() + grace
        for req, buf, _what in self._items:
            left = max(deadline - time.monotonic(), 0.0)
            if not wait_until(req.Test, left, _backoff()):
                abandon(req, buf)
        self._items.clear()


def abandon(request: Any, buf: Any) -> None:
    """Keep a request MPI cannot cancel (a collective, a send being matched) and its
    buffer alive for the life of the process, after a wait on it failed: collected,
    mpi4py would free the active request and Python its memory under MPI."""
    _ABANDONED.append((request, buf))


def agree(comm: Any, error: str | None, timeout: float, what: str) -> None:
    """Every rank learns whether any rank failed; then all raise, or none does.

    Collective: every rank of `comm` calls it at the same point, with its own error
    (None: ok). One nonblocking allgather carries each rank's message.

    Args:
        comm: the mpi4py communicator.
        error: this rank's error message, or None.
        timeout: seconds to wait for every rank.
        what: the step being agreed on, for the messages.

    Raises:
        ValueError: on every rank, if any rank failed: "`what` failed on rank r: ...".
        TimeoutError: a rank did not reach this point in time.
    """
    mine = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
    if error is not None:
        data = (error or "failed").encode()[: _MESSAGE_BYTES - 1]
        mine[0] = 1
        mine[1:1 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    everyone = np.zeros((comm.Get_size(), _MESSAGE_BYTES), dtype=np.uint8)
    _collective(comm.Iallgather(mine, everyone), (mine, everyone), timeout,
                f"{what}: every rank's ok or error")
    failed = [(r, bytes(row[1:]).rstrip(b"\0").decode(errors="replace"))
              for r, row in enumerate(everyone) if row[0]]
    if failed:
        raise ValueError("; ".join(f"{what} failed on rank {r}: {msg}" for r, msg in failed))


def alltoall(comm: Any, objects: Sequence[Any], timeout: float, what: str) -> list[Any]:
    """mpi4py's `comm.alltoall` of picklable objects, with a deadline: the sizes, then
    the pickles, each by a nonblocking collective polled like any request.

    Args:
        comm: the mpi4py communicator (collective: every rank calls it).
        objects: one object per rank of `comm`, sent to that rank.
        timeout: seconds each of the two exchanges may take.
        what: the exchange, for the message.

    Returns:
        One object per rank: what that rank sent to this one.

    Raises:
        TimeoutError: a rank did not take part in time.
    """
    from mpi4py import MPI

    blobs = [pickle.dumps(obj) for obj in objects]
    sizes = np.array([len(b) for b in blobs], dtype=np.int64)
    theirs = np.zeros(comm.Get_size(), dtype=np.int64)
    _collective(comm.Ialltoall(sizes, theirs), (sizes, theirs), timeout, what)
    send = np.frombuffer(b"".join(blobs) or b"\0", dtype=np.uint8)
    recv = np.empty(max(int(theirs.sum()), 1), dtype=np.uint8)
    counts, rcounts = sizes.tolist(), theirs.tolist()
    req = comm.Ialltoallv([send, (counts, _offsets(counts)), MPI.BYTE],
                          [recv, (rcounts, _offsets(rcounts)), MPI.BYTE])
    _collective(req, (send, recv), timeout, what)
    offsets = _offsets(rcounts)
    return [pickle.loads(recv[o:o + n].tobytes()) for o, n in zip(offsets, rcounts,
                                                                   strict=True)]


def _offsets(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)][:-1]


def _collective(request: Any, bufs: Any, timeout: float, what: str) -> None:
    """Wait for a nonblocking collective; one that times out is abandoned (MPI cannot
    cancel a collective), its buffers kept alive."""
    try:
        wait_requests([request], timeout, what)
    except TimeoutError:
        abandon(request, bufs)
        raise


def from_rank_0(comm: Any, what: str, make: Callable[[], Any]) -> Any:
    """`make()` on rank 0, broadcast; if it fails, every rank raises the reason (none
    waits forever for a result that never comes).

    Args:
        comm: the mpi4py communicator.
        what: what rank 0 does, for the message.
        make: the work (rank 0 only).

    Returns:
        Rank 0's result, on every rank.

    Raises:
        ValueError: on every rank, if `make` raised ValueError, KeyError or RuntimeError;
            on the other ranks, if it raised anything else, which rank 0 raises itself
            (a bug there must not leave the others in the broadcast for ever).
    """
    value: Any = None
    failed: BaseException | None = None
    if comm.Get_rank() == 0:
        try:
            value = make()
        except (ValueError, KeyError, RuntimeError) as exc:
            value = exc
        except Exception as exc:  # noqa: BLE001 - raised here once the others know
            failed, value = exc, RuntimeError(f"{type(exc).__name__}: {exc}")
    value = comm.bcast(value, root=0)
    if failed is not None:
        raise failed
    if isinstance(value, Exception):
        raise ValueError(f"{what} on rank 0 failed: {value}") from None
    return value
