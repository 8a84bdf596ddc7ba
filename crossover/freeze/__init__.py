"""Freezing-aware training: which layers to freeze and when (`criterion`)."""

from crossover.freeze.criterion import FreezeCriterion, FreezeDecision, GradientTracker, LayerChange

__all__ = ["FreezeCriterion", "FreezeDecision", "GradientTracker", "LayerChange"]
