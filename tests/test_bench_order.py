"""The order in which a benchmark runs its arms, repetition by repetition (pure), the
teardown of its daemons, and the reading of a daemon's decisions."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from bench.harness.common import DecisionLog, arm_order, stop_all
from bench.harness.jobs import TORCH_EXIT_ABORT, result_line
from crossover.launch.local import DaemonProcess


@pytest.mark.parametrize(("n", "reps", "orders"), [
    (1, 2, [[0], [0]]),
    (2, 3, [[0, 1], [1, 0], [0, 1]]),
    (4, 4, [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]),
    # crossover_bench: solos, plain together, uncoordinated, crossover, auto
    (5, 3, [[0, 1, 4, 2, 3], [1, 2, 0, 3, 4], [2, 3, 1, 4, 0]]),
    (3, 6, [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]),
])
def test_arm_order_table(n: int, reps: int, orders: list[list[int]]) -> None:
    assert [arm_order(n, rep) for rep in range(reps)] == orders


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_arm_takes_every_place_and_follows_every_arm_equally_often(n: int) -> None:
    cycle = n if n % 2 == 0 else 2 * n
    orders = [arm_order(n, rep) for rep in range(cycle)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert arm_order(n, cycle) == orders[0]
    for arm in range(n):
        assert Counter(order.index(arm) for order in orders) == \
            dict.fromkeys(range(n), cycle // n)
    follows = Counter((a, b) for order in orders for a, b in pairwise(order))
    assert follows == {(a, b): cycle // n for a in range(n) for b in range(n) if a != b}


def test_bad_counts_are_named() -> None:
    with pytest.raises(ValueError, match="order of 0 arms"):
        arm_order(0, 1)


def _hold(job: int, start_ms: float, end_ms: float) -> dict:
    return {"ph": "X", "name": "hold", "pid": job, "tid": 0, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": {"device": "h0/cpu0"}}


def _wait(job: int, start_ms: float, end_ms: float) -> dict:
    return {**_hold(job, start_ms, end_ms), "name": "slot wait"}


@pytest.mark.parametrize(("events", "held_ms", "idle_ms", "span_ms"), [
    # antiphase: B waits from 5 ms, gets the device 2 ms after A's release at 10 ms
    ([_hold(1, 0, 10), _wait(2, 5, 12), _hold(2, 12, 20)], 18, 2, 20),
    # a gap nobody waits through is not the scheduler's idle time
    ([_hold(1, 0, 10), _hold(2, 12, 20)], 18, 0, 20),
    # concurrent: B's short hold inside A's long one leaves no gap, and counts once
    ([_hold(1, 0, 10), _hold(2, 1, 3), _wait(2, 4, 8), _hold(2, 8, 9)], 10, 0, 10),
    # overlapping, then a real gap after the later end
    ([_hold(1, 0, 10), _hold(2, 5, 15), _wait(1, 12, 17), _hold(1, 17, 20)], 18, 2, 20),
])
def test_idle_gaps_count_overlapping_holds_once(events: list[dict], held_ms: float,
                                                idle_ms: float, span_ms: float) -> None:
    from bench.colocation.summary import idle_gaps

    dev = idle_gaps(events)["devices"]["h0/cpu0"]
    assert dev == pytest.approx({"held_s": held_ms / 1e3, "idle_while_waiting_s": idle_ms / 1e3,
                                 "span_s": span_ms / 1e3})


def _job(seconds: float, start: float = 0.0) -> dict:
    return {"seconds": seconds, "start": start, "end": start + seconds}


def test_paired_vs_best_compares_each_repetition_with_its_own_baselines() -> None:
    from bench.colocation.summary import paired_vs_best

    solos = [[_job(5.0), _job(5.0)], [_job(6.0), _job(6.0)]]  # sequential 10 s, then 12 s
    plain = [[_job(9.0), _job(8.0, 0.5)], [_job(14.0), _job(13.0)]]  # 9 s, then 14 s
    auto = [[_job(9.9), _job(9.0)], [_job(10.0, 1.0), _job(10.0)]]  # 9.9 s, then 11 s
    assert paired_vs_best(solos, plain, auto) == pytest.approx([9.0 / 9.9, 12.0 / 11.0])
    with pytest.raises(ValueError, match="2 solo, 1 plain-together and 2 auto"):
        paired_vs_best(solos, plain[:1], auto)


def _row(workload: str, mbit: float, vs_best: float, vs_best_wall: float,
         reps: list[float], comm_s: float = 1.0) -> dict:
    return {"workload": workload, "mbit": mbit, "compute_s": 2.0, "comm_s": comm_s,
            "auto_vs_best_baseline": vs_best, "auto_vs_best_baseline_wall": vs_best_wall,
            "auto_vs_best_baseline_reps": reps, "single_job_overhead": 0.01,
            "bound_with_link_fraction": 0.9, "auto_vs_plain": 1.1, "auto_vs_sequential": 1.2,
            "crossover_vs_plain_uncoordinated": 1.15}


def test_headline_keys_the_worst_row_both_ways_and_the_comm_heavy_rows() -> None:
    from bench.colocation.summary import headline

    rows = [_row("mlp", 500, 1.05, 1.08, [1.1, 1.0], comm_s=3.0),
            _row("mlp", 0, 0.90, 1.20, [0.97, 0.95]),   # below 0.98 in every repetition
            _row("cnn", 0, 0.95, 0.93, [0.99, 0.91])]   # the worst counted back to back
    keys = headline(rows)
    assert keys["worst_vs_best_baseline"] == 0.90
    assert keys["worst_vs_best_baseline_wall"] == 0.93
    assert keys["rows_below_in_every_rep"] == ["mlp@0"]
    assert keys["headline_rows"] == ["mlp@500"]  # comm >= compute and a link
    assert keys["link_bound_fraction"] == 0.9


@pytest.mark.parametrize(("wins", "n", "p"), [
    (8, 8, 2 / 256), (0, 8, 2 / 256), (7, 8, 2 * 9 / 256), (6, 8, 2 * 37 / 256),
    (4, 8, 1.0), (3, 6, 1.0), (0, 0, 1.0), (5, 5, 2 / 32)])
def test_sign_test_table(wins: int, n: int, p: float) -> None:
    from bench.colocation.paired import sign_test

    assert sign_test(wins, n) == pytest.approx(p)


def test_summarize_pairs_each_run_with_its_partner_and_ties_count_for_neither() -> None:
    from bench.colocation.paired import sign_test, summarize

    times = [(10.0, 8.0), (12.0, 12.0), (9.0, 10.0), (11.0, 10.0)]
    verdict = summarize(("plain", "auto"), times)
    assert verdict["plain_over_auto"] == pytest.approx([1.25, 1.0, 0.9, 1.1])
    assert verdict["plain_over_auto_median"] == pytest.approx(1.05)
    assert (verdict["auto_faster_pairs"], verdict["plain_faster_pairs"]) == (2, 1)
    assert verdict["sign_test_p"] == pytest.approx(sign_test(2, 3))
    assert (verdict["plain_median_s"], verdict["auto_median_s"]) == (10.5, 10.0)
    with pytest.raises(ValueError, match="4 wins in 3 pairs"):
        sign_test(4, 3)


class Interrupted:
    """A daemon whose stop is cut short by Ctrl-C (a second signal during the teardown)."""

    def stop(self) -> None:
        raise KeyboardInterrupt


def test_a_signal_during_the_teardown_still_stops_every_daemon(tmp_path: Path) -> None:
    """Regression: the benchmark stopped its arms' daemons in a plain loop, so a Ctrl-C
    while one stopped left the next arm's daemon running."""
    daemon = DaemonProcess(tmp_path / "run", policy="off")
    with pytest.raises(KeyboardInterrupt):
        stop_all([Interrupted(), daemon])
    assert daemon.proc.poll() is not None, "the daemon after the interrupted one still runs"


