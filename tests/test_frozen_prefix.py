"""The frozen front cut off and cached per sample (pure: one process, no MPI)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crossover.pipeline.frozen_prefix import FrozenPrefix
from crossover.pipeline.graph import Graph, GraphError
from crossover.pipeline.models import build
from crossover.pipeline.profile import Costs, OpCost


def chain():
    spec = build("chain", torch.float64, small=True)
    return spec, Graph.from_fx(spec.module)


def test_the_rest_fed_from_the_cache_computes_the_model():
    spec, graph = chain()
    prefix = FrozenPrefix(graph, ["body_0", "body_1", "body_2"])
    assert prefix.crossing == ["body_2"]
    assert list(prefix.rest.ops) == ["body_2", "body_3", "body_4", "body_5", "body_6",
                                     "body_7", "head"]
    assert set(prefix.tensors) == {"body.0.weight", "body.0.bias", "body.2.weight",
                                   "body.2.bias"}
    x, _ = spec.make_batch(8, 7)
    fed = prefix.values(x, torch.arange(8))
    out = prefix.rest.run(fed)[graph.output]
    assert torch.allclose(out, spec.module(**x), rtol=1e-12, atol=0)


def test_a_sample_runs_through_the_prefix_once():
    spec, graph = chain()
    prefix = FrozenPrefix(graph, ["body_0", "body_1"])
    x, _ = spec.make_batch(8, 7)
    first = prefix.values({"x": x["x"][:4]}, [10, 11, 12, 13])
    assert (prefix.misses, prefix.hits, len(prefix)) == (4, 0, 4)
    # two known rows, two new ones, in another order: only the new ones are computed
    mixed = prefix.values({"x": x["x"][[2, 0, 4, 5]]}, [12, 10, 14, 15])
    assert (prefix.misses, prefix.hits, len(prefix)) == (6, 2, 6)
    assert torch.equal(mixed["body_1"][0], first["body_1"][2])
    assert torch.equal(mixed["body_1"][1], first["body_1"][0])
    # a cached row is what was computed, even when the input now differs (no
    # augmentation is the contract): the cache is keyed by sample, not by value
    again = prefix.values({"x": torch.zeros(4, 16, dtype=torch.float64)}, [10, 11, 12, 13])
    assert torch.equal(again["body_1"], first["body_1"])


def test_an_index_that_does_not_match_the_rows_is_named():
    spec, graph = chain()
    prefix = FrozenPrefix(graph, ["body_0"])
    x, _ = spec.make_batch(8, 7)
    with pytest.raises(ValueError, match="index has 3 sample keys for a batch of 8 rows"):
        prefix.values(x, [0, 1, 2])


def test_a_value_that_is_not_per_sample_cannot_be_cached():
    root = nn.Linear(4, 4).double()
    graph = Graph.from_modules(["x"], [("a", root, ["x"]), ("s", lambda t: t.sum(), ["a"]),
                                       ("out", lambda a, s: a * s, ["a", "s"])], root=root)
    prefix = FrozenPrefix(graph, ["a", "s"])
    with pytest.raises(ValueError, match="'s' crosses the frozen cut as \\(\\), not one row"):
        prefix.values({"x": torch.ones(3, 4, dtype=torch.float64)}, [0, 1, 2])


@pytest.mark.parametrize("prefix, words", [
    (["body_0", "head"], "holds the output 'head'"),
    (["body_1"], "reads \\['body_0'\\] outside the prefix"),
])
def test_what_is_not_a_front_is_refused(prefix, words):
    _, graph = chain()
    with pytest.raises(GraphError, match=words):
        graph.without_prefix(prefix)


def test_fed_ops_cost_nothing_but_their_size():
    costs = Costs({"a": OpCost(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), "b": OpCost(1.0)})
    fed = costs.fed(["a"])
    assert fed.of("a") == OpCost(act_per_sample=5.0)
    assert fed.of("b") == OpCost(1.0)


def test_batch_norm_in_training_mode_cannot_be_cached():
    """Its output for a sample depends on the rest of the batch: refused at once."""
    from crossover.pipeline.train import PipelineTrainer

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="batch norm in training mode mixes the samples.*1"):
        PipelineTrainer(model, nn.functional.cross_entropy, batch=4, comm="unused",
                        freeze_every=1, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        repartition=True, cache_frozen=True)
