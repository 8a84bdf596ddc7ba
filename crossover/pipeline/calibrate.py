"""What the stage runner pays on this machine beyond its ops and the wire: the probe
behind `profile.Runtime` and the transport `Link` that real runs are simulated with.

    mpirun -np 2 python -m crossover.pipeline.calibrate --out runtime.json

Four probes, medians after a warm-up (about ten seconds):

- messages (2 ranks): tensors exchanged with mpi4py `Isend`/`Irecv` on their own memory
  and completed by `waits.wait_requests`, as the runner does (polling back to back, as
  with a core per rank). Posting a bare send, and completing a receive whose message
  has already arrived; ping-pong one-way times at two sizes, less those two, give the
  wire's latency and bandwidth. A receive that waits 2 ms for its message, once polled
  back to back and once sleeping between polls (as when the ranks outnumber the
  cores), gives `sleep_wake_s`: what the sleeping wait overshoots.
- the runner's messages (2 ranks): one tensor through `StageRunner`'s own send and
  receive paths (buffers, tags, request bookkeeping); their mean is each side's
  `message_s`.
- actions (every rank on its own): `StageRunner` runs a one-stage plan of a tiny model on
  `COMM_SELF`; what an iteration takes beyond its ops' profiled time, per forward or
  backward action, is `action_s`.
- sharing (2 ranks, each on a core of its own): a small MLP's forward and backward for
  half a second on one rank alone, then on two at once: `shared_slowdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Stage, make_plan
from crossover.pipeline.profile import Link, Runtime, profile
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import schedule_for
from crossover.pipeline.waits import SPIN_S, wait_requests

SMALL, LARGE = 64, 1 << 20  # bytes of the two ping-pong sizes
REPS, WARMUP = 41, 5
# Raised when what the probes measure changes, so that cached figures are made again
# (2: messages through the runner's own path, the sharing probe sustained and pinned).
PROBES = 2
PHASE_S = 0.5  # seconds of each sharing probe phase
COMPUTE_S = 2e-4  # seconds of work before each of the runner's timed sends and receives
LATE = 2e-3  # seconds a waiting receive's message comes after the receive was posted


def _busy(seconds: float) -> None:
    """Wait on the CPU, as a rank that computes until its receive: after a sleep, a
    VM's idle core took 20-60 us to complete a message that had already arrived."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _median_after_warmup(fn, reps: int = REPS) -> float:
    times = [fn() for _ in range(reps + WARMUP)]
    return statistics.median(times[WARMUP:])


