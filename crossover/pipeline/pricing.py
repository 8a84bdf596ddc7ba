"""What a candidate stage costs (seconds per micro-batch, bytes of memory), shared by
both partitioners, the simulator and the brute-force tests, and the shapes a stage may
take (micro-batch sizes, replica counts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Plan
from crossover.pipeline.profile import Costs


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
        # op sums and the edge list as arrays: the graph search prices thousands of
        # candidate stages of hundreds of ops each
        names = list(graph.ops)
        self.index = {n: i for i, n in enumerate(names)}
        per_op = [costs.of(n) for n in names]
        self.fixed = np.array([c.fwd + c.bwd for c in per_op])
        self.per_sample = np.array([c.fwd_per_sample + c.bwd_per_sample for c in per_op])
        self.act = np.array([c.act_per_sample for c in per_op])
        self.params = np.array([c.param_bytes for c in per_op])
        edges = sorted({(self.index[s], self.index[d]) for s, ds in graph.succ.items()
                        for d in ds})
        self.src = np.array([e[0] for e in edges], dtype=np.int64)
        self.dst = np.array([e[1] for e in edges], dtype=np.int64)
        self.fwd = np.array([[c.fwd, c.fwd_per_sample] for c in per_op]).reshape(-1, 2)
        self.bwd = np.array([[c.bwd, c.bwd_per_sample] for c in per_op]).reshape(-1, 2)
        # the simulator prices the same stages under many replica deals
        self._memo: dict[tuple[str, ...], tuple[StageInfo, tuple[float, ...]]] = {}

    def stage(self, ops: tuple[str, ...]) -> tuple[StageInfo, tuple[float, ...]]:
        """`info(ops)` and the stage's (forward fixed, forward per sample, backward
        fixed, backward per sample) seconds, memoized by the op tuple."""
        if ops not in self._memo:
            idx = np.fromiter(map(self.index.__getitem__, ops), dtype=np.int64)
            f, b = self.fwd[idx].sum(axis=0), self.bwd[idx].sum(axis=0)
            self._memo[ops] = (self.info(ops), (float(f[0]), float(f[1]), float(b[0]),
                                                float(b[1])))
        return self._memo[ops]

    def info(self, ops: Iterable[str]) -> StageInfo:
        inside = np.zeros(len(self.index), dtype=bool)
        inside[np.fromiter(map(self.index.__getitem__, ops), dtype=np.int64)] = True
        src_in, dst_in = inside[self.src], inside[self.dst]
        # sent forward (their gradients come back): produced here, read elsewhere
        sent = np.unique(self.src[src_in & ~dst_in])
        # received, kept for backward, their gradients sent back
        received = np.unique(self.src[dst_in & ~src_in])
        sent_bytes, received_bytes = self.act[sent].sum(), self.act[received].sum()
        return StageInfo(float(self.fixed[inside].sum()), float(self.per_sample[inside].sum()),
                         len(sent) + len(received), float(sent_bytes + received_bytes),
                         float(self.act[inside].sum() + received_bytes),
                         float(self.params[inside].sum()))

    def time(self, info: StageInfo, replicas: int, b: int, num_micro: int) -> float:
        """Seconds per micro-batch: compute, the runner's cost per action and message,
        sends (sender pays the wire), amortised allreduce."""
        link, rt = self.costs.link, self.costs.runtime
        share = b / replicas
        # a boundary tensor is sent one way and received the other (its gradient) each
        # micro-batch: one latency, two sides' message costs; a forward and a backward
        return (info.fixed + info.per_sample * share + 2 * rt.action_s
                + info.messages * (link.latency + 2 * rt.message_s)
                + info.comm_per_sample * share / link.bandwidth
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


def evaluate(graph: Graph, costs: Costs, plan: Plan, pricer: StagePricer | None = None
             ) -> tuple[float, float]:
    """(bottleneck, critical path) of a plan under the pricer (`pricer`: one already
    built for `graph` and `costs`), or (inf, inf) if a stage does not fit. In-flight
    micro-batches per stage: its depth to the sink."""
    pricer = pricer or StagePricer(graph, costs)
    depth = plan.depth_to_sink() if plan.kind == "graph" else \
        [len(plan.stages) - i for i in range(len(plan.stages))]
    times = []
    for i, st in enumerate(plan.stages):
        info = pricer.stage(tuple(st.ops))[0] if plan.kind == "graph" else \
            _chain_info(pricer, plan, i)
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
    base = pricer.stage(tuple(plan.stages[i].ops))[0]
    c = pricer.costs
    inb = plan.edges.get((i - 1, i), ())
    out = plan.edges.get((i, i + 1), ())
    comm = sum(c.of(n).act_per_sample for n in inb) + sum(c.of(n).act_per_sample for n in out)
    act = base.act_per_sample - sum(c.of(n).act_per_sample
                                    for n in {s for o in plan.stages[i].ops
                                              for s in pricer.graph.ops[o].inputs}
                                    - set(plan.stages[i].ops))
    act += sum(c.of(n).act_per_sample for n in inb)
    # one message per tensor and hop, as the runner sends them
    return StageInfo(base.fixed, base.per_sample, len(inb) + len(out), comm, act,
                     base.param_bytes)


def micro_batch_sizes(batch: int, limit: int = 6) -> list[int]:
    """Candidate micro-batch sizes: powers of two dividing `batch` (largest `limit`),
    with at least two micro-batches unless the batch is 1."""
    sizes = [b for b in (2 ** i for i in range(20)) if b <= max(batch // 2, 1) and batch % b == 0]
    return sizes[-limit:]


def replica_counts(d: int, b: int, replicate: bool) -> list[int]:
    """Replica counts a stage may run on: any count up to `d` that splits the micro-batch
    into equal shards (ascending)."""
    if not replicate:
        return [1]
    return [r for r in range(1, d + 1) if b % r == 0]


def has_parameters(graph: Graph) -> bool:
    """Whether any op holds parameters: the searches then avoid stages without any
    (an optimizer over no parameters fails), unless nothing else fits."""
    return any(op.params for op in graph.ops.values())


def no_fit(costs: Costs, devices: int, batch: int) -> str:
    """The message when no plan fits: what to relax."""
    if math.isinf(costs.memory):  # nothing to fit: too few ops for a stage per device
        msg = (f"no partition of the model has a stage on each of {devices} devices: use "
               f"fewer devices, or let the search leave some out (use_all=False)")
    else:
        msg = (f"no partition of the model over {devices} devices fits {costs.memory:.3g} "
               f"bytes per device at batch {batch}: raise the memory limit, add devices, "
               f"or use smaller micro-batches")
    return msg