def test_start_barrier_waits_for_every_rank_of_every_job(tmp_path: Path) -> None:
    """The start barrier of jobs launched together (`crossover.testing.start_barrier`)."""
    from crossover.testing import start_barrier

    for rank in range(2):
        (tmp_path / f"jobA.{rank}.2").touch()
    (tmp_path / "job.B.0.2").touch()  # a dot in a job's name is fine
    with pytest.raises(RuntimeError, match=r"not all ranks of 2 jobs.*--start-jobs 2"):
        start_barrier(tmp_path, 2, 1, 3, job="job.B", timeout_s=0.05)  # says 3 ranks: short
    (tmp_path / "job.B.1.3").unlink()
    start_barrier(tmp_path, 2, 1, 2, job="job.B", timeout_s=5.0)  # the last rank: at once
    with pytest.raises(RuntimeError, match="not all ranks of 3 jobs"):
        start_barrier(tmp_path, 3, 1, 2, job="job.B", timeout_s=0.05)
    start_barrier(None, 3, 0, 2)  # no barrier: nothing to wait for


@pytest.mark.parametrize("ends, start, end, expected", [
    ([0.0, 1.0, 2.0, 3.0, 4.0], 0.5, 3.5, 1.0),  # steps 1..3: 2 intervals in 2 s
    ([0.0, 0.5, 1.0, 1.5, 2.0, 10.0], 0.0, 2.0, 2.0),  # the step after the window is out
    ([0.0, 1.0, 2.0], 0.5, 2.5, None),  # two steps: no rate
    ([], 0.0, 1.0, None),
])
def test_neighbour_rate_counts_the_steps_that_ended_in_the_window(
        ends: list[float], start: float, end: float, expected: float | None) -> None:
    from bench.freeze.neighbour import rate

    assert rate(ends, start, end) == expected


