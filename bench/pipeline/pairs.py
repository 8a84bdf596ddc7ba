"""Two plans of one model timed in one launch, in alternating blocks of iterations, so
that both meet the same machine: run under mpirun by `bench/pipeline/compare.py`.

    mpirun -np 2 python -m bench.pipeline.pairs --model chain --plans "$PLANS" \
        --blocks 8 --block-iters 4 --warmup 10 --out t.json

On a shared VM, identical launches of the same plan ran 6.2-12.3 ms an iteration
minutes apart; two plans measured in separate launches then compare the machine's
moments as much as the plans. Here every rank builds both plans' stage runners (the
same graph and parameters; each plan's own stage for this rank) and runs them in turn,
`--block-iters` iterations at a time, alternating which goes first in each block.
`--plans` is JSON, {name: {"kind": "graph" | "sequential", "stages": [[op, ...],
...]}} (the kind sets what the edges carry, as in `make_plan`); rank 0
writes {"plans": {name: {"times": [...], "spent": [per rank, per iteration {kind: s}],
"stage_of_rank": [...], "plan": text, "loss": the last iteration's}}, "order": [name of
each block, as run]} to `--out`. Nothing updates the parameters, so every plan's loss
is the same model's on the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from crossover.pipeline.__main__ import timed_iterations
from crossover.pipeline.graph import Graph
from crossover.pipeline.models import build
from crossover.pipeline.placement import check_ranks, stage_of_rank
from crossover.pipeline.plan import Stage, make_plan
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import schedule_for


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    ap = argparse.ArgumentParser(prog="bench/pipeline/pairs.py")
    ap.add_argument("--model", required=True)
    ap.add_argument("--plans", required=True,
                    help='JSON: {name: {"kind": ..., "stages": [[op, ...], ...]}}')
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--warmup", type=int, default=10, help="untimed iterations per plan")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-iters", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    spec = build(args.model, torch.float32)
    graph = Graph.from_fx(spec.module)
    b = args.batch // args.micro
    feeds, targets = spec.make_batch(args.batch, 1)
    micro = {m: {k: v[m * b:(m + 1) * b] for k, v in feeds.items()} for m in range(args.micro)}
    shapes = output_shapes(graph, micro[0])
    runners: dict[str, StageRunner] = {}
    for name, given in json.loads(args.plans).items():
        plan = make_plan(graph, [Stage(tuple(o)) for o in given["stages"]], b, args.micro,
                         given["kind"])
        try:
            check_ranks(plan, comm.Get_size())
        except ValueError as exc:
            print(f"rank {rank}: plan {name!r}: {exc}", file=sys.stderr, flush=True)
            return 2
        stage, _ = stage_of_rank(plan, rank)
        runners[name] = StageRunner(graph, plan, schedule_for(plan, args.schedule), stage,
                                    comm, shapes, None, args.timeout)

    def target(m: int) -> torch.Tensor:
        return targets[m * b:(m + 1) * b]

    got: dict[str, dict] = {name: {"times": [], "spent": [], "loss": 0.0} for name in runners}

    def timed(name: str, iters: int) -> tuple[list[float], list[dict[str, float]]]:
        times, spent, got[name]["loss"] = timed_iterations(runners[name], iters, micro,
                                                           target, spec.loss)
        return times, spent

    for name in runners:
        timed(name, args.warmup)
    names, order = list(runners), []
    for block in range(args.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            times, spent = timed(name, args.block_iters)
            got[name]["times"] += times
            got[name]["spent"] += spent
            order.append(name)
    out: dict[str, dict] = {}
    for name, runner in runners.items():
        spent_by_rank = comm.gather(got[name]["spent"], root=0)
        stages = comm.gather(runner.s, root=0)
        # the last iteration's loss: summed from the ranks (the last stage's hold it)
        loss = comm.reduce(got[name]["loss"], root=0)
        out[name] = {"times": got[name]["times"], "spent": spent_by_rank,
                     "stage_of_rank": stages, "plan": runner.plan.describe(), "loss": loss}
    if rank == 0:
        Path(args.out).write_text(json.dumps({"plans": out, "order": order}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
