"""GraphPipe's search as a dynamic programme over a series-parallel tree.

A series node's stages are runs of its children, a parallel node's branches get their
own devices and run at the same time (or share stages in groups), a group of a parallel
child's branches may share a stage with the series children just before or just after
it (the other branches on their own devices in between: e.g. a two-tower model's [text
tower | image tower + join + head]), and any stage may run on several data-parallel
replicas. No stage holds only graph inputs (an input goes with a consumer).

The DP state is (tree node, devices, stages downstream k) -> {depth h: best}; `k + h`
is how many micro-batches a stage holds in a one-forward-one-backward schedule, which is
what the memory limit prices. Each state keeps the least bottleneck per depth (the
critical path breaks ties) and drops a depth another beats in depth, bottleneck and
critical path at once. A node that fits on one device with every micro-batch in flight
is solved once for every k. With a bound (1.25x the best chain plan's estimate), a part
whose `critical path + (M - 1) * bottleneck` exceeds it is dropped: composing parts
only grows both terms. Stages are priced from their SP nodes' ports (`node_sums`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossover.pipeline.node_sums import NodeSums
from crossover.pipeline.pricing import StageInfo, StagePricer, replica_counts
from crossover.pipeline.sptree import SPNode

Best = tuple[float, float, tuple]  # (bottleneck, critical path, stages as a cons list)
Table = dict[int, dict[int, Best]]  # devices -> depth -> best


def _better(a: Best | None, b: Best) -> bool:
    return a is None or (b[0], b[1]) < (a[0], a[1])


def _put(table: Table, d: int, h: int, cand: Best) -> None:
    row = table.setdefault(d, {})
    if _better(row.get(h), cand):
        row[h] = cand


def _merge(into: Table, table: Table) -> None:
    for d, row in table.items():
        for h, best in row.items():
            _put(into, d, h, best)


def _prune(table: Table) -> Table:
    """Drop every plan that another on as many devices beats or ties in bottleneck,
    critical path and depth at once: whatever is built on it (deeper stages, a longer
    path, more micro-batches in flight upstream) is no better."""
    for d, row in table.items():
        if len(row) < 2:
            continue
        kept: dict[int, Best] = {}
        for h in sorted(row):
            bn, cr, _pl = row[h]
            if not any(b2 <= bn and c2 <= cr for b2, c2, _ in kept.values()):
                kept[h] = row[h]
        table[d] = kept
    return table


def flatten_stages(cons: tuple) -> list[tuple[tuple[str, ...], int]]:
    """A plan's cons list as [(ops, replicas)] (its stages hold SP nodes)."""
    out, stack = [], [cons]
    while stack:
        c = stack.pop()
        if not c:
            continue
        if c[0] == "+":
            stack.append(c[2])
            stack.append(c[1])
        else:
            nodes, r = c
            out.append((tuple(o for n in nodes for o in n.ops), r))
    return out


def _join(a: tuple, b: tuple) -> tuple:
    if not a:
        return b
    if not b:
        return a
    return ("+", a, b)


_NOTHING: Table = {0: {0: (0.0, 0.0, ())}}  # an empty plan: no devices, no stages


def _bridge_groups(m: int) -> list[int]:
    """Groups of a parallel node's m branches (bitmasks) that may share one stage with the
    series children just before or just after the node: every nonempty proper subset for up
    to 4 branches, single branches beyond."""
    if m > 4:
        return [1 << g for g in range(m)]
    return list(range(1, (1 << m) - 1))


@dataclass
class StageCache:
    """Candidate stages' sums, which do not depend on the micro-batch size, so the DPs
    for several sizes share them: (kind, ...) -> (SP nodes, info), and the ids of the infos
    of stages made only of graph inputs and of stages without parameters."""

    infos: dict[tuple, tuple[tuple[SPNode, ...], StageInfo]] = field(default_factory=dict)
    input_only: set[int] = field(default_factory=set)
    untrained: set[int] = field(default_factory=set)
    sums: NodeSums | None = None


