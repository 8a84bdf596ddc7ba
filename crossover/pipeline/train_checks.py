"""What a `PipelineTrainer` refuses or warns of before it trains: settings that cannot
work together, batches of the wrong size, and a stage with nothing to train.

Every check names the problem and the fix. A stage without parameters (the searches
make one only where nothing else fits, as with fewer ops with parameters than ranks, or
where it simulates clearly faster: `finalists.prefer_trained`) is not an error, since
it still runs its ops, but a plain `torch.optim.SGD(trainer.parameters())` on its rank
fails with torch's "optimizer got an empty parameter list"; so every rank is told at
construction which stage it is, why, and what to do.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Plan


class EmptyStageWarning(UserWarning):
    """A stage of the plan holds no parameters (its rank has nothing to optimize)."""


def empty_stages(graph: Graph, plan: Plan) -> list[int]:
    """The stages of `plan` whose ops hold no parameter."""
    return [s for s, st in enumerate(plan.stages)
            if not any(graph.ops[o].params for o in st.ops)]


def empty_stage_message(graph: Graph, plan: Plan, stages: Iterable[int], ranks: int,
                        owns_optimizer: bool) -> str:
    """What to tell every rank about the stages without parameters: which, why, and
    what to do (the same text on every rank)."""
    stages = list(stages)
    trained = sum(1 for op in graph.ops.values() if op.params)
    names = "; ".join(f"stage {s} (ranks {plan.devices_of(s)}: "
                      f"{', '.join(plan.stages[s].ops[:3])}"
                      f"{', ...' if len(plan.stages[s].ops) > 3 else ''})" for s in stages)
    said = [n.split(": ", 1)[-1] for n in plan.notes if "holds no parameters" in n]
    why = (f"the model has {trained} ops with parameters for {ranks} ranks"
           if trained < len(plan.stages) else said[0] if said else
           "no plan over every rank without such a stage fits the costs and memory limit")
    fix = ("the trainer builds no optimizer there (trainer.optimizer is None)"
           if owns_optimizer else
           "trainer.parameters() is empty on those ranks and torch.optim refuses an "
           "empty parameter list: pass optimizer=lambda ps: torch.optim.SGD(ps, ...) to "
           "the trainer (it builds none for such a stage), or build your optimizer only "
           "where trainer.has_parameters")
    return (f"{names} holds no parameters: {why}. It still runs its ops; {fix}; or "
            f"launch fewer ranks to give every stage parameters")


def warn_empty_stages(graph: Graph, plan: Plan, ranks: int, owns_optimizer: bool) -> None:
    """Warn (`EmptyStageWarning`) on this rank if any stage of `plan` holds no
    parameters."""
    stages = empty_stages(graph, plan)
    if stages:
        warnings.warn(empty_stage_message(graph, plan, stages, ranks, owns_optimizer),
                      EmptyStageWarning, stacklevel=3)


def check_freeze_signal(freeze_every: int | None, freeze_signal: str,
                        freeze_loss_gate: float | None, signals: Iterable[str]) -> None:
    """Raise ValueError, naming the fix, for a freezing signal or gate that cannot work
    (`signals`: the known ones)."""
    if freeze_signal not in signals:
        raise ValueError(f"freeze_signal={freeze_signal!r}: give one of {', '.join(signals)}")
    for name, value, default in (("freeze_signal", freeze_signal, "gradient"),
                                 ("freeze_loss_gate", freeze_loss_gate, None)):
        if freeze_every is None and value != default:
            raise ValueError(f"{name}={value!r} sets the freezing criterion: pass "
                             f"freeze_every too")


def check_settings(model: nn.Module, batch: int, num_micro: int,
                   optimizer: Callable[..., Any] | None, scheduler: Callable[..., Any] | None,
                   freeze_every: int | None, freeze_sample_every: int | None,
                   repartition: bool, cache_frozen: bool) -> None:
    """Raise ValueError, naming the fix, for settings that cannot work together."""
    if batch % num_micro:
        raise ValueError(f"{num_micro} micro-batches do not divide the batch of {batch}")
    for name, value in (("freeze_every", freeze_every),
                        ("freeze_sample_every", freeze_sample_every)):
        if value is not None and (not isinstance(value, numbers.Integral)
                                  or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}: give 1 or more steps")
    if freeze_sample_every is not None:
        if freeze_every is None:
            raise ValueError(f"freeze_sample_every={freeze_sample_every} samples the "
                             f"freezing criterion's intervals: pass freeze_every too")
        if freeze_sample_every > freeze_every:
            raise ValueError(f"freeze_sample_every={freeze_sample_every} exceeds "
                             f"freeze_every={freeze_every}: every interval would read one "
                             f"step; give at most {freeze_every}")
    if repartition and (optimizer is None or freeze_every is None):
        raise ValueError("repartition=True needs optimizer=<factory> (the trainer "
                         "rebuilds the optimizer over each new stage) and freeze_every")
    if scheduler is not None and optimizer is None:
        raise ValueError("scheduler=<factory> is built over the trainer's optimizer: pass "
                         "optimizer=<factory> too")
    if cache_frozen and not repartition:
        raise ValueError("cache_frozen=True re-plans the model without its frozen front:"
                         " pass repartition=True (with optimizer= and freeze_every=)")
    batch_stats = [n for n, m in model.named_modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if cache_frozen and batch_stats:
        raise ValueError(f"cache_frozen=True caches the frozen front's output per sample,"
                         f" but batch norm in training mode mixes the samples of a batch "
                         f"({', '.join(batch_stats[:3])}): train without cache_frozen, "
                         f"or use a per-sample norm (GroupNorm, LayerNorm)")


def check_rows(tensors: Mapping[str, torch.Tensor], batch: int) -> None:
    """Raise ValueError unless every tensor has `batch` rows."""
    for name, t in tensors.items():
        if t.shape[0] != batch:
            raise ValueError(f"{name} has {t.shape[0]} rows, not the batch of {batch}: "
                             f"give every step a whole batch (drop the last partial one)")

