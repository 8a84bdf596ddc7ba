"""Run a model's pipeline under mpirun, one rank per stage replica; rank 0 writes the
gradients (.pt, for tests against one process) or timings (.json).

    mpirun -np 3 python -m crossover.pipeline --model uno --small --dtype float64
    mpirun -np 3 python -m crossover.pipeline --model chain --small --replicas 2,1
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from crossover import environment as E
from crossover import session
from crossover.pipeline.gather import gather_grads
from crossover.pipeline.graph import Graph
from crossover.pipeline.placement import (
    check_ranks,
    parse_replicas,
    stage_of_rank,
    with_replicas,
)
from crossover.pipeline.plan import Stage, make_plan
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import ScheduleError


def timed_iterations(runner: StageRunner, iters: int, micro: Mapping[int, Any],
                     target: Callable[[int], torch.Tensor], loss_fn: Callable[..., Any]
                     ) -> tuple[list[float], list[dict[str, float]], float]:
    """`iters` iterations of `runner` between barriers on its communicator, gradients
    cleared before each: seconds per iteration, seconds in each action kind per
    iteration, and the last loss. A timeout or a broken schedule aborts the job (every
    rank stops at once, with the reason on stderr)."""
    comm, graph = runner.comm, runner.g
    times, spent, loss = [], [], 0.0
    seen = dict(runner.spent)
    for _ in range(iters):
        for p in graph.parameters().values():
            p.grad = None
        comm.Barrier()
        t0 = time.perf_counter()
        try:
            loss = runner.run(micro.__getitem__, target, loss_fn)
        except (TimeoutError, ScheduleError) as exc:
            print(f"rank {comm.Get_rank()}: {exc}", file=sys.stderr, flush=True)
            comm.Abort(3)
        comm.Barrier()
        times.append(time.perf_counter() - t0)
        spent.append({k: v - seen.get(k, 0.0) for k, v in runner.spent.items()})
        seen = dict(runner.spent)
    return times, spent, loss


def main(argv: list[str] | None = None) -> int:
    """Run a model's pipeline under mpirun; rank 0 writes gradients and timings."""
    from mpi4py import MPI

    from crossover.pipeline import plan_for, schedule_for
    from crossover.pipeline.models import build

    ap = argparse.ArgumentParser(prog="python -m crossover.pipeline")
    ap.add_argument("--model", default="uno")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per iteration")
    ap.add_argument("--partitioner", default="graph", choices=["graph", "sequential"])
    ap.add_argument("--plan", help="a plan as JSON: [[op, ...], ...] per stage (overrides)")
    ap.add_argument("--replicas", help="data-parallel replicas per stage, e.g. 2,1 (stage "
                    "order of --plan, else of the planned stages; default 1 each): the "
                    "launch needs their sum of ranks")
    ap.add_argument("--replicate", action="store_true", help="let the partitioner choose "
                    "data-parallel replicas of stages over the -np ranks (without --plan)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--slots", action="store_true", help="take the crossover device slot")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", help="rank 0 writes gradients (.pt) or timings (.json) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    spec = build(args.model, getattr(torch, args.dtype), small=args.small)
    graph = Graph.from_fx(spec.module)
    b = args.batch // args.micro
    if args.plan:
        ops = json.loads(args.plan)
        reps = parse_replicas(args.replicas, len(ops)) or [1] * len(ops)
        stages = [Stage(tuple(o), r) for o, r in zip(ops, reps, strict=True)]
        plan = make_plan(graph, stages, b, args.micro, args.partitioner)
    else:
        reps = parse_replicas(args.replicas)
        stages_n = len(reps) if reps else size
        plan = comm.bcast(plan_for(graph, stages_n, args.batch, args.micro, args.partitioner,
                                   replicate=args.replicate and not reps)
                          if rank == 0 else None, root=0)
        if reps:
            plan = with_replicas(plan, reps)
    # every rank checks before the first message, so a wrong -np fails at once, no hang
    try:
        check_ranks(plan, size)
    except ValueError as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    stage, _replica = stage_of_rank(plan, rank)
    sched = schedule_for(plan, args.schedule)
    feeds_all, target_all = spec.make_batch(args.batch, 1)
    micro = {m: {k: v[m * b:(m + 1) * b] for k, v in feeds_all.items()}
             for m in range(args.micro)}
    shapes = output_shapes(graph, micro[0])
    client = None
    if args.slots:  # the job's name, trace and node come from CROSSOVER_* as for any job
        client = session.init(job=E.job_name() or f"pipeline-{args.model}")
    runner = StageRunner(graph, plan, sched, stage, comm, shapes, client, args.timeout)
    times, spent, loss = timed_iterations(runner, args.iters, micro,
                                          lambda m: target_all[m * b:(m + 1) * b], spec.loss)
    grads = gather_grads(graph, comm, plan=plan)
    # each rank's own stage gradients, so a test can see the replicas agree
    own = {k: p.grad.detach().numpy().copy() for k, p in runner.params.items()
           if p.grad is not None}
    rank_grads = comm.gather(own, root=0)
    losses = comm.gather(loss, root=0)
    peak_live = comm.gather(runner.peak_live, root=0)
    # seconds in each action kind per iteration, per rank (the validator's measure)
    spent_by_rank = comm.gather(spent, root=0)
    stages_of = comm.gather(stage, root=0)
    session.shutdown()
    if rank == 0 and args.out:
        if args.out.endswith(".json"):
            with open(args.out, "w") as f:
                json.dump({"times": times, "median_s": statistics.median(times),
                           "plan": plan.describe(), "loss": sum(losses),
                           "spent": spent_by_rank, "stage_of_rank": stages_of}, f)
        else:
            with open(args.out, "wb") as f:
                pickle.dump({"grads": {k: v.numpy() for k, v in grads.items()},
                             "loss": sum(losses), "plan": [list(s.ops) for s in plan.stages],
                             "replicas": [s.replicas for s in plan.stages],
                             "devices": [plan.devices_of(i) for i in range(len(plan.stages))],
                             "rank_grads": rank_grads, "kind": plan.kind,
                             "peak_live": peak_live}, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
