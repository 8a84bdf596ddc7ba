"""bench/device_suite.sh: the dry run of every part here, and the runner's budget rules.

The dry run is the check that the suite will run on a GPU machine as prepared: every
part's commands and result files, toy sized on this CPU, into a temporary directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from bench.gpu import suite as device_suite
from bench.gpu.parts import Figure, Part, Plan, Run
from tests.conftest import PY, REPO


def committed_results_state() -> str:
    """What git sees changed under bench/results (a dry run must change nothing there)."""
    return subprocess.run(["git", "status", "--porcelain", "--", "bench/results"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_dry_run_runs_every_part_and_writes_its_records(tmp_path):
    before = committed_results_state()
    out, export = tmp_path / "results", tmp_path / "export"
    started = time.monotonic()
    res = subprocess.run(["bash", "bench/device_suite.sh", "--dry-run", "--out", str(out),
                          "--export", str(export)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHON": PY})
    wall = time.monotonic() - started
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    print(f"dry run: {wall:.0f} s")

    # the summary table: every part, its status
    table = res.stdout[res.stdout.rindex("device suite: none: a dry run"):]
    for name in ("ddp", "neighbour", "horovod", "manycore", "gpu_rows"):
        assert f"\n{name} " in table, table

    record = json.loads((out / "gpu/device_suite.json").read_text())
    assert record["dry_run"] is True and record["device"]["gpu"].startswith("none")
    assert record["code"] and "unknown" not in record["code"]
    assert record["command"].startswith("bash bench/device_suite.sh --dry-run")
    parts = record["parts"]
    assert list(parts) == ["ddp", "neighbour", "horovod", "manycore", "gpu_rows"]
    for name in ("ddp", "neighbour", "manycore"):
        part = parts[name]
        assert part["status"] == "ok", (name, part)
        assert part["files"], (name, part)
        # every key figure came out of the part's own result file
        assert all(v is not None for v in part["figures"].values()), (name, part["figures"])
        for name_ in part["files"]:
            path = out / name_
            doc = json.loads(path.read_text())
            assert doc["device"] == record["device"], path
            assert doc["code"] == record["code"], path
            assert doc["command"], path  # the bench's own command line
            assert doc["suite"]["commands"] == part["commands"], path
            assert doc["suite"]["dry_run"] is True
    assert "release check left out" in parts["ddp"]["notes"][0]
    # targets are named, and not judged on toy figures
    assert parts["neighbour"]["targets"]["neighbour_speedup_after_cut"] == {
        "want": ">= 1.3", "met": None}
    assert parts["manycore"]["targets"]["max_sim_error_2_ranks"] == {"want": "<= 0.1",
                                                                     "met": None}
    assert parts["manycore"]["files"] == [f"pipeline/pipeline_{os.cpu_count()}core.json"]
    assert parts["horovod"]["status"] == "skipped" and "--parts horovod" in \
        parts["horovod"]["reason"]
    assert parts["gpu_rows"]["status"] == "not built" and "makespan.py" in \
        parts["gpu_rows"]["reason"]

    with tarfile.open(export / "device_suite.tar.gz") as tar:
        names = tar.getnames()
    assert "bench/results/gpu/device_suite.json" in names
    assert "bench/results/gpu/freeze_neighbour.json" in names
    assert committed_results_state() == before, "the dry run wrote into bench/results"


def suite(tmp_path: Path, parts: list[Part], budget: float, named: bool = False
          ) -> device_suite.Suite:
    run = Run(dry=True, python=PY, results=tmp_path, cores=2)
    return device_suite.Suite(run, parts, budget, None, dict(os.environ), named=named)


def quick(name: str, code: str, budget: float, optional: bool = False,
          needs: tuple[str, ...] = ()) -> Part:
    """A part that runs `python -c code` and writes nothing."""
    return Part(name, name, budget, budget, optional=optional, needs=needs,
                plan=lambda run: Plan([[run.python, "-c", code]],
                                      {"x": Figure("none.json", "x", ("==", 1))}))


def test_an_optional_part_runs_only_if_the_later_required_parts_keep_their_budgets(
        tmp_path):
    s = suite(tmp_path, [quick("extra", "pass", 50, optional=True),
                         quick("last", "pass", 40)], budget=80, named=True)
    assert s.go() == 0
    parts = s.record["parts"]
    assert parts["extra"]["status"] == "skipped"
    assert "40 s after the later parts' budgets; it needs 50 s" in parts["extra"]["reason"]
    assert parts["last"]["status"] == "ok"
    assert parts["last"]["targets"]["x"] == {"want": "== 1", "met": None}  # no file


def test_a_whole_dry_run_leaves_optional_parts_to_be_named(tmp_path):
    s = suite(tmp_path, [quick("extra", "pass", 10, optional=True)], budget=100)
    assert s.go() == 0
    assert "--dry-run --parts extra" in s.record["parts"]["extra"]["reason"]


def test_a_part_past_its_budget_is_stopped_and_recorded_before_the_next(tmp_path):
    budget = device_suite.GRACE_S + 2  # SIGINT after 2 s
    s = suite(tmp_path, [quick("slow", "import time; time.sleep(60)", budget),
                         quick("next", "pass", 40)], budget=100)
    started = time.monotonic()
    assert s.go() == 1
    assert time.monotonic() - started < 30
    parts = json.loads((tmp_path / "gpu/device_suite.json").read_text())["parts"]
    assert parts["slow"]["status"] == "timeout" and "ran past" in parts["slow"]["reason"]
    assert parts["next"]["status"] == "ok"


def test_a_part_whose_precondition_is_missing_is_skipped_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(device_suite, "check", lambda name, run, env: (False, "not here"))
    s = suite(tmp_path, [quick("needy", "pass", 40, needs=("mpi",))], budget=100)
    assert s.go() == 0
    assert s.record["preconditions"]["mpi"] == {"met": False, "detail": "not here"}
    assert s.record["parts"]["needy"]["status"] == "skipped"
    assert "missing: mpi" in s.record["parts"]["needy"]["reason"]


def test_targets_are_judged_on_numbers_only():
    assert device_suite.met(1.4, (">=", 1.3)) is True
    assert device_suite.met(0.12, ("<=", 0.10)) is False
    assert device_suite.met(0, ("==", 0)) is True
    assert device_suite.met(None, ("==", 0)) is None
    assert device_suite.met(True, ("==", 1)) is None


@pytest.mark.parametrize("args, says", [
    (["--parts", "ddp,gpu"], "unknown ['gpu']; choose from ddp, neighbour"),
    (["--dry-run", "--out", "bench/results"], "would write toy figures over the committed"),
    (["--dry-run", "--budget", "0"], "give the run's seconds"),
])
def test_bad_arguments_say_what_to_give(args, says):
    res = subprocess.run(["bash", "bench/device_suite.sh", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": PY})
    assert res.returncode == 2 and says in res.stderr, res.stderr
