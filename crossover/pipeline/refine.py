"""The last step of the graph search on small graphs: moving single ops between stages.

The DPs keep one plan per state, the least bottleneck, and rank plans by an estimate
that charges every stage on the critical path its whole forward and backward; the
simulator runs the schedule. On small graphs the plan the simulator picked can often be
made faster by moving an op across a stage boundary: the tail of a branch to the stage
of the join, one tower's first op to the stage holding another's (random graphs of 5-10
ops: up to 12% faster than the best finalist). So the chosen plan takes, a step at a
time, the move of one op to a stage it exchanges a tensor with that simulates fastest,
while that beats the plan in hand; every plan tried is valid (its stages form a DAG,
fit in memory, and none holds only graph inputs or, where asked, no parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import PartitionError, Plan, Stage, make_plan
from crossover.pipeline.pricing import StagePricer, evaluate
from crossover.pipeline.profile import Costs

#: The most moves taken (each tries every op next to a stage boundary).
MAX_MOVES = 8
#: A move is taken only if it simulates faster by more than this share (noise in
#: floating point sums is not a reason to change the plan).
MIN_GAIN = 1e-6


def moves(graph: Graph, plan: Plan) -> list[tuple[str, int]]:
    """(op, stage) for every op that exchanges a tensor with another stage's op: the op
    moved to that stage."""
    where = {o: i for i, st in enumerate(plan.stages) for o in st.ops}
    out: set[tuple[str, int]] = set()
    for a, readers in graph.succ.items():
        for b in readers:
            if where[a] != where[b]:
                out.add((a, where[b]))
                out.add((b, where[a]))
    return sorted(out)


def moved(graph: Graph, plan: Plan, op: str, to: int, require_params: bool) -> Plan | None:
    """`plan` with `op` moved to stage `to`, or None where that leaves a stage empty,
    of graph inputs only, without parameters (with `require_params`), or the stages in
    a cycle."""
    stages = [list(st.ops) for st in plan.stages]
    src = next(i for i, ops in enumerate(stages) if op in ops)
    stages[src].remove(op)
    stages[to].append(op)
    for ops in stages:
        if not ops or all(graph.ops[o].is_input for o in ops):
            return None
        if require_params and not any(graph.ops[o].params for o in ops):
            return None
    try:
        out = make_plan(graph, [Stage(tuple(ops), st.replicas)
                                for ops, st in zip(stages, plan.stages, strict=True)],
                        plan.micro_batch, plan.num_micro)
    except PartitionError:  # the stages now read from each other in a cycle
        return None
    return replace(out, notes=list(plan.notes))


def refine(graph: Graph, costs: Costs, plan: Plan, iteration_s: Callable[[Plan], float],
           pricer: StagePricer, require_params: bool = False) -> Plan:
    """`plan` improved by single-op moves while one simulates faster (module doc).

    Args:
        graph, costs: the graph and its costs; plan: a graph plan.
        iteration_s: simulated seconds of a plan; pricer: for the memory check.
        require_params: every stage keeps an op with parameters.

    Returns:
        The plan in hand when no move beats it (`plan` itself if none did), its
        estimate set from its own stage DAG.
    """
    best, best_s = plan, iteration_s(plan)
    for _ in range(MAX_MOVES):
        step = None
        for op, to in moves(graph, best):
            cand = moved(graph, best, op, to, require_params)
            if cand is None or evaluate(graph, costs, cand, pricer)[0] == math.inf:
                continue  # a stage outgrows the memory, or its replicas split no batch
            t = iteration_s(cand)
            if t < best_s * (1 - MIN_GAIN) and (step is None or t < step[0]):
                step = (t, cand)
        if step is None:
            break
        best_s, best = step
    if best is not plan:
        bn, cr = evaluate(graph, costs, best, pricer)
        best.estimate = cr + (best.num_micro - 1) * bn
    return best
