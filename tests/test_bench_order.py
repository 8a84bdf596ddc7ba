"""The order in which a benchmark runs its arms, repetition by repetition (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import rotation  # noqa: E402


@pytest.mark.parametrize(("n", "reps", "orders"), [
    (1, 2, [[0], [0]]),
    (2, 3, [[0, 1], [1, 0], [0, 1]]),
    # crossover_bench: solos, plain together, uncoordinated, crossover, auto
    (5, 3, [[0, 1, 2, 3, 4], [2, 3, 4, 0, 1], [4, 0, 1, 2, 3]]),
])
def test_rotation_table(n: int, reps: int, orders: list[list[int]]) -> None:
    assert [rotation(n, rep) for rep in range(reps)] == orders


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_arm_takes_every_place_once_in_n_repetitions(n: int) -> None:
    orders = [rotation(n, rep) for rep in range(n)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    for arm in range(n):
        assert sorted(order.index(arm) for order in orders) == list(range(n))


def test_bad_counts_are_named() -> None:
    with pytest.raises(ValueError, match="rotation of 0 arms"):
        rotation(0, 1)
