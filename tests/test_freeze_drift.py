"""The weight-drift signal: each layer's move per interval against its weights' norm."""

from __future__ import annotations

import pytest
import torch

from crossover.freeze import DriftTracker


def layers() -> dict[str, list[torch.nn.Parameter]]:
    """Two layers: a weight of norm 5 (3, 4) and a bias of 0; a weight of norm 10."""
    return {"a": [torch.nn.Parameter(torch.tensor([3.0, 4.0])),
                  torch.nn.Parameter(torch.tensor([0.0]))],
            "b": [torch.nn.Parameter(torch.tensor([[6.0, 8.0]]))]}


def test_drift_is_the_interval_move_over_the_weight_norm():
    params = layers()
    tracker = DriftTracker(params)
    with torch.no_grad():
        params["a"][0].copy_(torch.tensor([3.0, 4.0]) * 1.2)  # moved by 1 (norm 6 now)
    tracker.accumulate()
    got = tracker.changes()
    assert got["a"].relative == pytest.approx(1.0 / 6.0)
    assert got["b"].relative == 0.0  # still: stable at any threshold
    assert tracker.steps == 0
    # the next interval measures from where this one ended
    with torch.no_grad():
        params["b"][0].add_(torch.tensor([[0.6, 0.8]]))  # moved by 1, norm 11
    assert tracker.changes()["b"].relative == pytest.approx(1.0 / 11.0)


def test_a_tracker_built_after_a_repartition_skips_its_partial_interval():
    params = layers()
    tracker = DriftTracker(params)
    tracker.adopt(tracker.export(), steps=3)  # built mid-interval: 3 steps already run
    assert tracker.steps == 3 and tracker.export() == {}
    with torch.no_grad():
        params["a"][0].mul_(1.001)  # a short interval's small move
    assert tracker.changes() == {}, "a partial interval must not look stable"
    assert set(tracker.changes()) == {"a", "b"}  # whole intervals from then on


def test_forgotten_layers_are_not_reported():
    tracker = DriftTracker(layers())
    tracker.forget(["a"])
    assert set(tracker.changes()) == {"b"}
