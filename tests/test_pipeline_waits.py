"""How the stage runner's waits poll: back to back while each rank has a core, with
sleeping pauses beyond (pure logic: requests are stand-ins that complete after a
number of tests; the runner's real MPI waits are covered by its own tests)."""

import time

import pytest

from crossover.pipeline import waits


class _Request:
    def __init__(self, tests_until_done: int) -> None:
        self.left = tests_until_done

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        self.left -= 1
        return self.left <= 0


@pytest.mark.parametrize("local_ranks, cores, polls", [
    (1, 1, True), (2, 2, True), (2, 16, True), (3, 2, False), (8, 2, False),
    (0, 4, False),
])
def test_spin_budget_table(local_ranks, cores, polls):
    assert waits.spin_budget(local_ranks, cores) == (waits.SPIN_S if polls else 0.0)


def test_host_spin_budget_reads_the_launchers_local_size(monkeypatch):
    for name in ("HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(waits, "usable_cores", lambda: 4)
    assert waits.host_spin_budget(5) == 0.0  # no launcher: every rank counted as local
    assert waits.host_spin_budget(4) == waits.SPIN_S
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "64")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert waits.host_spin_budget(64) == 0.0  # 8 ranks here, 4 cores
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert waits.host_spin_budget(64) == waits.SPIN_S  # 64 in all, 4 of them here


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),
    ({}, None),
])
def test_a_containers_cpu_quota_caps_the_cores(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert waits._cgroup_quota(tmp_path) == quota


def test_a_polled_wait_never_sleeps(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    waits.wait_requests([_Request(500), _Request(3)], 5.0, "x", spin_s=1.0)
    assert slept == []


def test_without_a_budget_the_wait_sleeps_between_polls(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    waits.wait_requests([_Request(4)], 5.0, "x", spin_s=0.0)
    assert slept == pytest.approx([1e-5, 2e-5])  # after the 2nd and 3rd tests


def test_a_spent_budget_falls_back_to_pauses_and_still_times_out():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stage 1's input: not done in 0.05 s"):
        waits.wait_requests([_Request(10**9)], 0.05, "stage 1's input", spin_s=0.02)
    assert 0.05 <= time.monotonic() - t0 < 1.0
