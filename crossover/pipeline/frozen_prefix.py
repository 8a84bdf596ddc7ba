"""The frozen front of a model, cut off and cached per sample (PipeTransformer's AutoCache).

Once a prefix of the model is frozen, its output for a given sample never changes (as
long as the sample itself does not: no random augmentation). So the pipeline need not
run it at all: the trainer pipelines only the rest of the model (`Graph.without_prefix`),
whose inputs are the values crossing the cut, and those values come from this cache,
keyed by the sample's index in the data set. A sample seen for the first time since
the cut runs through the frozen prefix once, forward only; from then on it is a lookup.

Freed of the prefix, the pipeline is cheaper, and the ranks that ran it can serve the
rest (the trainer re-plans it over every rank, with data-parallel replicas).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from crossover.pipeline.graph import Graph


class FrozenPrefix:
    """A frozen prefix of `graph`: what remains to train, and its inputs by sample.

    Args:
        graph: the whole model.
        frozen: ops that need no gradient (no trainable parameter on them or before
            them): a front of the graph that does not hold the output.

    Attributes:
        frozen: the ops cut off.
        rest: the graph without the prefix; its inputs are `crossing`.
        crossing: the values that cross the cut (prefix ops' or model inputs').
        tensors: the prefix's parameters and buffers by qualified name (whoever
            computes the prefix needs their current values).
        hits, misses: samples served from the cache / computed through the prefix.

    Raises:
        GraphError: `frozen` is not a front of the graph or holds the output.
    """

    def __init__(self, graph: Graph, frozen: Iterable[str]) -> None:
        self.frozen = frozenset(frozen)
        self.graph = graph
        self.rest = graph.without_prefix(self.frozen)
        self.crossing = list(self.rest.inputs)
        # only what the crossing values need, in the graph's order
        need = set(self.crossing)
        for name in reversed(list(graph.ops)):
            if name in need:
                need.update(graph.ops[name].inputs)
        self.ops = [n for n in graph.ops if n in need]
        self.tensors = {k: t for n in self.ops
                        for k, t in {**graph.ops[n].params, **graph.ops[n].buffers}.items()}
        self.hits = self.misses = 0
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}

    def values(self, inputs: Mapping[str, torch.Tensor], index: Sequence[int] | torch.Tensor
               ) -> dict[str, torch.Tensor]:
        """The crossing values for a batch: cached rows, the others computed now.

        Args:
            inputs: the batch's model inputs by name (rows in `index`'s order).
            index: each row's sample index in the data set (the cache key).

        Returns:
            crossing value name -> tensor with one row per batch row.

        Raises:
            ValueError: `index` is not one key per row, or a crossing value is not a
                tensor with one row per sample (it cannot be cached).
        """
        keys = [int(k) for k in index]
        rows = next(iter(inputs.values())).shape[0]
        if len(keys) != rows:
            raise ValueError(f"index has {len(keys)} sample keys for a batch of {rows} rows:"
                             f" give each row's index in the data set")
        missing = [j for j, k in enumerate(keys) if k not in self._rows]
        if missing:
            self._compute(inputs, keys, missing)
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        return {name: torch.stack([self._rows[k][i] for k in keys])
                for i, name in enumerate(self.crossing)}

    def _compute(self, inputs: Mapping[str, torch.Tensor], keys: list[int],
                 missing: list[int]) -> None:
        pick = torch.tensor(missing)
        with torch.no_grad():
            env = self.graph.run({k: v[pick] for k, v in inputs.items()}, self.ops)
        for name in self.crossing:
            v = env[name]
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != len(missing):
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{name!r} crosses the frozen cut as {shape}, not one row per"
                                 f" sample: it cannot be cached per sample; train without "
                                 f"cache_frozen")
        for pos, j in enumerate(missing):
            # clones: a row view would keep its whole batch alive
            self._rows[keys[j]] = tuple(env[n][pos].clone() for n in self.crossing)

    def __len__(self) -> int:
        """Samples cached."""
        return len(self._rows)
