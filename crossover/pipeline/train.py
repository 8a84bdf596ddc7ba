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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from crossover import session
from crossover.freeze import FreezeCriterion, FreezeDecision, GradientTracker, LayerChange
from crossover.pipeline.graph import Graph
from crossover.pipeline.partition import plan_for
from crossover.pipeline.placement import check_ranks, stage_of_rank, with_replicas
from crossover.pipeline.profile import Costs
from crossover.pipeline.runner import StageRunner, output_shapes
from crossover.pipeline.schedule import schedule_for


class PipelineTrainer:
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
            freeze); freeze_threshold, freeze_patience: see `FreezeCriterion`. Frozen
            layers get no gradient, so the optimizer leaves them alone; decisions are
            the same on every rank (`freeze_log`).
        timeout: longest wait for any message between stages, seconds.
        leaf_modules: module types torch.fx keeps whole.

    Raises:
        ValueError: `num_micro` does not divide `batch`, no example on rank 0, or the
            plan needs another number of ranks (the message says how many).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                           torch.Tensor],
                 batch: int, num_micro: int = 4,
                 example: Mapping[str, torch.Tensor] | None = None, comm: Any = None,
                 partitioner: str = "graph", schedule: str = "1f1b",
                 costs: Costs | None = None, slots: bool = False, timeout: float = 60.0,
                 leaf_modules: Sequence[type[nn.Module]] = (),
                 replicas: Sequence[int] | None = None, freeze_every: int | None = None,
                 freeze_threshold: float = 0.05, freeze_patience: int = 2) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        if batch % num_micro:
            raise ValueError(f"{num_micro} micro-batches do not divide the batch of {batch}")
        self.model, self.loss_fn, self.comm = model, loss_fn, comm
        self.batch = batch
        self.replicas = list(replicas) if replicas else None
        self.graph = Graph.from_fx(model, leaf_modules=tuple(leaf_modules))
        rank = comm.Get_rank()
        planned: Any = None
        if rank == 0:
            try:
                planned = self._plan(example, num_micro, partitioner, costs)
            except (ValueError, KeyError, RuntimeError) as exc:
                planned = exc  # every rank raises it: none waits for a plan forever
        planned = comm.bcast(planned, root=0)
        if isinstance(planned, Exception):
            raise ValueError(f"planning on rank 0 failed: {planned}") from None
        self.plan, shapes = planned
        check_ranks(self.plan, comm.Get_size())
        self.stage, self.replica = stage_of_rank(self.plan, rank)
        ops = self.plan.stages[self.stage].ops
        self.needs_inputs = any(self.graph.ops[o].is_input for o in ops)
        self.needs_target = self.graph.output in ops
        client = session.init() if slots else None
        self.runner = StageRunner(self.graph, self.plan, schedule_for(self.plan, schedule),
                                  self.stage, comm, shapes, client, timeout)
        # front to back: the graph's ops are in topological order
        layers = {n: list(op.params.values()) for n, op in self.graph.ops.items() if op.params}
        self.freeze_every = freeze_every
        self.freeze_log: list[FreezeDecision] = []
        self.steps = 0
        if freeze_every is not None:
            if freeze_every < 1:
                raise ValueError(f"freeze_every={freeze_every}: give 1 or more steps")
            self.criterion = FreezeCriterion(list(layers), freeze_threshold, freeze_patience)
            self.tracker = GradientTracker({n: ps for n, ps in layers.items() if n in ops})

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
        _check_rows(inputs, self.batch)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage's parameters: give them to the optimizer."""
        return iter(self.runner.params.values())

    def step(self, inputs: Mapping[str, torch.Tensor] | None,
             target: torch.Tensor | None) -> float:
        """Forward and backward of one batch through the pipeline; gradients accumulate
        in this stage's parameters' `.grad` (step and zero the optimizer as usual).

        Args:
            inputs: the batch's inputs by forward-argument name (None where
                `needs_inputs` is False).
            target: the batch's target (None where `needs_target` is False).

        Returns:
            The batch's loss, on every rank.

        Raises:
            ValueError: inputs or target missing where needed, or not of `batch` rows.
            TimeoutError: a stage did not answer in time (it names which).
        """
        m_rows = self.plan.micro_batch
        if self.needs_inputs:
            if inputs is None:
                raise ValueError(f"stage {self.stage} holds input ops: pass the inputs")
            self._check_inputs(inputs)
        if self.needs_target:
            if target is None:
                raise ValueError(f"stage {self.stage} holds the output: pass the target")
            _check_rows({"target": target}, self.batch)

        def feeds(m: int) -> dict[str, torch.Tensor]:
            if not self.needs_inputs:
                return {}
            return {k: v[m * m_rows:(m + 1) * m_rows] for k, v in inputs.items()}

        loss = self.runner.run(feeds, lambda m: target[m * m_rows:(m + 1) * m_rows],
                               self.loss_fn)
        self.steps += 1
        if self.freeze_every is not None:
            self._maybe_freeze()
        return self.comm.allreduce(loss)

    def _maybe_freeze(self) -> None:
        """After a step's backward: track gradients; at an interval's end, decide from
        every stage's figures (gathered, so every rank decides alike) and freeze."""
        self.tracker.accumulate()
        if self.steps % self.freeze_every:
            return
        local = self.tracker.changes()
        merged: dict[str, LayerChange] = {}
        for part in self.comm.allgather(local if self.replica == 0 else {}):
            merged.update(part)  # a stage's replicas hold the same (summed) gradients
        decision = self.criterion.evaluate(self.steps - 1, merged)
        if decision is None:
            return
        for name in decision.layers:
            for p in self.graph.ops[name].params.values():
                p.requires_grad_(False)
                p.grad = None  # the optimizer skips it from this step on
        self.tracker.forget(decision.layers)
        self.freeze_log.append(decision)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank: each parameter from the first replica
        of the stage that trains it, buffers from this rank's copy (running statistics
        that only another stage updates are not gathered: see docs/pipeline.md). It
        loads into the unpipelined model. Collective: every rank calls it."""
        mine = {}
        if self.replica == 0:
            mine = {k: p.detach().clone() for k, p in self.runner.params.items()}
        trained: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather(mine):
            trained.update(part)
        return {k: trained.get(k, v.detach().clone())
                for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the whole model (as `state_dict` or the unpipelined model gave it)."""
        self.model.load_state_dict(state)


def _check_rows(tensors: Mapping[str, torch.Tensor], batch: int) -> None:
    for name, t in tensors.items():
        if t.shape[0] != batch:
            raise ValueError(f"{name} has {t.shape[0]} rows, not the batch of {batch}: "
                             f"give every step a whole batch (drop the last partial one)")

