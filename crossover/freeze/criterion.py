"""When a layer has stopped learning: the freezing criterion (FreezePipe, AutoFreeze).

Every `interval` steps each layer's gradient norm, averaged over the interval's steps
that the tracker read (`reads_gradients`), is compared with the previous interval's:
the relative change `|n_k - n_(k-1)| / n_(k-1)` (AutoFreeze's and PipeTransformer's
measure). A layer whose change stays under `threshold` for `patience` evaluations in a
row is stable. (The change of the mean
gradient vector, FreezePipe's wording, never settles under minibatch noise: as the
mean gradient shrinks toward zero its relative change grows; on the digits example it
froze nothing at any threshold up to 0.6.) `crossover/freeze/drift.py` measures a
layer by its weights' move instead (for fine-tuning), and a loss gate holds every layer
back until the training loss has fallen.
Layers freeze front first: the longest run of stable layers right after the frozen
prefix freezes, and a stable layer behind an unstable one waits, so backward can always
stop at the end of the frozen prefix (PipeTransformer's rule).

Two parts, so that every rank decides the same: a `GradientTracker` on each rank
accumulates the gradients of the layers its stage trains and turns them into two
numbers per layer and interval; those numbers are gathered to every rank, and the pure
`FreezeCriterion` turns the same numbers into the same decision everywhere.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerChange:
    """One layer's gradient change over one interval: |n_k - n_(k-1)| and n_(k-1), where
    n is the interval's mean gradient norm."""

    diff_norm: float
    prev_norm: float

    @property
    def relative(self) -> float:
        return self.diff_norm / self.prev_norm if self.prev_norm > 0 else math.inf


@dataclass(frozen=True)
class FreezeDecision:
    """Freeze `layers` (in order, right after the frozen prefix) after step `step`."""

    step: int
    layers: tuple[str, ...]
    reason: str


@dataclass
class FreezeCriterion:
    """Pure: layer changes in, freeze decisions out.

    Args:
        layers: every trainable layer, front to back (the graph's topological order).
        threshold: a layer is stable while its change (`LayerChange.relative`: of its
            gradient norm from `GradientTracker`, of its weights from `DriftTracker`) is
            below this.
        patience: evaluations in a row a layer must be stable before it freezes.
        keep_last: layers at the back that never freeze (the head keeps adapting).
        loss_gate: no layer counts as stable until an evaluation's training loss is at
            most this share of the first evaluation's (then the gate stays open): a body
            still learning its features should not freeze, and a pretrained one has
            them once the new head fits. None: no gate. (A first loss of 0 opens it at
            once; a NaN loss keeps it shut.)
        measure: what the changes measure, for the decisions' reasons.

    Raises:
        ValueError: a setting out of range, naming it.
    """

    layers: Sequence[str]
    threshold: float = 0.05
    patience: int = 2
    keep_last: int = 1
    loss_gate: float | None = None
    measure: str = "gradient change"
    frozen: list[str] = field(default_factory=list)
    _stable: dict[str, int] = field(default_factory=dict)
    _first_loss: float | None = None
    _gate_open: bool = False

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"freeze threshold {self.threshold!r}: give a change > 0")
        if self.patience < 1:
            raise ValueError(f"freeze patience {self.patience!r}: give 1 or more evaluations")
        if self.keep_last < 0:
            raise ValueError(f"keep_last {self.keep_last!r}: give 0 or more layers")
        if self.loss_gate is not None and (not isinstance(self.loss_gate, numbers.Real)
                                           or isinstance(self.loss_gate, bool)
                                           or not 0 < self.loss_gate <= 1):
            raise ValueError(f"freeze loss gate {self.loss_gate!r}: give a share of the "
                             f"first loss in (0, 1], or none")

    def evaluate(self, step: int, changes: Mapping[str, LayerChange],
                 loss: float | None = None) -> FreezeDecision | None:
        """One evaluation: the layers to freeze now, or None.

        Args:
            step: the training step just finished.
            changes: the interval's change for every trainable layer not yet frozen
                (a missing layer counts as unstable).
            loss: the interval's mean training loss (needed with `loss_gate`).

        Raises:
            ValueError: a loss gate and no loss.
        """
        if self.loss_gate is not None and not self._gate_open:
            if loss is None:
                raise ValueError("the freeze loss gate needs each interval's training loss")
            if self._first_loss is None:
                self._first_loss = loss
            self._gate_open = loss <= self.loss_gate * self._first_loss
            if not self._gate_open:
                changes = {}  # every layer counts as unstable until the loss has fallen
        for name in self.layers:
            ch = changes.get(name)
            stable = ch is not None and ch.relative < self.threshold
            self._stable[name] = self._stable.get(name, 0) + 1 if stable else 0
        candidates = list(self.layers[len(self.frozen):len(self.layers) - self.keep_last])
        newly = []
        for name in candidates:
            if self._stable[name] < self.patience:
                break
            newly.append(name)
        if not newly:
            return None
        self.frozen += newly
        worst = max(changes[n].relative for n in newly)
        return FreezeDecision(step, tuple(newly),
                              f"{self.measure} under {self.threshold:g} for {self.patience} "
                              f"evaluations (at most {worst:.3g})")


