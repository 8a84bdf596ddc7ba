"""Partitioners: cut an operator graph into pipeline stages.

`graph_partition` (GraphPipe-style) decomposes the DAG into a series-parallel tree and runs
a dynamic programme over it: a series node's stages are runs of its children, a parallel
node's branches get their own devices and run at the same time (or share stages in
groups), a group of a parallel child's branches may share a stage with the series children
just before or just after it (the other branches on their own devices in between: e.g. a
two-tower model's [text tower | image tower + join + head]), and any stage may run on
several data-parallel replicas. No stage holds only graph inputs (an input goes with a
consumer). `sequential_partition` (PipeDream-style) cuts a topological order into a chain.
Both price stages with the same `StagePricer`, so they can be compared on the same graph
and costs.

The DP state is (tree node, devices, stages downstream k) -> {depth h: best}; `k + h`
is how many micro-batches a stage holds in a one-forward-one-backward schedule, which is
what the memory limit prices. Each state minimises the bottleneck stage time (the
critical path breaks ties); the root picks micro-batch size, device count and depth by
the estimated iteration time `critical path + (M - 1) * bottleneck`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from crossover.pipeline.graph import Graph
from crossover.pipeline.profile import Costs
from crossover.pipeline.sptree import SPNode, coarsen, decompose


class PartitionError(ValueError):
    """No plan fits (memory limit, batch size, devices); says what to relax."""


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: ops (topological order) run on `replicas` data-parallel devices."""

    ops: tuple[str, ...]
    replicas: int = 1


@dataclass
class Plan:
    """A partition: stages in topological order, what travels between them, batch split.

    Args:
        stages: the stages; stage i runs on devices `devices_of(i)`.
        edges: (from stage, to stage) -> names of the tensors sent forward on that edge.
        micro_batch: samples per micro-batch.
        num_micro: micro-batches per iteration.
        kind: "graph" (a stage DAG) or "sequential" (a chain; tensors pass through).
        notes: what the partitioner wants the user to know (non-SP parts, coarsening).
        estimate: the partitioner's estimated iteration time, seconds.
        search_s: how long the search took, seconds.
    """

    stages: list[Stage]
    edges: dict[tuple[int, int], tuple[str, ...]]
    micro_batch: int
    num_micro: int
    kind: str = "graph"
    notes: list[str] = field(default_factory=list)
    estimate: float = math.nan
    search_s: float = 0.0

    @property
    def devices(self) -> int:
        return sum(s.replicas for s in self.stages)

    def devices_of(self, stage: int) -> list[int]:
        first = sum(s.replicas for s in self.stages[:stage])
        return list(range(first, first + self.stages[stage].replicas))

    def preds(self, stage: int) -> list[int]:
        return sorted(a for a, b in self.edges if b == stage)

    def succs(self, stage: int) -> list[int]:
        return sorted(b for a, b in self.edges if a == stage)

    def depth_to_sink(self) -> list[int]:
        """Stages on the longest path from each stage to a sink, itself included."""
        depth = [1] * len(self.stages)
        for s in reversed(range(len(self.stages))):
            for t in self.succs(s):
                depth[s] = max(depth[s], depth[t] + 1)
        return depth

    def describe(self) -> str:
        parts = [f"{i}:{'+'.join(s.ops) if len(s.ops) <= 3 else s.ops[0] + '..' + s.ops[-1]}"
                 f"{'x' + str(s.replicas) if s.replicas > 1 else ''}"
                 for i, s in enumerate(self.stages)]
        return (f"{self.kind} plan, {len(self.stages)} stages on {self.devices} devices, "
                f"micro-batch {self.micro_batch} x {self.num_micro}: " + " | ".join(parts))


