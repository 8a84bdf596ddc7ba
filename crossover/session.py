"""The process's crossover session: one slot client per process, set up from the
environment, plus the context managers for custom training loops.

The environment it reads is listed, and parsed, in `crossover.environment`: a bad value
there is said once and never stops the job. Without CROSSOVER_JOB the job's name is
"<script>-<pid of rank 0>" and its start rank 0's clock, agreed over Horovod (or
torch.distributed) so all ranks use them: with the name, the start is the job's place in
the order every node serves jobs in.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crossover import environment as E
from crossover.client import RankInfo, SlotClient
from crossover.protocol import Phase
from crossover.trace import TraceRecorder

_client: SlotClient | None = None


def enabled() -> bool:
    """False when CROSSOVER_ENABLE is off (or not a flag, said once): hooks then leave
    the job untouched."""
    return E.enabled()


def init(job: str | None = None, gpu: int | None = None) -> SlotClient:
    """Connect this process to its node's daemon (once; later calls return the same).

    Call after hvd.init(). The hooks call it for you.

    Args:
        job: the job's name (default: $CROSSOVER_JOB, else agreed among the ranks).
        gpu: the CUDA device index of this rank, None on CPU.

    Returns:
        The process's slot client (uncoordinated, with a warning, if no daemon answers).
    """
    global _client
    if _client is not None:
        return _client
    info = RankInfo.from_env()
    name, start_ns = job or E.job_name(), E.job_start_ns()
    if name is None:
        name, start_ns = _agreed_identity(info)
    trace_dir = E.trace_dir()
    trace = TraceRecorder(name, info.rank, Path(trace_dir) / f"{name}.rank{info.rank}.json") \
        if trace_dir else None
    _client = SlotClient(
        name, info,
        weight=E.priority(),
        gpu=gpu,
        pin_cpu=E.pin_cpu(),
        trace=trace,
        start_ns=start_ns,
    )
    atexit.register(shutdown)
    _write_trace_on_sigterm(trace)
    return _client


def _write_trace_on_sigterm(trace: TraceRecorder | None) -> None:
    """A rank stopped by SIGTERM (mpirun passing on a launcher's stop, a job timeout)
    leaves the daemon and writes its trace, then dies of the signal as it would have.
    Only with a trace to write (the daemon sees a dead rank's socket close anyway), and
    only where the program left SIGTERM to its default: a handler of its own stays. A
    rank stuck in native code (a hung collective) runs no handler: SIGKILL ends it."""
    if (trace is not None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, os.getpid()))


def _on_sigterm(owner: int, signum: int, _frame: Any) -> None:
    installed = signal.getsignal(signum)
    ours = isinstance(installed, functools.partial) and installed.func is _on_sigterm
    try:
        if os.getpid() == owner:  # not in a forked child, whose client is a copy
            shutdown()
    finally:
        # A handler installed after ours that calls it (Lightning chains them) decides
        # what the signal does; otherwise die of it, as without us.
        if ours:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def shutdown() -> None:
    """Leave the daemon and write the trace (runs at exit too)."""
    global _client
    if _client is not None:
        _client.close()
        _client = None


@contextmanager
def step() -> Iterator[SlotClient]:
    """Hold the device slot for one training step of a custom loop.

    A wrapped optimizer inside the block still gives the slot up while its gradients
    are averaged; use `communicate()` for your own collectives.
    """
    client = init()
    client.acquire()
    try:
        yield client
    finally:
        client.release(Phase.IDLE)


@contextmanager
def communicate() -> Iterator[None]:
    """Give the slot up while the block waits on the network; take it back after."""
    client = init()
    was_holding = client.holding
    client.release(Phase.COMMUNICATE)
    try:
        yield
    finally:
        if was_holding:
            client.acquire()


def _agreed_identity(info: RankInfo) -> tuple[str, int]:
    """The job's name and start, rank 0's, for a job launched without them."""
    local = (f"{Path(sys.argv[0] or 'python').stem}-{os.getpid()}", time.time_ns())
    if info.size == 1:
        return local
    for mod in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(mod)
        if hvd is not None and hvd.is_initialized():
            return tuple(hvd.broadcast_object(local, root_rank=0, name="crossover.job"))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        agreed = [local]
        dist.broadcast_object_list(agreed, src=0)
        return tuple(agreed[0])
    raise RuntimeError(
        "crossover cannot name this job: set CROSSOVER_JOB to a name shared by all its "
        "ranks, or call hvd.init() (or torch.distributed.init_process_group) before "
        "crossover.init()"
    )
