"""Where a plan comes from: the search entry points.

`graph_partition` (GraphPipe-style) runs the chain DP and the series-parallel DP
(`graph_dp`) for each candidate micro-batch size, ranks their plans by the estimated
iteration time `critical path + (M - 1) * bottleneck`, and leaves the choice among those
estimated near the least to the simulator (`finalists`). `plan_for` gives a
runnable plan on exactly the ranks a launch has, with either partitioner
(`sequential.sequential_partition` is the PipeDream-style chain baseline); both price
stages with the same `pricing.StagePricer`, so they compare on the same graph and costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from crossover.pipeline import finalists as final
from crossover.pipeline.chain import Intervals, chain_search, intervals
from crossover.pipeline.graph import Graph
from crossover.pipeline.graph_dp import GraphDP, StageCache, flatten_stages
from crossover.pipeline.ideals import MAX_OPS, ideal_intervals, wider_tree
from crossover.pipeline.plan import PartitionError, Plan, Stage, make_plan
from crossover.pipeline.pricing import (
    StagePricer,
    evaluate,
    has_parameters,
    micro_batch_sizes,
    no_fit,
)
from crossover.pipeline.profile import Costs, synthetic
from crossover.pipeline.refine import refine
from crossover.pipeline.sequential import sequential_partition, sequential_shortlist
from crossover.pipeline.sptree import SPNode, coarsen, decompose

#: Cut positions of the chain plans the graph search also holds (all of them up to this
#: many; beyond, `chain._thin` keeps the cheapest crossing of each stretch).
CHAIN_CUTS = 512


def graph_frontier(graph: Graph, costs: Costs, devices: int, micro_batch: int,
                   num_micro: int, replicate: bool = True
                   ) -> dict[tuple[int, int], tuple[float, float, Plan]]:
    """The DP's root table for one micro-batch size (no coarsening): for each (devices
    used, pipeline depth), the least bottleneck, its critical path and its plan.

    Args:
        graph, costs, devices, replicate: as `graph_partition`.
        micro_batch: samples per micro-batch; num_micro: micro-batches per iteration.

    Returns:
        {(d, h): (bottleneck seconds, critical path seconds, plan)}.
    """
    tree, _ = decompose(graph)
    dp = GraphDP(StagePricer(graph, costs), tree, devices, micro_batch, num_micro, replicate)
    out = {}
    for d, row in dp.solve(tree, 0).items():
        for h, (bn, cr, pl) in row.items():
            plan = make_plan(graph, [Stage(ops, r) for ops, r in flatten_stages(pl)], micro_batch,
                             num_micro, "graph")
            out[(d, h)] = (bn, cr, plan)
    return out


def graph_partition(graph: Graph, costs: Costs, devices: int, batch: int,
                    micro_batches: Sequence[int] | None = None, replicate: bool = True,
                    max_children: int = 16, use_all: bool = False,
                    wider: bool = True) -> Plan:
    """GraphPipe-style search: series-parallel DP over the graph.

    Args:
        graph: the graph; costs: its costs, link and memory limit.
        devices: devices available.
        batch: samples per iteration (split into micro-batches).
        micro_batches: candidate micro-batch sizes (default `micro_batch_sizes(batch)`).
        replicate: allow data-parallel replicas of a stage.
        max_children: series runs longer than this are coarsened into blocks first.
        use_all: plans must use every device (the runner's tests want one stage a rank).
        wider: also search stages that cut inside branches (chains of downsets,
            `ideals.py`), where the graph's downsets are few enough.

    Returns:
        The plan whose iteration simulates shortest among those estimated near the
        least (`finalists.shortlist`), replica counts dealt again (`finalists.fastest`).

    Raises:
        PartitionError: nothing fits the memory limit; the message says what to relax.
    """
    t0 = time.perf_counter()
    tree, notes = decompose(graph)
    downsets, moves = None, False
    if wider:
        shaped, note = wider_tree(tree, costs)
        if shaped is not None:
            downsets = ideal_intervals(graph, costs, shaped)
        elif note:
            notes.append(note)
        # single-op moves by simulation on small graphs with branches: those searched
        # wider, and those whose SP tree has no parallel node though the graph branches
        # (not series-parallel, searched as if in series: the moves cut inside branches)
        moves = downsets is not None or (not note and len(graph.ops) <= MAX_OPS
                                         and _branches(graph))
    tree, cnotes = coarsen(tree, costs, max_children)
    notes += cnotes
    sizes = list(micro_batches or micro_batch_sizes(batch))
    chains = intervals(graph, costs, direct=True, max_cuts=CHAIN_CUTS)
    pricer = StagePricer(graph, costs)
    cache = StageCache()
    found: dict[bool, Plan | None] = {}
    # no stage without parameters (an optimizer over none fails) unless nothing else
    # fits or it pays clearly (`finalists.prefer_trained`)
    for require in ([True, False] if has_parameters(graph) else [False]):
        plans = _finalists(graph, costs, devices, batch, sizes, replicate, use_all, tree,
                           chains, pricer, cache, require, downsets)
        # the estimate ranks plans within the searches; the simulator, which runs the
        # schedule, decides between the finalists (on a tie the earlier, best estimated)
        found[require] = final.fastest(graph, costs, plans, devices if replicate else None,
                                       use_all) if plans else None
        if moves and found[require] is not None:
            found[require] = refine(graph, costs, found[require],
                                    final.timer(graph, costs, pricer), pricer, require)
    plan = final.prefer_trained(graph, costs, found.get(True), found[False])
    if plan is None:
        raise PartitionError(no_fit(costs, devices, batch))
    plan.notes, plan.search_s = notes + plan.notes, time.perf_counter() - t0
    return plan


def _branches(graph: Graph) -> bool:
    """Whether an op reads two ops, or two ops read it (graph inputs aside)."""
    real = {n for n, op in graph.ops.items() if not op.is_input}
    return any(sum(s in real for s in graph.succ[o]) > 1
               or sum(s in real for s in graph.ops[o].inputs) > 1 for o in real)


def _finalists(graph: Graph, costs: Costs, devices: int, batch: int, sizes: Sequence[int],
               replicate: bool, use_all: bool, tree: SPNode, chains: Intervals,
               pricer: StagePricer, cache: StageCache, require_params: bool,
               downsets: Intervals | None = None) -> list[Plan]:
    """The plans `graph_partition` simulates: the chain DP's, the SP DP's and (with
    `downsets`) the wider space's estimated near the least, and on graphs searched
    exactly the sequential DP's, sent direct."""
    # Chain plans first, priced as graph stages (tensors go straight to their readers):
    # the space then holds every sequential plan, a branch cut part-way included, and
    # they bound the series-parallel DP (as loosely as the shortlist reaches).
    chain_found: list[tuple[float, tuple[int, list]]] = []
    for b in sizes:
        chain_found += [(est, (b, stages)) for est, stages in
                        chain_search(chains, costs, devices, b, batch // b, replicate,
                                     use_all, require_params, final.SHORTLIST_SLACK)]
    if downsets is not None:
        chain_found += _wider(graph, costs, devices, batch, sizes, replicate, use_all,
                              downsets, pricer, require_params)
    bound = min((f[0] for f in chain_found), default=math.inf) * (1 + final.SHORTLIST_SLACK)
    found: list[tuple[float, tuple[int, list]]] = []
    for b in sizes:
        m = batch // b
        dp = GraphDP(pricer, tree, devices, b, m, replicate, cache, bound=bound,
                     require_params=require_params)
        for d, row in dp.solve(tree, 0).items():
            if use_all and d != devices:
                continue
            for _h, (bn, cr, pl) in row.items():
                found.append((cr + (m - 1) * bn, (b, flatten_stages(pl))))
    plans = []
    # series-parallel plans first: on a tie they stay (no deeper than a chain's)
    for est, (b, stages) in final.shortlist(found + chain_found):
        plans.append(make_plan(graph, [Stage(ops, r) for ops, r in stages], b, batch // b))
        plans[-1].estimate = est
    if chains.exact:
        # The chain DP keeps per state the least bottleneck, so where few micro-batches
        # make the critical path count it can miss the sequential DP's plans, and it
        # never gives graph inputs a stage (which `use_all` may need): on graphs it
        # searches exactly (cheap ones), the sequential DP's shortlist, sent direct,
        # joins the finalists.
        try:
            seqs = sequential_shortlist(graph, costs, devices, batch, sizes, replicate,
                                        use_all, require_params)
        except PartitionError:
            seqs = []
        direct = [make_plan(graph, seq.stages, seq.micro_batch, seq.num_micro, "graph")
                  for seq in seqs]
        for p in direct:
            bn, cr = evaluate(graph, costs, p, pricer)
            p.estimate = cr + (p.num_micro - 1) * bn
        # a stage of graph inputs alone trains nothing: such plans only when nothing
        # else fits
        trains = [p for p in direct
                  if not any(all(graph.ops[o].is_input for o in st.ops) for st in p.stages)]
        plans += trains if trains or plans else direct
    return plans


def _wider(graph: Graph, costs: Costs, devices: int, batch: int, sizes: Sequence[int],
           replicate: bool, use_all: bool, downsets: Intervals, pricer: StagePricer,
           require_params: bool) -> list[tuple[float, tuple[int, list]]]:
    """Plans whose stages cut inside branches: the chain DP over chains of downsets
    (`ideals.py`), each plan estimated again on its own stage DAG (the chain prices
    every stage on one path and as deep as its place in the chain)."""
    out = []
    for b in sizes:
        # no slack: the chain's estimates are above the plans' own, so none is dropped
        # for them
        for _est, stages in chain_search(downsets, costs, devices, b, batch // b, replicate,
                                         use_all, require_params):
            plan = make_plan(graph, [Stage(ops, r) for ops, r in stages], b, batch // b)
            bn, cr = evaluate(graph, costs, plan, pricer)
            if bn < math.inf:
                out.append((cr + (batch // b - 1) * bn, (b, stages)))
    return out


def parameter_costs(graph: Graph) -> Costs:
    """Deterministic stand-in costs: time per sample proportional to an op's parameter
    count (multiply-adds of a dense layer), so every rank plans the same without timing."""
    per = {n: 1e-9 * (1 + sum(p.numel() for p in op.params.values()))
           for n, op in graph.ops.items() if not op.is_input}
    # parameter bytes price the gradient allreduce of a replicated stage
    sizes = {n: float(sum(p.numel() * p.element_size() for p in op.params.values()))
             for n, op in graph.ops.items()}
    return synthetic(graph, per, fixed=1e-6, act_per_sample=256.0, param_bytes=sizes)


def plan_for(graph: Graph, devices: int, batch: int, num_micro: int,
             partitioner: str = "graph", costs: Costs | None = None,
             replicate: bool = False, use_all: bool = True) -> Plan:
    """A runnable plan on `devices` ranks (all of them, by default) with `num_micro`
    micro-batches.

    Args:
        graph: the graph.
        devices: ranks; without `replicate`, also the number of stages.
        batch: samples per iteration; num_micro: micro-batches (must divide `batch`).
        partitioner: "graph" or "sequential".
        costs: op costs (default `parameter_costs(graph)`).
        replicate: let the partitioner run a stage on several data-parallel replicas
            (their counts divide the micro-batch; the runner needs them at launch).
        use_all: the plan uses every device; False lets the search leave devices out
            where the estimate says they do not pay (plans use the lowest ranks).

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
              replicate=replicate, use_all=use_all)
