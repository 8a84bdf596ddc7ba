"""bench/overhead/alone.py's in-process step cost: the step-cost scripts under their
launchers, against a real daemon, toy sized."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.overhead.alone import step_cost
from crossover.launch.local import DaemonProcess


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["horovod", "ddp"])
def test_step_cost_times_three_models_with_the_wrapped_one_coordinated_and_alone(
        tmp_path: Path, framework: str) -> None:
    with DaemonProcess(tmp_path / "run", log=tmp_path / "daemon.log") as daemon:
        env = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir), "CROSSOVER_JOB": "solo",
               "OMPI_MCA_mpi_yield_when_idle": "1"}
        cost = step_cost(framework, runs=2, steps=3, env=env, hidden=16, layers=2)
    assert len(cost["runs"]) == 2
    for run in cost["runs"]:  # the wrapped model's client ran under the daemon, alone
        assert run.pop("kept_device") is True
        assert set(run) == {"plain", "plain_again", "crossover"}
        assert all(t["wall_us"] >= t["cpu_us"] * 0.5 > 0 for t in run.values())
    for key in ("wall_overhead", "cpu_overhead", "wall_noise_floor", "cpu_noise_floor"):
        assert isinstance(cost[key], float)
    assert cost["command"].endswith("--wrapped 0|1|2")
