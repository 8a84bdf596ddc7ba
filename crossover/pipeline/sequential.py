"""The sequential baseline (PipeDream-style): stages are intervals of a topological
order, forming a chain; a tensor crossing several cuts travels through every stage in
between (one message per tensor and hop). Priced by the same `StagePricer` terms as the
graph partitioner (`chain.intervals`, vectorised with numpy). Ops that share a
parameter (tied weights) may fall on different stages: each holds a copy (`ties`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from crossover.pipeline.chain import chain_search, intervals
from crossover.pipeline.finalists import SHORTLIST_SLACK, fastest, prefer_trained, shortlist
from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import PartitionError, Plan, Stage, make_plan
from crossover.pipeline.pricing import has_parameters, micro_batch_sizes, no_fit
from crossover.pipeline.profile import Costs

#: Cut positions the baseline searches exactly; beyond, `chain._thin` picks this many.
MAX_CUTS = 2048


def sequential_partition(graph: Graph, costs: Costs, devices: int, batch: int,
                         micro_batches: Sequence[int] | None = None, replicate: bool = True,
                         use_all: bool = False) -> Plan:
    """PipeDream-style search: stages are intervals of a topological order (a chain).

    Tensors that cross a cut travel along the chain through every stage in between.

    Args: as `graph_partition`.

    Returns:
        The plan (kind "sequential") that simulates fastest among those estimated near
        the least, with replica counts dealt again (`finalists.fastest`).

    Raises:
        PartitionError: nothing fits the memory limit, or (with `use_all`) the graph
            has fewer ops than stages.
    """
    t0 = time.perf_counter()
    found: dict[bool, Plan | None] = {}
    for require in ([True, False] if has_parameters(graph) else [False]):
        try:
            plans = sequential_shortlist(graph, costs, devices, batch, micro_batches,
                                         replicate, use_all, require)
        except PartitionError:
            found[require] = None
            continue
        found[require] = fastest(graph, costs, plans, devices if replicate else None,
                                 use_all)
    plan = prefer_trained(graph, costs, found.get(True), found[False])
    if plan is None:
        raise PartitionError(no_fit(costs, devices, batch))
    plan.search_s = time.perf_counter() - t0
    return plan


def sequential_shortlist(graph: Graph, costs: Costs, devices: int, batch: int,
                         micro_batches: Sequence[int] | None = None, replicate: bool = True,
                         use_all: bool = False, require_params: bool | None = None
                         ) -> list[Plan]:
    """The sequential plans estimated near the least (`finalists.shortlist`), least
    estimate first. Args and raises: as `sequential_partition`; require_params: every
    stage holds parameters (None: where the graph has any, unless nothing else fits).
    """
    iv = intervals(graph, costs, direct=False, max_cuts=MAX_CUTS)
    found: list = []
    for require in ([require_params] if require_params is not None
                    else [True, False] if has_parameters(graph) else [False]):
        for b in micro_batches or micro_batch_sizes(batch):
            found += [(est, (b, stages)) for est, stages in
                      chain_search(iv, costs, devices, b, batch // b, replicate, use_all,
                                   require, SHORTLIST_SLACK)]
        if found:
            break
    if not found:
        raise PartitionError(no_fit(costs, devices, batch))
    plans = []
    for est, (b, stages) in shortlist(found):
        plans.append(make_plan(graph, [Stage(ops, r) for ops, r in stages], b, batch // b,
                               "sequential"))
        plans[-1].estimate = est
    return plans