def message_costs(comm: Any, timeout: float = 30.0) -> dict[str, float]:
    """Ranks 0 and 1: send and receive sides' costs per message, and the one-way time at
    `SMALL` and `LARGE` bytes. Returns the same figures on both ranks."""
    rank = comm.Get_rank()
    peer = 1 - rank
    small = torch.zeros(SMALL // 4)
    large = torch.zeros(LARGE // 4)
    spin = SPIN_S  # as a runner's waits with a core each (`sleep_wake_s` is the rest)

    def post_send() -> float:
        comm.Barrier()
        if rank == 0:
            t0 = time.perf_counter()
            req = comm.Isend(small.numpy(), dest=peer, tag=1)
            dt = time.perf_counter() - t0
            wait_requests([req], timeout, "calibration send", spin)
        else:
            wait_requests([comm.Irecv(small.numpy(), source=peer, tag=1)], timeout,
                          "calibration receive", spin)
            dt = 0.0
        return comm.bcast(dt, root=0)

    def complete_arrived() -> float:
        if rank == 0:
            wait_requests([comm.Isend(small.numpy(), dest=peer, tag=2)], timeout,
                          "calibration send", spin)
        comm.Barrier()
        dt = 0.0
        if rank == 1:
            _busy(1e-3)  # the message is surely here
            t0 = time.perf_counter()
            wait_requests([comm.Irecv(small.numpy(), source=peer, tag=2)], timeout,
                          "calibration receive", spin)
            dt = time.perf_counter() - t0
        return comm.bcast(dt, root=1)

    def one_way(buf: torch.Tensor) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        for first in (0, 1):
            if rank == first:
                wait_requests([comm.Isend(buf.numpy(), dest=peer, tag=3)], timeout,
                              "calibration ping", spin)
            else:
                wait_requests([comm.Irecv(buf.numpy(), source=peer, tag=3)], timeout,
                              "calibration pong", spin)
        return comm.bcast((time.perf_counter() - t0) / 2, root=0)

    def late_delivery(spin_s: float) -> float:
        # rank 1 waits from before rank 0 sends; both read one host's monotonic clock
        # (the two calibration ranks are launched on one host)
        comm.Barrier()
        if rank == 0:
            time.sleep(LATE)
            sent = time.perf_counter()
            wait_requests([comm.Isend(small.numpy(), dest=peer, tag=4)], timeout,
                          "calibration send", spin)
        else:
            wait_requests([comm.Irecv(small.numpy(), source=peer, tag=4)], timeout,
                          "calibration late receive", spin_s)
            sent = time.perf_counter()  # here: when the wait ended
        ends = comm.allgather(sent)
        return ends[1] - ends[0]

    return {"send_s": _median_after_warmup(post_send),
            "receive_s": _median_after_warmup(complete_arrived),
            "one_way_small_s": _median_after_warmup(lambda: one_way(small)),
            "one_way_large_s": _median_after_warmup(lambda: one_way(large)),
            "late_polled_s": _median_after_warmup(lambda: late_delivery(SPIN_S)),
            "late_slept_s": _median_after_warmup(lambda: late_delivery(0.0))}


def shared_slowdown(comm: Any, rounds: int = 3) -> float:
    """Ranks 0 and 1: a small MLP's forward and backward run for `PHASE_S` on rank 0
    alone (rank 1 asleep), then on both at once, each rank on a core of its own; the
    median over `rounds` of rank 0's time per call together over alone.

    Phases are sustained because bursts of a few milliseconds read 1.0 to 1.96 on an
    idle 2-core VM that runs two such loops for seconds at 1.00."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x = torch.randn(64, 256)

    def per_call() -> float:
        calls, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < PHASE_S:
            model(x).sum().backward()
            calls += 1
        return elapsed / calls

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) > 1:
        os.sched_setaffinity(0, {allowed[comm.Get_rank() % len(allowed)]})
    ratios = []
    try:
        per_call()  # warm-up
        for _ in range(rounds):
            comm.Barrier()
            if comm.Get_rank() == 0:
                alone = per_call()
            else:
                time.sleep(PHASE_S + 0.1)  # rank 0 runs alone
            comm.Barrier()
            both = per_call()
            if comm.Get_rank() == 0:
                ratios.append(both / alone)
    finally:
        os.sched_setaffinity(0, allowed)
    return comm.bcast(statistics.median(ratios) if ratios else None, root=0)


def runner_messages(comm: Any, width: int = 8, rows: int = 1) -> dict[str, float]:
    """Ranks 0 and 1: what one tensor costs the stage runner's own send (rank 0) and
    its receive of a message that has already arrived (rank 1), through `StageRunner`'s
    send and receive paths on a two-stage plan of a tiny model. Beyond the MPI calls
    that `message_costs` times, these pay the buffers, tags and request bookkeeping.

    Each call follows `COMPUTE_S` of work on the CPU, as in a run, where a send follows
    its forward and a receive the action before it: rank 0 sends them all, then rank 1,
    once every message is there, receives them one by one."""
    torch.manual_seed(0)
    root = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    graph = Graph.from_modules(["x"], [("a", root[0], ["x"]), ("b", root[1], ["a"])],
                               root=root)
    plan = make_plan(graph, [Stage(("x", "a")), Stage(("b",))], rows, REPS + WARMUP)
    shapes = output_shapes(graph, {"x": torch.randn(rows, width)})
    rank = comm.Get_rank()
    runner = StageRunner(graph, plan, schedule_for(plan), rank, comm, shapes, None, 30.0)
    runner.spin_s = SPIN_S  # as with a core per rank, as `message_costs`
    tensor = torch.randn(rows, width)
    times = []
    if rank == 1:
        comm.Barrier()  # every message has been sent
    for m in range(REPS + WARMUP):
        _busy(COMPUTE_S)
        t0 = time.perf_counter()
        if rank == 0:
            runner._send(tensor, 1, "a", m, False)
        else:
            runner._recv("a", 0, m, False)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        comm.Barrier()
    runner.inflight.wait(30.0, SPIN_S)
    mine = statistics.median(times[WARMUP:])
    send, receive = comm.bcast(mine, root=0), comm.bcast(mine, root=1)
    return {"runner_send_s": send, "runner_receive_s": receive}


def action_cost(micro: int = 16, width: int = 8) -> dict[str, float]:
    """This rank alone: a one-stage plan of a tiny two-layer model through `StageRunner`
    on COMM_SELF, micro-batches of one sample; seconds per action beyond the ops."""
    from mpi4py import MPI

    torch.manual_seed(0)
    root = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    graph = Graph.from_modules(["x"], [("a", root[0], ["x"]), ("b", root[1], ["a"])],
                               root=root)
    costs = profile(graph, lambda b: {"x": torch.randn(b, width)}, sizes=(1, 2),
                    repeats=REPS)
    ops_s = sum(costs.of(o).forward(1) + costs.of(o).backward(1) for o in graph.ops)
    plan = make_plan(graph, [Stage(tuple(graph.ops))], 1, micro)
    feeds = {m: {"x": torch.randn(1, width)} for m in range(micro)}
    runner = StageRunner(graph, plan, schedule_for(plan), 0, MPI.COMM_SELF,
                         output_shapes(graph, feeds[0]), None, 30.0)
    target = torch.zeros(1, width)

    def iteration() -> float:
        t0 = time.perf_counter()
        runner.run(feeds.__getitem__, lambda m: target, nn.functional.mse_loss)
        return time.perf_counter() - t0

    per_micro = _median_after_warmup(iteration, 21) / micro
    return {"ops_s": ops_s, "per_micro_batch_s": per_micro,
            "action_s": max(per_micro - ops_s, 0.0) / 2}


def measure(comm: Any) -> dict[str, Any]:
    """The three probes (collective on `comm`, which needs at least 2 ranks): the figures
    and the `Runtime` and `Link` made of them."""
    torch.set_num_threads(1)
    pair = comm.Split(0 if comm.Get_rank() < 2 else 1, comm.Get_rank())
    msgs = comm.bcast(message_costs(pair) if comm.Get_rank() < 2 else None, root=0)
    msgs.update(comm.bcast(runner_messages(pair) if comm.Get_rank() < 2 else None, root=0))
    slowdown = comm.bcast(shared_slowdown(pair) if comm.Get_rank() < 2 else None, root=0)
    actions = comm.allgather(action_cost()["action_s"])
    small, large = msgs["one_way_small_s"], msgs["one_way_large_s"]
    # the wire: a one-way time less both sides' bare MPI calls; each side's cost in a
    # run: the runner's own path, both sides alike (their mean)
    latency = max(small - msgs["send_s"] - msgs["receive_s"], 0.0)
    message_s = (msgs["runner_send_s"] + msgs["runner_receive_s"]) / 2
    bandwidth = (LARGE - SMALL) / max(large - small, 1e-9)
    runtime = Runtime(action_s=statistics.median(actions), message_s=message_s,
                      cores=os.cpu_count() or 1, shared_slowdown=max(slowdown, 1.0),
                      sleep_wake_s=max(msgs["late_slept_s"] - msgs["late_polled_s"], 0.0))
    return {"runtime": asdict(runtime), "link": {"latency": latency, "bandwidth": bandwidth},
            "messages": msgs, "action_s_per_rank": actions,
            "ranks": comm.Get_size(), "probes": PROBES, **machine()}


def machine() -> dict[str, Any]:
    """What calibrated figures belong to: this host, its cores, the torch that ran."""
    return {"host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__}


def stale(figures: dict[str, Any], here: dict[str, Any] | None = None) -> str | None:
    """Why cached `figures` do not describe this machine (`here`, by default
    `machine()`), or None: measured on another host (a home directory shared between
    hosts), with another core count, or under another torch (its kernels and Python
    overhead set `action_s`), or by another version of these probes (`PROBES`). Files
    from before a key was recorded count as stale."""
    if figures.get("probes") != PROBES:
        return f"probes version {figures.get('probes')!r}, where this one is {PROBES}"
    here = machine() if here is None else here
    for key, now in here.items():
        if figures.get(key) != now:
            return f"{key} {figures.get(key)!r} where this machine has {now!r}"
    return None


def load(path: str) -> tuple[Runtime, Link]:
    """The `Runtime` and transport `Link` a calibration file holds."""
    with open(path) as f:
        got = json.load(f)
    return Runtime(**got["runtime"]), Link(**got["link"])


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    ap = argparse.ArgumentParser(prog="python -m crossover.pipeline.calibrate")
    ap.add_argument("--out", required=True, help="rank 0 writes the figures here (JSON)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        print("calibration needs 2 ranks: mpirun -np 2 python -m crossover.pipeline."
              "calibrate --out FILE", file=sys.stderr)
        return 2
    figures = measure(comm)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
        print(json.dumps({k: figures[k] for k in ("runtime", "link")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