def make_plan(graph: Graph, stages: Sequence[Stage], micro_batch: int, num_micro: int,
              kind: str = "graph") -> Plan:
    """Order stages topologically and work out what each edge carries.

    Args:
        graph: the graph the stages cover.
        stages: every op in exactly one stage.
        micro_batch: samples per micro-batch; num_micro: micro-batches per iteration.
        kind: "graph": tensors go straight to the stages that read them; "sequential":
            stages form a chain in the given order and every tensor crossing a cut is
            passed along it (a sequential pipeline).

    Returns:
        The plan.

    Raises:
        PartitionError: ops missing or in two stages, or the stages depend on each
            other in a cycle.
    """
    where: dict[str, int] = {}
    for i, st in enumerate(stages):
        for op in st.ops:
            if op in where:
                raise PartitionError(f"op {op!r} is in stages {where[op]} and {i}")
            where[op] = i
    missing = [n for n in graph.ops if n not in where]
    if missing:
        raise PartitionError(f"ops {missing[:5]} are in no stage: every op needs one")
    pos = {n: i for i, n in enumerate(graph.ops)}
    stages = [Stage(tuple(sorted(s.ops, key=pos.__getitem__)), s.replicas) for s in stages]
    if kind == "graph":
        deps = {i: set() for i in range(len(stages))}
        for a, b in graph.edges():
            if where[a] != where[b]:
                deps[where[b]].add(where[a])
        order = _stage_order(deps, stages)
        remap = {old: new for new, old in enumerate(order)}
        stages = [stages[o] for o in order]
        where = {n: remap[s] for n, s in where.items()}
        carried: dict[tuple[int, int], list[str]] = {}
        for a in graph.ops:
            for s in sorted({where[b] for b in graph.succ[a]} - {where[a]}):
                carried.setdefault((where[a], s), []).append(a)
    elif kind == "sequential":
        carried = {}
        for i in range(len(stages) - 1):
            carried[(i, i + 1)] = [a for a in graph.ops if where[a] <= i
                                   and any(where[b] > i for b in graph.succ[a])]
            if any(where[b] < where[a] for a, b in graph.edges()):
                raise PartitionError("a sequential plan's stages must follow a topological "
                                     "order of the ops")
    else:
        raise PartitionError(f"plan kind must be 'graph' or 'sequential', not {kind!r}")
    return Plan(stages, {e: tuple(v) for e, v in carried.items()}, micro_batch, num_micro, kind)


def _stage_order(deps: dict[int, set[int]], stages: Sequence[Stage]) -> list[int]:
    order, done = [], set()
    while len(order) < len(stages):
        ready = [i for i in deps if i not in done and deps[i] <= done]
        if not ready:
            cyc = sorted(i for i in deps if i not in done)
            raise PartitionError(f"stages {cyc} depend on each other in a cycle: a stage "
                                 f"must not both feed and read another; move ops between them")
        order.append(min(ready))
        done.add(order[-1])
    return order


# --- pricing -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StageInfo:
    """Batch-size-free sums over a candidate stage's ops."""

    fixed: float          # fwd + bwd seconds per call
    per_sample: float     # fwd + bwd seconds per sample
    messages: int         # boundary tensors (each a message per micro-batch)
    comm_per_sample: float  # boundary bytes per sample
    act_per_sample: float   # activation bytes kept per sample and micro-batch in flight
    param_bytes: float


class StagePricer:
    """Time and memory of a stage, shared by both partitioners and the brute-force tests.

    Args:
        graph: the graph.
        costs: the op costs, link and memory limit.
    """

    def __init__(self, graph: Graph, costs: Costs) -> None:
        self.graph, self.costs = graph, costs

    def info(self, ops: Iterable[str]) -> StageInfo:
        ops = set(ops)
        g, c = self.graph, self.costs
        fixed = per = act = params = comm = 0.0
        msgs = 0
        for n in ops:
            oc = c.of(n)
            fixed += oc.fwd + oc.bwd
            per += oc.fwd_per_sample + oc.bwd_per_sample
            act += oc.act_per_sample
            params += oc.param_bytes
            if any(s not in ops for s in g.succ[n]):  # sent forward, its gradient comes back
                msgs += 1
                comm += oc.act_per_sample
        # received tensors: kept for backward, their gradients sent back
        for src in {s for n in ops for s in g.ops[n].inputs} - ops:
            msgs += 1
            comm += c.of(src).act_per_sample
            act += c.of(src).act_per_sample
        return StageInfo(fixed, per, msgs, comm, act, params)

    def time(self, info: StageInfo, replicas: int, b: int, num_micro: int) -> float:
        """Seconds per micro-batch: compute, sends (sender pays), amortised allreduce."""
        link = self.costs.link
        share = b / replicas
        return (info.fixed + info.per_sample * share
                + info.messages * link.latency + info.comm_per_sample * share / link.bandwidth
                + link.allreduce(info.param_bytes, replicas) / num_micro)

    def memory(self, info: StageInfo, replicas: int, b: int, inflight: int) -> float:
        return (info.param_bytes * self.costs.param_factor
                + inflight * info.act_per_sample * b / replicas)

    def price(self, info: StageInfo, replicas: int, b: int, num_micro: int,
              inflight: int) -> float | None:
        """Stage time, or None if it does not fit in memory or cannot split the batch."""
        if b % replicas:
            return None
        if self.memory(info, replicas, b, min(inflight, num_micro)) > self.costs.memory:
            return None
        return self.time(info, replicas, b, num_micro)


def evaluate(graph: Graph, costs: Costs, plan: Plan) -> tuple[float, float]:
    """(bottleneck, critical path) of a plan under the pricer, or (inf, inf) if a stage
    does not fit. In-flight micro-batches per stage: its depth to the sink."""
    pricer = StagePricer(graph, costs)
    depth = plan.depth_to_sink() if plan.kind == "graph" else \
        [len(plan.stages) - i for i in range(len(plan.stages))]
    times = []
    for i, st in enumerate(plan.stages):
        info = pricer.info(st.ops) if plan.kind == "graph" else _chain_info(pricer, plan, i)
        t = pricer.price(info, st.replicas, plan.micro_batch, plan.num_micro, depth[i])
        if t is None:
            return math.inf, math.inf
        times.append(t)
    crit = [0.0] * len(times)
    for s in reversed(range(len(times))):
        crit[s] = times[s] + max((crit[t] for t in plan.succs(s)), default=0.0)
    return max(times), max(crit)


