"""The one backoff helper every polling loop uses."""

import time

import pytest

from crossover.backoff import Backoff, wait_until


@pytest.mark.parametrize("first, most, factor, pauses", [
    (0.001, 0.02, 2, [0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02]),
    (0.5, 10, 2, [0.5, 1, 2, 4, 8, 10, 10]),
    (1, 1, 2, [1, 1, 1]),
    (0.1, 1, 1, [0.1, 0.1, 0.1]),
])
def test_pauses_grow_to_the_cap(first, most, factor, pauses):
    b = Backoff(first, most, factor)
    assert [b.next() for _ in pauses] == pytest.approx(pauses)


def test_reset_starts_over():
    b = Backoff(0.01, 1)
    for _ in range(5):
        b.next()
    b.reset()
    assert b.next() == 0.01


@pytest.mark.parametrize("args, words", [
    ((0, 1), "first pause 0"),
    ((0.5, 0.1), "cap 0.1 is shorter"),
    ((0.1, 1, 0.5), "factor 0.5"),
])
def test_bad_settings_are_named(args, words):
    with pytest.raises(ValueError, match=words):
        Backoff(*args)


def test_wait_until_true_after_some_polls():
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 4, 5.0, Backoff(0.001, 0.002))
    assert len(calls) == 4


def test_wait_until_times_out_without_oversleeping():
    t0 = time.monotonic()
    # unclamped, the second pause would be 2 s: it is cut to what is left of the 0.1 s
    assert not wait_until(lambda: False, 0.1, Backoff(0.05, 10, factor=40))
    assert 0.1 <= time.monotonic() - t0 < 1.5
