"""Graph pipeline parallelism: a model cut into a DAG of stages, run by micro-batches.

The pieces, one concept each:

    graph.py      model -> operator DAG (torch.fx, or an explicit graph of submodules)
    ties.py       tied weights: a copy on each stage, gradients summed between them
    profile.py    per-op costs (measured or given) and the transfer model
    sptree.py     series-parallel decomposition (what the graph partitioner searches)
    plan.py       a partition plan: stages, stage edges, batch split
    pricing.py    what a candidate stage costs (time, memory), shared by all searches
    graph_dp.py   GraphPipe's dynamic programme over the series-parallel tree
    sequential.py the PipeDream-style chain partitioner (the baseline)
    partition.py  search entry points: graph_partition, plan_for
    schedule.py   schedules as data (GPipe, 1F1B on chains and DAGs), lowering, validator
    simulate.py   a schedule against the cost model: throughput, bubble, memory
    finalists.py  which plan a search keeps: the simulator decides among the near-best
    runner.py     one MPI process per stage; slots from the crossover daemon
    waits.py      MPI waits with deadlines, cancelling on failure; decisions all ranks share
    repartition.py  live re-plan after layers freeze (`crossover.freeze` decides which)
    migrate.py    parameters and optimizer state to their new ranks, bit for bit
    frozen_prefix.py  the frozen front cut off, its outputs cached per sample
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
from crossover.pipeline.partition import graph_partition, parameter_costs, plan_for
from crossover.pipeline.plan import PartitionError, Plan, Stage, make_plan
from crossover.pipeline.profile import Costs, Link, OpCost, profile, synthetic
from crossover.pipeline.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    lower,
    one_f_one_b,
    schedule_for,
    validate,
)
from crossover.pipeline.sequential import sequential_partition
from crossover.pipeline.simulate import SimResult, simulate

__all__ = [
    "Action", "Costs", "Graph", "GraphError", "Link", "Op", "OpCost", "PartitionError",
    "Plan", "Schedule", "ScheduleError", "SimResult", "Stage", "gpipe", "graph_partition",
    "lower", "make_plan", "one_f_one_b", "parameter_costs", "plan_for", "profile",
    "schedule_for",
    "sequential_partition", "simulate", "synthetic", "validate",
]
