"""Which of a search's plans to keep: the simulator decides.

Both searches rank plans by `critical path + (M - 1) * bottleneck`, which charges each
stage on the path its whole forward and backward before the next stage starts; a 1F1B
schedule overlaps more than that where micro-batches are few (Uno at 8 devices, 2
micro-batches: a plan estimated 7% slower than the best simulated 12% faster). So the
plans estimated within `SHORTLIST_SLACK` of the best (at most `SHORTLIST_MOST`) are
simulated, and the fastest is taken.

A search also keeps one deal of replica counts per (devices, depth), the one with the
least bottleneck, which may be a deal the schedule runs slower (Uno at 8 devices:
towers and head on 2 replicas each, where towers on 1, 1 and 2 and the head on 4
simulate 14% faster). So the fastest few plans are simulated again under other deals
of their stages' replica counts: the `DEAL_SIMULATED` deals of least busiest-stage time
(`num_micro x bottleneck`), where a plan has at most `DEAL_LIMIT` deals (past that,
many stages on many devices, none are tried: listing them would cost more than the
search).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from functools import cache
from typing import TypeVar

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Plan, Stage
from crossover.pipeline.pricing import StagePricer, evaluate, replica_counts
from crossover.pipeline.profile import Costs
from crossover.pipeline.schedule import Schedule, schedule_for
from crossover.pipeline.simulate import simulate

T = TypeVar("T")

#: Plans estimated within this share of the least estimate go to the simulator (at most
#: `SHORTLIST_MOST` of them).
SHORTLIST_SLACK, SHORTLIST_MOST = 0.25, 16
#: Replica counts are dealt again for the (at most `DEAL_MOST`) fastest plans with
#: distinct stages that simulate within `DEAL_WITHIN` of the fastest, each in its
#: `DEAL_SIMULATED` deals of least busiest-stage time, if it has at most `DEAL_LIMIT`.
DEAL_WITHIN, DEAL_MOST, DEAL_LIMIT, DEAL_SIMULATED = 0.15, 3, 1024, 32
#: A plan with a stage that holds no parameters (it trains nothing, and a plain
#: optimizer over its rank's parameters fails) is taken only if it simulates faster
#: than the best plan without one by more than this share.
UNTRAINED_GAIN = 0.05


def shortlist(found: Iterable[tuple[float, T]], slack: float | None = None,
              most: int | None = None) -> list[tuple[float, T]]:
    """The (estimate, candidate) pairs estimated within `slack` (default
    `SHORTLIST_SLACK`) of the least, at most `most` (default `SHORTLIST_MOST`), least
    estimate first (the earlier of a tie first)."""
    slack = SHORTLIST_SLACK if slack is None else slack
    most = SHORTLIST_MOST if most is None else most
    ranked = sorted(found, key=lambda f: f[0])
    if not ranked:
        return []
    limit = ranked[0][0] * (1 + slack)
    return [f for f in ranked[:most] if f[0] <= limit]


def replica_deals(counts: Sequence[int], stages: int, devices: int, exact: bool
                  ) -> Iterator[tuple[int, ...]]:
    """Every way to give `stages` stages a replica count each from `counts` (ascending)
    on at most `devices` devices (exactly `devices` with `exact`)."""
    if stages == 0:
        if not exact or devices == 0:
            yield ()
        return
    for r in counts:
        if r > devices - (stages - 1):
            break
        for rest in replica_deals(counts, stages - 1, devices - r, exact):
            yield (r, *rest)


def deal_count(counts: Sequence[int], stages: int, devices: int, exact: bool) -> int:
    """How many deals `replica_deals` gives, without listing them."""
    @cache
    def n(s: int, d: int) -> int:
        if s == 0:
            return int(not exact or d == 0)
        return sum(n(s - 1, d - r) for r in counts if r <= d - (s - 1))

    return n(stages, devices)


def timer(graph: Graph, costs: Costs, pricer: StagePricer) -> Callable[[Plan], float]:
    """Simulated 1F1B iteration seconds of a plan; plans with the same stage DAG and
    micro-batch count share one schedule (replica counts do not change it)."""
    schedules: dict[tuple, Schedule] = {}

    def iteration_s(plan: Plan) -> float:
        key = (tuple(tuple(plan.succs(s)) for s in range(len(plan.stages))), plan.num_micro)
        if key not in schedules:
            schedules[key] = schedule_for(plan)
        return simulate(graph, costs, plan, schedules[key], pricer).iteration_s

    return iteration_s


def _deals(graph: Graph, costs: Costs, plan: Plan, devices: int, use_all: bool,
           pricer: StagePricer) -> list[Plan]:
    """`plan`'s stages under the `DEAL_SIMULATED` other deals of replica counts that fit
    in memory with the least busiest-stage time; none past `DEAL_LIMIT` deals."""
    counts = replica_counts(devices, plan.micro_batch, True)
    n = len(plan.stages)
    if deal_count(counts, n, devices, use_all) > DEAL_LIMIT:
        return []
    own = tuple(st.replicas for st in plan.stages)
    scored = []
    for deal in replica_deals(counts, n, devices, use_all):
        if deal == own:
            continue
        # lists copied: no two plans share a mutable field
        cand = replace(plan, stages=[Stage(st.ops, r) for st, r in
                                     zip(plan.stages, deal, strict=True)],
                       edges=dict(plan.edges), notes=list(plan.notes))
        bn, cr = evaluate(graph, costs, cand, pricer)
        if bn < math.inf:  # fits in memory and splits the micro-batch
            cand.estimate = cr + (cand.num_micro - 1) * bn
            scored.append((cand.num_micro * bn, len(scored), cand))
    return [c for _, _, c in sorted(scored, key=lambda s: s[:2])[:DEAL_SIMULATED]]


def fastest(graph: Graph, costs: Costs, plans: Sequence[Plan], devices: int | None = None,
            use_all: bool = False) -> Plan:
    """The plan whose 1F1B iteration simulates shortest (the earlier of a tie).

    With `devices`, the `DEAL_MOST` fastest plans with distinct stages that simulate
    within `DEAL_WITHIN` of the fastest also compete with their stages' replica counts
    dealt again (on at most, or with `use_all` exactly, that many devices; module doc).
    """
    pricer = StagePricer(graph, costs)
    iteration_s = timer(graph, costs, pricer)
    timed = [(iteration_s(p), i, p) for i, p in enumerate(plans)]
    best = min(timed, key=lambda t: t[:2])
    if devices is None:
        return best[2]
    seen: set[tuple] = set()
    limit = best[0] * (1 + DEAL_WITHIN)
    for t, i, plan in sorted(timed, key=lambda t: t[:2]):
        if t > limit or len(seen) == DEAL_MOST:
            break
        key = (tuple(st.ops for st in plan.stages), plan.micro_batch)
        if key in seen:
            continue
        seen.add(key)
        for cand in _deals(graph, costs, plan, devices, use_all, pricer):
            best = min(best, (iteration_s(cand), len(plans) + i, cand), key=lambda x: x[:2])
    return best[2]


def prefer_trained(graph: Graph, costs: Costs, trained: Plan | None, free: Plan | None
                   ) -> Plan | None:
    """The plan whose every stage holds parameters (`trained`), unless there is none or
    `free` (searched without that rule) simulates faster by more than `UNTRAINED_GAIN`;
    a `free` plan taken that has a stage without parameters says why in its notes."""
    if trained is None or free is None:
        chosen = trained or free
        gain = None
    else:
        iteration_s = timer(graph, costs, StagePricer(graph, costs))
        t_trained, t_free = iteration_s(trained), iteration_s(free)
        chosen = free if t_free < t_trained * (1 - UNTRAINED_GAIN) else trained
        gain = t_trained / t_free - 1 if t_free > 0 else 0.0  # (costs all zero)
    if chosen is not None and chosen is free and any(
            not any(graph.ops[o].params for o in st.ops) for st in chosen.stages):
        why = ("no plan without one fits" if gain is None else
               f"it simulates {gain:.0%} faster than the best plan without one")
        chosen.notes = [*chosen.notes, f"a stage holds no parameters (it trains nothing): "
                                       f"{why}"]
    return chosen
