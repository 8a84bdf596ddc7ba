"""bench/colocation/comm_cpu.py end to end on the emulated hosts: each way of allreducing
runs on both hosts and lands in the result file. Needs root and network namespaces; skipped
elsewhere. Its figures are the benchmark's to report: no timing is asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCH = [sys.executable, "-m", "bench.colocation.comm_cpu"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the emulated cluster needs root, ip and tc")


def test_every_way_runs_across_the_hosts_and_is_written(tmp_path):
    env = {**os.environ, "CROSSOVER_BENCH_RESULTS": str(tmp_path)}
    res = subprocess.run([*BENCH, "--runs", "1", "--steps", "3",
                          "--name", "smoke"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "colocation" / "smoke.json").read_text())
    from bench.colocation.comm_cpu import WAYS, gradient_floats

    assert doc["floats"] == gradient_floats() > 1_000_000  # the demo's MLP gradients
    assert set(doc["per_run"]) == set(WAYS) == set(doc["per_step_medians"])
    for way in WAYS:
        (run,) = doc["per_run"][way]
        assert [r["rank"] for r in run] == [0, 1], (way, run)  # one rank on each host
        for r in run:
            assert r["wall_ms"] > 0 and r["cpu_ms"] == pytest.approx(
                r["user_ms"] + r["sys_ms"]), (way, r)
    assert "median horovod_quiet" in res.stdout


@pytest.mark.parametrize("bad, named", [(["--runs", "0"], "--runs 0"),
                                        (["--floats", "-5"], "--floats -5"),
                                        (["--mbit", "0"], "--mbit 0")])
def test_bad_input_is_refused_with_the_values_before_anything_is_built(bad, named):
    res = subprocess.run([*BENCH, *bad], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and named in res.stderr, res.stderr
