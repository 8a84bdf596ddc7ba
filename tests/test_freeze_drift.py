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
    # the first interval reports nothing: its copy predates the first update, and it
    # ends before its last (so with one-step intervals it would measure no move at all)
    assert tracker.changes() == {}
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


def test_after_a_repartition_only_the_layers_that_stayed_go_on():
    params = layers()
    before = DriftTracker({"a": params["a"]})  # this rank held "a" only
    before.changes()  # past the first interval: whole intervals from here
    with torch.no_grad():
        params["a"][0].copy_(torch.tensor([3.0, 4.0]) * 1.2)  # moved by 1 this interval
    # mid-interval, "a" stays on this rank and "b" arrives from another
    after = DriftTracker({"a": params["a"], "b": params["b"]})
    after.adopt(before.export(), steps=3)
    assert after.steps == 3 and before.export() == {}
    after.continue_from(DriftTracker({"a": params["a"]}))  # a copy taken mid-interval
    assert after.changes() == {}, "copies from mid-interval must not report"
    after = DriftTracker(params)
    after.adopt({}, steps=3)
    after.continue_from(before)  # "a"'s copy from the interval's start
    got = after.changes()
    assert set(got) == {"a"} and got["a"].relative == pytest.approx(1.0 / 6.0)
    assert set(after.changes()) == {"a", "b"}  # whole intervals from then on


def test_forgotten_layers_are_not_reported():
    tracker = DriftTracker(layers())
    tracker.changes()
    tracker.forget(["a"])
    assert set(tracker.changes()) == {"b"}


def test_a_tracker_that_goes_on_owns_the_copies_it_took():
    """Closing an interval changes the copies in place, so `continue_from` takes them
    from the tracker before it (which stops tracking those layers) instead of sharing."""
    params = layers()
    before = DriftTracker({"a": params["a"]})
    before.changes()
    with torch.no_grad():
        params["a"][0].copy_(torch.tensor([3.0, 4.0]) * 1.2)  # moved by 1
    after = DriftTracker({"a": params["a"]})
    after.adopt({}, steps=3)
    after.continue_from(before)
    assert before.changes() == {}  # no longer tracks "a"
    assert after.changes()["a"].relative == pytest.approx(1.0 / 6.0)


def test_a_copy_of_other_tensors_is_not_taken_over():
    before = DriftTracker({"a": [torch.nn.Parameter(torch.zeros(3))]})
    before.changes()
    after = DriftTracker(layers())
    after.adopt({}, steps=3)
    after.continue_from(before)  # "a" is two tensors here: a fresh interval instead
    assert after.changes() == {}
    assert set(after.changes()) == {"a", "b"}


def test_a_layer_without_parameters_is_refused():
    with pytest.raises(ValueError, match=r"\['x'\] have no parameters"):
        DriftTracker({"x": [], **layers()})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_drift_holds_in_every_weight_dtype(dtype):
    """A float16 weight of norm 325 squares past 65504: the sums are taken in float32."""
    w = torch.nn.Parameter(torch.full((10_000,), 3.0, dtype=dtype))
    tracker = DriftTracker({"A": [w]})
    tracker.changes()
    with torch.no_grad():
        w.add_(0.25)  # every element 3.25 (exact in each dtype): moved by 25, norm 325
    got = tracker.changes()["A"]
    assert got.prev_norm == pytest.approx(325.0, rel=1e-3)
    assert got.relative == pytest.approx(25.0 / 325.0, rel=1e-3)
