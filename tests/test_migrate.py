"""Live re-partitioning: parameters and optimizer state move between ranks bit-exactly."""

from __future__ import annotations

import pytest
import torch

from crossover.freeze.migrate import (
    Move,
    load_optimizer_state,
    optimizer_state,
    plan_moves,
    state_hash,
)
from crossover.pipeline.graph import Graph
from crossover.pipeline.models import build
from crossover.pipeline.partition import parameter_costs

PARAM_OPS = {"body_0", "body_2", "body_4", "body_6", "head"}  # the small chain's Linears
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


@pytest.mark.parametrize("old, new, moves", [
    # a stage's parameter changes rank
    ({"a": [0], "b": [1]}, {"a": [0], "b": [0]}, [Move("b", 1, 0)]),
    # nothing moves for a rank that keeps its parameter
    ({"a": [0]}, {"a": [0]}, []),
    # spreading onto two new ranks: the old replicas take turns sending
    ({"a": [0, 1]}, {"a": [2, 3]}, [Move("a", 0, 2), Move("a", 1, 3)]),
    # a replica that already holds it keeps it, the other new one receives
    ({"a": [1]}, {"a": [0, 1]}, [Move("a", 1, 0)]),
])
def test_plan_moves(old, new, moves):
    assert plan_moves(old, new) == moves


def test_a_parameter_nobody_holds_is_named():
    with pytest.raises(ValueError, match="parameter 'w' has no current owner"):
        plan_moves({}, {"w": [0]})


def _trained(name: str, steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    opt = OPTIMIZERS[name](list(model.parameters()))
    for s in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator()
                          .manual_seed(s))).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_by_name_moves_into_a_new_optimizer_exactly(name):
    """State taken by name and loaded into an optimizer that lists the parameters in
    another order continues exactly as the original (here: one more step each)."""
    model, opt = _trained(name)
    params = dict(model.named_parameters())
    state = optimizer_state(opt, params)
    assert set(state) == set(params) and all(state.values())
    # copies, as a transfer gives: the two optimizers must not share state tensors
    state = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for n, s in state.items()}
    twin, _ = _trained(name, steps=0)
    twin.load_state_dict(model.state_dict())
    twin_params = dict(twin.named_parameters())
    twin_opt = OPTIMIZERS[name](list(reversed(list(twin.parameters()))))
    load_optimizer_state(twin_opt, twin_params, state)
    assert state_hash(twin.state_dict(), optimizer_state(twin_opt, twin_params)) == \
        state_hash(model.state_dict(), state)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(torch.ones(5, 4, dtype=torch.float64)).square().mean().backward()
        o.step()
    assert state_hash(twin.state_dict()) == state_hash(model.state_dict())


def test_state_for_a_parameter_the_optimizer_does_not_train_is_refused():
    model, opt = _trained("sgd")
    params = dict(model.named_parameters())
    state = optimizer_state(opt, params)
    small = torch.optim.SGD([params["0.weight"]], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="optimizer state for '0.bias'"):
        load_optimizer_state(small, params, state)


def test_state_hash_sees_one_bit_and_not_the_order():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.zeros(1)}
    b = {"b": torch.zeros(1), "w": a["w"].clone()}
    assert state_hash(a) == state_hash(b)
    b["w"].view(torch.int64)[0] ^= 1  # the last bit of the mantissa
    assert state_hash(a) != state_hash(b)
    assert state_hash(a, {"w": {"step": 1}}) != state_hash(a, {"w": {"step": 2}})


def test_a_frozen_op_costs_a_sixth_and_keeps_one_copy_of_its_weights():
    graph = Graph.from_fx(build("chain", torch.float64, small=True).module)
    costs = parameter_costs(graph)
    frozen = costs.frozen(["body_0"])
    was, now = costs.of("body_0"), frozen.of("body_0")
    active = was.forward(8) + was.backward(8)
    assert now.forward(8) + now.backward(8) == pytest.approx(active / 6)
    assert now.backward(8) == 0.0
    assert now.param_bytes == was.param_bytes / costs.param_factor
    assert frozen.of("body_2") == costs.of("body_2")
    with pytest.raises(ValueError, match="frozen cost factor 0"):
        costs.frozen(["body_0"], 0)
