"""The wider plan space: stages that cut inside branches.

A plan's stages form a DAG, so some order of them runs every stage after the ones it
reads from; the ops of the first k stages in that order are then a *downset* of the
graph (every op's inputs included). So every valid plan is a chain of downsets
from the empty set to the whole graph, each stage the difference of two consecutive
ones, and the chain DP of `chain.py` searches such chains once its positions are
downsets instead of the prefixes of one topological order. A stage may then hold the
first ops of two towers, or the tail of one branch with the join after it: cuts inside
branches, with the other branches placed wherever the chain puts them.

The downsets come from the series-parallel tree (a series node's first children whole
and a downset of the next; a parallel node's branches' downsets combined), so a
parallel block of branches of lengths l1..lm has (l1 + 1) x ... x (lm + 1) of them.
Where that passes `MAX_IDEALS`, long series are coarsened into fewer blocks first (a
branch is then cut only between blocks); where even blocks of two are too many, or the
graph has more than `MAX_OPS` ops (the 1039-op graph of the benchmark), the wider space
is left out and the plan's notes say so.

The chain DP prices a stage h positions from the end as holding min(h, M) micro-batches
in flight and its critical path as the sum of all stages: both at least what the
plan's stage DAG gives (stages in parallel branches are not on one path), so a plan
found here is estimated again on its own stage DAG before it joins the finalists.
"""

from __future__ import annotations

import numpy as np

from crossover.pipeline.chain import Intervals
from crossover.pipeline.graph import Graph
from crossover.pipeline.profile import Costs
from crossover.pipeline.sptree import SPNode, coarsen

#: The most downsets searched (the chain DP's matrices are this many squared).
MAX_IDEALS = 600
#: Graphs with more ops than this leave the wider space out: a chain DP over hundreds
#: of downsets, and the finalists it adds, cost the 1039-op graph of the benchmark 2-4x
#: its search time (8 and 32 devices) for plans 0.3% faster in simulation.
MAX_OPS = 256
#: Series nodes are coarsened into at most this many blocks, halving until the
#: downsets fit `MAX_IDEALS`; below the last, the wider space is not searched.
COARSENINGS = (16, 8, 4, 2)


def count_ideals(node: SPNode) -> int:
    """How many downsets of `node`'s ops its SP shape gives (the empty one included)."""
    if node.kind == "leaf":
        return 2
    if node.kind == "series":
        return 1 + sum(count_ideals(c) - 1 for c in node.children)
    out = 1
    for c in node.children:
        out *= count_ideals(c)
    return out


def ideals(node: SPNode, bit: dict[str, int]) -> list[int]:
    """The downsets of `node`'s ops as bitmasks (`bit[op]` is the op's bit), the empty
    one first."""
    if node.kind == "leaf":
        return [0, _mask(node.ops, bit)]
    if node.kind == "series":
        out, done = [0], 0
        for c in node.children:
            out += [done | s for s in ideals(c, bit)[1:]]
            done |= _mask(c.ops, bit)
        return out
    out = [0]
    for c in node.children:
        out = [a | s for a in out for s in ideals(c, bit)]
    return out


def _mask(ops: tuple[str, ...], bit: dict[str, int]) -> int:
    m = 0
    for o in ops:
        m |= 1 << bit[o]
    return m


def wider_tree(tree: SPNode, costs: Costs, limit: int = MAX_IDEALS
               ) -> tuple[SPNode | None, str]:
    """The SP tree coarsened as little as lets its downsets fit `limit`, or None if
    even blocks of two do not, the graph has more than `MAX_OPS` ops, or the tree has
    no parallel node (a chain, whose downsets are its prefixes, or a graph that is not
    series-parallel, decomposed as one series: the chain search covers its space);
    and a note saying which (empty for a tree without a parallel node)."""
    if not _branches(tree):
        return None, ""
    if len(tree.ops) > MAX_OPS:
        return None, (f"cuts inside branches not searched: more than {MAX_OPS} ops "
                      f"({len(tree.ops)})")
    for most in COARSENINGS:
        shaped, _ = coarsen(tree, costs, most)
        n = count_ideals(shaped)
        if n <= limit:
            how = "" if most == COARSENINGS[0] else f", series coarsened to {most} blocks"
            return shaped, f"cuts inside branches searched over {n} downsets{how}"
    return None, (f"cuts inside branches not searched: more than {limit} downsets even "
                  f"with series coarsened to {COARSENINGS[-1]} blocks")


def _branches(node: SPNode) -> bool:
    return node.kind == "parallel" or any(_branches(c) for c in node.children)


def ideal_intervals(graph: Graph, costs: Costs, tree: SPNode) -> Intervals:
    """The chain DP's sums over every pair of downsets I within J of `tree`, stage J - I
    priced as a graph stage (`StagePricer.info`: it sends what it makes and a later
    stage reads, and receives and keeps what it reads from an earlier one).

    Pairs that are not nested, or whose difference holds no op but graph inputs (a
    device and a hop for nothing), are not stages (`Intervals.valid`).
    """
    order = graph.order()
    n = len(order)
    bit = {o: i for i, o in enumerate(order)}
    masks = sorted(set(ideals(tree, bit)), key=lambda m: (m.bit_count(), m))
    p = len(masks)
    member = np.array([[m >> i & 1 for i in range(n)] for m in masks], dtype=bool)
    c = [costs.of(o) for o in order]
    fixed = np.array([x.fwd + x.bwd for x in c])
    per = np.array([x.fwd_per_sample + x.bwd_per_sample for x in c])
    act = np.array([x.act_per_sample for x in c])
    params = np.array([x.param_bytes for x in c])
    trained = np.array([1.0 if graph.ops[o].params else 0.0 for o in order])
    real = np.array([0.0 if graph.ops[o].is_input else 1.0 for o in order])
    reads = np.zeros((n, n))  # reads[o, r]: op r reads op o
    for o in order:
        for r in graph.succ[o]:
            reads[bit[o], bit[r]] = 1.0
    inside_f = member.astype(float)

    def span(v: np.ndarray) -> np.ndarray:
        s = inside_f @ v
        return s[None, :] - s[:, None]  # J - I for nested pairs

    # readers of each op inside each downset; an op of J with one outside J is sent on
    readers_in = inside_f @ reads.T  # (p, n)
    read_after = member & (readers_in < reads.sum(axis=1)[None, :])
    sent_j = read_after.astype(float)
    # sent by J - I: ops of J - I read after J = read_after[J] minus its ops in I
    sent = (sent_j @ act)[None, :] - (inside_f * act) @ sent_j.T
    sent_n = sent_j.sum(axis=1)[None, :] - inside_f @ sent_j.T
    # received by J - I: ops of I with a reader in J - I (more readers in J than in I)
    recv, recv_n = np.zeros((p, p)), np.zeros((p, p))
    for o in np.flatnonzero(reads.sum(axis=1)):  # op by op: p x p at a time, not p x p x n
        got = member[:, o][:, None] & (readers_in[None, :, o] > readers_in[:, o][:, None])
        recv += got * act[o]
        recv_n += got
    nested = (inside_f @ (~member).T.astype(float)) == 0  # I within J
    valid = nested & (span(real) > 0)
    pos = np.arange(p)
    return Intervals(order, pos, span(fixed), span(per), span(params),
                     span(act) + recv, sent + recv, sent_n + recv_n, span(trained),
                     exact=True, valid=valid,
                     members=[frozenset(o for o in order if m >> bit[o] & 1) for m in masks])
