"""Live re-partitioning of a training pipeline after layers freeze (FreezePipe's step).

A mixin of `PipelineTrainer`: it owns the trainer's plan, graph, stage and optimizer and
changes them in flight, between two steps, without a restart. Frozen layers cost less
(no backward, no gradient, no optimizer state), so rank 0 re-plans and every parameter
whose owners change moves with its optimizer state, bit for bit (`migrate`).

With `cache_frozen` the frozen front is not priced at a fraction: it is cut off
(`FrozenPrefix`), and the rest of the model is re-planned over every rank, where the
partitioner may now run a stage on several data-parallel replicas: the ranks that ran
the front serve the bottleneck instead (PipeTransformer's AutoPipe + AutoDP). The
ranks that feed the rest keep the front's parameters to fill the cache.

Dependencies point down: the trainer imports this module, never the other way round,
and this module takes the freezing policy (the trackers) from `crossover.freeze`, which
imports nothing of the pipeline.
What the mixin needs of its host is spelled out as the `Host` protocol, and the plan
itself comes from `replan`, a function of the graph and the settings alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from crossover.freeze.criterion import GradientTracker
from crossover.freeze.drift import DriftTracker
from crossover.pipeline.frozen_prefix import FrozenPrefix
from crossover.pipeline.graph import Graph
from crossover.pipeline.migrate import load_optimizer_state, migrate, optimizer_state
from crossover.pipeline.partition import parameter_costs, plan_for
from crossover.pipeline.placement import check_ranks, replica_comms, with_replicas
from crossover.pipeline.plan import PartitionError, Plan
from crossover.pipeline.profile import Costs
from crossover.pipeline.ties import split_ties
from crossover.pipeline.waits import from_rank_0


class Host(Protocol):
    """What `Repartitioning` reads and rebuilds on the trainer it is mixed into."""

    comm: Any
    graph: Graph
    plan: Plan
    prefix: FrozenPrefix | None
    replica: int | None
    replicas: list[int] | None
    replica_comms: dict[int, Any]
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    make_optimizer: Any
    costs: Costs | None
    partitioner: str
    batch: int
    num_micro: int
    timeout: float
    frozen_cost: float
    cache_frozen: bool
    freeze_every: int | None
    tracker: GradientTracker | DriftTracker
    steps: int
    repartitions: list[tuple[int, str]]

    def frozen_ops(self) -> list[str]: ...

    def _build(self, plan: Plan) -> None: ...

    def _schedule(self) -> tuple[list[dict], dict | None] | None: ...

    def _replan(self, plan: Plan | None, prefix: FrozenPrefix | None) -> Plan: ...


class Repartitioning:
    """Re-plan and move stages in flight (mixed into `PipelineTrainer`)."""

    def frozen_ops(self: Host) -> list[str]:
        """Ops whose output needs no gradient (no trainable parameter on them or before
        them): they run forward only, which is what a re-plan prices them as."""
        needs: set[str] = set()
        for name, op in self.graph.ops.items():
            if any(p.requires_grad for p in op.params.values()) or \
                    any(i in needs for i in op.inputs):
                needs.add(name)
        return [n for n, op in self.graph.ops.items() if n not in needs and not op.is_input]

    def repartition(self: Host, plan: Plan | None = None) -> bool:
        """Re-plan with the frozen layers' lower cost and move the stages, in flight.

        Rank 0 plans (rank 0's `plan` if given) with the same stage and replica counts,
        pricing `frozen_ops()` at `frozen_cost`; every rank gets its plan. With
        `cache_frozen` the frozen front is cut off instead and the rest is planned over
        every rank, replicas allowed. If the plan changed, parameters and optimizer
        state go to their new owners over MPI (`crossover.pipeline.migrate`,
        bit-exactly), as do buffers (running statistics); each rank builds its new
        stage, and the factories build a new optimizer (and scheduler) over the stage's
        trainable parameters with the moved state, the hyperparameters and the
        schedule in force. Gradient-tracker figures move with their layers, so
        freezing loses no interval; weight-drift copies stay on their rank, so a layer
        that moves skips the interval it moved in. Collective: every rank calls it,
        between steps.

        Args:
            plan: the new plan (default: re-planned by the trainer's partitioner).

        Returns:
            True if the plan changed (and stages moved), False if it stayed.

        Raises:
            ValueError: no optimizer factory (the message says to pass one), or
                re-planning on rank 0 failed (every rank raises the reason).
            TimeoutError: a migration message did not arrive in time.
        """
        if self.make_optimizer is None:
            raise ValueError("re-partitioning moves optimizer state into a new optimizer: "
                             "pass optimizer=<factory>, e.g. lambda ps: torch.optim.SGD("
                             "ps, lr=0.1), instead of stepping your own")
        prefix = self.prefix
        if self.cache_frozen and plan is None:
            frozen = set(self.frozen_ops())
            if frozen and (prefix is None or frozen != prefix.frozen):
                prefix = FrozenPrefix(self.graph, frozen)  # the same on every rank
        planned = from_rank_0(self.comm, "re-planning", lambda: self._replan(plan, prefix))
        if prefix is self.prefix and _layout(planned) == _layout(self.plan):
            return False
        params = self.graph.parameters()
        state = optimizer_state(self.optimizer, params)
        # the hyperparameters and schedule now in force, from any rank that trains:
        # a rank may get an optimizer it did not have, and a factory gives initial ones
        schedule = next((s for s in self.comm.allgather(self._schedule()) if s), None)
        tensors = {**params, **self.graph.buffers()}  # running statistics move too
        figures: dict = {}
        if self.freeze_every is not None:
            mine = self.tracker.export() if self.replica == 0 else {}
            for part in self.comm.allgather(mine):
                figures.update(part)
            steps = self.tracker.steps
            before = self.tracker
        kept = migrate(tensors, state, owners(self.graph, self.plan, self.prefix),
                       owners(self.graph, planned, prefix), self.comm, self.timeout)
        for p in params.values():
            p.grad = None  # consumed by the last step; stale ones would mislead gather_grads
        self.prefix = prefix
        for sub in self.replica_comms.values():
            sub.Free()
        self.replica_comms = replica_comms(planned, self.comm)
        self._build(planned)
        load_optimizer_state(self.optimizer, params,
                             {n: s for n, s in kept.items() if params[n].requires_grad})
        if schedule and self.optimizer is not None:
            groups, scheduler = schedule
            for group, hyper in zip(self.optimizer.param_groups, groups, strict=True):
                group.update(hyper)
            if self.scheduler is not None:
                self.scheduler.load_state_dict(scheduler)
        if self.freeze_every is not None:
            self.tracker.adopt(figures, steps)
            self.tracker.continue_from(before)  # what stays on this rank (weight copies)
        self.repartitions.append((self.steps, planned.describe()))
        return True

    def _schedule(self: Host) -> tuple[list[dict], dict | None] | None:
        """This rank's optimizer hyperparameters per param group and scheduler state."""
        if self.optimizer is None:
            return None
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return groups, self.scheduler.state_dict() if self.scheduler is not None else None

    def _replan(self: Host, plan: Plan | None, prefix: FrozenPrefix | None) -> Plan:
        """Rank 0: `replan` with this trainer's settings and frozen set."""
        return replan(self.graph, self.comm.Get_size(), self.batch, self.num_micro,
                      self.partitioner, self.costs, self.frozen_ops(), self.frozen_cost,
                      self.replicas, prefix, self.cache_frozen, plan)


def replan(graph: Graph, size: int, batch: int, num_micro: int, partitioner: str = "graph",
           costs: Costs | None = None, frozen: Sequence[str] = (), frozen_cost: float = 1 / 6,
           replicas: Sequence[int] | None = None, prefix: FrozenPrefix | None = None,
           spare: bool = False, plan: Plan | None = None) -> Plan:
    """The plan after layers froze: `plan` checked, or a new one.

    Without `prefix` the graph is planned on the same stage and replica counts, the
    `frozen` ops priced at `frozen_cost`; with it, the rest of the graph is planned over
    all `size` ranks, replicas allowed, and the search may leave ranks out (spare).

    Args:
        graph: the whole model; size: ranks in the communicator.
        batch, num_micro, partitioner: as the trainer's.
        costs: op costs of `graph` (default `parameter_costs(graph)`).
        frozen: ops that need no gradient; frozen_cost: their time as a fraction.
        replicas: replicas per stage (None: one rank per stage).
        prefix: the frozen front cut off, or None.
        spare: ranks past the plan's devices may run no stage.
        plan: a plan to check instead of searching.

    Returns:
        The plan.

    Raises:
        PartitionError: no plan fits, or `plan` splits ops that share a parameter.
        ValueError: the plan needs another number of ranks.
    """
    if plan is None:
        costs = costs or parameter_costs(graph)
        if prefix is not None:
            # the search may leave ranks out: they become spare (`stage` None)
            plan = plan_for(prefix.rest, size, batch, num_micro, partitioner,
                            costs.fed(prefix.crossing), replicate=True, use_all=False)
        else:
            plan = plan_for(graph, len(replicas) if replicas else size, batch, num_micro,
                            partitioner, costs.frozen(frozen, frozen_cost))
            plan = with_replicas(plan, replicas) if replicas else plan
    run = prefix.rest if prefix is not None else graph
    ties = split_ties(run, {o: i for i, st in enumerate(plan.stages) for o in st.ops})
    if ties:  # a plan made by hand: make_plan would have refused it
        raise PartitionError(f"{'; '.join(ties)}: ops that share a parameter must be in one "
                             f"stage, or each stage trains its own copy and they drift "
                             f"apart; move them into one stage")
    check_ranks(plan, size, spare=spare)
    return plan


def owners(graph: Graph, plan: Plan, prefix: FrozenPrefix | None) -> dict[str, list[int]]:
    """Parameter or buffer name -> the ranks that hold it under `plan` (its stage's
    replicas; with a cut-off front, the front's tensors are held by every rank that
    feeds the rest, which computes the front for samples not yet cached)."""
    run = prefix.rest if prefix is not None else graph
    out = {name: plan.devices_of(s) for s, st in enumerate(plan.stages) for o in st.ops
           for name in [*run.ops[o].params, *run.ops[o].buffers]}
    if prefix is not None:
        feeders = {r for s, st in enumerate(plan.stages)
                   if any(run.ops[o].is_input for o in st.ops) for r in plan.devices_of(s)}
        # a tensor of the front may also be held by a stage of the rest (a weight tied
        # across the cut): its owners are both
        out.update({name: sorted(feeders | set(out.get(name, ()))) for name in prefix.tensors})
    return out


def _layout(plan: Plan) -> list[tuple[Any, int]]:
    return [(tuple(s.ops), s.replicas) for s in plan.stages]
