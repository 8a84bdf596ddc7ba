"""The freezing criterion as tables of gradient changes -> decisions (pure)."""

from __future__ import annotations

import math

import pytest
import torch

from crossover.freeze import (
    FreezeCriterion,
    FreezeDecision,
    GradientTracker,
    LayerChange,
    default_sample_every,
    reads_gradients,
)

LAYERS = ["l0", "l1", "l2", "l3"]


def changes(*relative: float | None) -> dict[str, LayerChange]:
    """Per layer a relative change (None: the layer reported nothing)."""
    return {n: LayerChange(r, 1.0) for n, r in zip(LAYERS, relative, strict=False)
            if r is not None}


@pytest.mark.parametrize("rows, expected", [
    # every layer stable twice: all but the head freeze, front first, at the 2nd evaluation
    ([(0.01, 0.01, 0.01, 0.01), (0.01, 0.01, 0.01, 0.01)],
     [None, ("l0", "l1", "l2")]),
    # l1 still learns: l0 freezes alone, l2 waits behind l1 however stable it is
    ([(0.01, 0.5, 0.01, 0.01), (0.01, 0.5, 0.01, 0.01), (0.01, 0.5, 0.01, 0.01)],
     [None, ("l0",), None]),
    # a spike resets the count: l0 needs two stable evaluations in a row
    ([(0.01, 0.9, 0.9, 0.9), (0.2, 0.9, 0.9, 0.9), (0.01, 0.9, 0.9, 0.9),
      (0.01, 0.9, 0.9, 0.9)],
     [None, None, None, ("l0",)]),
    # later layers freeze after the prefix, in a later decision
    ([(0.01, 0.5, 0.5, 0.5), (0.01, 0.5, 0.5, 0.5), (None, 0.01, 0.01, 0.5),
      (None, 0.01, 0.01, 0.5)],
     [None, ("l0",), None, ("l1", "l2")]),
    # a layer that reports nothing (its first interval) is not stable
    ([(None, 0.01, 0.01, 0.01), (0.01, 0.01, 0.01, 0.01), (0.01, 0.01, 0.01, 0.01)],
     [None, None, ("l0", "l1", "l2")]),
    # at the threshold is not under it
    ([(0.05, 0.01, 0.01, 0.01), (0.05, 0.01, 0.01, 0.01)], [None, None]),
])
def test_decisions(rows, expected):
    crit = FreezeCriterion(LAYERS, threshold=0.05, patience=2, keep_last=1)
    got = []
    for step, row in enumerate(rows):
        d = crit.evaluate(step, changes(*row))
        got.append(d.layers if d else None)
    assert got == expected


def test_decision_names_the_step_and_why():
    crit = FreezeCriterion(LAYERS, threshold=0.1, patience=1, keep_last=2)
    d = crit.evaluate(40, changes(0.02, 0.03, 0.0, 0.0))
    assert d == FreezeDecision(40, ("l0", "l1"), "gradient change under 0.1 for 1 "
                                                 "evaluations (at most 0.03)")
    assert crit.frozen == ["l0", "l1"]
    assert crit.evaluate(41, changes(None, None, 0.0, 0.0)) is None  # the head stays


def test_a_zero_gradient_is_never_stable():
    assert LayerChange(0.0, 0.0).relative == math.inf


@pytest.mark.parametrize("losses, expected", [
    # stable from the start, but nothing freezes until the loss is at most 0.2 of the
    # first interval's (1.0 -> 0.2 at the 3rd evaluation); patience counts from there
    ([1.0, 0.5, 0.2, 0.2], [None, None, None, ("l0", "l1", "l2")]),
    # once open the gate stays open, whatever the loss does after
    ([1.0, 0.1, 0.9, 0.9], [None, None, ("l0", "l1", "l2"), None]),
    # never low enough: nothing freezes
    ([1.0, 0.8, 0.6, 0.4], [None, None, None, None]),
])
def test_a_loss_gate_holds_freezing_back_until_the_loss_has_fallen(losses, expected):
    crit = FreezeCriterion(LAYERS, threshold=0.05, patience=2, loss_gate=0.2)
    got = []
    for step, loss in enumerate(losses):
        d = crit.evaluate(step, changes(0.01, 0.01, 0.01, 0.01), loss)
        got.append(d.layers if d else None)
    assert got == expected


