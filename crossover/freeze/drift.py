"""How far a layer's weights moved: the weight-drift signal for the freezing criterion.

`FreezeCriterion` judges a layer by one number per interval, `LayerChange.relative`.
The gradient tracker makes it the relative change of the layer's mean gradient norm;
`DriftTracker` makes it how far the layer's weights moved over the interval against the
weights' norm, `|W_k - W_(k-1)| / |W_k|`. On a fine-tuned pretrained body the gradient
norms fall with the training loss, so their change never settles; the weights' relative
move does (bench/freeze/replay.py). It is not safe alone on a body trained from random
weights, whose early moves are small against its initial norm: pair it with the
criterion's loss gate.

It keeps a copy of the tracked weights and costs nothing per step; once an interval it
takes the move in place in that copy and copies the weights into it again, allocating
nothing (its cost: bench/freeze/tracker_cost.py). A layer whose copy does not date from its
interval's start reports nothing for that interval, so that a short interval's small
move never looks stable: the first interval (the copy is taken
before the first update, the interval ends before its last) and, after a re-partition,
the interval in which a layer came to this rank. A layer that stayed on its rank goes
on from its copy (`continue_from`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from crossover.freeze.criterion import LayerChange, tensor_norms


class DriftTracker:
    """One rank's view: each of its layers' weight move per interval.

    The interface is `GradientTracker`'s, so the trainer and the re-partitioner use
    either alike; figures do not move between ranks (`export` gives none).

    Args:
        params: layer -> its parameters (only the layers this rank trains).
    """

    def __init__(self, params: Mapping[str, Sequence[torch.nn.Parameter]]) -> None:
        self.params = {k: list(v) for k, v in params.items()}
        empty = [k for k, v in self.params.items() if not v]
        if empty:
            raise ValueError(f"drift tracker: layers {empty} have no parameters to track; "
                             f"pass only layers that have parameters")
        # per layer, a copy of each parameter as the interval started
        self._start = {k: [p.detach().clone() for p in v] for k, v in self.params.items()}
        self._partial = set(self.params)  # copies that do not date from the interval's start
        self._steps = 0

    def accumulate(self) -> None:
        """After a step's backward: nothing to read (the move is taken once an interval)."""
        self._steps += 1

    @torch.no_grad()
    def changes(self) -> dict[str, LayerChange]:
        """Close the interval: each layer's move over it against its weights' norm (a
        layer whose snapshot is younger than the interval reports nothing)."""
        reported = [name for name in self.params if name not in self._partial]
        params = [p.detach() for name in reported for p in self.params[name]]
        copies = [c for name in reported for c in self._start[name]]
        out: dict[str, LayerChange] = {}
        if params:
            torch._foreach_sub_(copies, params)  # the copies now hold minus the moves
            # every tensor's move and norm, read back at once (one host sync)
            squares = torch.cat([tensor_norms(copies), tensor_norms(params)]).square().tolist()
            moved, norms = squares[:len(params)], squares[len(params):]
            i = 0
            for name in reported:
                n = len(self.params[name])
                out[name] = LayerChange(math.sqrt(sum(moved[i:i + n])),
                                        math.sqrt(sum(norms[i:i + n])))
                i += n
        if self.params:  # the next interval's start
            torch._foreach_copy_([c for cs in self._start.values() for c in cs],
                                 [p.detach() for ps in self.params.values() for p in ps])
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
        """After a re-partition (this tracker built then): every layer reports nothing at
        the end of this interval, whose start it did not see, unless `continue_from`
        gives it the copy from the interval's start."""
        self._steps = steps
        self._partial = set(self.params)

    def continue_from(self, previous: DriftTracker) -> None:
        """Go on from `previous` (this rank's tracker before a re-partition) for the
        layers that stayed on this rank: their copies date from the interval's start."""
        for name in self.params.keys() & previous._start.keys():
            copies = previous._start[name]
            if [(c.shape, c.dtype, c.device) for c in copies] != \
                    [(p.shape, p.dtype, p.device) for p in self.params[name]]:
                continue  # not the same tensors: this interval's copy stays partial
            self._start[name] = copies
            partial = name in previous._partial
            # closing an interval changes the copies in place: they are this tracker's now
            previous.forget([name])
            if not partial:
                self._partial.discard(name)

    @property
    def steps(self) -> int:
        """Reads (`accumulate` calls) in the current interval."""
        return self._steps
