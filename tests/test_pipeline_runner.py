"""The MPI stage runner: a pipelined step's gradients equal one process's (float64)."""

from __future__ import annotations

import pickle
import subprocess

import numpy as np
import pytest
import torch

from crossover.pipeline.models import build
from tests.conftest import PY, REPO, Proc, mpirun

pytestmark = pytest.mark.mpi


def reference(name: str, batch: int) -> tuple[dict[str, np.ndarray], float]:
    spec = build(name, torch.float64, small=True)
    feeds, target = spec.make_batch(batch, 1)
    loss = spec.loss(spec.module(**feeds), target)
    loss.backward()
    return {k: p.grad.numpy() for k, p in spec.module.named_parameters()}, float(loss.detach())


def run_pipeline(tmp_path, env, name, np_, *extra, batch=8, micro=4, timeout=120):
    out = tmp_path / f"{name}.pkl"
    cmd = mpirun(np_, PY, "-m", "crossover.pipeline.runner", "--model", name, "--small",
                 "--dtype", "float64", "--batch", str(batch), "--micro", str(micro),
                 "--out", str(out), "--timeout", "30", *extra)
    Proc(cmd, env, tmp_path / f"{name}.log").wait(timeout)
    with open(out, "rb") as f:
        return pickle.load(f)


def assert_same_grads(got, name, batch=8):
    ref, loss = reference(name, batch)
    assert set(got["grads"]) == set(ref)
    for k, r in ref.items():
        err = np.abs(got["grads"][k] - r).max() / max(np.abs(r).max(), 1e-300)
        assert err < 1e-6, f"{k}: relative error {err}"
    assert got["loss"] == pytest.approx(loss, rel=1e-9)


@pytest.mark.parametrize("name, np_, partitioner, schedule, stages", [
    ("chain", 2, "graph", "1f1b", None),
    ("two_tower", 3, "graph", "1f1b", ["tokens", "patches", "cat"]),
    ("uno", 4, "graph", "1f1b", ["cell", "drug1", "drug2", "cat"]),
    ("uno", 4, "sequential", "gpipe", None),
])
def test_pipelined_gradients_equal_single_process(tmp_path, cluster, name, np_, partitioner,
                                                  schedule, stages):
    env = dict(cluster.env, CROSSOVER_ENABLE="0")
    got = run_pipeline(tmp_path, env, name, np_, "--partitioner", partitioner,
                       "--schedule", schedule)
    assert len(got["plan"]) == np_
    if stages is not None:  # the branches really ran on different ranks
        assert sorted(p[0] for p in got["plan"]) == sorted(stages)
    assert_same_grads(got, name)


def test_pipeline_stages_take_slots_from_the_daemon(tmp_path, cluster):
    with cluster.daemon():
        env = dict(cluster.env, CROSSOVER_JOB="pipe")
        got = run_pipeline(tmp_path, env, "two_tower", 3, "--slots")
    log = (tmp_path / "two_tower.log").read_text()
    assert "uncoordinated" not in log, log[-2000:]
    assert_same_grads(got, "two_tower")


def test_a_missing_peer_times_out_with_a_message():
    code = (
        "from mpi4py import MPI\n"
        "import numpy as np\n"
        "from crossover.pipeline.runner import _wait\n"
        "req = MPI.COMM_SELF.Irecv(np.empty(3), source=0, tag=5)\n"
        "try:\n"
        "    _wait(req, 0.5, 'stage 1 waited for x')\n"
        "except TimeoutError as e:\n"
        "    print('TIMEOUT', e)\n"
        "    req.Cancel()\n"
    )
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert "TIMEOUT stage 1 waited for x: is that rank alive" in out.stdout, out.stderr