def test_a_loss_gate_without_a_loss_is_named():
    with pytest.raises(ValueError, match="loss gate needs each interval's training loss"):
        FreezeCriterion(LAYERS, loss_gate=0.2).evaluate(0, changes(0.01))


@pytest.mark.parametrize("kw, words", [
    ({"threshold": 0}, "threshold 0"),
    ({"patience": 0}, "patience 0"),
    ({"keep_last": -1}, "keep_last -1"),
    ({"loss_gate": 0.0}, r"loss gate 0.0: give a share of the first loss in \(0, 1\]"),
    ({"loss_gate": 1.5}, "loss gate 1.5"),
])
def test_bad_settings_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        FreezeCriterion(LAYERS, **kw)


@pytest.mark.parametrize("every, sample_every, read", [
    (15, 8, [8, 15, 23, 30]),   # every 8th of each interval and its last; counts restart
    (5, 8, [5, 10, 15, 20, 25, 30]),  # a short interval: its last step only
    (16, 8, [8, 16, 24]),
    (4, 1, list(range(1, 31))),  # 1: every step
    (6, 2, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]),
    (7, 3, [3, 6, 7, 10, 13, 14, 17, 20, 21, 24, 27, 28]),
])
def test_reads_gradients_samples_each_interval_alike(every, sample_every, read):
    assert [s for s in range(1, 31) if reads_gradients(s, every, sample_every)] == read


@pytest.mark.parametrize("every, sample_every", [
    (1, 1), (15, 1), (31, 1), (32, 2), (64, 4), (127, 7), (128, 8), (1000, 8)])
def test_short_intervals_read_every_step_and_long_ones_every_8th(every, sample_every):
    assert default_sample_every(every) == sample_every
    reads = sum(reads_gradients(s, every, sample_every) for s in range(1, every + 1))
    assert reads >= min(every, 16)  # enough for a steady interval mean


@pytest.mark.parametrize("every, sample_every, words", [
    (0, 8, "freeze_every=0: give 1 or more steps"),
    (5, 0, "freeze_sample_every=0: give 1 or more steps"),
])
def test_bad_sampling_is_named(every, sample_every, words):
    with pytest.raises(ValueError, match=words):
        reads_gradients(1, every, sample_every)


def test_tracker_compares_interval_mean_norms():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    tracker = GradientTracker({"A": [a], "B": [b]})
    # interval 1: A's norms 1 and 3 (mean 2), B's 2 and 2 (mean 2)
    for ga, gb in [([1.0, 0.0], [2.0]), ([0.0, -3.0], [-2.0])]:
        a.grad, b.grad = torch.tensor(ga), torch.tensor(gb)
        tracker.accumulate()
    assert tracker.changes() == {}  # nothing to compare with yet
    for ga, gb in [([3.0, 4.0], [1.0])]:  # interval 2: A's norm 5, B's 1
        a.grad, b.grad = torch.tensor(ga), torch.tensor(gb)
        tracker.accumulate()
    got = tracker.changes()
    assert got["A"] == LayerChange(3.0, 2.0) and got["B"] == LayerChange(1.0, 2.0)
    tracker.forget(["A"])
    b.grad = torch.tensor([1.0])
    tracker.accumulate()
    assert set(tracker.changes()) == {"B"}


