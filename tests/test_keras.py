"""The tf_keras hooks under mpirun: a Keras fit() job, a Keras custom-loop job (tape) and
a PyTorch job (2 ranks each) share one daemon; each is compared with itself trained
alone (CROSSOVER_ENABLE=0). Plus the Keras 3 refusal.

TensorFlow processes are slow to start: the solo runs are shared (module fixture) and
run side by side, and the three jobs share one daemon run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from crossover import trace
from tests.conftest import PY, REPO, Cluster, Proc, assert_ran_together, mpirun, same_weights

pytestmark = pytest.mark.mpi

STEPS = 20
STRAGGLE_MS = 100  # rank 1 of the fit() job sleeps this long at every batch end
KERAS = str(REPO / "examples/keras_mlp.py")


def keras_job(c: Cluster, name: str, seed: int, crossover: bool = True,
              extra: tuple[str, ...] = ()) -> Proc:
    # KEEP_WHEN_ALONE=0: the in-step releases show in the trace even while a job is alone
    env = dict(c.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(c.traces),
               CROSSOVER_KEEP_WHEN_ALONE="0",
               TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    if not crossover:
        env["CROSSOVER_ENABLE"] = "0"
    out = c.tmp / f"{name}.npz"
    proc = Proc(mpirun(2, PY, KERAS, "--seed", str(seed), "--steps", str(STEPS),
                       "--out", str(out), *extra), env, c.tmp / f"{name}.log")
    proc.weights = out
    c.procs.append(proc)
    return proc


def keras_weights_equal(a: Path, b: Path) -> bool:
    wa, wb = np.load(a), np.load(b)
    return wa.files == wb.files and all(np.array_equal(wa[k], wb[k]) for k in wa.files)


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict[str, Path]:
    """Each job's final weights trained alone, without crossover (run side by side)."""
    c = Cluster(tmp_path_factory.mktemp("solo"))
    try:
        jobs = {"K": keras_job(c, "K", 1, crossover=False),
                "G": keras_job(c, "G", 3, crossover=False, extra=("--tape",)),
                "T": c.job("T", 2, 5 * STEPS, crossover=False)}
        for job in jobs.values():
            job.wait(240)
    finally:
        c.cleanup()
    return {name: job.weights for name, job in jobs.items()}


def spans(c: Cluster, job: str, rank: int, name: str) -> list[tuple[float, float]]:
    """(start_us, end_us) of one rank's spans called `name`, in time order."""
    events = trace.load(c.traces / f"{job}.rank{rank}.json")
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("ph") == "X" and e["name"] == name)


def test_keras_jobs_release_during_the_allreduce_and_keep_their_math(cluster: Cluster, solo):
    with cluster.daemon():
        together = cluster.start_args(3)
        fit = keras_job(cluster, "K", 1, extra=("--straggle-ms", str(STRAGGLE_MS), *together))
        tape = keras_job(cluster, "G", 3, extra=("--tape", *together))
        torch_job = cluster.job("T", 2, 5 * STEPS, extra=together)
        for job in (fit, tape, torch_job):
            job.wait(240)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    holds = trace.holds_by_device(events)
    assert len(holds) == 2, f"expected two CPU devices, got {list(holds)}"
    for device, device_spans in holds.items():
        assert {s[2] for s in device_spans} == {"K", "G", "T"}, device

    # One release per step and rank, made inside the compiled step (fit) or the tape;
    # step 0 traces the step and computes without the slot, so it has nothing to release.
    for job in ("K", "G"):
        for rank in (0, 1):
            assert len(spans(cluster, job, rank, "communicate")) == STEPS - 1, (job, rank)

    # Causal order: rank 0's allreduce of batch k needs rank 1's gradients of batch k,
    # which rank 1 computes only after its straggle sleep at the end of batch k-1. A
    # release on rank 0 before that sleep ends came while the allreduce was running.
    # Released only at batch boundaries (after the allreduce), no batch would pass.
    released = [None] + [start for start, _ in spans(cluster, "K", 0, "communicate")]
    straggle_end = [end for _, end in spans(cluster, "K", 1, "straggle")]
    assert len(straggle_end) == STEPS
    early = [k for k in range(1, STEPS) if released[k] < straggle_end[k - 1]]
    assert len(early) >= (STEPS - 1) // 2, (
        f"rank 0 released before rank 1 could have computed in only batches {early} "
        f"of 1..{STEPS - 1}")

    assert same_weights(torch_job.weights, solo["T"])
    assert keras_weights_equal(fit.weights, solo["K"]), "fit(): weights differ from solo"
    assert keras_weights_equal(tape.weights, solo["G"]), "tape: weights differ from solo"


def _run_alone(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_keras3_is_refused_with_the_fix_in_the_message(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update(CROSSOVER_RUNTIME_DIR=str(tmp_path), CROSSOVER_JOB="k3", TF_CPP_MIN_LOG_LEVEL="2")
    # the example refuses before training: tf.keras is Keras 3
    res = _run_alone([PY, KERAS, "--steps", "2"], env)
    assert res.returncode != 0
    assert "KerasVersionError" in res.stderr and "Set TF_USE_LEGACY_KERAS=1" in res.stderr
    # with the flag, a Keras 3 optimizer (from `import keras`) is refused too
    script = ("import keras, horovod.tensorflow.keras as hvd, crossover.hooks.keras as ck\n"
              "hvd.init()\n"
              "ck.wrap(hvd.DistributedOptimizer(keras.optimizers.SGD()))\n")
    res = _run_alone([PY, "-c", script], dict(env, TF_USE_LEGACY_KERAS="1"))
    assert res.returncode != 0
    assert "KerasVersionError: SGD is a Keras 3 class" in res.stderr, res.stderr[-2000:]
    assert "not `import keras`" in res.stderr
