"""A candidate stage of the graph search priced from the SP-tree nodes it is made of.

Every stage the graph DP forms is a union of whole SP-tree nodes (a run of a series
node's children, a group of branches, a bridge of both). Sums of op times, activations
and parameters add over the nodes; what crosses the stage's boundary can only cross at
a node's *ports*: its ops read from outside it and its ops whose outputs leave it. So a
stage of hundreds of ops is priced by looking at a handful of ports, not at every op
(`StagePricer.info` does the same from the op list, and the tests check they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from crossover.pipeline.pricing import StageInfo, StagePricer
from crossover.pipeline.sptree import SPNode


@dataclass(frozen=True)
class _Node:
    fixed: float
    per_sample: float
    act: float
    params: float
    mask: int                                  # bit i: op i of the graph is inside
    out_ports: tuple[tuple[int, int], ...]     # (op, bitmask of its readers) read outside
    in_ports: tuple[int, ...]                  # ops outside that ops inside read


class NodeSums:
    """`info(nodes)`: the StageInfo of the stage made of `nodes` (disjoint SP nodes).

    Args:
        pricer: the pricer whose per-op sums and edges are used.
    """

    def __init__(self, pricer: StagePricer) -> None:
        self.p = pricer
        n = len(pricer.index)
        self.readers = [0] * n
        self.reads: list[list[int]] = [[] for _ in range(n)]
        for s, d in zip(pricer.src.tolist(), pricer.dst.tolist(), strict=True):
            self.readers[s] |= 1 << d
            self.reads[d].append(s)
        self.nodes: dict[int, _Node] = {}

    def node(self, node: SPNode) -> _Node:
        got = self.nodes.get(id(node))
        if got is None:
            p = self.p
            idx = [p.index[o] for o in node.ops]
            mask = 0
            for i in idx:
                mask |= 1 << i
            outs = tuple((i, self.readers[i]) for i in idx if self.readers[i] & ~mask)
            ins = tuple(sorted({s for i in idx for s in self.reads[i] if not mask >> s & 1}))
            got = self.nodes[id(node)] = _Node(
                float(p.fixed[idx].sum()), float(p.per_sample[idx].sum()),
                float(p.act[idx].sum()), float(p.params[idx].sum()), mask, outs, ins)
        return got

    def info(self, nodes: Sequence[SPNode]) -> StageInfo:
        parts = [self.node(n) for n in nodes]
        mask = 0
        for q in parts:
            mask |= q.mask
        act = self.p.act
        sent = [i for q in parts for i, readers in q.out_ports if readers & ~mask]
        received = {s for q in parts for s in q.in_ports if not mask >> s & 1}
        sent_bytes = sum(act[i] for i in sent)
        received_bytes = sum(act[s] for s in received)
        return StageInfo(sum(q.fixed for q in parts), sum(q.per_sample for q in parts),
                         len(sent) + len(received), float(sent_bytes + received_bytes),
                         sum(q.act for q in parts) + float(received_bytes),
                         sum(q.params for q in parts))