def _chain_info(pricer: StagePricer, plan: Plan, i: int) -> StageInfo:
    """A sequential stage also receives and forwards the tensors passing through it."""
    base = pricer.info(plan.stages[i].ops)
    c = pricer.costs
    inb = plan.edges.get((i - 1, i), ())
    out = plan.edges.get((i, i + 1), ())
    comm = sum(c.of(n).act_per_sample for n in inb) + sum(c.of(n).act_per_sample for n in out)
    act = base.act_per_sample - sum(c.of(n).act_per_sample
                                    for n in {s for o in plan.stages[i].ops
                                              for s in pricer.graph.ops[o].inputs}
                                    - set(plan.stages[i].ops))
    act += sum(c.of(n).act_per_sample for n in inb)
    return StageInfo(base.fixed, base.per_sample, int(bool(inb)) + int(bool(out)), comm, act,
                     base.param_bytes)


def micro_batch_sizes(batch: int, limit: int = 6) -> list[int]:
    """Candidate micro-batch sizes: powers of two dividing `batch` (largest `limit`),
    with at least two micro-batches unless the batch is 1."""
    sizes = [b for b in (2 ** i for i in range(20)) if b <= max(batch // 2, 1) and batch % b == 0]
    return sizes[-limit:]


def _replica_counts(d: int, b: int, replicate: bool) -> list[int]:
    """Replica counts a stage may run on: any count up to `d` that splits the micro-batch
    into equal shards (ascending)."""
    if not replicate:
        return [1]
    return [r for r in range(1, d + 1) if b % r == 0]


# --- graph partitioner ---------------------------------------------------------------------
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


def _flatten(cons: tuple) -> list[tuple[tuple[str, ...], int]]:
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


class _GraphDP:
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
        self.rs = _replica_counts(devices, b, replicate)
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
    dp = _GraphDP(StagePricer(graph, costs), tree, devices, micro_batch, num_micro, replicate)
    out = {}
    for d, row in dp.solve(tree, 0).items():
        for h, (bn, cr, pl) in row.items():
            plan = make_plan(graph, [Stage(ops, r) for ops, r in _flatten(pl)], micro_batch,
                             num_micro, "graph")
            out[(d, h)] = (bn, cr, plan)
    return out


def graph_partition(graph: Graph, costs: Costs, devices: int, batch: int,
                    micro_batches: Sequence[int] | None = None, replicate: bool = True,
                    max_children: int = 16, use_all: bool = False) -> Plan:
    """GraphPipe-style search: series-parallel DP over the graph.

    Args:
        graph: the graph; costs: its costs, link and memory limit.
        devices: devices available.
        batch: samples per iteration (split into micro-batches).
        micro_batches: candidate micro-batch sizes (default `micro_batch_sizes(batch)`).
        replicate: allow data-parallel replicas of a stage.
        max_children: series runs longer than this are coarsened into blocks first.
        use_all: plans must use every device (the runner's tests want one stage a rank).

    Returns:
        The plan with the least estimated iteration time.

    Raises:
        PartitionError: nothing fits the memory limit; the message says what to relax.
    """
    t0 = time.perf_counter()
    tree, notes = decompose(graph)
    tree, cnotes = coarsen(tree, costs, max_children)
    notes += cnotes
    pricer = StagePricer(graph, costs)
    best: tuple[float, int, int, list] | None = None
    infos: dict = {}  # stage sums do not depend on the micro-batch size
    for b in micro_batches or micro_batch_sizes(batch):
        m = batch // b
        dp = _GraphDP(pricer, tree, devices, b, m, replicate, infos)
        for d, row in dp.solve(tree, 0).items():
            if use_all and d != devices:
                continue
            for _h, (bn, cr, pl) in row.items():
                est = cr + (m - 1) * bn
                if best is None or est < best[0]:
                    best = (est, b, m, _flatten(pl))
    if best is None:
        raise PartitionError(_no_fit(costs, devices, batch))
    est, b, m, stages = best
    plan = make_plan(graph, [Stage(ops, r) for ops, r in stages], b, m, "graph")
    plan.notes, plan.estimate, plan.search_s = notes, est, time.perf_counter() - t0
    return plan


def _no_fit(costs: Costs, devices: int, batch: int) -> str:
    return (f"no partition of the model over {devices} devices fits {costs.memory:.3g} bytes "
            f"per device at batch {batch}: raise the memory limit, add devices, or use "
            f"smaller micro-batches")
