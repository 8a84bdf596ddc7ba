"""Train a model with the graph pipeline: one MPI rank per stage replica, under mpirun.

    from mpi4py import MPI
    trainer = PipelineTrainer(model, nn.functional.cross_entropy, batch=64, num_micro=4,
                              example={"x": x[:64]})
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)  # this rank's stage only
    for x, y in batches:
        opt.zero_grad()
        loss = trainer.step({"x": x} if trainer.needs_inputs else None,
                            y if trainer.needs_target else None)
        opt.step()
    torch.save(trainer.state_dict(), "model.pt")  # the whole model: loads unpipelined

Rank 0 plans (the partitioner, from parameter costs or given costs) and measures the
boundary tensors' shapes; every rank receives both, builds its stage's runner and trains
its stage's parameters with the user's optimizer, as torch.distributed.pipelining's
stages do. Only the stages that hold input ops need the inputs and only the stage that
holds the output needs the target, so data can be loaded where it is used. The loss
comes back to every rank. Scheduling never changes the math: in float64 a pipelined
step equals a one-process step of the same model on the same batch.

With `optimizer=` (a factory: parameters -> optimizer) the trainer owns the optimizer,
`step` is a whole training step, and stages can move between ranks in flight after
layers freeze (`repartition`, or `repartition=True` after every freeze decision):

    trainer = PipelineTrainer(model, loss, batch=64, example={"x": x[:64]}, freeze_every=50,
                              optimizer=lambda ps: torch.optim.Adam(ps), repartition=True)
    for x, y in batches:  # needs_inputs / needs_target may change after a re-plan
        loss = trainer.step({"x": x} if trainer.needs_inputs else None,
                            y if trainer.needs_target else None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from crossover import session
from crossover.freeze import (
    DriftTracker,
    FreezeCriterion,
    FreezeDecision,
    GradientTracker,
    LayerChange,
    default_sample_every,
    reads_gradients,
)
from crossover.pipeline.frozen_prefix import FrozenPrefix
from crossover.pipeline.graph import Graph
from crossover.pipeline.partition import plan_for
from crossover.pipeline.placement import (
    check_ranks,
    replica_comms,
    stage_of_rank,
    with_replicas,
)
from crossover.pipeline.plan import Plan
from crossover.pipeline.profile import Costs
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import schedule_for
from crossover.pipeline.train_checks import (
    check_freeze_signal,
    check_rows,
    check_settings,
    warn_empty_stages,
)
from crossover.pipeline.trainer_state import Checkpoints, TiedRepartitioning, sync_tied
from crossover.pipeline.waits import from_rank_0
from crossover.protocol import Phase

#: freeze_signal -> the tracker that turns a rank's layers into `LayerChange`s
TRACKERS: dict[str, type[GradientTracker] | type[DriftTracker]] = {
    "gradient": GradientTracker, "weight-drift": DriftTracker}
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class PipelineTrainer(Checkpoints, TiedRepartitioning):
    """A model cut into pipeline stages over the ranks of `comm`; this rank runs one.

    Args:
        model: the whole model (every rank builds the same one, same seed): torch.fx
            must trace it (`leaf_modules` stay whole ops).
        loss_fn: (output, target) -> mean loss over the batch.
        batch: samples per step; num_micro: micro-batches per step (divides `batch`).
        example: one batch of inputs by forward-argument name, needed on rank 0 only
            (it sizes the messages between stages).
        comm: an mpi4py communicator (default COMM_WORLD); its size is the device count.
        partitioner: "graph" (GraphPipe) or "sequential" (a chain).
        schedule: "1f1b" or "gpipe".
        costs: op costs for the partitioner (default: proportional to parameter counts).
        slots: take the crossover device slot around every compute (the job's name and
            trace come from CROSSOVER_JOB / CROSSOVER_TRACE, as for any job).
        replicas: data-parallel replicas per stage (the plan then has len(replicas)
            stages over their sum of ranks); default one rank per stage.
        freeze_every: evaluate the freezing criterion every this many steps (None: never
            freeze); freeze_threshold, freeze_patience: see `FreezeCriterion`;
            freeze_sample_every: the interval's mean gradient norms come from every
            this many steps and the interval's last (`reads_gradients`; a read costs
            4-10% of a CPU step of a small MLP); default `default_sample_every`: every
            step of intervals under 32 steps, up to every 8th of 128 or more (at least
            16 reads an interval). freeze_signal: what the criterion judges a layer
            by: "gradient" (the relative change of its mean gradient norm) or
            "weight-drift" (its weights' move over the interval against their norm,
            `DriftTracker`; for fine-tuning, with a loss gate); freeze_loss_gate: see
            `FreezeCriterion`. Frozen
            layers get no gradient, so the optimizer leaves them alone; decisions are
            the same on every rank (`freeze_log`).
        timeout: longest wait for any message between stages, seconds.
        leaf_modules: module types torch.fx keeps whole.
        optimizer: a factory, list of parameters -> torch.optim optimizer, called with
            this stage's trainable parameters (again after each re-partition, with the
            moved state loaded: hold on to `trainer.optimizer`, not to a copy; give an
            LR scheduler as `scheduler`). With it `step`
            also zeroes the gradients and steps the optimizer; a stage with nothing to
            train has `optimizer` None. Without it the caller steps their own optimizer
            on `parameters()` and cannot re-partition.
        repartition: re-plan and migrate after every freeze decision (needs `optimizer`
            and `freeze_every`).
        frozen_cost: a frozen op's time as a fraction of an active op's, for re-plans.
        scheduler: a factory, optimizer -> LR scheduler, stepped after every optimizer
            step (a per-step schedule; needs `optimizer`). A re-plan builds the new
            optimizer and scheduler from the factories and carries over the current
            hyperparameters (the param groups' lr, momentum, ...: also those set by
            hand) and the scheduler's state, so the schedule goes on as in one process.
        cache_frozen: once a front of the model is frozen, stop running it: pipeline
            only the rest, fed from a per-sample cache of the values crossing the cut
            (`crossover.pipeline.frozen_prefix`), re-planned over every rank with data-parallel
            replicas where they pay. Needs `repartition`, every step's `index`, and
            data without random augmentation (a sample's prefix output must not change).

    Raises:
        ValueError: `num_micro` does not divide `batch`, no example on rank 0, the
            plan needs another number of ranks (the message says how many), or
            `repartition` without `optimizer` and `freeze_every`, or `cache_frozen`
            without `repartition`.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                           torch.Tensor],
                 batch: int, num_micro: int = 4,
                 example: Mapping[str, torch.Tensor] | None = None, comm: Any = None,
                 partitioner: str = "graph", schedule: str = "1f1b",
                 costs: Costs | None = None, slots: bool = False, timeout: float = 60.0,
                 leaf_modules: Sequence[type[nn.Module]] = (),
                 replicas: Sequence[int] | None = None, freeze_every: int | None = None,
                 freeze_threshold: float = 0.05, freeze_patience: int = 2,
                 freeze_sample_every: int | None = None, freeze_signal: str = "gradient",
                 freeze_loss_gate: float | None = None,
                 optimizer: OptimizerFactory | None = None, repartition: bool = False,
                 frozen_cost: float = 1 / 6, cache_frozen: bool = False,
                 scheduler: SchedulerFactory | None = None) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        check_settings(model, batch, num_micro, optimizer, scheduler, freeze_every,
                       freeze_sample_every, repartition, cache_frozen)
        check_freeze_signal(freeze_every, freeze_signal, freeze_loss_gate, TRACKERS)
        self.model, self.loss_fn, self.comm = model, loss_fn, comm
        self.batch, self.num_micro, self.timeout = batch, num_micro, timeout
        self.partitioner, self.schedule, self.costs = partitioner, schedule, costs
        self.make_optimizer, self.auto_repartition = optimizer, repartition
        self.make_scheduler = scheduler
        self.frozen_cost, self.cache_frozen = frozen_cost, cache_frozen
        self.prefix: FrozenPrefix | None = None  # the frozen front cut off (cache_frozen)
        self.replicas = list(replicas) if replicas else None
        self.graph = Graph.from_fx(model, leaf_modules=tuple(leaf_modules))
        self.tracker_type = TRACKERS[freeze_signal]
        if freeze_every is not None:  # front to back: the graph's ops are in topological order
            self.criterion = FreezeCriterion(
                [n for n, op in self.graph.ops.items() if op.params], freeze_threshold,
                freeze_patience, loss_gate=freeze_loss_gate,
                measure="gradient change" if freeze_signal == "gradient" else "weight drift")
        plan, self.shapes = from_rank_0(
            comm, "planning", lambda: self._plan(example, num_micro, partitioner, costs))
        check_ranks(plan, comm.Get_size())
        self.client = session.init() if slots else None
        self.replica_comms = replica_comms(plan, comm)
        self.freeze_every = freeze_every
        self.freeze_sample_every = default_sample_every(freeze_every) \
            if freeze_every is not None and freeze_sample_every is None \
            else freeze_sample_every
        self.freeze_log: list[FreezeDecision] = []
        self.repartitions: list[tuple[int, str]] = []  # (after step, new plan)
        self.steps = 0
        self._interval_loss = 0.0  # this rank's part of the interval's loss (a loss gate)
        warn_empty_stages(self.graph, plan, comm.Get_size(), optimizer is not None)
        self.runner = None
        self._build(plan)
        # tied copies start equal even where the ranks' seeds differed
        sync_tied(self.graph, plan, comm, self.optimizer, timeout)

    def _build(self, plan: Plan) -> None:
        """This rank's stage of `plan`: runner, gradient tracker, optimizer. A rank past
        the plan's devices is spare: no stage (`stage` None), no runner, no work but
        the collectives; with slots its device goes to the jobs it shares with."""
        self.plan = plan
        if self.runner is not None:
            self.runner.close()
        self.stage = self.replica = self.runner = None
        ops: tuple[str, ...] = ()
        if self.comm.Get_rank() < plan.devices:
            self.stage, self.replica = stage_of_rank(plan, self.comm.Get_rank())
            ops = plan.stages[self.stage].ops
        graph = self.run_graph
        self.needs_inputs = any(graph.ops[o].is_input for o in ops)
        self.needs_target = graph.output in ops
        if self.stage is None:
            self.release_device()  # kept since the last step: free for the jobs beside
        else:
            self.runner = StageRunner(graph, plan, schedule_for(plan, self.schedule),
                                      self.stage, self.comm, self.shapes, self.client,
                                      self.timeout, self.replica_comms,
                                      spare=self.cache_frozen)
        if self.freeze_every is not None:
            frozen = set(self.criterion.frozen)
            # only a stage's first replica reports (its replicas hold the same figures)
            self.tracker = self.tracker_type({o: list(graph.ops[o].params.values())
                                              for o in ops if graph.ops[o].params
                                              and o not in frozen and self.replica == 0})
        # frozen parameters get no optimizer (and so no optimizer state)
        trainable = [p for p in self.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = \
            self.make_optimizer(trainable) if self.make_optimizer and trainable else None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = \
            self.make_scheduler(self.optimizer) if self.make_scheduler and self.optimizer \
            else None

    def _plan(self, example: Mapping[str, torch.Tensor] | None, num_micro: int,
              partitioner: str, costs: Costs | None) -> tuple:
        """Rank 0: the plan and the shapes of every op's output for one micro-batch."""
        if example is None:
            raise ValueError("rank 0 needs `example` (one batch of inputs) to size the "
                             "tensors that travel between stages")
        self._check_inputs(example)
        stages = len(self.replicas) if self.replicas else self.comm.Get_size()
        plan = plan_for(self.graph, stages, self.batch, num_micro, partitioner, costs)
        if self.replicas:
            plan = with_replicas(plan, self.replicas)
        micro = {k: v[: self.batch // num_micro] for k, v in example.items()}
        return plan, output_shapes(self.graph, micro)

    def _check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        if set(inputs) != set(self.graph.inputs):
            raise ValueError(f"the inputs are named {sorted(inputs)} but the model's traced "
                             f"forward takes {sorted(self.graph.inputs)}: name them so")
        check_rows(inputs, self.batch)

    @property
    def run_graph(self) -> Graph:
        """The graph the pipeline runs: the model, or its rest after a cached cut."""
        return self.prefix.rest if self.prefix is not None else self.graph

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage's parameters: give them to the optimizer (they change when
        the trainer re-partitions). Empty on a stage without parameters (the trainer
        warned at construction, `EmptyStageWarning`) and on a spare rank: torch.optim
        refuses an empty list, so build an optimizer only where `has_parameters`, or
        pass `optimizer=` and let the trainer build them."""
        return iter(self.runner.params.values() if self.runner else ())

    @property
    def has_parameters(self) -> bool:
        """Whether this rank's stage holds parameters (an optimizer over
        `parameters()` can be built)."""
        return bool(self.runner and self.runner.params)

    def release_device(self) -> None:
        """Give this rank's device slot up until the next step (which takes it again).

        A step ends holding the device, as a Horovod step does, for the optimizer update
        and what the caller does between steps; call this before a long pause
        (evaluation, checkpointing, the end of training) so that the jobs sharing the
        device need not wait for the lease to run out. A no-op without slots.
        """
        if self.client is not None:
            self.client.release(Phase.IDLE)

    def step(self, inputs: Mapping[str, torch.Tensor] | None,
             target: torch.Tensor | None,
             index: torch.Tensor | Sequence[int] | None = None) -> float:
        """Forward and backward of one batch through the pipeline; gradients accumulate
        in this stage's parameters' `.grad` (step and zero the optimizer as usual).

        Args:
            inputs: the batch's inputs by forward-argument name (None where
                `needs_inputs` is False).
            target: the batch's target (None where `needs_target` is False).
            index: each row's sample index in the data set (needed with
                `cache_frozen`: the key of the frozen prefix's cached outputs).

        With an optimizer factory this is the whole training step: gradients are
        zeroed first and the optimizer steps after the freeze decision (frozen layers
        are skipped); with `repartition=True` a freeze decision is then followed by a
        re-partition (`repartition`), before this returns.

        Returns:
            The batch's loss, on every rank.

        Raises:
            ValueError: inputs or target missing where needed, or not of `batch` rows,
                or no `index` with `cache_frozen`.
            TimeoutError: a stage did not answer in time (it names which).
        """
        m_rows = self.plan.micro_batch
        if self.needs_inputs:
            if inputs is None:
                raise ValueError(f"stage {self.stage} holds input ops: pass the inputs")
            self._check_inputs(inputs)
        if self.cache_frozen and index is None:
            raise ValueError("cache_frozen=True caches the frozen prefix's outputs by "
                             "sample: pass index=<each row's index in the data set>")
        if self.prefix is not None and self.needs_inputs:
            inputs = self.prefix.values(inputs, index)
        if self.needs_target:
            if target is None:
                raise ValueError(f"stage {self.stage} holds the output: pass the target")
            check_rows({"target": target}, self.batch)

        def feeds(m: int) -> dict[str, torch.Tensor]:
            if not self.needs_inputs:
                return {}
            return {k: v[m * m_rows:(m + 1) * m_rows] for k, v in inputs.items()}

        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        if self.runner is not None:  # a spare rank only joins the collectives
            loss = self.runner.run(feeds, lambda m: target[m * m_rows:(m + 1) * m_rows],
                                   self.loss_fn)
        self.steps += 1
        decision = self._maybe_freeze(loss) if self.freeze_every is not None else None
        if self.optimizer is not None:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if decision is not None and self.auto_repartition:
            self.repartition()
        return self.comm.allreduce(loss)

    def _maybe_freeze(self, loss: float) -> FreezeDecision | None:
        """After a step's backward (`loss`: this rank's part of it): track gradients (on
        sampled steps); at an interval's end, decide from every stage's figures and the
        interval's loss (gathered, so every rank decides alike) and freeze."""
        if reads_gradients(self.steps, self.freeze_every, self.freeze_sample_every):
            self.tracker.accumulate()
        self._interval_loss += loss
        if self.steps % self.freeze_every:
            return None
        local = self.tracker.changes()
        merged: dict[str, LayerChange] = {}
        summed = 0.0  # every rank's loss over the interval: the steps' returned totals
        for part, part_loss in self.comm.allgather(
                (local if self.replica == 0 else {}, self._interval_loss)):
            merged.update(part)  # a stage's replicas hold the same (summed) gradients
            summed += part_loss
        self._interval_loss = 0.0
        decision = self.criterion.evaluate(self.steps - 1, merged,
                                           summed / self.freeze_every)
        if decision is None:
            return None
        for name in decision.layers:
            for p in self.graph.ops[name].params.values():
                p.requires_grad_(False)
                p.grad = None  # the optimizer skips it from this step on
        self.tracker.forget(decision.layers)
        self.freeze_log.append(decision)
        return decision
