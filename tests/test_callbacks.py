"""The PyTorch loop callback and the Lightning callback under mpirun: a hand-marked loop
job (C) and a Lightning job (L), 2 ranks each, share one daemon; each is compared with
itself trained alone (CROSSOVER_ENABLE=0).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from crossover import trace
from tests.conftest import PY, REPO, Cluster, Proc, assert_ran_together, mpirun, same_weights

pytestmark = pytest.mark.mpi

STEPS = 60
SCRIPTS = {"C": "examples/torch_callback_mlp.py", "L": "examples/lightning_mlp.py"}
SEEDS = {"C": 1, "L": 2}


def job(c: Cluster, name: str, crossover: bool = True, extra: tuple[str, ...] = ()) -> Proc:
    # every release point shows in the trace even while the job is alone on a device
    env = dict(c.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(c.traces),
               CROSSOVER_KEEP_WHEN_ALONE="0")
    if not crossover:
        env["CROSSOVER_ENABLE"] = "0"
    out = c.tmp / f"{name}.pt"
    proc = Proc(mpirun(2, PY, str(REPO / SCRIPTS[name]), "--seed", str(SEEDS[name]),
                       "--steps", str(STEPS), "--out", str(out), *extra),
                env, c.tmp / f"{name}.log")
    proc.weights = out
    c.procs.append(proc)
    return proc


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict[str, Path]:
    """Each job's final weights trained alone, without crossover; plus the same model
    and data as C trained by examples/torch_mlp.py (the wrapped optimizer)."""
    c = Cluster(tmp_path_factory.mktemp("solo"))
    try:
        jobs = {name: job(c, name, crossover=False) for name in SCRIPTS}
        jobs["wrapped"] = c.job("wrapped", SEEDS["C"], STEPS, crossover=False)
        for proc in jobs.values():
            proc.wait(180)
    finally:
        c.cleanup()
    return {name: proc.weights for name, proc in jobs.items()}


def test_loop_and_lightning_callbacks_share_devices_and_keep_their_math(cluster: Cluster,
                                                                       solo):
    with cluster.daemon():
        together = cluster.start_args(2)
        loop, lightning = job(cluster, "C", extra=together), job(cluster, "L", extra=together)
        loop.wait(180)
        lightning.wait(180)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    holds = trace.holds_by_device(events)
    assert len(holds) == 2, f"expected two CPU devices, got {list(holds)}"
    for name in SCRIPTS:
        for rank in (0, 1):
            names = [e["name"] for e in trace.load(cluster.traces / f"{name}.rank{rank}.json")
                     if e.get("ph") == "X"]
            # released once per step while Horovod averages, then held again for the update
            assert names.count("communicate") == STEPS, (name, rank)
            assert names.count("hold") >= STEPS, (name, rank)
    assert same_weights(loop.weights, solo["C"])
    assert same_weights(lightning.weights, solo["L"])
    # the hand-marked loop does the same math as the wrapped optimizer
    assert same_weights(solo["C"], solo["wrapped"])
