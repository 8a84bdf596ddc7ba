"""How far a layer's weights moved: the weight-drift signal for the freezing criterion.

`FreezeCriterion` judges a layer by one number per interval, `LayerChange.relative`.
The gradient tracker makes it the relative change of the layer's mean gradient norm;
`DriftTracker` makes it how far the layer's weights moved over the interval against the
weights' norm, `|W_k - W_(k-1)| / |W_k|`. On a fine-tuned pretrained body the gradient
norms fall with the training loss, so their change never settles; the weights' relative
move does (bench/freeze_replay.py). It is not safe alone on a body trained from random
weights, whose early moves are small against its initial norm: pair it with the
criterion's loss gate.

It keeps a copy of the tracked weights (taken again once an interval) and costs nothing
per step. A re-partition builds a new tracker mid-interval, whose first interval would
be short and its move small: every layer then reports nothing until a whole interval
has passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from crossover.freeze.criterion import LayerChange


class DriftTracker:
    """One rank's view: each of its layers' weight move per interval.

    The interface is `GradientTracker`'s, so the trainer and the re-partitioner use
    either alike; figures do not move between ranks (`export` gives none).

    Args:
        params: layer -> its parameters (only the layers this rank trains).
    """

    def __init__(self, params: Mapping[str, Sequence[torch.nn.Parameter]]) -> None:
        self.params = {k: list(v) for k, v in params.items()}
        self._start = {k: self._weights(k) for k in self.params}
        self._partial: set[str] = set()  # snapshots taken mid-interval
        self._steps = 0

    @torch.no_grad()
    def _weights(self, layer: str) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params[layer]]).clone()

    def accumulate(self) -> None:
        """After a step's backward: nothing to read (the move is taken once an interval)."""
        self._steps += 1

    @torch.no_grad()
    def changes(self) -> dict[str, LayerChange]:
        """Close the interval: each layer's move over it against its weights' norm (a
        layer whose snapshot is younger than the interval reports nothing)."""
        out = {}
        for name in self.params:
            now = self._weights(name)
            if name not in self._partial:
                out[name] = LayerChange(float((now - self._start[name]).norm()),
                                        float(now.norm()))
            self._start[name] = now
        self._partial.clear()
        self._steps = 0
        return out

    def forget(self, layers: Sequence[str]) -> None:
        """Stop tracking frozen layers."""
        for name in layers:
            self.params.pop(name, None)
            self._start.pop(name, None)

    def export(self) -> dict:
        """Nothing moves with a layer: its new owner starts its own interval."""
        return {}

    def adopt(self, figures: Mapping, steps: int) -> None:
        """After a re-partition (this tracker built mid-interval): every layer reports
        nothing at the end of this interval, whose start it did not see."""
        self._steps = steps
        self._partial = set(self.params)

    @property
    def steps(self) -> int:
        """Steps in the current interval."""
        return self._steps
