"""Chrome traces: overlap detection, merging with a real Horovod timeline, the Gantt plot."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from crossover import trace
from crossover.trace import TraceRecorder
from tests.conftest import PY, REPO, mpirun


def spans(tmp_path, job: str, holds: list[tuple[float, float]], device="n/cpu0"):
    rec = TraceRecorder(job, 0, tmp_path / f"{job}.json")
    for start, end in holds:
        rec.span("hold", start, end, device=device)
    rec.flush()
    return tmp_path / f"{job}.json"


def test_overlaps_finds_only_holds_of_different_jobs_on_one_device(tmp_path):
    a = spans(tmp_path, "a", [(0.0, 1.0), (2.0, 3.0)])
    b = spans(tmp_path, "b", [(1.0, 2.0), (2.5, 2.6)])  # the second one overlaps a
    c = spans(tmp_path, "c", [(0.5, 0.7)], device="n/cpu1")  # other device: fine
    events = trace.merge([a, b, c], tmp_path / "m.json")
    found = trace.overlaps(events)
    assert len(found) == 1
    dev, first, second = found[0]
    assert dev == "n/cpu0" and {first[2], second[2]} == {"a", "b"}


def test_handovers_count_the_changes_of_job_on_each_device(tmp_path):
    # taking turns: a b a b on cpu0; one after the other: a then b on cpu1
    a = spans(tmp_path, "a", [(0.0, 1.0), (2.0, 3.0)])
    b = spans(tmp_path, "b", [(1.0, 2.0), (3.0, 4.0)])
    a1 = spans(tmp_path, "a1", [(0.0, 1.0), (1.0, 2.0)], device="n/cpu1")
    b1 = spans(tmp_path, "b1", [(2.0, 3.0), (3.0, 4.0)], device="n/cpu1")
    events = trace.merge([a, b, a1, b1], tmp_path / "m.json")
    assert trace.handovers(events) == {"n/cpu0": 3, "n/cpu1": 1}


def test_busy_is_the_share_of_a_devices_time_some_rank_held_it(tmp_path):
    a = spans(tmp_path, "a", [(0.0, 1.0), (2.0, 3.0)])
    b = spans(tmp_path, "b", [(0.5, 1.5), (3.0, 4.0)])  # overlapping a's first: counted once
    c = spans(tmp_path, "c", [(0.0, 2.0)], device="n/cpu1")
    busy = trace.busy(trace.merge([a, b, c], tmp_path / "m.json"))
    assert busy == {"n/cpu0": pytest.approx(3.5 / 4.0), "n/cpu1": pytest.approx(1.0)}


def test_rank_skew_measures_how_far_apart_a_jobs_ranks_start_their_holds(tmp_path):
    paths = []
    for job, rank, device, lag in [("a", 0, "n0/cpu0", 0.0), ("a", 1, "n1/cpu0", 0.05),
                                   ("b", 0, "n0/cpu0", 0.5), ("b", 1, "n1/cpu0", 0.5),
                                   ("c", 0, "n0/cpu1", 0.0)]:
        rec = TraceRecorder(job, rank, tmp_path / f"{job}{rank}.json")
        for step in range(10):  # a's rank 1 starts 50 ms late 4 times, then 30 ms early
            start = step + lag - (0.08 if job == "a" and rank == 1 and step >= 4 else 0.0)
            rec.span("hold", start, start + 0.2, device=device)
        rec.flush()
        paths.append(tmp_path / f"{job}{rank}.json")
    skew = trace.rank_skew(trace.merge(paths, tmp_path / "m.json"))
    assert set(skew) == {"a", "b"}  # c has one rank
    assert skew["a"]["median_ms"] == pytest.approx(30.0, abs=0.01)
    assert skew["a"]["p90_ms"] == pytest.approx(50.0, abs=0.01)
    assert skew["a"]["holds"] == 10
    assert skew["b"] == {"median_ms": 0.0, "p90_ms": 0.0, "hold_ms": pytest.approx(200.0),
                         "holds": 10, "apart": 0.0}
    assert skew["a"]["apart"] == 0.0  # 30-50 ms: less than half a hold (100 ms)


def test_rank_skew_counts_the_holds_a_hold_apart(tmp_path):
    """Two hosts a hold apart run different jobs at once (each step waits for both jobs'
    holds): the share of holds more than half the job's hold from its other rank's."""
    paths = []
    for rank, device in [(0, "n0/cpu0"), (1, "n1/cpu0")]:
        rec = TraceRecorder("a", rank, tmp_path / f"a{rank}.json")
        for step in range(10):  # rank 1 one hold (150 ms) late in steps 6-9
            start = step * 0.4 + (0.15 if rank == 1 and step >= 6 else 0.01 * rank)
            rec.span("hold", start, start + 0.15, device=device)
        rec.flush()
        paths.append(tmp_path / f"a{rank}.json")
    skew = trace.rank_skew(trace.merge(paths, tmp_path / "m.json"))
    assert skew["a"]["apart"] == pytest.approx(0.4)
    assert skew["a"]["median_ms"] == pytest.approx(10.0, abs=0.01)


def test_a_long_hold_is_compared_with_every_later_one(tmp_path):
    a = spans(tmp_path, "a", [(0.0, 10.0)])
    b = spans(tmp_path, "b", [(1.0, 2.0), (5.0, 6.0)])
    assert len(trace.overlaps(trace.merge([a, b], tmp_path / "m.json"))) == 2


def test_not_a_trace_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json: not a Chrome trace"):
        trace.load(bad)


@pytest.mark.mpi
def test_merge_with_a_real_horovod_timeline_and_plot(tmp_path):
    timeline = tmp_path / "timeline.json"
    env = dict(os.environ, HOROVOD_TIMELINE=str(timeline), CROSSOVER_ENABLE="0")
    subprocess.run(mpirun(2, PY, str(REPO / "examples/torch_mlp.py"), "--steps", "5"),
                   env=env, check=True, timeout=180, capture_output=True, cwd=REPO)
    now = time.time()
    ours = spans(tmp_path, "job", [(now - 1.0, now)])
    out = tmp_path / "merged.json"
    subprocess.run([PY, "-m", "crossover", "trace", "merge", str(ours), str(timeline),
                    "-o", str(out)], check=True, timeout=60, cwd=REPO)
    events = json.loads(out.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "hold" in names
    assert any("ALLREDUCE" in str(n) for n in names), "Horovod's allreduce events are kept"
    # On one clock: Horovod's events fall within minutes of ours, not at 1970.
    hvd_ts = [e["ts"] for e in events if "ALLREDUCE" in str(e.get("name")) and "ts" in e]
    assert abs(min(hvd_ts) / 1e6 - now) < 600
    png = tmp_path / "gantt.png"
    subprocess.run([PY, "-m", "crossover", "trace", "plot", str(out), "-o", str(png)],
                   check=True, timeout=120, cwd=REPO)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gantt_chart_draws_marks_at_their_wall_clock_time(tmp_path, monkeypatch):
    rec = TraceRecorder("jobA", 0, tmp_path / "a.json")
    rec.span("hold", 100.0, 101.0, device="vm/cpu0")
    rec.span("hold", 102.0, 103.0, device="vm/cpu0")
    drawn = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda ax, x, **kw: drawn.append(x) or original(ax, x, **kw))
    trace.plot_gantt(rec.events, tmp_path / "g.png", marks=[("cut", 101.5)])
    assert drawn == [1500.0]  # ms after the first hold began
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
