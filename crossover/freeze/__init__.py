"""Freezing-aware training: which layers to freeze and when (`criterion`), and moving
a stage's parameters and optimizer state to new ranks after a re-plan (`migrate`)."""

from crossover.freeze.criterion import FreezeCriterion, FreezeDecision, GradientTracker, LayerChange
from crossover.freeze.migrate import (
    Move,
    load_optimizer_state,
    migrate,
    optimizer_state,
    plan_moves,
    state_hash,
)

__all__ = ["FreezeCriterion", "FreezeDecision", "GradientTracker", "LayerChange", "Move",
           "load_optimizer_state", "migrate", "optimizer_state", "plan_moves", "state_hash"]
