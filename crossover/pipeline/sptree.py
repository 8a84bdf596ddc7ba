"""Series-parallel decomposition of an operator DAG (the graph partitioner's search tree).

A node-based decomposition: a set of ops splits in *parallel* into its weakly connected
components, and in *series* at its bottleneck ops (ops every other op of the set reaches
or is reached from). Ancestor sets are Python-int bitsets, so a 1000-op graph decomposes
in milliseconds.

A connected set without a bottleneck is not series-parallel. It is cut at the
topological position crossed by the fewest edges and the two parts are treated as in
series: the search then never puts ops of both parts in parallel branches (it loses
some plans, never correctness: the stage graph is built from the real edges). Every
such cut is reported in the notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossover.pipeline.graph import Graph
from crossover.pipeline.profile import Costs


@dataclass(eq=False)
class SPNode:
    """A node of the SP tree: a leaf (one op, or a coarsened run of ops), or a series or
    parallel composition of children. `ops` lists every op below, topologically."""

    kind: str
    ops: tuple[str, ...]
    children: list[SPNode] = field(default_factory=list)

    def leaves(self) -> int:
        return 1 if self.kind == "leaf" else sum(c.leaves() for c in self.children)

    def show(self, indent: int = 0) -> str:
        pad = "  " * indent
        if self.kind == "leaf":
            return f"{pad}{'+'.join(self.ops)}"
        return "\n".join([f"{pad}{self.kind}"] + [c.show(indent + 1) for c in self.children])


def decompose(graph: Graph) -> tuple[SPNode, list[str]]:
    """The series-parallel tree of `graph`.

    Args:
        graph: the validated graph.

    Returns:
        (tree, notes): notes name every non-series-parallel part and how it was cut.
    """
    groups = [(o,) for o in graph.order()]
    order = [u[0] for u in groups]
    idx = {n: v for v, u in enumerate(groups) for n in u}
    preds = [sorted({idx[s] for n in u for s in graph.ops[n].inputs} - {v})
             for v, u in enumerate(groups)]
    succs = [sorted({idx[s] for n in u for s in graph.succ[n]} - {v})
             for v, u in enumerate(groups)]
    anc = [0] * len(order)
    for v in range(len(order)):
        for p in preds[v]:
            anc[v] |= anc[p] | (1 << p)
    desc = [0] * len(order)
    for v in reversed(range(len(order))):
        for s in succs[v]:
            desc[v] |= desc[s] | (1 << s)
    notes: list[str] = []

    def leaf(v: int) -> SPNode:
        return SPNode("leaf", groups[v])

    def build(nodes: list[int]) -> SPNode:
        if len(nodes) == 1:
            return leaf(nodes[0])
        mask = 0
        for v in nodes:
            mask |= 1 << v
        comps = _components(nodes, mask, preds, succs)
        if len(comps) > 1:
            return _make("parallel", [build(c) for c in comps])
        n = len(nodes)
        bott = [v for v in nodes if ((anc[v] | desc[v]) & mask).bit_count() == n - 1]
        if bott:
            bmask = 0
            for v in bott:
                bmask |= 1 << v
            segs: list[list[int]] = [[] for _ in range(len(bott) + 1)]
            for v in nodes:
                if not bmask >> v & 1:
                    segs[(anc[v] & bmask).bit_count()].append(v)
            parts: list[SPNode] = []
            for i, seg in enumerate(segs):
                if seg:
                    parts.append(build(seg))
                if i < len(bott):
                    parts.append(leaf(bott[i]))
            return _make("series", parts)
        # Not series-parallel here: cut where the fewest edges cross.
        pos = {v: i for i, v in enumerate(nodes)}
        cross = [0] * (n + 1)
        for v in nodes:
            for s in succs[v]:
                if s in pos:
                    cross[pos[v] + 1] += 1
                    cross[pos[s] + 1] -= 1
        run, best = 0, None
        for k in range(1, n):
            run += cross[k]
            key = (run, abs(2 * k - n))
            if best is None or key < best[0]:
                best = (key, k)
        k = best[1]
        a, b = nodes[:k], nodes[k:]
        notes.append(f"not series-parallel: {_names(order, a)} and {_names(order, b)} "
                     f"(crossed by {best[0][0]} edges) are searched as if in series")
        return _make("series", [build(a), build(b)])

    return build(list(range(len(order)))), notes


def _names(order: list[str], vs: list[int]) -> str:
    names = [order[v] for v in vs]
    return "{" + ", ".join(names[:3]) + (f", ... {len(names)} ops" if len(names) > 3 else "") + "}"


def _make(kind: str, parts: list[SPNode]) -> SPNode:
    flat: list[SPNode] = []
    for p in parts:
        flat.extend(p.children if p.kind == kind else [p])
    return SPNode(kind, tuple(o for p in flat for o in p.ops), flat)


def _components(nodes: list[int], mask: int, preds: list[list[int]],
                succs: list[list[int]]) -> list[list[int]]:
    comp: dict[int, int] = {}
    comps: list[list[int]] = []
    for v in nodes:
        if v in comp:
            continue
        comp[v] = len(comps)
        stack, members = [v], []
        while stack:
            u = stack.pop()
            members.append(u)
            for w in preds[u] + succs[u]:
                if mask >> w & 1 and w not in comp:
                    comp[w] = comp[v]
                    stack.append(w)
        comps.append(sorted(members))
    return comps


def coarsen(tree: SPNode, costs: Costs, max_children: int) -> tuple[SPNode, list[str]]:
    """Group runs of leaves in long series nodes into blocks of similar cost, so that no
    series node has more than about `max_children` children (bounds the DP's work).

    Args:
        tree: the SP tree; costs: op costs (per-sample forward + backward is balanced).
        max_children: the target number of children per series node.

    Returns:
        (new tree, notes saying where blocks were formed).
    """
    notes: list[str] = []

    def cost(node: SPNode) -> float:
        return sum(costs.of(o).fwd_per_sample + costs.of(o).bwd_per_sample + costs.of(o).fwd
                   for o in node.ops)

    def walk(node: SPNode) -> SPNode:
        if node.kind == "leaf":
            return node
        kids = [walk(c) for c in node.children]
        if node.kind == "series" and len(kids) > max_children:
            target = sum(cost(c) for c in kids) / max_children
            out: list[SPNode] = []
            block: list[SPNode] = []

            def close() -> None:
                if block:
                    out.append(SPNode("leaf", tuple(o for b in block for o in b.ops)))
                    block.clear()

            acc = 0.0
            for c in kids:
                if c.kind != "leaf":
                    close()
                    acc = 0.0
                    out.append(c)
                    continue
                block.append(c)
                acc += cost(c)
                if acc >= target:
                    close()
                    acc = 0.0
            close()
            notes.append(f"coarsened a series of {len(kids)} parts into {len(out)} blocks")
            kids = out
        return SPNode(node.kind, node.ops, kids)

    return walk(tree), notes
