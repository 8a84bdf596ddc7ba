"""What a benchmark matrix can resolve (bench/resolution.py): the noise of a row's runs
and the ratio an auto exactly as fast as the better fixed mode would read (pure)."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from resolution import assess, null_ratios, pooled_noise, run_times  # noqa: E402


def _run(*seconds: float, start: float = 0.0) -> list[dict]:
    """One run of jobs that start at `start` and take `seconds` each."""
    return [{"seconds": s, "start": start, "end": start + s} for s in seconds]


@pytest.mark.parametrize(("times", "sigma"), [
    ({"a": [1.0, 1.0, 1.0]}, 0.0),
    # one arm, two runs e^-s and e^s: residuals +-s, one degree of freedom
    ({"a": [math.exp(-0.1), math.exp(0.1)]}, math.sqrt(2) * 0.1),
    # a second arm with the same spread at another speed pools to the same figure
    ({"a": [math.exp(-0.1), math.exp(0.1)], "b": [2 * math.exp(-0.1), 2 * math.exp(0.1)]},
     math.sqrt(2) * 0.1),
    # an arm of one run adds nothing
    ({"a": [math.exp(-0.1), math.exp(0.1)], "b": [5.0]}, math.sqrt(2) * 0.1),
])
def test_pooled_noise_table(times: dict[str, list[float]], sigma: float) -> None:
    assert pooled_noise(times) == pytest.approx(sigma)


@pytest.mark.parametrize(("times", "says"), [
    ({"a": [3.0], "b": [4.0]}, "no arm has two runs"),
    ({"a": [3.0, 0.0]}, "times must be > 0"),
])
def test_pooled_noise_refuses_what_it_cannot_measure(times, says) -> None:
    with pytest.raises(ValueError, match=says):
        pooled_noise(times)


def test_without_noise_a_perfect_auto_reads_exactly_one() -> None:
    assert set(null_ratios(3, 0.0, 1.2, trials=50)) == {1.0}


def test_the_faster_of_two_noisy_modes_biases_the_ratio_low() -> None:
    """Two fixed modes equally fast: the faster median of the two is, on average, faster
    than auto's, though auto is as fast as either; a mode far slower takes no part."""
    close = statistics.median(null_ratios(3, 0.08, 1.0, trials=4000))
    apart = statistics.median(null_ratios(3, 0.08, 1.5, trials=4000))
    assert close < 0.985
    assert apart == pytest.approx(1.0, abs=0.01)


def test_null_ratios_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="other_slower >= 1"):
        null_ratios(3, 0.05, 0.9)


def test_a_row_is_read_per_repetition_and_assessed() -> None:
    """Sequential is the sum of a repetition's solos (one result each); the other arms
    are makespans of runs (a result per job)."""
    row = {"workload": "mlp", "mbit": 1000.0, "raw": {
        "solo_a": [*_run(5.0), *_run(5.2)], "solo_b": [*_run(6.0), *_run(5.8)],
        "solo_daemon": [*_run(9.0), *_run(9.0)],
        "plain_together": [_run(12.0, 11.0), _run(12.4, 12.0)],
        "crossover": [_run(10.0, 9.0), _run(10.2, 10.0)],
        "auto": [_run(10.0, 9.5), _run(11.0, 10.0)]}}
    assert run_times(row) == {"sequential": [11.0, 11.0], "plain_together": [12.0, 12.4],
                              "crossover": [10.0, 10.2], "auto": [10.0, 11.0]}
    out = assess(row, target=0.99)
    assert out["reps"] == 2
    assert out["auto_vs_best_fixed_mode"] == pytest.approx(10.1 / 10.5, abs=1e-3)
    assert 0 < out["run_noise"] < 0.1
    assert 0 <= out["p_null"] <= 1 and 0 <= out["null_reaches_target"] <= 1
