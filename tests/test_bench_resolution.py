"""What a benchmark matrix can resolve (bench/colocation/resolution.py): the noise of a row's runs
and the ratio an auto exactly as fast as the better fixed mode would read (pure)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench.colocation.resolution import (
    assess,
    noise,
    null_ratios,
    replaces_other_files,
    rows_of,
    run_times,
)

E = math.exp


def _run(*seconds: float, start: float = 0.0) -> list[dict]:
    """One run of jobs that start at `start` and take `seconds` each."""
    return [{"seconds": s, "start": start, "end": start + s} for s in seconds]


@pytest.mark.parametrize(("times", "residual", "shared"), [
    ({"a": [1.0, 1.0], "b": [2.0, 2.0]}, 0.0, 0.0),
    # every arm slower in the second repetition alike: all of it is the repetition's
    ({"a": [1.0, E(0.2)], "b": [2.0, 2 * E(0.2)], "c": [3.0, 3 * E(0.2)]},
     0.0, math.sqrt(0.02)),
    # two arms moving in opposite directions: all of it is the runs' own (one degree of
    # freedom, residuals +-0.05 in each of the four cells)
    ({"a": [1.0, E(0.1)], "b": [1.0, E(-0.1)]}, math.sqrt(4 * 0.05 ** 2), 0.0),
])
def test_noise_table(times: dict[str, list[float]], residual: float, shared: float) -> None:
    assert noise(times) == pytest.approx((residual, shared), abs=1e-9)


@pytest.mark.parametrize(("times", "says"), [
    ({"a": [3.0], "b": [4.0]}, "two or more each.*--reps 2"),
    ({"a": [3.0, 3.1]}, "two arms or more"),
    ({"a": [3.0, 3.1], "b": [3.0, 3.1, 3.2]}, "same number of runs"),
    ({"a": [3.0, 0.0], "b": [3.0, 3.1]}, "times must be > 0"),
])
def test_noise_refuses_what_it_cannot_measure(times, says) -> None:
    with pytest.raises(ValueError, match=says):
        noise(times)


def test_without_noise_a_perfect_auto_reads_exactly_one() -> None:
    assert set(null_ratios(3, 0.0, 0.0, 1.2, trials=50)) == {1.0}


def test_a_repetitions_shared_slowdown_cancels_in_the_ratio() -> None:
    assert null_ratios(3, 0.0, 0.2, 1.0, trials=200) == pytest.approx([1.0] * 200)


def test_the_faster_of_two_noisy_modes_biases_the_ratio_low() -> None:
    """Two fixed modes equally fast: the faster median of the two is, on average, faster
    than auto's, though auto is as fast as either; a mode far slower takes no part."""
    close = statistics.median(null_ratios(3, 0.08, 0.0, 1.0, trials=4000))
    apart = statistics.median(null_ratios(3, 0.08, 0.0, 1.5, trials=4000))
    assert close < 0.985
    assert apart == pytest.approx(1.0, abs=0.01)


def test_null_ratios_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="other_slower >= 1"):
        null_ratios(3, 0.05, 0.0, 0.9)


def _row(auto: list[float]) -> dict:
    """A row of three repetitions: always antiphase the better mode, plain together 10 %
    slower, runs off by about 2 %, and `auto`'s makespans."""
    wobble = [1.0, 1.02, 0.98]
    return {"workload": "mlp", "mbit": 1000.0, "raw": {
        "solo_a": [*_run(5.0), *_run(5.2), *_run(5.1)],
        "crossover": [_run(10 * w) for w in wobble],
        "plain_together": [_run(11 * w) for w in wobble[::-1]],
        "auto": [_run(a) for a in auto]}}


def test_a_row_is_read_as_the_makespans_of_its_arms_together() -> None:
    """From the first job's start to the last job's end; sequential and solos are not
    read (a sum of solo runs, which the ratio does not use)."""
    row = _row([10.0, 10.5, 10.2])
    row["raw"]["plain_together"][0] = _run(11.5, 10.0, start=0.5)
    times = run_times(row)
    assert list(times) == ["crossover", "plain_together", "auto"]
    assert times["crossover"] == pytest.approx([10.0, 10.2, 9.8])
    assert times["plain_together"] == pytest.approx([11.5, 11.22, 11.0])
    assert times["auto"] == pytest.approx([10.0, 10.5, 10.2])


@pytest.mark.parametrize(("auto", "low", "high"), [
    ([13.0, 13.2, 12.9], 0.0, 0.01),   # auto clearly slower: a perfect auto never reads so low
    ([10.0, 10.1, 9.9], 0.2, 1.0),     # as fast as the better mode: nothing to tell
    ([8.0, 8.1, 7.9], 0.99, 1.0),      # faster than both
])
def test_p_null_says_how_often_a_perfect_auto_reads_as_low(auto, low, high) -> None:
    out = assess(_row(auto), target=0.99)
    assert out["reps"] == 3
    assert low <= out["p_null"] <= high
    assert low <= out["p_null_even"] <= high
    assert out["auto_vs_best_fixed_mode"] == pytest.approx(10.0 / statistics.median(auto))


def test_rows_of_keeps_the_rows_with_auto_and_both_fixed_modes(tmp_path: Path) -> None:
    whole, partial = _row([10.0, 10.1, 9.9]), _row([10.0, 10.1, 9.9])
    del partial["raw"]["crossover"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [whole, partial]}))
    assert rows_of(path) == [whole]


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"no": "rows"}', '{"rows": [3]}'])
def test_a_file_that_is_no_result_is_named_with_the_fix(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.json: not a readable result.*bench/results"):
        rows_of(path)


def test_the_default_name_does_not_replace_the_resolution_of_other_files(
        tmp_path: Path) -> None:
    out = tmp_path / "resolution.json"
    assert replaces_other_files(out, ["a.json"]) is None  # new
    out.write_text(json.dumps({"rows": [{"file": "b.json"}, {"file": "a.json"}]}))
    assert replaces_other_files(out, ["a.json", "b.json"]) is None  # the same files again
    said = replaces_other_files(out, ["c.json"])
    assert said is not None and "holds the resolution of a.json, b.json" in said
    assert "--name resolution_<setting>" in said
    assert said.endswith("or replace it with --name resolution"), said
