"""The benchmarks' one-host Gloo launch (`rank_launch.local_gloo_run`), with real Horovod jobs.

bench/gpu/sharing.py launches its jobs this way on a GPU machine (no MPI there); here the
same jobs run on the CPU: the weights each job trains under crossover, beside the other
job, must be bit-identical to its run alone.
"""

from __future__ import annotations

import pytest

from bench.harness.jobs import run_jobs
from bench.harness.rank_launch import local_gloo_run
from crossover import trace
from crossover.launch.local import DaemonProcess
from tests.conftest import assert_shared_in_turns

WORKLOAD = ["--model", "mlp", "--width", "64", "--layers", "2", "--batch", "32",
            "--deterministic"]


def launch(argv: list[str]) -> list[str]:
    return local_gloo_run(2, argv, timeout_s=120)


@pytest.mark.timeout(300)
def test_local_gloo_jobs_train_the_same_weights_alone_and_under_crossover(tmp_path):
    plain = {"CROSSOVER_ENABLE": "0"}
    solo_a = run_jobs(launch, ["soloA"], WORKLOAD, 4, plain, tmp_path, 120, first_seed=1,
                      reference=True)[0]
    solo_b = run_jobs(launch, ["soloB"], WORKLOAD, 4, plain, tmp_path, 120, first_seed=2,
                      reference=True)[0]
    assert solo_a["weights_sha256"] != solo_b["weights_sha256"]  # the digest sees the seed
    traces = tmp_path / "traces"
    # Always antiphase: the no-overlap check below is its property. Under the default
    # policy, auto, jobs on one host's CPU are served concurrently, and their holds
    # overlap by design (this check once passed there only when the jobs' holds missed
    # each other).
    with DaemonProcess(tmp_path / "run", policy="crossover",
                       log=tmp_path / "daemon.log") as daemon:
        both = run_jobs(launch, ["xA", "xB"], WORKLOAD, 4,
                        {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir),
                         "CROSSOVER_TRACE": str(traces)}, tmp_path, 120,
                        start_together=True)
    assert [r["weights_sha256"] for r in both] == [solo_a["weights_sha256"],
                                                   solo_b["weights_sha256"]]
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    # each job's two ranks are local ranks 0 and 1 of this host: two devices, both shared
    assert_shared_in_turns(events, {"xA", "xB"}, devices=2)
