"""A partition plan: stages in topological order, the tensors on each stage edge, and
the batch split. Every partitioner produces one; the schedules, the simulator and the
runner consume it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from crossover.pipeline.graph import Graph


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
