"""The torch.distributed.pipelining peer of the pipeline benchmark: it runs on 2 ranks,
its gradients match one process's, and a wrong gradient makes it fail (no numbers)."""

from __future__ import annotations

import pytest

from bench.pipeline import torch_peer as peer

pytestmark = pytest.mark.mpi

# the small chain (4 Linear+ReLU layers, head) cut in the middle, as our 2-stage plan does
PLAN = [["x", "body_0", "body_1", "body_2", "body_3"],
        ["body_4", "body_5", "body_6", "body_7", "head"]]
ARGS = ("--small", "--dtype", "float64", "--batch", "8", "--micro", "4",
        "--warmup", "1", "--iters", "1")


@pytest.mark.timeout(180)
def test_peer_runs_and_matches_one_process() -> None:
    res = peer.launch(PLAN, *ARGS, timeout=80)
    for kind in peer.SCHEDULES:
        check = res["check"][kind]
        assert check["passed"], check
        assert check["params_checked"] == 10 and not check["missing"]
        assert check["max_grad_rel_err"] < 1e-9 and check["loss_rel_err"] < 1e-9
        assert res[kind]["samples_per_s"] > 0 and len(res[kind]["times"]) == 1
    assert res["settings"]["stages"] == PLAN


@pytest.mark.timeout(180)
def test_peer_with_wrong_gradients_fails() -> None:
    with pytest.raises(peer.PeerError, match="check FAILED"):
        peer.launch(PLAN, *ARGS, "--fault", timeout=80)
