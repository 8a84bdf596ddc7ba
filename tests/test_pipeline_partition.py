"""Both partitioners against brute force on small graphs with random costs."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from crossover.pipeline import (
    Graph,
    PartitionError,
    Stage,
    graph_partition,
    make_plan,
    plan_for,
    sequential_partition,
    synthetic,
)
from crossover.pipeline.models import build
from crossover.pipeline.partition import evaluate, graph_frontier
from crossover.pipeline.profile import Link
from crossover.pipeline.sptree import SPNode, decompose


def ident(*xs):
    return xs[0]


def explicit(edges: dict[str, list[str]]) -> Graph:
    return Graph.from_modules(["x"], [(n, ident, srcs) for n, srcs in edges.items()])


GRAPHS = {
    "chain": {"a": ["x"], "b": ["a"], "c": ["b"], "d": ["c"], "e": ["d"]},
    "diamond": {"a": ["x"], "b": ["x"], "c": ["a", "b"], "d": ["c"]},
    "two_branch": {"a1": ["x"], "a2": ["a1"], "b1": ["x"], "b2": ["b1"], "c": ["a2", "b2"]},
    "three_branch": {"a": ["x"], "b": ["x"], "c": ["x"], "d": ["a", "b", "c"], "e": ["d"]},
    "nested": {"a": ["x"], "b1": ["a"], "b2": ["a"], "c": ["b1", "b2"], "d": ["x"],
               "e": ["c", "d"]},
}


def random_costs(g: Graph, seed: int, memory: float = math.inf):
    rng = random.Random(seed)
    per = {n: rng.uniform(1e-4, 1e-3) for n in g.ops}
    params = {n: rng.choice([0.0, 1e5, 1e6]) for n in g.ops}
    return synthetic(g, per, fixed=rng.uniform(0, 2e-4), act_per_sample=rng.uniform(1e3, 1e5),
                     param_bytes=params, link=Link(1e9, 1e-5), memory=memory)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]


def representable(tree: SPNode) -> set[frozenset]:
    """Stage op-sets the SP search may form, listed independently of the DP."""
    out: set[frozenset] = set()

    def walk(node: SPNode) -> None:
        out.add(frozenset(node.ops))
        kids = node.children
        if node.kind == "series":
            for i in range(len(kids)):
                for j in range(i + 1, len(kids) + 1):
                    out.add(frozenset(o for c in kids[i:j] for o in c.ops))
        elif node.kind == "parallel" and len(kids) <= 4:
            for r in range(2, len(kids) + 1):
                for grp in itertools.combinations(kids, r):
                    out.add(frozenset(o for c in grp for o in c.ops))
        for c in kids:
            walk(c)

    walk(tree)
    return out


def brute_bottleneck(g, costs, devices, b, m, kind, allowed=None):
    best = math.inf
    order = g.order()
    if kind == "graph":
        candidates = set_partitions(order)
    else:
        candidates = ([order[i:j] for i, j in itertools.pairwise((0, *cuts, len(order)))]
                      for k in range(len(order)) for cuts in
                      itertools.combinations(range(1, len(order)), k))
    for parts in candidates:
        if allowed is not None and any(frozenset(p) not in allowed for p in parts):
            continue
        if len(parts) > devices:
            continue
        for reps in itertools.product((1, 2, 4), repeat=len(parts)):
            if sum(reps) > devices:
                continue
            try:
                plan = make_plan(g, [Stage(tuple(p), r) for p, r in zip(parts, reps,
                                                                        strict=True)],
                                 b, m, kind)
            except PartitionError:  # the stage graph has a cycle
                continue
            best = min(best, evaluate(g, costs, plan)[0])
    return best


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graph_dp_equals_brute_force(name, seed):
    g = explicit(GRAPHS[name])
    memory = [math.inf, 4e6, 2.5e6][seed]
    costs = random_costs(g, seed, memory)
    devices, b, m = 4, 4, 8
    table = graph_frontier(g, costs, devices, b, m)
    for (d, _h), (bn, _cr, plan) in table.items():
        assert plan.devices == d
        # the DP's bookkeeping (depths, in-flight counts) agrees with a fresh evaluation
        assert evaluate(g, costs, plan)[0] == pytest.approx(bn, rel=1e-9)
    dp_best = min((v[0] for v in table.values()), default=math.inf)
    tree, _ = decompose(g)
    brute = brute_bottleneck(g, costs, devices, b, m, "graph", representable(tree))
    assert dp_best == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("memory", [math.inf, 1.2e7, 4e6])
def test_sequential_dp_equals_brute_force(name, memory):
    g = explicit(GRAPHS[name])
    costs = random_costs(g, 7, memory)
    devices, b, m = 4, 4, 4096  # many micro-batches: the bottleneck decides
    brute = brute_bottleneck(g, costs, devices, b, m, "sequential")
    if brute == math.inf:
        with pytest.raises(PartitionError):
            sequential_partition(g, costs, devices, b * m, micro_batches=[b])
        return
    plan = sequential_partition(g, costs, devices, b * m, micro_batches=[b])
    assert evaluate(g, costs, plan)[0] == pytest.approx(brute, rel=1e-3)


def test_graph_partitioner_runs_branches_on_their_own_devices():
    g = Graph.from_fx(build("uno", small=True).module)
    plan = plan_for(g, 4, 16, 4)
    firsts = sorted(s.ops[0] for s in plan.stages)
    assert firsts == ["cat", "cell", "drug1", "drug2"]
    assert plan.depth_to_sink() == [2, 2, 2, 1]
    seq = plan_for(g, 4, 16, 4, "sequential")
    assert seq.depth_to_sink() == [4, 3, 2, 1]


def test_sequential_plan_passes_tensors_through():
    g = explicit(GRAPHS["two_branch"])
    plan = make_plan(g, [Stage(("x", "a1", "a2")), Stage(("b1", "b2")), Stage(("c",))], 1, 1,
                     "sequential")
    # a2 is read by c only, but travels through stage 1 on a chain
    assert plan.edges[(0, 1)] == ("x", "a2") and plan.edges[(1, 2)] == ("a2", "b2")
    graph_plan = make_plan(g, plan.stages, 1, 1, "graph")
    assert graph_plan.edges[(0, 2)] == ("a2",)


def test_memory_limit_that_nothing_fits_says_what_to_relax():
    g = explicit(GRAPHS["chain"])
    costs = random_costs(g, 0, memory=10.0)
    with pytest.raises(PartitionError, match="raise the memory limit"):
        graph_partition(g, costs, 2, 8)


def test_bad_plans_are_refused():
    g = explicit(GRAPHS["diamond"])
    with pytest.raises(PartitionError, match="in no stage"):
        make_plan(g, [Stage(("x", "a"))], 1, 1)
    with pytest.raises(PartitionError, match="in a cycle"):
        make_plan(g, [Stage(("x", "a", "d")), Stage(("b", "c"))], 1, 1)


def test_large_graph_is_coarsened_and_planned():
    edges: dict[str, list[str]] = {}
    prev = "x"
    for blk in range(4):
        outs = []
        for br in range(3):
            p = prev
            for i in range(20):
                n = f"b{blk}_{br}_{i}"
                edges[n] = [p]
                p = n
            outs.append(p)
        edges[f"join{blk}"] = outs
        prev = f"join{blk}"
    g = explicit(edges)
    costs = random_costs(g, 3)
    plan = graph_partition(g, costs, 8, 64, max_children=8)
    assert any("coarsened" in n for n in plan.notes)
    assert sorted(o for s in plan.stages for o in s.ops) == sorted(g.ops)
    assert evaluate(g, costs, plan)[0] < math.inf
