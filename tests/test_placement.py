"""Disjoint cores for CPU jobs that share one host (`crossover.placement`).

The split as tables and a property; then two real 2-rank jobs under an `auto` daemon on
this host: each job's ranks are pinned to a share of the cores of their own, the shares
are disjoint and cover the host, and each job trains the same weights as alone.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness.jobs import ONE_HOST_ENV, one_host_launch, run_jobs
from crossover import trace
from crossover.launch.local import DaemonProcess
from crossover.placement import partition


@pytest.mark.parametrize("cores,jobs,expected", [
    ([0, 1], [("A", 2), ("B", 2)], {"A": [0], "B": [1]}),
    ([0, 1], [("A", 2)], {}),  # alone: where the launcher put it
    ([0, 1], [("A", 1), ("B", 1), ("C", 1)], {}),  # fewer cores than jobs: no split
    (list(range(8)), [("A", 2), ("B", 2)], {"A": [0, 1, 2, 3], "B": [4, 5, 6, 7]}),
    # 6 spare cores in proportion 3:1 is 4.5 and 1.5; the tie goes to the first job
    (list(range(8)), [("A", 3), ("B", 1)], {"A": [0, 1, 2, 3, 4, 5], "B": [6, 7]}),
    ([0, 1, 2, 3], [("A", 1), ("B", 1), ("C", 1)], {"A": [0, 1], "B": [2], "C": [3]}),
    ([4, 6], [("B", 2), ("A", 2)], {"B": [4], "A": [6]}),  # the given order and cores
])
def test_partition(cores, jobs, expected):
    assert partition(cores, jobs) == expected


def test_partition_refuses_a_job_without_ranks():
    with pytest.raises(ValueError, match=r"at least one rank.*\('B', 0\)"):
        partition([0, 1], [("A", 1), ("B", 0)])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(1, 16), min_size=2, max_size=10))
def test_shares_are_disjoint_cover_the_host_and_none_is_empty(n_cores, ranks):
    cores = list(range(100, 100 + n_cores))
    jobs = [(f"j{i}", r) for i, r in enumerate(ranks)]
    shares = partition(cores, jobs)
    if n_cores < len(jobs):
        assert shares == {}
        return
    assert list(shares) == [j for j, _ in jobs]
    assert all(shares.values())
    assert sorted(c for share in shares.values() for c in share) == cores
    # in proportion: one core each, and the spare cores within one of the job's
    # proportional part; a job with more ranks never has fewer cores than any other
    spare = n_cores - len(jobs)
    for job, r in jobs:
        assert abs(len(shares[job]) - 1 - spare * r / sum(ranks)) < 1, (job, r, shares)
    for a, ra in jobs:
        for b, rb in jobs:
            if ra > rb:
                assert len(shares[a]) >= len(shares[b]), (a, b, shares)


WORKLOAD = ["--model", "mlp", "--width", "256", "--layers", "2", "--batch", "128",
            "--deterministic"]
STEPS = [300, 600]  # about 2-3 s alone for jA; jB trains on alone once jA is done


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
@pytest.mark.timeout(300)
def test_two_cpu_jobs_on_one_host_get_cores_of_their_own_and_train_as_alone(tmp_path):
    plain = {"CROSSOVER_ENABLE": "0"}
    solo = [run_jobs(one_host_launch, [f"solo{x}"], WORKLOAD, STEPS[i], plain, tmp_path, 120,
                     job_env=ONE_HOST_ENV, first_seed=i + 1, reference=True)[0]
            for i, x in enumerate("AB")]
    traces = tmp_path / "traces"
    with DaemonProcess(tmp_path / "run", policy="auto", log=tmp_path / "daemon.log") as d:
        # Loops started together: the second job's start-up (2-3 s on 2 busy cores) once
        # outlasted the first one's loop on a fast day, and the jobs never shared the host.
        both = run_jobs(one_host_launch, ["jA", "jB"], WORKLOAD, STEPS,
                        {"CROSSOVER_RUNTIME_DIR": str(d.runtime_dir),
                         "CROSSOVER_TRACE": str(traces)}, tmp_path, 120, job_env=ONE_HOST_ENV,
                        start_together=True)
    assert [r["weights_sha256"] for r in both] == [r["weights_sha256"] for r in solo]
    events = trace.merge(sorted(traces.glob("*.json")), tmp_path / "merged.json")
    names = {ev["pid"]: ev["args"]["name"] for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "process_name"}
    host = sorted(os.sched_getaffinity(0))
    placed: dict[tuple[str, int], list[tuple[float, ...]]] = {}  # (job, rank) -> its shares
    for ev in sorted((e for e in events if e.get("ph") == "i"), key=lambda e: e["ts"]):
        if ev["name"].startswith("cores "):
            # the rank's own affinity, read back after pinning: its share, or the whole
            # host given back
            assert ev["args"]["applied"] == (ev["args"]["share"] or host), ev
            placed.setdefault((names[ev["pid"]], ev["tid"]), []).append(
                tuple(ev["args"]["share"]))
    shares = {job: {s for (j, _), seq in placed.items() if j == job for s in seq if s}
              for job in ("jA", "jB")}
    assert all(shares.values()), placed  # every job was given a share
    (a,), (b,) = shares["jA"], shares["jB"]  # one share each, the same on every rank
    assert not set(a) & set(b)
    assert sorted(a + b) == host
    # jB trained on after jA left: its ranks ran on the whole host again
    assert all(seq[-1] == () for (j, _), seq in placed.items() if j == "jB"), placed
    said = [ln.split("cores on node ", 1)[1] for ln in
            (tmp_path / "daemon.log").read_text().splitlines() if "cores on node " in ln]
    split = next(i for i, ln in enumerate(said) if "jA [" in ln)
    assert any("shared by all" in ln for ln in said[split + 1:]), said  # the last one left
