"""Priority weights end to end: CROSSOVER_PRIORITY in a job's environment reaches the
daemon's `priority` policy and orders the grants of real Horovod jobs.

Two 2-rank jobs (under mpirun, on this host) share both devices; A has weight 4. While both
run, weighted fair queuing gives A about 4 holds for each of B's (1 each with equal
weights, which is what a weight lost on the way would give). Counted from the traces;
no timing is asserted.
"""

from __future__ import annotations

import pytest

from bench.harness.jobs import ONE_HOST_ENV, one_host_launch, run_jobs
from crossover import trace
from crossover.launch.local import DaemonProcess

WORKLOAD = ["--model", "mlp", "--width", "256", "--layers", "2", "--batch", "128"]
STEPS = 600  # 6 s alone; the loops start together, once every rank has set up


@pytest.mark.timeout(300)
def test_a_heavier_job_gets_more_turns_while_both_run(tmp_path):
    traces = tmp_path / "traces"
    with DaemonProcess(tmp_path / "run", policy="priority",
                       log=tmp_path / "daemon.log") as daemon:
        run_jobs(one_host_launch, ["pA", "pB"], WORKLOAD, STEPS,
                 {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir),
                  "CROSSOVER_TRACE": str(traces)}, tmp_path, 120, job_env=ONE_HOST_ENV,
                 job_envs=[{"CROSSOVER_PRIORITY": "4"}, {"CROSSOVER_PRIORITY": "1"}],
                 start_together=True)  # a late second job once left them hardly together
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    for device, spans in trace.holds_by_device(events).items():
        first = {job: min(s for s, _, j, _ in spans if j == job) for job in ("pA", "pB")}
        last = {job: max(e for _, e, j, _ in spans if j == job) for job in ("pA", "pB")}
        # the stretch in which both jobs were there and asking
        lo, hi = max(first.values()), min(last.values())
        both = [j for s, e, j, _ in spans if s >= lo and e <= hi]
        n_a, n_b = both.count("pA"), both.count("pB")
        assert n_b >= 3, f"{device}: the jobs hardly overlapped: {spans}"
        assert n_a >= 2 * n_b, f"{device}: A held {n_a} times, B {n_b}, while both ran"
