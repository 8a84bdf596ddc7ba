"""bench/freeze/replay.py: the shipped criterion replayed on recorded gradient norms."""

from __future__ import annotations

import pytest

from bench.freeze.replay import (
    body_frozen_epoch,
    cost,
    gate_step,
    interval_changes,
    replay,
)

# three hidden layers and a head, ten steps an epoch
STEADY = [[1.0, 2.0, 3.0, 4.0]] * 60
# every norm halves every five steps: the loss going to zero under all of them
FALLING = [[x * 0.5 ** (s // 5) for x in (1.0, 2.0, 3.0, 4.0)] for s in range(60)]
# the front layer keeps moving while the others are steady
RESTLESS_FRONT = [[1.0 + (s // 5) % 2, 2.0, 3.0, 4.0] for s in range(60)]


@pytest.mark.parametrize("norms, signal, patience, expected", [
    # steady: the first change comes at step 10, stable from then on; patience in
    # intervals of five steps
    (STEADY, "norm", 1, [(10, ("L0", "L1", "L2"))]),
    (STEADY, "norm", 2, [(15, ("L0", "L1", "L2"))]),
    # halving norms change by 0.5 every interval: never under 0.1
    (FALLING, "norm", 1, []),
    # as shares of the head's norm they do not change at all
    (FALLING, "share", 1, [(10, ("L0", "L1", "L2"))]),
    # a restless front layer holds back the stable ones behind it (front first)
    (RESTLESS_FRONT, "norm", 1, []),
])
def test_replay_feeds_the_criterion_as_a_run_would(norms, signal, patience, expected):
    changes = interval_changes({"norms": norms}, signal, every=5)
    assert replay(changes, threshold=0.1, patience=patience) == expected


def test_drift_signals_compare_the_interval_move_with_the_right_scale():
    # per interval and layer: (move over the interval, move since the start, weight norm)
    run = {"drift": {5: [[(1.0, 1.0, 10.0)] * 4, [(0.5, 1.5, 10.0)] * 4,
                         [(0.05, 1.55, 10.0)] * 4]}}
    drift = interval_changes(run, "drift", every=5)
    assert [(step, round(layers[0].relative, 3)) for step, layers in drift] == \
        [(5, 1.0), (10, 0.333), (15, 0.032)]
    weight = interval_changes(run, "drift_weight", every=5)
    assert [round(layers[0].relative, 3) for _, layers in weight] == [0.1, 0.05, 0.005]
    # under 0.05: the third interval only, for every hidden layer at once
    assert replay(drift, threshold=0.05, patience=1) == [(15, ("L0", "L1", "L2"))]


@pytest.mark.parametrize("decisions, expected", [
    ([], None),
    ([(10, ("L0",))], None),  # part of the body only
    ([(10, ("L0",)), (25, ("L1", "L2"))], 2.5),
    ([(20, ("L0", "L1", "L2"))], 2.0),
])
def test_body_frozen_epoch(decisions, expected):
    assert body_frozen_epoch(decisions, hidden=3, steps_per_epoch=10) == expected


@pytest.mark.parametrize("frozen_in, expected", [
    (None, 0.0),  # never froze: nothing lost
    (2.5, 1.4),  # frozen during epoch 3: the cell for frozen from its start
    (3.0, 0.7),  # frozen at the end of epoch 3: the cell for frozen from epoch 4
    (1.5, None),  # before the table: nothing known
    (9.2, 0.1),  # past the table: its last epoch's
])
def test_cost_reads_the_oracle_cell_for_the_next_epoch(frozen_in, expected):
    assert cost({3: 1.4, 4: 0.7, 5: 0.1}, frozen_in) == expected


def test_a_loss_gate_holds_freezing_back_until_the_loss_has_fallen():
    losses = [2.0] * 10 + [1.0] * 5 + [0.3] * 5 + [0.1] * 40  # intervals of five steps
    assert gate_step(losses, 5, None) == 0
    assert gate_step(losses, 5, 0.2) == 20  # 0.3 <= 0.2 * 2.0 first at steps 16-20
    assert gate_step(losses, 5, 0.01) == 61  # never
    changes = interval_changes({"norms": STEADY}, "norm", every=5)
    assert replay(changes, 0.1, patience=2, from_step=20) == [(25, ("L0", "L1", "L2"))]