def test_neighbour_windows_run_from_the_first_cut_to_the_last() -> None:
    from bench.freeze.neighbour import windows

    rows = [{"wall_start": 10.0, "wall_end": 11.0, "repartition_walls": []},
            {"wall_start": 11.5, "wall_end": 12.5, "repartition_walls": [12.0]},
            {"wall_start": 13.0, "wall_end": 14.0, "repartition_walls": [13.2, 13.4]}]
    assert windows(rows) == (10.0, 12.0, 13.4, 14.0)
    with pytest.raises(RuntimeError, match="never re-partitioned.*--freeze-threshold"):
        windows([{**r, "repartition_walls": []} for r in rows])


def _steps(start: float, stop: float, per_s: float) -> list[float]:
    return [start + i / per_s for i in range(1, int((stop - start) * per_s) + 1)]


def test_the_neighbour_is_compared_over_the_same_offsets_beside_the_control() -> None:
    from bench.freeze.neighbour import PipelineRun, compare

    # freeze arm: trains 0-4 s, cuts at 1 s and 1.5 s, exits at 5 s; the neighbour runs
    # 10 steps/s until the last cut, 20 after it, 40 once the pipeline has exited
    rows = [{"wall_start": 0.0, "wall_end": 2.0, "repartition_walls": [1.0, 1.5],
             "accuracy": 0.9, "frozen": ["a"], "devices": 1, "spare_device_s": 2.5},
            {"wall_start": 2.0, "wall_end": 4.0, "repartition_walls": [],
             "accuracy": 0.95, "frozen": ["a"], "devices": 1, "spare_device_s": 2.5}]
    ends = _steps(0, 1.5, 10) + _steps(1.5, 5.0, 20) + _steps(5.0, 14.0, 40)
    # control: trains 100-112 s at a steady 10 steps/s beside the neighbour
    ctl_rows = [{"wall_start": 100.0, "wall_end": 112.0, "repartition_walls": [],
                 "accuracy": 0.97}]
    r = compare(PipelineRun(rows, 5.0, ends), PipelineRun(ctl_rows, 113.0,
                                                          _steps(100, 113, 10)))
    assert r["before"] == pytest.approx(10) and r["after"] == pytest.approx(20)
    assert r["alone"] == pytest.approx(40)
    assert r["control_before"] == pytest.approx(10) and r["control_after"] == pytest.approx(10)
    assert r["control_span"] == pytest.approx(10)
    # over 12 s: 15 + 70 + 280 steps against 120 beside the control
    assert 25 < r["over_control_span"] < 35
    assert (r["cut_after_s"], r["after_window_s"], r["pipeline_s"],
            r["control_pipeline_s"]) == (1.0, 2.5, 4.0, 12.0)
    with pytest.raises(RuntimeError, match="raise --neighbour-steps"):
        compare(PipelineRun(rows, 5.0, ends[:-100]), PipelineRun(ctl_rows, 113.0,
                                                                 _steps(100, 113, 10)))


RESULT = '{"model": "mlp", "seconds": 1.0}'


@pytest.mark.parametrize("output, rc, reference, done", [
    (f"warming up\n{RESULT}\n", 0, False, True),
    ("warming up\n", 0, False, False),  # no result: failed whatever the exit code
    (f"{RESULT}\n{TORCH_EXIT_ABORT}\n", 1, False, False),  # a measured job must exit 0
    (f"{RESULT}\n{TORCH_EXIT_ABORT}\n", 1, True, True),  # a reference run's result stands
    (f"{TORCH_EXIT_ABORT}\n{RESULT}\n", 1, True, False),  # aborted before it finished
    (f"{RESULT}\nTraceback\n", 1, True, False),  # another failure after the result
])
def test_a_reference_job_counts_as_done_when_torch_aborts_after_its_result(
        output, rc, reference, done):
    assert result_line(output, rc, reference) == (RESULT if done else None)


def test_a_decision_log_gives_each_run_the_decisions_it_added(tmp_path):
    log = tmp_path / "daemon.log"
    decisions = DecisionLog(log)
    assert decisions.new() == []  # no log yet
    line = "crossover-daemon 2026-11-28 12:51:47,088 mode {} for group 0 (nodes 0-1): {}\n"
    log.write_text(line.format("antiphase", "job A joined: probing antiphase")
                   + "crossover-daemon 2026-11-28 12:51:48,000 a job joined\n"
                   + line.format("concurrent", "probing concurrent"))
    assert decisions.new() == ["job A joined: probing antiphase", "probing concurrent"]
    with open(log, "a") as out:
        out.write(line.format("antiphase", "antiphase 1.20x concurrent: antiphase"))
    assert decisions.new() == ["antiphase 1.20x concurrent: antiphase"]
    assert decisions.new() == []
    with open(log, "a") as out:  # a line the daemon is still writing
        out.write(line.format("concurrent", "antiphase 0.8").rstrip("\n"))
    assert decisions.new() == []
    with open(log, "a") as out:
        out.write("5x concurrent: concurrent\n")
    assert decisions.new() == ["antiphase 0.85x concurrent: concurrent"]
