"""The release check of bench/harness/release_check.py, on hand-made profiles (pure logic).

The check itself runs on a GPU (bench/gpu/sharing.py); here a profile is a list of Chrome
trace events, as the torch profiler writes them, so every rule is pinned by a table.
"""

from __future__ import annotations

import pytest

from bench.harness.release_check import MARK, busy_union, check_rank, clock_offset_us, overlap_s

#: The profiler's clock runs this far ahead of the wall clock (µs) in these profiles.
OFFSET = 5_000.0


def marker(wall_us: float, phase: str = "hold") -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"{MARK}{phase}@{wall_us / 1e6:.6f}",
            "ts": wall_us + OFFSET, "dur": 1}


def work(cat: str, start_us: float, end_us: float) -> dict:
    """A kernel or copy, given in wall-clock µs, stored on the profiler's clock."""
    return {"ph": "X", "cat": cat, "name": cat, "ts": start_us + OFFSET,
            "dur": end_us - start_us}


HOLDS = [(1_000.0, 2_000.0), (3_000.0, 4_000.0), (5_000.0, 6_000.0)]


@pytest.mark.parametrize("events, expected", [
    # every kernel inside a hold: nothing outside
    ([work("kernel", 1_100, 1_900), work("kernel", 3_000, 3_990)],
     {"outside": 0, "overruns": 0, "kernels_released": 0, "max_overrun_us": 0.0}),
    # within the slack (10 µs) past the release: the clock mapping's tolerance
    ([work("kernel", 1_100, 2_008)], {"outside": 0, "overruns": 0}),
    # launched in the hold, still running 500 µs after the release: an overrun
    ([work("kernel", 1_900, 2_500)],
     {"outside": 1, "overruns": 1, "kernel_overruns": 1, "copy_overruns": 0,
      "max_overrun_us": 500.0, "overrun_s": 500e-6}),
    # a copy that overran counts too, apart: communication begun while holding (gloo's
    # copy of a DDP bucket to host memory)
    ([work("kernel", 3_100, 3_200), work("gpu_memcpy", 3_500, 4_200)],
     {"outside": 1, "overruns": 1, "kernel_overruns": 0, "copy_overruns": 1, "copies": 1}),
    # a kernel started between two holds: a violation; a copy there: communication
    ([work("kernel", 2_500, 2_600), work("gpu_memcpy", 2_500, 2_700)],
     {"outside": 1, "kernels_released": 1, "copies_released": 1, "overruns": 0}),
    # before the first hold counts as not holding
    ([work("kernel", 100, 200)], {"outside": 1, "kernels_released": 1}),
])
def test_check_rank_table(events, expected):
    profile = [marker(1_000), marker(2_000, "communicate"), *events]
    result = check_rank(profile, HOLDS)
    assert {k: result[k] for k in expected} == pytest.approx(expected)


def test_margin_is_the_least_time_between_a_holds_last_work_and_its_release():
    profile = [marker(1_000), work("kernel", 1_100, 1_700), work("kernel", 3_100, 3_950)]
    assert check_rank(profile, HOLDS)["min_margin_us"] == pytest.approx(50.0)


def test_the_clock_offset_is_the_median_over_the_markers():
    profile = [marker(1_000), marker(2_000), {**marker(3_000), "ts": 3_000 + OFFSET + 900}]
    assert clock_offset_us(profile) == pytest.approx(OFFSET)


def test_a_profile_without_markers_or_kernels_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="mark_phases"):
        check_rank([work("kernel", 1_100, 1_200)], HOLDS)
    with pytest.raises(ValueError, match="ProfilerActivity.CUDA"):
        check_rank([marker(1_000)], HOLDS)


def test_busy_time_of_two_jobs_at_once():
    a = busy_union([(0, 10), (5, 20), (30, 40)])
    assert a == [(0, 20), (30, 40)]
    b = busy_union([(15, 35)])
    assert overlap_s(a, b) == pytest.approx(10e-6)  # 15-20 and 30-35
    assert overlap_s(a, []) == 0.0
