"""The sequential baseline (PipeDream-style): stages are intervals of a topological
order, forming a chain; a tensor crossing several cuts travels through every stage in
between. Priced by the same `StagePricer` as the graph partitioner, vectorised over the
end of the first stage with numpy. The order is that of `ties.units`, and cuts fall only
between units, so ops that share a parameter (tied weights) always share a stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import PartitionError, Plan, Stage, make_plan
from crossover.pipeline.pricing import micro_batch_sizes, no_fit, replica_counts
from crossover.pipeline.profile import Costs
from crossover.pipeline.ties import units


def sequential_partition(graph: Graph, costs: Costs, devices: int, batch: int,
                         micro_batches: Sequence[int] | None = None, replicate: bool = True,
                         use_all: bool = False) -> Plan:
    """PipeDream-style search: stages are intervals of a topological order (a chain).

    Tensors that cross a cut travel along the chain through every stage in between.

    Args: as `graph_partition`.

    Returns:
        The plan (kind "sequential") with the least estimated iteration time.

    Raises:
        PartitionError: nothing fits the memory limit, or (with `use_all`) tied ops
            leave fewer units than stages.
    """
    t0 = time.perf_counter()
    groups = units(graph)
    order = [o for u in groups for o in u]  # topological, each unit contiguous
    n = len(order)
    # where a stage may start or end: between units, never inside one
    bounds = np.cumsum([0] + [len(u) for u in groups])
    cuttable = np.zeros(n + 1, dtype=bool)
    cuttable[bounds] = True
    ends = {i: np.flatnonzero(cuttable[i + 1:]) + i + 1 for i in bounds[:-1].tolist()}
    pos = {o: i for i, o in enumerate(order)}
    c, link = costs, costs.link
    fixed = np.concatenate([[0.0], np.cumsum([c.of(o).fwd + c.of(o).bwd for o in order])])
    per = np.concatenate([[0.0], np.cumsum([c.of(o).fwd_per_sample + c.of(o).bwd_per_sample
                                            for o in order])])
    act = np.concatenate([[0.0], np.cumsum([c.of(o).act_per_sample for o in order])])
    par = np.concatenate([[0.0], np.cumsum([c.of(o).param_bytes for o in order])])
    # cut[j]: bytes per sample of the tensors produced before position j and read at or
    # after it: what crosses the boundary between stage [.., j) and [j, ..).
    diff = np.zeros(n + 1)
    for o in order:
        last = max((pos[s] for s in graph.succ[o]), default=pos[o])
        if last > pos[o]:
            diff[pos[o] + 1] += c.of(o).act_per_sample
            diff[last + 1] -= c.of(o).act_per_sample
    cut = np.cumsum(diff)
    cut[0] = cut[n] = 0.0
    best: tuple[float, int, int, list] | None = None
    for b in micro_batches or micro_batch_sizes(batch):
        m = batch // b
        rs = replica_counts(devices, b, replicate)
        inf = math.inf
        # S[h][d][i]: best (bottleneck, critical) for suffix i on d devices in h stages
        bn = np.full((devices + 1, devices + 1, n + 1), inf)
        cr = np.full_like(bn, inf)
        arg = np.full((devices + 1, devices + 1, n + 1, 2), -1, dtype=np.int64)
        bn[0, 0, n] = cr[0, 0, n] = 0.0
        for h in range(1, devices + 1):
            for d in range(h, devices + 1):
                for r in rs:
                    if r > d - (h - 1):
                        break
                    for i, j in ends.items():
                        share = b / r
                        steps = 2 * (r - 1)
                        t = (fixed[j] - fixed[i] + (per[j] - per[i]) * share
                             + ((cut[j] > 0).astype(float) + (cut[i] > 0)) * link.latency
                             + (cut[j] + cut[i]) * share / link.bandwidth
                             + (steps * link.latency
                                + steps / r * (par[j] - par[i]) / link.bandwidth) / m)
                        mem = ((par[j] - par[i]) * c.param_factor
                               + min(h, m) * (act[j] - act[i] + cut[i]) * share)
                        v = np.maximum(t, bn[h - 1, d - r, j])
                        v[mem > c.memory] = inf
                        k = int(np.argmin(v))
                        if v[k] == inf:
                            continue
                        crit = t[k] + cr[h - 1, d - r, j[k]]
                        if (v[k], crit) < (bn[h, d, i], cr[h, d, i]):
                            bn[h, d, i], cr[h, d, i] = v[k], crit
                            arg[h, d, i] = (j[k], r)
        for h in range(1, devices + 1):
            for d in range(h, devices + 1):
                if (use_all and d != devices) or bn[h, d, 0] == inf:
                    continue
                est = cr[h, d, 0] + (m - 1) * bn[h, d, 0]
                if best is None or est < best[0]:
                    stages, i, hh, dd = [], 0, h, d
                    while i < n:
                        j, r = arg[hh, dd, i]
                        stages.append((tuple(order[i:j]), int(r)))
                        i, hh, dd = int(j), hh - 1, dd - int(r)
                    best = (est, b, m, stages)
    if best is None:
        raise PartitionError(no_fit(costs, devices, batch, graph))
    est, b, m, stages = best
    plan = make_plan(graph, [Stage(ops, r) for ops, r in stages], b, m, "sequential")
    plan.estimate, plan.search_s = est, time.perf_counter() - t0
    return plan
