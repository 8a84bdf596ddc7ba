"""The job order is the job's own: every rank carries (its job's start, its name), and
every node's daemon serves jobs in that order with no word from any other node
(`crossover.scheduler.state.JobOrder`). Real daemons, real clients."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossover.client import CrossoverDuplicateError, RankInfo, SlotClient
from crossover.probe import daemon_status
from tests.conftest import Cluster


def rank(runtime: Path, job: str, start_ns: int, r: int = 0, size: int = 1) -> SlotClient:
    return SlotClient(job, RankInfo(r, size, r, size), runtime_dir=runtime, pin_cpu=False,
                      start_ns=start_ns)


def jobs_in_order(runtime: Path) -> list[str]:
    (snap,) = daemon_status(runtime).values()
    return list(snap["jobs"])  # sorted by their order (`SchedulerViews.snapshot`)


def test_two_nodes_that_never_meet_order_jobs_alike(tmp_path: Path):
    """Two daemons with no world between them (as two sides of a cut, or two leaders at
    once) see jobs A and B arrive in opposite orders: both serve B (started first)
    before A, and neither waited for anyone to say so."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = Cluster(tmp_path / "one"), Cluster(tmp_path / "two")
    with one.daemon(), two.daemon():
        on_one = [rank(one.runtime, "A", 2_000), rank(one.runtime, "B", 1_000)]
        on_two = [rank(two.runtime, "B", 1_000), rank(two.runtime, "A", 2_000)]
        try:
            assert all(c.coordinated for c in on_one + on_two)
            assert jobs_in_order(one.runtime) == jobs_in_order(two.runtime) == ["B", "A"]
        finally:
            for c in on_one + on_two:
                c.close()


def test_a_job_run_again_under_its_name_takes_its_new_place(cluster: Cluster):
    """A job's order ends with its ranks: run again under the same name, it is ordered
    by its new start (a leader's order that a node kept while away stayed for ever)."""
    with cluster.daemon():
        other = rank(cluster.runtime, "other", 5_000)
        first = rank(cluster.runtime, "again", 1_000)
        assert jobs_in_order(cluster.runtime) == ["again", "other"]
        first.close()
        second = rank(cluster.runtime, "again", 9_000)
        try:
            assert second.coordinated
            assert jobs_in_order(cluster.runtime) == ["other", "again"]
        finally:
            second.close()
            other.close()


def test_two_jobs_of_one_name_on_a_node_are_told_apart(cluster: Cluster):
    """Ranks of one name that started at different times are two jobs: the later is
    refused with both starts and the fix, and the first serves on."""
    with cluster.daemon():
        first = rank(cluster.runtime, "same", 1_000, r=0, size=2)
        try:
            with pytest.raises(CrossoverDuplicateError,
                               match=r"started at 2000 ns, its other ranks here at "
                                     r"\[1000\].*CROSSOVER_JOB"):
                rank(cluster.runtime, "same", 2_000, r=1, size=2)
            assert first.coordinated
        finally:
            first.close()