# an interval's mean norm from at least this many reads where sampling: as many as the
# 15-step intervals the freezing benchmarks judge from (the criterion's thresholds were
# chosen there); how far fewer reads move its decisions is not measured
STEADY_READS = 16
MAX_SAMPLE_EVERY = 8  # a read every 8th step keeps the tracker near 1% of a step


def default_sample_every(every: int) -> int:
    """How often the tracker reads gradients by default in `every`-step intervals: every
    step of intervals under 32 steps, every 8th of intervals of 128 or more."""
    return max(1, min(MAX_SAMPLE_EVERY, every // STEADY_READS))


def reads_gradients(step: int, every: int, sample_every: int) -> bool:
    """Whether the tracker reads step `step`'s gradients (steps count from 1): every
    `sample_every`-th step of each `every`-step interval, and always the interval's last,
    so every interval has at least one read.

    Reading is one pass over every trained gradient, 4-10% of a CPU step of the digits
    MLP on one thread (bench/freeze/tracker_cost.py); sampling spreads that over the steps
    between.

    Raises:
        ValueError: `every` or `sample_every` under 1, naming it.
    """
    for name, value in (("freeze_every", every), ("freeze_sample_every", sample_every)):
        if value < 1:
            raise ValueError(f"{name}={value}: give 1 or more steps")
    position = (step - 1) % every + 1
    return position % sample_every == 0 or position == every


def tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm, in few calls whatever their count, stacked on the first
    one's device: in at least float32 (float16 norms overflow past 65504; float32 holds
    the relative changes they feed), float64 where a tensor is."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) \
        else torch.float32
    device = tensors[0].device
    return torch.stack([n.to(device) for n in
                        torch._foreach_norm(list(tensors), 2, dtype=dtype)])


class GradientTracker:
    """One rank's view: sums its layers' gradient norms over an interval and reports how
    much the interval's mean norm moved from the previous interval's.

    Args:
        params: layer -> its parameters (only the layers this rank trains).
    """

    def __init__(self, params: Mapping[str, Sequence[torch.nn.Parameter]]) -> None:
        self.params = {k: list(v) for k, v in params.items()}
        self._sum: dict[str, float] = {}
        self._prev: dict[str, float] = {}
        self._steps = 0
        # this interval's summed norms, per layer of `_layers`, not yet read back: a
        # step adds to them on the gradients' device, with no host sync (one per
        # parameter cost 2-7 % of a step on the digits example)
        self._pending: torch.Tensor | None = None
        self._layers: list[str] = []
        # per layer of `_layers`: reads in `_pending` where it had a gradient; a layer's
        # mean divides by its own reads, so a read without its gradient counts for
        # nothing instead of as a zero norm
        self._seen: dict[int, int] = {}
        self._reads: dict[str, int] = {}  # the same, read back, this interval
        self._index: tuple[tuple[tuple[int, ...], torch.device], torch.Tensor] | None = None

    @torch.no_grad()  # gradients made with create_graph must not tie the sums to a graph
    def accumulate(self) -> None:
        """After a step's backward: add each layer's current gradient norm."""
        self._steps += 1
        grads, owners = [], []
        for i, ps in enumerate(self.params.values()):
            for p in ps:
                if p.grad is not None:
                    grads.append(p.grad)
                    owners.append(i)
        if not grads:
            return
        layers = list(self.params)
        device = grads[0].device
        if layers != self._layers or (self._pending is not None
                                      and self._pending.device != device):
            self._read_back()
            self._layers = layers
        key = (tuple(owners), device)
        if self._index is None or self._index[0] != key:
            self._index = (key, torch.tensor(owners, device=device))
        # every tensor's norm in one call, then a layer's norm from its tensors' squares
        norms = tensor_norms(grads)
        per_layer = torch.zeros(len(layers), dtype=norms.dtype, device=device)
        per_layer.index_add_(0, self._index[1], norms * norms).sqrt_()
        if self._pending is None:
            self._pending = per_layer
        else:
            self._pending.add_(per_layer)
        for i in set(owners):
            self._seen[i] = self._seen.get(i, 0) + 1

    def _read_back(self) -> None:
        """Move the pending sums into `_sum` (one host sync)."""
        if self._pending is not None:
            totals = self._pending.tolist()
            for i, reads in sorted(self._seen.items()):  # no gradient yet: nothing
                name = self._layers[i]
                self._sum[name] = self._sum.get(name, 0.0) + totals[i]
                self._reads[name] = self._reads.get(name, 0) + reads
        self._pending, self._seen = None, {}

    def changes(self) -> dict[str, LayerChange]:
        """Close the interval: each layer's change against the previous interval (a
        layer in its first interval reports nothing yet)."""
        self._read_back()
        out = {}
        for name, total in self._sum.items():
            mean = total / self._reads[name]
            prev = self._prev.get(name)
            if prev is not None:
                out[name] = LayerChange(abs(mean - prev), prev)
            self._prev[name] = mean
        self._sum, self._reads, self._steps = {}, {}, 0
        return out

    def forget(self, layers: Sequence[str]) -> None:
        """Stop tracking frozen layers."""
        self._read_back()
        for name in layers:
            for figures in (self._prev, self._sum, self._reads, self.params):
                figures.pop(name, None)

    def export(self) -> dict[str, tuple[float | None, int, float | None]]:
        """Each tracked layer's figures so far: (this interval's sum of norms, the reads
        it came from, the previous interval's mean), what a new owner needs to go on
        judging the layer after a re-partition without losing an interval."""
        self._read_back()
        return {n: (self._sum.get(n), self._reads.get(n, 0), self._prev.get(n))
                for n in self.params}

    def adopt(self, figures: Mapping[str, tuple[float | None, int, float | None]],
              steps: int) -> None:
        """Take over figures from layers' previous owners (`export` on those ranks).

        Args:
            figures: layer -> (interval sum, its reads, previous mean); layers this
                tracker does not track are ignored.
            steps: reads so far in the current interval (the previous owner's
                `steps`, the same on every rank), not steps: with sampling they differ.
        """
        self._read_back()
        self._steps = steps
        for name, (total, reads, prev) in figures.items():
            if name in self.params:
                if total is not None:
                    self._sum[name], self._reads[name] = total, reads
                if prev is not None:
                    self._prev[name] = prev

    def continue_from(self, previous: GradientTracker) -> None:
        """Nothing to take from this rank's tracker before a re-partition: the figures
        moved with their layers (`export`, `adopt`)."""

    @property
    def steps(self) -> int:
        """Reads (`accumulate` calls) in the current interval."""
        return self._steps
