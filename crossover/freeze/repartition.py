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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crossover.freeze.cache import FrozenPrefix
from crossover.freeze.migrate import load_optimizer_state, migrate, optimizer_state
from crossover.pipeline.graph import Graph
from crossover.pipeline.partition import parameter_costs, plan_for
from crossover.pipeline.placement import check_ranks, replica_comms, with_replicas
from crossover.pipeline.plan import Plan

if TYPE_CHECKING:
    from crossover.pipeline.train import PipelineTrainer


class Repartitioning:
    """Re-plan and move stages in flight (mixed into `PipelineTrainer`)."""

    def frozen_ops(self: PipelineTrainer) -> list[str]:
        """Ops whose output needs no gradient (no trainable parameter on them or before
        them): they run forward only, which is what a re-plan prices them as."""
        needs: set[str] = set()
        for name, op in self.graph.ops.items():
            if any(p.requires_grad for p in op.params.values()) or \
                    any(i in needs for i in op.inputs):
                needs.add(name)
        return [n for n, op in self.graph.ops.items() if n not in needs and not op.is_input]

    def repartition(self: PipelineTrainer, plan: Plan | None = None) -> bool:
        """Re-plan with the frozen layers' lower cost and move the stages, in flight.

        Rank 0 plans (rank 0's `plan` if given) with the same stage and replica counts,
        pricing `frozen_ops()` at `frozen_cost`; every rank gets its plan. With
        `cache_frozen` the frozen front is cut off instead and the rest is planned over
        every rank, replicas allowed. If the plan changed, parameters and optimizer
        state go to their new owners over MPI (`crossover.freeze.migrate`,
        bit-exactly), as do buffers (running statistics); each rank builds its new
        stage, and the factories build a new optimizer (and scheduler) over the stage's
        trainable parameters with the moved state, the hyperparameters and the
        schedule in force. Gradient-tracker figures move with their layers, so
        freezing loses no interval. Collective: every rank calls it, between steps.

        Args:
            plan: the new plan (default: re-planned by the trainer's partitioner).

        Returns:
            True if the plan changed (and stages moved), False if it stayed.

        Raises:
            ValueError: no optimizer factory (the message says to pass one), or
                re-planning on rank 0 failed (every rank raises the reason).
            TimeoutError: a migration message did not arrive in time.
        """
        from crossover.pipeline.train import from_rank_0

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
        self.repartitions.append((self.steps, planned.describe()))
        return True

    def _schedule(self: PipelineTrainer) -> tuple[list[dict], dict | None] | None:
        """This rank's optimizer hyperparameters per param group and scheduler state."""
        if self.optimizer is None:
            return None
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        return groups, self.scheduler.state_dict() if self.scheduler is not None else None

    def _replan(self: PipelineTrainer, plan: Plan | None, prefix: FrozenPrefix | None
                ) -> Plan:
        """Rank 0: `plan` checked, or the plan for the current frozen set (on the same
        stages and replicas, or, with the front cut off, over every rank)."""
        size = self.comm.Get_size()
        if plan is None:
            costs = self.costs or parameter_costs(self.graph)
            if prefix is not None:
                # the search may leave ranks out: they become spare (`stage` None)
                plan = plan_for(prefix.rest, size, self.batch, self.num_micro,
                                self.partitioner, costs.fed(prefix.crossing), replicate=True,
                                use_all=False)
            else:
                costs = costs.frozen(self.frozen_ops(), self.frozen_cost)
                stages = len(self.replicas) if self.replicas else size
                plan = plan_for(self.graph, stages, self.batch, self.num_micro,
                                self.partitioner, costs)
                plan = with_replicas(plan, self.replicas) if self.replicas else plan
        check_ranks(plan, size, spare=self.cache_frozen)
        return plan


def owners(graph: Graph, plan: Plan, prefix: FrozenPrefix | None) -> dict[str, list[int]]:
    """Parameter or buffer name -> the ranks that hold it under `plan` (its stage's
    replicas; with a cut-off front, the front's tensors are held by every rank that
    feeds the rest, which computes the front for samples not yet cached)."""
    run = prefix.rest if prefix is not None else graph
    out = {name: plan.devices_of(s) for s, st in enumerate(plan.stages) for o in st.ops
           for name in [*run.ops[o].params, *run.ops[o].buffers]}
    if prefix is not None:
        feeders = sorted(r for s, st in enumerate(plan.stages)
                         if any(run.ops[o].is_input for o in st.ops)
                         for r in plan.devices_of(s))
        out.update({name: feeders for name in prefix.tensors})
    return out


def _layout(plan: Plan) -> list[tuple[Any, int]]:
    return [(tuple(s.ops), s.replicas) for s in plan.stages]
