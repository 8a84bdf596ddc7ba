"""Graph capture, validation errors, series-parallel decomposition."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crossover.pipeline import Graph, GraphError
from crossover.pipeline.models import MODELS, build
from crossover.pipeline.sptree import decompose


def ident(*xs):
    return xs[0] if len(xs) == 1 else sum(xs)


@pytest.mark.parametrize("name", MODELS)
def test_fx_graph_runs_like_the_model(name):
    spec = build(name, torch.float64, small=True)
    feeds, _ = spec.make_batch(4, 0)
    g = Graph.from_fx(spec.module)
    assert torch.equal(g.forward(*feeds.values()), spec.module(**feeds))
    assert set(g.parameters()) == {n for n, _ in spec.module.named_parameters()}


def test_explicit_graph_and_parameter_names():
    root = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    g = Graph.from_modules(["x"], [("a", root["a"], ["x"]), ("b", root["b"], ["x"]),
                                   ("sum", ident, ["a", "b"])], root=root)
    assert g.order()[0] == "x" and g.order()[-1] == "sum"
    assert set(g.parameters()) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    x = torch.randn(2, 3)
    assert torch.allclose(g.forward(x), root["a"](x) + root["b"](x))


def test_cycle_is_named():
    with pytest.raises(GraphError, match=r"cycle: (a -> b -> c -> a|b -> c -> a -> b|"
                                         r"c -> a -> b -> c).*break the cycle"):
        Graph.from_modules(["x"], [("a", ident, ["x", "c"]), ("b", ident, ["a"]),
                                   ("c", ident, ["b"])])


def test_dangling_input_is_named():
    with pytest.raises(GraphError, match=r"'b' reads 'zz', which no op produces"):
        Graph.from_modules(["x"], [("a", ident, ["x"]), ("b", ident, ["a", "zz"])])


def test_duplicate_and_missing_output():
    with pytest.raises(GraphError, match="two ops are named 'a'"):
        Graph.from_modules(["x"], [("a", ident, ["x"]), ("a", ident, ["x"])])
    with pytest.raises(GraphError, match="output 'nope' is not an op"):
        Graph.from_modules(["x"], [("a", ident, ["x"])], output="nope")


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return self.l(x)
        return x


class TwoOutputs(nn.Module):
    def forward(self, x):
        return x, x


def test_untraceable_model_says_what_to_do():
    with pytest.raises(GraphError, match=r"not traceable by torch.fx.*leaf_modules.*"
                                         r"Graph.from_modules"):
        Graph.from_fx(Untraceable())
    # the fix it suggests works: the offending module as a leaf
    wrapper = nn.Sequential(Untraceable(), nn.Linear(2, 2))
    g = Graph.from_fx(wrapper, leaf_modules=[Untraceable])
    assert len(g) == 3


def test_tuple_output_is_refused():
    with pytest.raises(GraphError, match="one tensor output"):
        Graph.from_fx(TwoOutputs())


def test_dead_ops_are_dropped():
    g = Graph.from_modules(["x"], [("dead", ident, ["x"]), ("a", ident, ["x"])], output="a")
    assert g.dropped == ["dead"] and "dead" not in g.ops


def test_sp_tree_of_three_towers():
    g = Graph.from_fx(build("uno", small=True).module)
    tree, notes = decompose(g)
    assert notes == []
    assert tree.kind == "series"
    par = tree.children[0]
    assert par.kind == "parallel" and len(par.children) == 3
    assert [c.ops[0] for c in par.children] == ["cell", "drug1", "drug2"]
    assert tree.children[1].ops == ("cat",)


def test_non_series_parallel_graph_is_cut_and_reported():
    # the "N" graph: a -> c, a -> d, b -> d; no series or parallel split exists
    g = Graph.from_modules(["x"], [("a", ident, ["x"]), ("b", ident, ["x"]),
                                   ("c", ident, ["a"]), ("d", ident, ["a", "b"]),
                                   ("out", ident, ["c", "d"])])
    tree, notes = decompose(g)
    assert len(notes) == 1 and "not series-parallel" in notes[0]
    assert sorted(tree.ops) == sorted(g.ops)
