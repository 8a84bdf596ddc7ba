"""Freezing-aware training: which layers to freeze and when (`criterion`), and moving
a stage's parameters and optimizer state to new ranks after a re-plan (`migrate`)."""

from crossover.freeze.criterion import (
    FreezeCriterion,
    FreezeDecision,
    GradientTracker,
    LayerChange,
    default_sample_every,
    reads_gradients,
)
from crossover.freeze.drift import DriftTracker
from crossover.freeze.migrate import (
    Move,
    load_optimizer_state,
    migrate,
    optimizer_state,
    plan_moves,
    state_hash,
)

__all__ = ["DriftTracker", "FreezeCriterion", "FreezeDecision", "GradientTracker",
           "LayerChange", "Move", "default_sample_every", "load_optimizer_state", "migrate",
           "optimizer_state", "plan_moves", "reads_gradients", "state_hash"]
