"""What `make demo` prints about where crossover's makespan went (examples/demo.py's
explain_holds), from a made-up trace and results: pure reporting, no processes."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")


def demo_module():
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def made_up_trace() -> list[dict]:
    """Two jobs taking turns on one device: jobA holds 70 ms, then jobB 70 ms, twice."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
              for pid, name in ((1, "jobA"), (2, "jobB"))]
    for i in range(4):
        events.append({"ph": "X", "name": "hold", "pid": 1 + i % 2, "tid": 0,
                       "ts": i * 70_000.0, "dur": 70_000.0, "args": {"device": "h0/cpu0"}})
    return events


RESULTS = {
    "crossover": [{"cpu_s": 6.9, "start": 100.0, "end": 114.2},
                  {"cpu_s": 6.9, "start": 100.1, "end": 114.1}],
    "jobA alone": [{"compute_s": 6.0}], "jobB alone": [{"compute_s": 5.8}],
}


def test_holds_against_compute_and_how_busy_host_0s_core_was(capsys):
    demo_module().explain_holds(made_up_trace(), RESULTS, 100, own_core=True)
    out = capsys.readouterr().out
    assert "h0/cpu0 100.0 %" in out
    assert "used 13.8 s of CPU in the 14.2 s run (at least 97 % busy)" in out
    assert "jobA: median hold 70.0 ms, compute a step alone 60.0 ms" in out
    assert "jobB: median hold 70.0 ms, compute a step alone 58.0 ms" in out


def test_no_core_figure_where_the_hosts_share_a_core(capsys):
    demo_module().explain_holds(made_up_trace(), RESULTS, 100, own_core=False)
    assert "host 0's core" not in capsys.readouterr().out
