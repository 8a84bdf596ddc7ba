"""Tied weights: ops that share a parameter always land in one stage, whoever plans."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from crossover.pipeline import (
    Graph,
    PartitionError,
    Plan,
    Stage,
    graph_partition,
    make_plan,
    parameter_costs,
    plan_for,
    sequential_partition,
    synthetic,
)
from crossover.pipeline.models import build
from crossover.pipeline.partition import graph_frontier


class TiedHead(nn.Module):
    """The output layer is an nn.Linear whose weight *is* the embedding's (the usual
    `lm_head.weight = embed.weight`): the tie spans the whole chain."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


class TwoTowersSharing(nn.Module):
    """Two parallel towers and a head; the towers' first layers share one Linear (a
    siamese network), and the head reuses the second tower's last weight."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.a = nn.Sequential(nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.b = nn.Sequential(nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.mid = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU())
        self.w = self.b[3].weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.a(self.shared(x)), self.b(self.shared(y))], dim=1)
        return nn.functional.linear(self.mid(h), self.w)


def graphs() -> dict[str, Graph]:
    torch.manual_seed(0)
    return {"tied_lm": Graph.from_fx(build("tied_lm", torch.float64, small=True).module),
            "tied_head": Graph.from_fx(TiedHead()),
            "two_towers": Graph.from_fx(TwoTowersSharing())}


def shared_ops(graph: Graph) -> list[set[str]]:
    """The ops holding each parameter held by more than one op (matched by identity)."""
    holders: dict[int, set[str]] = {}
    for name, op in graph.ops.items():
        for p in op.params.values():
            holders.setdefault(id(p), set()).add(name)
    return [ops for ops in holders.values() if len(ops) > 1]


def assert_ties_kept(graph: Graph, plan) -> None:
    where = {o: i for i, st in enumerate(plan.stages) for o in st.ops}
    for ops in shared_ops(graph):
        assert len({where[o] for o in ops}) == 1, (sorted(ops), plan.describe())


def test_the_example_graphs_have_ties():
    g = graphs()
    assert [sorted(s) for s in shared_ops(g["tied_lm"])] == [["embed", "embed_weight"]]
    assert [sorted(s) for s in shared_ops(g["tied_head"])] == [["embed", "head"]]
    assert len(shared_ops(g["two_towers"])) == 3  # shared's weight and bias, b.3.weight


def test_a_tied_weight_has_one_name_in_every_op():
    """`head.weight` is `embed.weight`: both ops call it by the model's one name, so
    the stage that trains it, the checkpoint and a migration all mean one tensor."""
    g = graphs()["tied_head"]
    assert set(g.ops["head"].params) == {"embed.weight"}
    assert set(g.parameters()) == {n for n, _ in TiedHead().named_parameters()}
    lm = graphs()["tied_lm"]
    assert set(lm.ops["embed_weight"].params) == {"embed.weight"}


@pytest.mark.parametrize("name", ["tied_lm", "tied_head", "two_towers"])
@pytest.mark.parametrize("partitioner", [graph_partition, sequential_partition])
def test_the_partitioners_never_split_tied_ops(name, partitioner):
    """Over device counts, replicas or not, every device used or not, cheap ops or
    compute-bound ones (where cutting pays): a plan keeps tied ops together, or there
    is no plan (too few units left for a stage per device)."""
    graph = graphs()[name]
    for costs in (parameter_costs(graph), synthetic(graph, {n: 1e-3 for n in graph.ops})):
        for devices, replicate, use_all in itertools.product((1, 2, 3, 4), (False, True),
                                                             (False, True)):
            try:
                plan = partitioner(graph, costs, devices, 8, replicate=replicate,
                                   use_all=use_all)
            except PartitionError:
                assert use_all, (devices, replicate)
                continue
            assert_ties_kept(graph, plan)


@pytest.mark.parametrize("name", ["tied_lm", "two_towers"])
def test_every_plan_of_the_graph_frontier_keeps_ties(name):
    graph = graphs()[name]
    table = graph_frontier(graph, parameter_costs(graph), 4, 2, 4)
    assert any(len(plan.stages) > 1 for _bn, _cr, plan in table.values())
    for _bn, _cr, plan in table.values():
        assert_ties_kept(graph, plan)


@pytest.mark.parametrize("partitioner", ["graph", "sequential"])
def test_a_tied_model_still_pipelines_over_two_stages(partitioner):
    """The embedding and the weight read share a stage; the rest of the model may
    still be cut (the weight travels to the output's stage as a value)."""
    graph = graphs()["tied_lm"]
    plan = plan_for(graph, 2, 8, 4, partitioner)
    assert len(plan.stages) == 2
    assert_ties_kept(graph, plan)


def test_a_plan_that_splits_tied_ops_is_refused_naming_them():
    graph = graphs()["tied_lm"]
    ops = graph.order()
    front = [o for o in ops if o != "embed_weight" and o != "linear"]
    with pytest.raises(PartitionError, match=r"parameter 'embed.weight' is shared by ops "
                                             r"'embed' \(stage 0\), 'embed_weight' \(stage 1\)"
                                             r".*one stage"):
        make_plan(graph, [Stage(tuple(front)), Stage(("embed_weight", "linear"))], 2, 4)


def test_a_tie_across_the_whole_chain_leaves_one_stage_and_says_why():
    """`head.weight = embed.weight` ties the two ends of a chain: everything between
    must share their stage, so the model cannot use 3 devices; the error says why."""
    graph = graphs()["tied_head"]
    for partitioner in ("graph", "sequential"):
        with pytest.raises(PartitionError, match=r"share a parameter.*'embed.weight' "
                                                 r"\(embed, head\).*fewer"):
            plan_for(graph, 3, 8, 4, partitioner)
        plan = plan_for(graph, 3, 8, 4, partitioner, use_all=False)
        assert_ties_kept(graph, plan)


def test_the_repartition_planner_keeps_ties_and_refuses_a_split():
    from crossover.freeze.cache import FrozenPrefix
    from crossover.freeze.repartition import replan

    graph = graphs()["two_towers"]
    frozen = ["shared", "shared_1"]  # priced lower, as after they froze
    for size in (2, 3, 4):
        plan = replan(graph, size, batch=8, num_micro=4, partitioner="graph",
                      frozen=frozen)
        assert_ties_kept(graph, plan)
    lm = graphs()["tied_lm"]
    prefix = FrozenPrefix(lm, ["tokens"])
    plan = replan(lm, 3, batch=8, num_micro=4, partitioner="sequential", prefix=prefix,
                  spare=True)
    assert_ties_kept(prefix.rest, plan)
    # a hand-made plan, not make_plan's: the planner checks what it is given
    split = Plan([Stage(tuple(o for o in lm.order() if o != "embed_weight")),
                  Stage(("embed_weight",))], {}, 2, 4)
    with pytest.raises(PartitionError, match="'embed.weight' is shared"):
        replan(lm, 2, batch=8, num_micro=4, partitioner="graph", plan=split)
