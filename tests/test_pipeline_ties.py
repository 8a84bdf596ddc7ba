"""Tied weights: ops that share a parameter may land on different stages, each holding a
copy whose gradient is summed with the others'; and no stage without parameters unless
nothing else fits."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import nn

from crossover.pipeline import (
    Graph,
    Stage,
    graph_partition,
    make_plan,
    parameter_costs,
    plan_for,
    sequential_partition,
    synthetic,
)
from crossover.pipeline.models import build
from crossover.pipeline.ties import gradient_groups, shared_parameters, tied_copies
from crossover.pipeline.train_checks import EmptyStageWarning, empty_stages, warn_empty_stages


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


def test_the_example_graphs_have_ties():
    g = graphs()
    assert [sorted(s) for s in shared_ops(g["tied_lm"])] == [["embed", "head"]]
    assert [sorted(s) for s in shared_ops(g["tied_head"])] == [["embed", "head"]]
    assert len(shared_ops(g["two_towers"])) == 3  # shared's weight and bias, b.3.weight


def test_a_tied_weight_has_one_name_in_every_op():
    """`head.weight` is `embed.weight`: both ops call it by the model's one name, so
    the copies, the gradient sums, the checkpoint and a migration all mean one tensor."""
    g = graphs()["tied_head"]
    assert set(g.ops["head"].params) == {"embed.weight"}
    assert set(g.parameters()) == {n for n, _ in TiedHead().named_parameters()}
    assert shared_parameters(g) == {"embed.weight": ("embed", "head")}


def test_which_ranks_hold_copies_and_which_sums_each_rank_takes_part_in():
    """A table: stage 0 on 2 replicas holds the embedding, stage 2 the tied head. The
    replicas sum their untied parameters between themselves, the tied weight is summed
    once over all three ranks (each replica adds its own share), and the middle stage
    takes part in nothing."""
    g = graphs()["tied_head"]
    ops = g.order()  # tokens, embed, body_0, body_1, body_2, head
    plan = make_plan(g, [Stage(tuple(ops[:3]), 2), Stage(tuple(ops[3:5])),
                         Stage(tuple(ops[5:]))], 2, 4)
    assert tied_copies(g, plan) == {"embed.weight": (0, 1, 3)}
    names = {s: [n for o in st.ops for n in g.ops[o].params] for s, st in
             enumerate(plan.stages)}
    assert gradient_groups(g, plan, 0, names[0]) == [
        ((0, 1), ("body.0.bias", "body.0.weight")), ((0, 1, 3), ("embed.weight",))]
    assert gradient_groups(g, plan, 1, names[1]) == []
    assert gradient_groups(g, plan, 2, names[2]) == [((0, 1, 3), ("embed.weight",))]
    # a frozen (untrained) tied weight is summed by nobody
    assert gradient_groups(g, plan, 2, []) == []
    together = make_plan(g, [Stage(tuple(ops))], 2, 4)
    assert tied_copies(g, together) == {}


@pytest.mark.parametrize("name", ["tied_lm", "tied_head", "two_towers"])
@pytest.mark.parametrize("partitioner", [graph_partition, sequential_partition])
def test_the_partitioners_may_split_tied_ops(name, partitioner):
    """Over device counts, replicas or not, every device used or not, cheap ops or
    compute-bound ones: a plan covers every op once, and a stage without parameters is
    taken only with a note saying how much faster the plan simulates than the best
    without one."""
    graph = graphs()[name]
    split = 0
    for costs in (parameter_costs(graph), synthetic(graph, {n: 1e-3 for n in graph.ops})):
        for devices, replicate, use_all in itertools.product((1, 2, 3, 4), (False, True),
                                                             (False, True)):
            plan = partitioner(graph, costs, devices, 8, replicate=replicate,
                               use_all=use_all)
            assert sorted(o for st in plan.stages for o in st.ops) == sorted(graph.ops)
            if empty_stages(graph, plan):
                assert any(re.search(r"holds no parameters .*: it simulates \d+% faster", n)
                           for n in plan.notes), (plan.describe(), plan.notes)
            split += bool(tied_copies(graph, plan))
    assert split, "no plan put tied ops on two stages: the test would prove nothing"


@pytest.mark.parametrize("partitioner", ["graph", "sequential"])
def test_a_head_tied_to_the_embedding_pipelines_over_every_rank(partitioner):
    """`head.weight = embed.weight` ties the two ends of a chain; the model still takes
    a stage per device, the embedding on the first and the head on the last."""
    graph = graphs()["tied_lm"]
    for devices in (2, 3, 4):
        plan = plan_for(graph, devices, 8, 4, partitioner)
        assert len(plan.stages) == devices
        assert tied_copies(graph, plan) == {"embed.weight": (0, devices - 1)}
        assert not empty_stages(graph, plan)


def test_a_plan_made_by_hand_may_split_tied_ops():
    from crossover.pipeline.repartition import replan

    lm = graphs()["tied_lm"]
    split = [Stage(tuple(o for o in lm.order() if o != "head")), Stage(("head",))]
    plan = make_plan(lm, split, 2, 4)
    assert tied_copies(lm, plan) == {"embed.weight": (0, 1)}
    assert replan(lm, 2, batch=8, num_micro=4, partitioner="graph", plan=plan) is plan
    for size in (2, 3):  # the re-partition planner, frozen ops priced lower
        plan = replan(graphs()["two_towers"], size, batch=8, num_micro=4,
                      partitioner="graph", frozen=["shared", "shared_1"])
        assert len(plan.stages) == size


def two_linears() -> Graph:
    """x -> Linear -> ReLU -> Linear: two ops with parameters, three ops in all."""
    torch.manual_seed(0)
    return Graph.from_fx(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))


@pytest.mark.parametrize("partitioner", [graph_partition, sequential_partition])
def test_a_stage_without_parameters_only_where_nothing_else_fits(partitioner):
    """On 2 devices the ReLU goes with a Linear; on 3, every device used, it must have
    a stage of its own (nothing else fits), and the graph search says so."""
    graph = two_linears()
    costs = synthetic(graph, {n: 1e-3 for n in graph.ops})
    plan = partitioner(graph, costs, 2, 8, replicate=False, use_all=True)
    assert len(plan.stages) == 2 and not empty_stages(graph, plan)
    plan = partitioner(graph, costs, 3, 8, replicate=False, use_all=True)
    assert len(plan.stages) == 3 and len(empty_stages(graph, plan)) == 1
    if partitioner is graph_partition:  # the ReLU alone (the input goes with its reader)
        assert [plan.stages[s].ops for s in empty_stages(graph, plan)] == [("_1",)]
        assert any("holds no parameters" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("owns, fix", [
    (False, r"torch.optim refuses an empty parameter list: pass optimizer=lambda ps"),
    (True, r"the trainer builds no optimizer there"),
])
def test_a_stage_without_parameters_is_named_with_why_and_what_to_do(owns, fix):
    graph = two_linears()
    plan = make_plan(graph, [Stage(("input_1", "_0")), Stage(("_1",)), Stage(("_2",))], 2, 4)
    with pytest.warns(EmptyStageWarning) as got:
        warn_empty_stages(graph, plan, 3, owns)
    msg = str(got[0].message)
    assert re.search(r"stage 1 \(ranks \[1\]: _1\) holds no parameters: the model has 2 "
                     r"ops with parameters for 3 ranks", msg), msg
    assert re.search(fix, msg) and "launch fewer ranks" in msg, msg