class GraphDP:
    """The DP over the SP tree for one micro-batch size.

    Stage shapes: a run of a series node's children; a group of a parallel node's branches
    (or one branch solved on its own); and *bridges* across a parallel child P of a series
    node: a stage holding the series children just before P plus a group of P's branches,
    and/or a stage holding another group of P's branches plus the series children just
    after P, with P's remaining branches on their own devices between the two. A stage
    made only of graph inputs is never formed (its inputs go with their consumers), nor,
    with `require_params`, one whose ops hold no parameters."""

    def __init__(self, pricer: StagePricer, tree: SPNode, devices: int, b: int, m: int,
                 replicate: bool, cache: StageCache | None = None,
                 bound: float = float("inf"), require_params: bool = False) -> None:
        self.require_params = require_params
        self.p, self.tree, self.D, self.b, self.M = pricer, tree, devices, b, m
        # Branch and bound: a plan's estimate `critical path + (M - 1) * bottleneck` is at
        # least that of any part of it (both terms only grow as parts are composed), so a
        # part estimated above `bound` (a plan already in hand) is dropped.
        self.M1, self.bound = m - 1, bound * (1 + 1e-12)
        self.rs = replica_counts(devices, b, replicate)
        self.memo: dict[tuple[int, int], Table] = {}
        self.pmemo: dict[tuple[int, int, int], Table] = {}
        self.fits_whole: dict[int, bool] = {}
        self.prices: dict[int, list[tuple[int, float, float]]] = {}  # by id of a StageInfo
        self.cache = cache or StageCache()
        if self.cache.sums is None:
            self.cache.sums = NodeSums(pricer)
        self.sums = self.cache.sums
        self.inputs = {n for n, op in pricer.graph.ops.items() if op.is_input}
        # bit i: op i (the pricer's index) holds parameters
        self.trained = sum(1 << i for n, i in pricer.index.items()
                           if pricer.graph.ops[n].params) if require_params else 0

    def stage(self, key: tuple, nodes_fn) -> tuple[tuple[SPNode, ...], StageInfo]:
        """The stage made of the SP nodes `nodes_fn()` (cached under `key`)."""
        got = self.cache.infos.get(key)
        if got is None:
            nodes = tuple(nodes_fn())
            got = self.cache.infos[key] = (nodes, self.sums.info(nodes))
            if all(o in self.inputs for n in nodes for o in n.ops):
                self.cache.input_only.add(id(got[1]))
            if self.require_params and \
                    not any(self.sums.node(n).mask & self.trained for n in nodes):
                self.cache.untrained.add(id(got[1]))
        return got

    def run(self, node: SPNode, i: int, j: int) -> tuple[tuple[SPNode, ...], StageInfo]:
        """Children i..j-1 of a series node (the whole node for a leaf)."""
        if not node.children:
            return self.stage(("node", id(node)), lambda: [node])
        return self.stage(("run", id(node), i, j), lambda: node.children[i:j])

    def branch_nodes(self, par: SPNode, mask: int) -> list[SPNode]:
        return [c for g, c in enumerate(par.children) if mask >> g & 1]

    def one_stage(self, info: StageInfo, nodes: tuple[SPNode, ...], k: int, table: Table,
                  rest: Table | None = None) -> None:
        """Add `nodes` as one stage (any replica count) in front of every plan in `rest`
        (None: nothing downstream inside this node). Prices exactly as
        `StagePricer.price` (the replica counts already divide the micro-batch)."""
        if id(info) in self.cache.input_only or \
                (self.require_params and id(info) in self.cache.untrained):
            return  # an input-only stage: a device and a hop for nothing
        k1, m, m1, bound = k + 1, self.M, self.M1, self.bound
        prices = self.priced(info)
        for extra_d, row2 in (rest if rest is not None else _NOTHING).items():
            for r, t, fits in prices:
                d = r + extra_d
                if d > self.D:
                    break
                if m * t > bound:
                    continue  # a plan holding it has a path and bottleneck of at least t
                row = table.get(d)
                if row is None:
                    row = table[d] = {}
                for h2, (bn2, cr2, pl2) in row2.items():
                    if (k1 + h2 if k1 + h2 < m else m) > fits:
                        continue
                    bn = t if t > bn2 else bn2
                    cr = t + cr2
                    if cr + m1 * bn > bound:
                        continue  # no plan holding it beats the bound
                    old = row.get(h2 + 1)
                    if old is None or bn < old[0] or (bn == old[0] and cr < old[1]):
                        row[h2 + 1] = (bn, cr, _join((nodes, r), pl2))

    def priced(self, info: StageInfo) -> list[tuple[int, float, float]]:
        """(replicas, seconds per micro-batch, most micro-batches in flight that fit) for
        each replica count, as `StagePricer.price` would have it."""
        got = self.prices.get(id(info))
        if got is None:
            p, b, m = self.p, self.b, self.M
            got = []
            for r in self.rs:
                base = p.memory(info, r, b, 0)
                per = p.memory(info, r, b, 1) - base
                spare = p.costs.memory - base
                fits = -1 if spare < 0 else m if spare >= per * m else spare // per
                got.append((r, p.time(info, r, b, m), fits))
            self.prices[id(info)] = got
        return got

    def solve(self, node: SPNode, k: int) -> Table:
        nodes, info = self.run(node, 0, len(node.children))
        k = self.memory_free_k(node, info, k)
        key = (id(node), k)
        if key in self.memo:
            return self.memo[key]
        table: Table = {}
        self.one_stage(info, nodes, k, table)
        if node.kind == "series":
            self._series(node, k, table)
        elif node.kind == "parallel":
            _merge(table, self.branches(node, (1 << len(node.children)) - 1, k))
        self.memo[key] = _prune(table)
        return table

    def memory_free_k(self, node: SPNode, info: StageInfo, k: int) -> int:
        """The `k` that `solve(node, k)` is the same for: memory admits at most M
        micro-batches in flight, so every k >= M - 1 prices alike; and if the whole node
        fits on one device with all M in flight, no stage inside it (a subset of its ops,
        holding at most its activations) meets the limit at any k."""
        got = self.fits_whole.get(id(node))
        if got is None:
            got = self.fits_whole[id(node)] = \
                self.p.memory(info, 1, self.b, self.M) <= self.p.costs.memory
        return 0 if got else min(k, self.M - 1)

    def _series(self, node: SPNode, k: int, table: Table) -> None:
        n = len(node.children)
        suffix: list[Table] = [{} for _ in range(n)] + [{0: {0: (0.0, 0.0, ())}}]
        for i in reversed(range(n)):
            g = suffix[i]
            for j in range(i + 1, n + 1):
                if i == 0 and j == n:
                    continue  # the whole node as one stage: added by solve
                nodes, info = self.run(node, i, j)
                self.one_stage(info, nodes, k, g, suffix[j])
            child = node.children[i]
            if child.kind != "leaf":
                self._then(lambda h2, c=child: self.solve(c, k + h2), suffix[i + 1], g)
            if child.kind == "parallel":
                self._bridges(node, i, k, suffix)
            _prune(g)  # complete: later children (done first) bridge into it, not after
        _merge(table, suffix[0])

    def _then(self, first, rest: Table, out: Table) -> None:
        """`first(h2)` (a table solved with h2 more stages downstream) feeding every stage
        plan in `rest` (whose first stage is at depth h2): series composition into `out`."""
        for d2, row2 in rest.items():
            for h2, (bn2, cr2, pl2) in row2.items():
                for d1, row1 in first(h2).items():
                    if d1 + d2 > self.D:
                        continue
                    for h1, (bn1, cr1, pl1) in row1.items():
                        bn, cr = max(bn1, bn2), cr1 + cr2
                        if cr + self.M1 * bn <= self.bound:
                            _put(out, d1 + d2, h1 + h2, (bn, cr, _join(pl1, pl2)))

    def _bridges(self, node: SPNode, i: int, k: int, suffix: list[Table]) -> None:
        """Stages across the parallel child i: [children i0..i-1 + branches G1] and/or
        [branches G2 + children i+1..j-1], the other branches on their own devices."""
        par, n = node.children[i], len(node.children)
        full = (1 << len(par.children)) - 1
        groups = _bridge_groups(len(par.children))
        kids = node.children
        tails: dict[int, Table] = {0: suffix[i + 1]}  # G2 -> plans of G2 + children i+1..
        if i + 1 < n:
            for g2 in groups:
                tail: Table = {}
                for j in range(i + 2, n + 1):
                    nodes, info = self.stage(
                        ("tail", id(node), i, j, g2),
                        lambda j=j, g2=g2: self.branch_nodes(par, g2) + kids[i + 1:j])
                    self.one_stage(info, nodes, k, tail, suffix[j])
                tails[g2] = tail
        for g1 in [0] + (groups if i > 0 else []):
            mid: Table = {}  # the branches outside G1 and what follows the node
            for g2, tail in tails.items():
                if g1 & g2 or (g1 == 0 and g2 == 0):
                    continue  # overlapping, or the plain case (solve(P) then suffix[i+1])
                others = full & ~g1 & ~g2
                if others:
                    self._then(lambda h2, m=others: self.branches(par, m, k + h2), tail, mid)
                else:
                    _merge(mid, tail)
            if g1 == 0:
                _merge(suffix[i], mid)
                continue
            for i0 in range(i):
                nodes, info = self.stage(
                    ("head", id(node), i0, i, g1),
                    lambda i0=i0, g1=g1: kids[i0:i] + self.branch_nodes(par, g1))
                self.one_stage(info, nodes, k, suffix[i0], mid)

    def branches(self, par: SPNode, mask: int, k: int) -> Table:
        """The branches in `mask` of parallel node `par` side by side, grouped by every set
        partition (up to 4 branches; beyond, one by one): a group of several branches is
        one stage, a single branch is solved on its own."""
        k = self.memory_free_k(par, self.run(par, 0, len(par.children))[1], k)
        key = (id(par), mask, k)
        if key in self.pmemo:
            return self.pmemo[key]
        low = mask & -mask
        rest_mask = mask & ~low
        firsts = [low]
        if len(par.children) <= 4:
            s = rest_mask
            while s:
                firsts.append(low | s)
                s = (s - 1) & rest_mask
        out: Table = {}
        for f in firsts:
            if f == low:
                sub = self.solve(par.children[low.bit_length() - 1], k)
            else:
                sub = {}
                nodes, info = self.stage(("group", id(par), f),
                                         lambda f=f: self.branch_nodes(par, f))
                self.one_stage(info, nodes, k, sub)
            if f == mask:
                _merge(out, sub)
                continue
            other = self.branches(par, mask & ~f, k)
            for d1, row1 in sub.items():
                for d2, row2 in other.items():
                    if d1 + d2 > self.D:
                        continue
                    for h1, (bn1, cr1, pl1) in row1.items():
                        for h2, (bn2, cr2, pl2) in row2.items():
                            bn, cr = max(bn1, bn2), max(cr1, cr2)
                            if cr + self.M1 * bn <= self.bound:
                                _put(out, d1 + d2, max(h1, h2), (bn, cr, _join(pl1, pl2)))
        self.pmemo[key] = _prune(out)
        return out