def test_a_layer_handed_to_another_tracker_mid_interval_reports_the_same_change():
    """After a re-partition the new owner adopts the old owner's figures: the change it
    reports equals what the old owner would have reported."""
    a = torch.nn.Parameter(torch.zeros(2))
    old, stay = GradientTracker({"A": [a]}), GradientTracker({"A": [a]})
    for g in ([1.0, 0.0], [0.0, 2.0], [3.0, 4.0]):  # interval 1: two steps; then one
        a.grad = torch.tensor(g)
        for t in (old, stay):
            t.accumulate()
        if old.steps == 2:
            assert old.changes() == stay.changes() == {}
    new = GradientTracker({"A": [a], "B": []})
    new.adopt(old.export(), old.steps)
    a.grad = torch.tensor([0.0, 5.0])
    for t in (new, stay):
        t.accumulate()
    assert new.changes() == stay.changes() == {"A": LayerChange(3.5, 1.5)}


def test_a_read_without_a_layers_gradient_does_not_count_as_a_zero_norm():
    """A layer whose parameters got no gradient on some reads (a branch not taken) is
    averaged over the reads that had one, also across a hand-over."""
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    tracker = GradientTracker({"A": [a], "B": [b]})
    for gb in (2.0, None, 2.0):  # interval 1: B's norm 2 on two of three reads
        a.grad, b.grad = torch.ones(1), None if gb is None else torch.tensor([gb])
        tracker.accumulate()
    tracker.changes()
    a.grad, b.grad = torch.ones(1), None  # interval 2 starts without B's gradient...
    tracker.accumulate()
    new = GradientTracker({"A": [a], "B": [b]})
    new.adopt(tracker.export(), tracker.steps)  # ...then B's owner changes
    b.grad = torch.tensor([3.0])
    new.accumulate()
    got = new.changes()
    assert got["B"] == LayerChange(1.0, 2.0) and got["A"] == LayerChange(0.0, 1.0)


def test_tracker_norms_match_the_layer_norm_formula_with_missing_gradients():
    """A layer's norm is the norm of all its tensors together; a tensor without a
    gradient adds nothing, and a layer that never had one reports nothing."""
    torch.manual_seed(0)
    w, b, v = (torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (4,), (5,)))
    never = torch.nn.Parameter(torch.zeros(2))
    tracker = GradientTracker({"A": [w, b], "B": [v], "C": [never]})
    sums = {"A": 0.0, "B": 0.0}
    means = []
    for _ in range(2):
        for step in range(3):
            w.grad = torch.randn(4, 3)
            b.grad = torch.randn(4) if step != 1 else None  # a step without b's gradient
            v.grad = torch.randn(5)
            sums["A"] += float(torch.cat([w.grad.flatten()] + ([b.grad] if b.grad is not None
                                                                  else [])).norm())
            sums["B"] += float(v.grad.norm())
            tracker.accumulate()
        means.append({k: s / 3 for k, s in sums.items()})
        sums = {"A": 0.0, "B": 0.0}
        got = tracker.changes()
    assert set(got) == {"A", "B"}
    for k in ("A", "B"):
        assert got[k].prev_norm == pytest.approx(means[0][k], rel=1e-6)
        assert got[k].diff_norm == pytest.approx(abs(means[1][k] - means[0][k]), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_tracker_norms_hold_in_every_gradient_dtype(dtype):
    """A float16 norm beyond 65504 must not overflow to inf (then no change could ever
    be measured), and float64 gradients keep their precision."""
    a = torch.nn.Parameter(torch.zeros(10_000, dtype=dtype))
    tracker = GradientTracker({"A": [a]})
    for scale in (1000.0, 1000.0, 1500.0):  # norms 1e5, 1e5 | 1.5e5
        a.grad = torch.full((10_000,), scale, dtype=dtype)
        tracker.accumulate()
        if scale == 1000.0 and tracker.steps == 2:
            assert tracker.changes() == {}
    got = tracker.changes()["A"]
    assert got.prev_norm == pytest.approx(1e5, rel=1e-3)
    assert got.relative == pytest.approx(0.5, rel=1e-2)


def test_tracker_sums_stay_out_of_autograd():
    a = torch.nn.Parameter(torch.ones(3))
    (a * a).sum().backward(create_graph=True)  # a gradient that requires grad
    tracker = GradientTracker({"A": [a]})
    tracker.accumulate()
    assert not tracker._pending.requires_grad
    a.grad = None  # break the cycle create_graph makes
