"""bench/comm_cpu.py end to end on the emulated hosts: each way of allreducing runs on
both hosts and lands in the result file. Needs root and network namespaces; skipped
elsewhere. Its figures are the benchmark's to report: no timing is asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench" / "comm_cpu.py"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the emulated cluster needs root, ip and tc")


def test_every_way_runs_across_the_hosts_and_is_written(tmp_path):
    env = {**os.environ, "CROSSOVER_BENCH_RESULTS": str(tmp_path)}
    res = subprocess.run([sys.executable, str(BENCH), "--runs", "1", "--steps", "3",
                          "--name", "smoke"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "smoke.json").read_text())
    sys.path.insert(0, str(REPO / "bench"))
    from comm_cpu import WAYS, gradient_floats

    assert doc["floats"] == gradient_floats() > 1_000_000  # the demo's MLP gradients
    assert set(doc["per_run"]) == set(WAYS) == set(doc["per_step_medians"])
    for way in WAYS:
        (run,) = doc["per_run"][way]
        assert run["wall_ms"] > 0 and run["cpu_ms"] == pytest.approx(
            run["user_ms"] + run["sys_ms"]), (way, run)
    assert "median horovod_quiet" in res.stdout


def test_bad_counts_are_refused_with_the_values():
    res = subprocess.run([sys.executable, str(BENCH), "--runs", "0"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "--runs 0" in res.stderr, res.stderr
