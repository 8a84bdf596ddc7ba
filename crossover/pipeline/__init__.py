"""Graph pipeline parallelism: a model cut into a DAG of stages, run by micro-batches.

The pieces, one concept each:

    graph.py      model -> operator DAG (torch.fx, or an explicit graph of submodules)
    profile.py    per-op costs (measured or given) and the transfer model
    sptree.py     series-parallel decomposition (what the graph partitioner searches)
    partition.py  graph partitioner (SP dynamic programme), sequential baseline, plans
    schedule.py   schedules as data (GPipe, 1F1B on chains and DAGs), lowering, validator
    simulate.py   a schedule against the cost model: throughput, bubble, memory
    runner.py     one MPI process per stage; slots from the crossover daemon
    models.py     example models (chain, two-tower transformer, DLRM, CANDLE-Uno)

Typical use:

    g = Graph.from_fx(model)
    costs = profile(g, make_batch)
    plan = graph_partition(g, costs, devices=4, batch=64)
    sched = schedule_for(plan)
    print(simulate(g, costs, plan, sched))
"""

from __future__ import annotations

from crossover.pipeline.graph import Graph, GraphError, Op
from crossover.pipeline.partition import (
    PartitionError,
    Plan,
    Stage,
    graph_partition,
    make_plan,
)
from crossover.pipeline.profile import Costs, Link, OpCost, profile, synthetic
from crossover.pipeline.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    lower,
    one_f_one_b,
    validate,
)
from crossover.pipeline.sequential import sequential_partition
from crossover.pipeline.simulate import SimResult, simulate

__all__ = [
    "Action", "Costs", "Graph", "GraphError", "Link", "Op", "OpCost", "PartitionError",
    "Plan", "Schedule", "ScheduleError", "SimResult", "Stage", "gpipe", "graph_partition",
    "lower", "make_plan", "one_f_one_b", "plan_for", "profile", "schedule_for",
    "sequential_partition", "simulate", "synthetic", "validate",
]


def schedule_for(plan: Plan, kind: str = "1f1b", slots: bool = True) -> Schedule:
    """The lowered schedule for a plan.

    Args:
        plan: the partition (its edges give the stage graph; a sequential plan's is a chain).
        kind: "1f1b" (GraphPipe's on a DAG, classic on a chain) or "gpipe".
        slots: include slot acquire/release around compute.

    Returns:
        The validated, lowered schedule.

    Raises:
        ValueError: unknown kind.
    """
    succs = [plan.succs(s) for s in range(len(plan.stages))]
    if kind == "1f1b":
        sched = one_f_one_b(succs, plan.num_micro)
    elif kind == "gpipe":
        sched = gpipe(succs, plan.num_micro)
    else:
        raise ValueError(f"schedule kind must be '1f1b' or 'gpipe', not {kind!r}")
    low = lower(sched, slots)
    validate(low)
    return low


def parameter_costs(graph: Graph) -> Costs:
    """Deterministic stand-in costs: time per sample proportional to an op's parameter
    count (multiply-adds of a dense layer), so every rank plans the same without timing."""
    per = {n: 1e-9 * (1 + sum(p.numel() for p in op.params.values()))
           for n, op in graph.ops.items() if not op.is_input}
    return synthetic(graph, per, fixed=1e-6, act_per_sample=256.0)


def plan_for(graph: Graph, devices: int, batch: int, num_micro: int,
             partitioner: str = "graph", costs: Costs | None = None,
             replicate: bool = False) -> Plan:
    """A runnable plan on exactly `devices` ranks with `num_micro` micro-batches.

    Args:
        graph: the graph.
        devices: ranks; without `replicate`, also the number of stages.
        batch: samples per iteration; num_micro: micro-batches (must divide `batch`).
        partitioner: "graph" or "sequential".
        costs: op costs (default `parameter_costs(graph)`).
        replicate: let the partitioner run a stage on several data-parallel replicas
            (their counts divide the micro-batch; the runner needs them at launch).

    Returns:
        The plan.

    Raises:
        PartitionError: no plan with that many stages (e.g. more stages than ops).
        ValueError: `num_micro` does not divide `batch`, or unknown partitioner.
    """
    if batch % num_micro:
        raise ValueError(f"{num_micro} micro-batches do not divide the batch of {batch}")
    costs = costs or parameter_costs(graph)
    fn = {"graph": graph_partition, "sequential": sequential_partition}.get(partitioner)
    if fn is None:
        raise ValueError(f"partitioner must be 'graph' or 'sequential', not {partitioner!r}")
    return fn(graph, costs, devices, batch, micro_batches=[batch // num_micro],
              replicate=replicate, use_all=True)
