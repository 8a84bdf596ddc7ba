"""What a rank reports about its steps, and when (`crossover.client.reporting`): pure,
on an injected clock. Times step by binary fractions so the rate limits compare exactly."""

from __future__ import annotations

import pytest

from crossover import protocol as P
from crossover.client.reporting import StepReporter
from tests.test_scheduler import FakeClock

START = 100.0  # a monotonic clock is long past 0 (the reporter's "never reported")

# (row, rank, alone, coordinated, seconds between step boundaries, steps, steps reported)
PROGRESS = [
    ("rank 0 with company: at most every REPORT_S", 0, False, True, 0.03125, 6, [1, 3, 5]),
    ("rank 0 alone: at most every ALONE_REPORT_S", 0, True, True, 0.375, 8, [1, 4, 7]),
    ("an uncoordinated rank reports nothing", 0, False, False, 1.0, 3, []),
    ("only rank 0 reports: its ranks step together", 1, False, True, 1.0, 3, []),
]


@pytest.mark.parametrize("row,rank,alone,coordinated,dt,steps,reported", PROGRESS,
                         ids=[p[0] for p in PROGRESS])
def test_progress_reports(row, rank, alone, coordinated, dt, steps, reported):
    clock = FakeClock()
    clock.now = START
    rep = StepReporter(rank, clock)
    got = []
    for _ in range(steps):
        msg = rep.step(points=7, alone=alone, coordinated=coordinated)
        if msg is not None:
            assert msg.points == 7
            got.append(msg.steps)
        clock.now += dt
    assert got == reported
    assert rep.steps == steps, "every rank counts every step, reported or not"


def test_a_progress_report_carries_the_steps_profile():
    clock = FakeClock()
    clock.now = START
    rep = StepReporter(0, clock)
    last = None
    for _ in range(5):  # compute 30 ms, release, gap 20 ms, wait 5 ms for the grant
        last = rep.step(points=0, alone=False, coordinated=True) or last
        clock.now += 0.030
        rep.communicating()
        clock.now += 0.020
        rep.computing()
        rep.waited_for_grant(0.005)
        clock.now += 0.005
    assert last.steps == 5
    assert last.compute_s == pytest.approx(0.030) and last.gap_s == pytest.approx(0.020)


# (row, daemon aligns phases, [(wait, about the turns)] one per 0.125 s, reported medians)
T, F = True, False
WAITS = [
    ("the median of WAIT_REPORT_MIN waits", T, [(1, T), (9, T), (2, T)], [2]),
    ("then no sooner than WAIT_REPORT_S after", T,
     [(1, T), (2, T), (3, T), (4, T), (5, T), (6, T), (7, T)], [2, 5.5]),
    ("a wait off the turns drops those kept", T,
     [(1, T), (2, T), (3, F), (4, T), (5, T), (6, T)], [5]),
    ("nothing to a daemon that does not align phases", F, [(1, T)] * 6, []),
]


@pytest.mark.parametrize("row,aligns,waits,reported", WAITS, ids=[w[0] for w in WAITS])
def test_wait_reports(row, aligns, waits, reported):
    clock = FakeClock()
    clock.now = START
    rep = StepReporter(0, clock)
    rep.report_waits = aligns
    got = []
    for seconds, about_turns in waits:
        clock.now += 0.125
        msg = rep.wait(seconds, about_turns)
        if msg is not None:
            assert isinstance(msg, P.Waited)
            got.append(msg.wait_s)
    assert got == reported


def test_a_gpu_ranks_memory_is_reported_when_due_and_changed():
    from crossover.client.reporting import MEMORY_REPORT_S

    clock = FakeClock()
    clock.now = START
    rep = StepReporter(3, clock)  # every rank reports its own device's memory
    figures = [(100, 200, 1000)]
    read = lambda: figures[0]  # noqa: E731
    assert rep.memory(read) == P.Memory(100, 200, 1000)
    clock.now += MEMORY_REPORT_S / 2
    figures[0] = (150, 200, 1000)
    assert rep.memory(read) is None  # not due yet
    clock.now += MEMORY_REPORT_S
    assert rep.memory(read) == P.Memory(150, 200, 1000)
    clock.now += MEMORY_REPORT_S
    assert rep.memory(read) is None  # unchanged
    rep.forget_memory()  # a new daemon: told at once
    assert rep.memory(read) == P.Memory(150, 200, 1000)
    clock.now += MEMORY_REPORT_S
    assert rep.memory(lambda: None) is None  # no CUDA in this process


def test_cuda_memory_reads_torch_only_where_the_process_used_cuda(monkeypatch):
    import sys
    import types

    from crossover.client.reporting import cuda_memory

    monkeypatch.setitem(sys.modules, "torch", None)
    assert cuda_memory(0) is None  # torch not imported: nothing is imported for it
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True, memory_reserved=lambda d: 5 << 30,
        max_memory_reserved=lambda d: 7 << 30,
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert cuda_memory(1) == (5 << 30, 7 << 30, 80 << 30)
    cuda.is_initialized = lambda: False
    assert cuda_memory(1) is None  # CUDA never used: no report
    cuda.is_initialized = lambda: 1 / 0
    assert cuda_memory(1) is None  # whatever torch raises, the job goes on
