"""The model's state across a trainer's ranks: tied copies kept equal, and the whole
model gathered (mixins of `PipelineTrainer`).

Each stage that runs an op of a tied parameter trains a copy of it (`ties`). The
gradient sums keep the copies equal step after step, but only if they start equal, and
a re-plan can give a rank a copy it did not train (its tensor is stale) while the
migration gives the parameter and its optimizer state to one stage's ranks only. So
the trainer copies each tied parameter, with its optimizer state, from one rank that
holds it current to every other rank that holds a copy, bit for bit, with the
migration's own transfer (`crossover.pipeline.migrate`).

`Checkpoints` gathers the whole model's state on every rank from the stages that hold
it: a checkpoint that loads into the unpipelined model, and the optimizer state by
parameter name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from crossover.pipeline.graph import Graph
from crossover.pipeline.migrate import State, load_optimizer_state, migrate, optimizer_state
from crossover.pipeline.plan import Plan
from crossover.pipeline.repartition import Repartitioning, owners
from crossover.pipeline.ties import tied_copies


def sync_tied(graph: Graph, plan: Plan, comm: Any, optimizer: torch.optim.Optimizer | None,
              timeout: float, source: Callable[[str, tuple[int, ...]], int] | None = None
              ) -> list[str]:
    """Give every copy of each parameter tied across stages the source rank's value and
    optimizer state (collective: every rank of `comm` calls it with the same plan).

    Args:
        graph: the graph the plan runs (every rank holds all its parameters).
        plan: the plan in force.
        comm: the trainer's communicator.
        optimizer: this rank's optimizer (None: no state to move).
        timeout: seconds each wait may take.
        source: (parameter name, ranks holding a copy) -> the rank whose copy is
            current; default the first of those ranks.

    Returns:
        The tied parameters' names (the same on every rank; empty: nothing was sent).

    Raises:
        TimeoutError: a rank did not take part in time.
    """
    tied = tied_copies(graph, plan)
    if not tied:
        return []
    params = graph.parameters()
    state = {n: s for n, s in optimizer_state(optimizer, params).items() if n in tied}
    old = {n: [source(n, ranks) if source else ranks[0]] for n, ranks in tied.items()}
    new = {n: list(ranks) for n, ranks in tied.items()}
    kept = migrate({n: params[n] for n in tied}, state, old, new, comm, timeout)
    if optimizer is not None:
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        load_optimizer_state(optimizer, params, {n: s for n, s in kept.items()
                                                 if id(params[n]) in trained})
    return sorted(tied)


class TiedRepartitioning(Repartitioning):
    """`Repartitioning` that keeps tied copies equal across a move (mixed into
    `PipelineTrainer`)."""

    comm: Any
    graph: Graph
    plan: Plan
    prefix: Any
    optimizer: torch.optim.Optimizer | None
    timeout: float

    run_graph: Graph  # the trainer's: the graph its stages run

    def repartition(self, plan: Plan | None = None) -> bool:
        """`Repartitioning.repartition`, then every copy of a parameter tied across
        stages gets the current value and optimizer state (a rank may hold a copy it
        did not train before). Collective."""
        moved = super().repartition(plan)
        if moved:
            # the migration gave the tied parameter and its state to these ranks
            fresh = owners(self.graph, self.plan, self.prefix)
            sync_tied(self.run_graph, self.plan, self.comm, self.optimizer, self.timeout,
                      lambda name, _ranks: fresh[name][0])
        return moved


class Checkpoints:
    """`state_dict`, `load_state_dict` and `optimizer_state` (mixed into
    `PipelineTrainer`)."""

    comm: Any
    model: nn.Module
    graph: Graph
    plan: Plan
    stage: int | None
    replica: int | None
    runner: Any
    prefix: Any
    optimizer: torch.optim.Optimizer | None
    needs_inputs: bool

    run_graph: Graph  # the trainer's: the graph its stages run

    def optimizer_state(self) -> State:
        """The whole model's optimizer state by parameter name, on every rank (each
        from the first replica of the stage that trains it; copies). Collective."""
        mine: State = {}
        if self.replica == 0:
            mine = {n: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in s.items()}
                    for n, s in optimizer_state(self.optimizer,
                                                self.graph.parameters()).items()}
        out: State = {}
        for part in self.comm.allgather(mine):
            out.update(part)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank: each parameter and each op's buffer
        (running statistics) from the first replica of the stage that holds it, other
        buffers from this rank's copy; a tied parameter is one value, under each of
        its names (as the model's own `state_dict` lists it). It loads into the
        unpipelined model.
        Collective: every rank calls it."""
        mine = {}
        if self.replica == 0:
            held = dict(self.runner.params)
            for o in self.plan.stages[self.stage].ops:  # running statistics
                held.update(self.run_graph.ops[o].buffers)
            if self.prefix is not None and self.needs_inputs:  # the cut-off front's
                held.update(self.prefix.tensors)
            mine = {k: p.detach().clone() for k, p in held.items()}
        trained: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather(mine):
            trained.update(part)
        # a tied weight is one parameter under several module paths: every path gets
        # the trained value (this rank's own copy may be one it no longer trains)
        name_of = {id(p): n for n, p in self.graph.parameters().items()}
        return {k: trained.get(name_of.get(id(v), k), v).detach().clone()
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the whole model (as `state_dict` or the unpipelined model gave it)."""
        self.model.load_state_dict(state)
