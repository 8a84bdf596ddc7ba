"""GraphPipe's search as a dynamic programme over a series-parallel tree.

A series node's stages are runs of its children, a parallel node's branches get their
own devices and run at the same time (or share stages in groups), a group of a parallel
child's branches may share a stage with the series children just before or just after
it (the other branches on their own devices in between: e.g. a two-tower model's [text
tower | image tower + join + head]), and any stage may run on several data-parallel
replicas. No stage holds only graph inputs (an input goes with a consumer).

The DP state is (tree node, devices, stages downstream k) -> {depth h: best}; `k + h`
is how many micro-batches a stage holds in a one-forward-one-backward schedule, which is
what the memory limit prices. Each state minimises the bottleneck stage time (the
critical path breaks ties).
"""

from __future__ import annotations

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


def flatten_stages(cons: tuple) -> list[tuple[tuple[str, ...], int]]:
    out, stack = [], [cons]
    while stack:
        c = stack.pop()
        if not c:
            continue
        if c[0] == "+":
            stack.append(c[2])
            stack.append(c[1])
        else:
            out.append(c)
    return out


def _join(a: tuple, b: tuple) -> tuple:
    if not a:
        return b
    if not b:
        return a
    return ("+", a, b)


def _bridge_groups(m: int) -> list[int]:
    """Groups of a parallel node's m branches (bitmasks) that may share one stage with the
    series children just before or just after the node: every nonempty proper subset for up
    to 4 branches, single branches beyond."""
    if m > 4:
        return [1 << g for g in range(m)]
    return list(range(1, (1 << m) - 1))


class GraphDP:
    """The DP over the SP tree for one micro-batch size.

    Stage shapes: a run of a series node's children; a group of a parallel node's branches
    (or one branch solved on its own); and *bridges* across a parallel child P of a series
    node: a stage holding the series children just before P plus a group of P's branches,
    and/or a stage holding another group of P's branches plus the series children just
    after P, with P's remaining branches on their own devices between the two. A stage
    made only of graph inputs is never formed (its inputs go with their consumers)."""

    def __init__(self, pricer: StagePricer, tree: SPNode, devices: int, b: int, m: int,
                 replicate: bool, infos: dict | None = None) -> None:
        self.p, self.tree, self.D, self.b, self.M = pricer, tree, devices, b, m
        self.rs = replica_counts(devices, b, replicate)
        self.memo: dict[tuple[int, int], Table] = {}
        self.pmemo: dict[tuple[int, int, int], Table] = {}
        # (kind, ...) -> (ops, info); batch-size-free, so shareable between micro-batch sizes
        self.infos: dict[tuple, tuple[tuple[str, ...], StageInfo]] = \
            {} if infos is None else infos
        self.inputs = {n for n, op in pricer.graph.ops.items() if op.is_input}

    def stage(self, key: tuple, ops_fn) -> tuple[tuple[str, ...], StageInfo]:
        got = self.infos.get(key)
        if got is None:
            ops = tuple(ops_fn())
            got = self.infos[key] = (ops, self.p.info(ops))
        return got

    def run(self, node: SPNode, i: int, j: int) -> tuple[tuple[str, ...], StageInfo]:
        """Children i..j-1 of a series node (the whole node for a leaf)."""
        if not node.children:
            return self.stage(("node", id(node)), lambda: node.ops)
        return self.stage(("run", id(node), i, j),
                          lambda: (o for c in node.children[i:j] for o in c.ops))

    def branch_ops(self, par: SPNode, mask: int) -> list[str]:
        return [o for g, c in enumerate(par.children) if mask >> g & 1 for o in c.ops]

    def one_stage(self, info: StageInfo, ops: tuple[str, ...], k: int, table: Table,
                  extra_d: int = 0, rest: dict[int, Best] | None = None) -> None:
        """Add `ops` as one stage (any replica count) in front of `rest` ({h: best} on
        `extra_d` devices; None: nothing downstream inside this node). Prices exactly as
        `StagePricer.price` (the replica counts already divide the micro-batch)."""
        if all(o in self.inputs for o in ops):
            return  # an input-only stage: a device and a hop for nothing
        rest = rest if rest is not None else {0: (0.0, 0.0, ())}
        p, limit = self.p, self.p.costs.memory
        for r in self.rs:
            if r + extra_d > self.D:
                break
            t = p.time(info, r, self.b, self.M)
            for h2, (bn2, cr2, pl2) in rest.items():
                if p.memory(info, r, self.b, min(k + h2 + 1, self.M)) > limit:
                    continue
                _put(table, r + extra_d, h2 + 1, (max(t, bn2), t + cr2, _join((ops, r), pl2)))

    def solve(self, node: SPNode, k: int) -> Table:
        key = (id(node), k)
        if key in self.memo:
            return self.memo[key]
        table: Table = {}
        ops, info = self.run(node, 0, len(node.children))
        self.one_stage(info, ops, k, table)
        if node.kind == "series":
            self._series(node, k, table)
        elif node.kind == "parallel":
            _merge(table, self.branches(node, (1 << len(node.children)) - 1, k))
        self.memo[key] = table
        return table

    def _series(self, node: SPNode, k: int, table: Table) -> None:
        n = len(node.children)
        suffix: list[Table] = [{} for _ in range(n)] + [{0: {0: (0.0, 0.0, ())}}]
        for i in reversed(range(n)):
            g = suffix[i]
            for j in range(i + 1, n + 1):
                if i == 0 and j == n:
                    continue  # the whole node as one stage: added by solve
                ops, info = self.run(node, i, j)
                for d2, rest in suffix[j].items():
                    self.one_stage(info, ops, k, g, d2, rest)
            child = node.children[i]
            if child.kind != "leaf":
                self._then(lambda h2, c=child: self.solve(c, k + h2), suffix[i + 1], g)
            if child.kind == "parallel":
                self._bridges(node, i, k, suffix)
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
                        _put(out, d1 + d2, h1 + h2, (max(bn1, bn2), cr1 + cr2, _join(pl1, pl2)))

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
                    ops, info = self.stage(
                        ("tail", id(node), i, j, g2),
                        lambda j=j, g2=g2: self.branch_ops(par, g2)
                        + [o for c in kids[i + 1:j] for o in c.ops])
                    for d2, rest in suffix[j].items():
                        self.one_stage(info, ops, k, tail, d2, rest)
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
                ops, info = self.stage(
                    ("head", id(node), i0, i, g1),
                    lambda i0=i0, g1=g1: [o for c in kids[i0:i] for o in c.ops]
                    + self.branch_ops(par, g1))
                for d2, rest in mid.items():
                    self.one_stage(info, ops, k, suffix[i0], d2, rest)

    def branches(self, par: SPNode, mask: int, k: int) -> Table:
        """The branches in `mask` of parallel node `par` side by side, grouped by every set
        partition (up to 4 branches; beyond, one by one): a group of several branches is
        one stage, a single branch is solved on its own."""
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
                ops, info = self.stage(("group", id(par), f), lambda f=f: self.branch_ops(par, f))
                self.one_stage(info, ops, k, sub)
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
                            _put(out, d1 + d2, max(h1, h2),
                                 (max(bn1, bn2), max(cr1, cr2), _join(pl1, pl2)))
        self.pmemo[key] = out
        return out
