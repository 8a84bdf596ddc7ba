"""Freezing policy: which layers to freeze and when (`criterion`: gradient changes,
`drift`: weight drift).

Policy only. Acting on a decision (cutting the frozen front off and caching it,
re-planning the rest, moving parameters and optimizer state to their new ranks) is
mechanics of the pipeline and lives there: `crossover.pipeline.frozen_prefix`,
`crossover.pipeline.repartition`, `crossover.pipeline.migrate`. Dependencies point
down: the pipeline imports this package, never the other way round
(`tests/test_layering.py` holds it).
"""

from crossover.freeze.criterion import (
    FreezeCriterion,
    FreezeDecision,
    GradientTracker,
    LayerChange,
    default_sample_every,
    reads_gradients,
)
from crossover.freeze.drift import DriftTracker

__all__ = ["DriftTracker", "FreezeCriterion", "FreezeDecision", "GradientTracker",
           "LayerChange", "default_sample_every", "reads_gradients"]
