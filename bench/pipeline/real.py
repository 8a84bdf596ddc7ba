"""The real runs of bench/pipeline/compare.py: plans launched under mpirun on this machine
and measured against the simulator's prediction.

Each real row runs both partitioners' plans (one rank per stage) in one launch of
bench/pipeline/pairs.py, in alternating blocks, and reports, per action kind, the measured
against the simulated seconds. The runner's own costs come from
`crossover.pipeline.calibrate` (cached). On the chain, 2 ranks, our runner is also timed
against torch.distributed.pipelining on the same stages (bench/pipeline/torch_peer.py).

Imported by compare.py, not run itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.harness.common import REPO
from bench.pipeline import torch_peer as peer
from crossover.launch import local
from crossover.pipeline import Costs, Graph, calibrate, plan_for, schedule_for, simulate
from crossover.pipeline.plan import Plan
from crossover.pipeline.simulate import SimResult

REAL_BATCH, REAL_MICRO = 64, 8
PEER_WARMUP, PEER_ITERS = 2, 20
# A real run's first iterations pay its start-up (allocator, caches, lazy init): with one
# warm-up and five timed iterations the chain measured 30-40% above the same run's
# steady state. So each plan warms up for 10 iterations, then both plans of a row run in
# 8 alternating blocks of 4 (32 timed iterations each) in one launch.
REAL_WARMUP, REAL_BLOCKS, REAL_BLOCK_ITERS = 10, 8, 4


def mpi_env() -> dict[str, str]:
    return {**os.environ, **local.mpi_env(), "PYTHONWARNINGS": "ignore"}


def launch(ranks: int, args: list[str], what: str, timeout: float) -> Any:
    """`mpirun -np ranks python ARGS --out FILE` here: the JSON rank 0 wrote.

    Raises:
        RuntimeError: non-zero exit or timeout (naming `what`), with the output's tail.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = local.mpirun(ranks, sys.executable, *args, "--out", str(out))
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), timeout=timeout,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{what}: timed out after {timeout} s") from exc
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{what}: exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(out.read_text())


def run_ours(name: str, stages: list[list[str]], kind: str, schedule: str, iters: int,
             warmup: int, timeout: float = 300.0) -> list[float]:
    """Our runner under mpirun (one rank per stage): the timed iterations' seconds."""
    got = launch(len(stages), ["-m", "crossover.pipeline", "--model", name, "--dtype",
                               "float32", "--batch", str(REAL_BATCH), "--micro",
                               str(REAL_MICRO), "--partitioner", kind, "--schedule", schedule,
                               "--iters", str(warmup + iters), "--plan", json.dumps(stages)],
                 f"{name} {kind} {schedule} runner", timeout)
    return got["times"][warmup:]


def calibration(path: Path, fresh: bool) -> dict:
    """The runner's costs on this machine (`crossover.pipeline.calibrate` on 2 ranks),
    cached in `path` and measured again when missing, `fresh`, or measured elsewhere."""
    why = "asked" if fresh else "none cached" if not path.exists() else \
        calibrate.stale(json.loads(path.read_text()))
    if why:
        print(f"pipeline bench: calibrating the runner ({why}) into {path}", flush=True)
        cmd = local.mpirun(2, sys.executable, "-m", "crossover.pipeline.calibrate", "--out",
                           str(path))
        subprocess.run(cmd, cwd=REPO, env=mpi_env(), timeout=300, check=True,
                       capture_output=True)
    return json.loads(path.read_text())


def kind_errors(measured: dict[int, dict[str, float]], simulated: dict[int, dict[str, float]]
                ) -> dict[str, dict[str, float]]:
    """Per action kind, seconds per iteration summed over stages, measured against
    simulated: where a miss comes from (receive kinds are waits)."""
    out = {}
    for kind in ("F", "B", "SF", "SB", "RF", "RB"):
        m = sum(row.get(kind, 0.0) for row in measured.values())
        s = sum(row.get(kind, 0.0) for row in simulated.values())
        if m or s:
            out[kind] = {"measured_s": m, "simulated_s": s,
                         "error": (s - m) / m if m else None}
    return out


def run_pair(name: str, plans: dict[str, Plan], first: str, timeout: float = 600.0
             ) -> dict[str, dict]:
    """Both plans in one launch (`bench/pipeline/pairs.py`), in alternating blocks of
    iterations starting with `first`: per plan, the timed iterations' seconds and, per
    stage, the median seconds per iteration in each action kind."""
    order = [first, *[k for k in plans if k != first]]
    spec = {k: {"kind": plans[k].kind, "stages": [list(s.ops) for s in plans[k].stages]}
            for k in order}
    got = launch(plans[first].devices,
                 ["-m", "bench.pipeline.pairs", "--model", name, "--batch",
                  str(REAL_BATCH), "--micro", str(REAL_MICRO), "--warmup", str(REAL_WARMUP),
                  "--blocks", str(REAL_BLOCKS), "--block-iters", str(REAL_BLOCK_ITERS),
                  "--plans", json.dumps(spec)], f"{name} {order} pair", timeout)
    return {k: {"times": v["times"], "spent": per_stage_spent(v["spent"], v["stage_of_rank"])}
            for k, v in got["plans"].items()}


def per_stage_spent(spent: list[list[dict[str, float]]], stage_of_rank: list[int]
                    ) -> dict[int, dict[str, float]]:
    """Per stage, the median over iterations of the seconds in each action kind."""
    return {stage: {k: statistics.median(it.get(k, 0.0) for it in its)
                    for k in sorted({k for it in its for k in it})}
            for its, stage in zip(spent, stage_of_rank, strict=True)}


def with_measured_compute(costs: Costs, plan: Plan, spent: dict[int, dict[str, float]],
                          sim: SimResult) -> Costs:
    """`costs` with each stage's op times scaled so that the simulated forward and
    backward seconds of every stage (`sim`, simulated under `costs`) equal the measured
    ones (`spent`: per stage, seconds per iteration in each action kind). The runner's
    own cost per action is kept as calibrated."""
    fixed = REAL_MICRO * costs.runtime.stretch(plan.devices) * costs.runtime.action_s
    simulated = sim.per_kind()
    ops = dict(costs.ops)
    for s, stage in enumerate(plan.stages):
        for kind, fields in (("F", ("fwd", "fwd_per_sample")), ("B", ("bwd", "bwd_per_sample"))):
            was, now = simulated.get(s, {}).get(kind, 0.0), spent.get(s, {}).get(kind, 0.0)
            if was <= fixed or now <= 0:
                continue  # nothing of the ops' own to scale
            factor = max(now - fixed, 0.0) / (was - fixed)
            for op in stage.ops:
                if op in ops:
                    ops[op] = replace(ops[op], **{f: getattr(ops[op], f) * factor
                                                  for f in fields})
    return replace(costs, ops=ops)


def real(name: str, g: Graph, costs: Costs, ranks: int, pairs: int) -> dict:
    """Both partitioners' plans run for real: `pairs` launches, each timing both plans
    in alternating blocks (so that both meet the same machine), alternating which plan
    goes first; the simulator's prediction beside the medians."""
    plans = {kind: plan_for(g, ranks, REAL_BATCH, REAL_MICRO, kind, costs)
             for kind in ("graph", "sequential")}
    preds = {kind: simulate(g, costs, p, schedule_for(p)) for kind, p in plans.items()}
    runs = [run_pair(name, plans, "graph" if rep % 2 == 0 else "sequential")
            for rep in range(pairs)]
    row: dict[str, Any] = {}
    for kind, plan in plans.items():
        per_run = [statistics.median(r[kind]["times"]) for r in runs]
        measured = statistics.median(per_run)
        first = runs[0][kind]["spent"]
        spent = {st: {k: statistics.median(r[kind]["spent"][st].get(k, 0.0) for r in runs)
                      for k in first[st]} for st in first}
        # the same simulation with each stage's compute as the runs measured it: what
        # is left is the model of the runtime (actions, messages, waits, schedule)
        given = simulate(g, with_measured_compute(costs, plan, spent, preds[kind]), plan,
                         schedule_for(plan)).iteration_s
        row[kind] = {"plan": plan.describe(), "measured_s": measured, "per_run_s": per_run,
                     "predicted_s": preds[kind].iteration_s,
                     "prediction_error": abs(preds[kind].iteration_s - measured) / measured,
                     "predicted_given_compute_s": given,
                     "error_given_compute": abs(given - measured) / measured,
                     "by_kind": kind_errors(spent, preds[kind].per_kind())}
    ratios = [s / gr for s, gr in zip(row["sequential"]["per_run_s"], row["graph"]["per_run_s"],
                                      strict=True)]
    row["gpp_vs_spp"] = statistics.median(ratios)
    row["gpp_vs_spp_per_pair"] = ratios
    row["gpp_vs_spp_predicted"] = (row["sequential"]["predicted_s"]
                                   / row["graph"]["predicted_s"])
    return row


def peer_comparison(g: Graph, costs: Costs, reps: int) -> dict:
    """Our runner vs torch.distributed.pipelining on the chain, 2 ranks, same stages.

    Both get the graph partitioner's 2-stage plan (op lists), batch, micro-batches, dtype,
    data, one thread per rank and the same warm-up/timed iteration counts; each
    repetition runs the four configurations back to back, in a rotated order so that load
    drifting on this shared machine does not always hit the same one. samples/s per
    repetition = batch / median timed iteration; reported: the median over repetitions.
    """
    plan = plan_for(g, 2, REAL_BATCH, REAL_MICRO, "graph", costs)
    stages = [list(s.ops) for s in plan.stages]
    per: dict[str, list[float]] = {"ours_gpipe": [], "ours_1f1b": [], "gpipe": [], "1f1b": []}
    checks = []

    def ours(schedule: str) -> None:
        times = run_ours("chain", stages, "graph", schedule, PEER_ITERS, PEER_WARMUP)
        per[f"ours_{schedule}"].append(REAL_BATCH / statistics.median(times))

    def torch_peer() -> None:
        res = peer.launch(stages, "--model", "chain", "--dtype", "float32", "--batch",
                          str(REAL_BATCH), "--micro", str(REAL_MICRO), "--warmup",
                          str(PEER_WARMUP), "--iters", str(PEER_ITERS), timeout=300)
        checks.append(res["check"])
        for kind in peer.SCHEDULES:
            per[kind].append(res[kind]["samples_per_s"])

    runs = [lambda: ours("gpipe"), lambda: ours("1f1b"), torch_peer]
    for rep in range(reps):
        for fn in runs[rep % 3:] + runs[:rep % 3]:
            fn()
    out: dict[str, Any] = {k: statistics.median(v) for k, v in per.items()}
    out["per_repetition"] = per
    # Other work on this machine swings a run's speed several-fold; the best repetition
    # (least disturbed) and the ratio within each repetition (back-to-back runs share the
    # load) are steadier than the ratio of medians, so all three are kept.
    out["best"] = {k: max(v) for k, v in per.items()}
    out["ours_vs_peer"] = {s: out[f"ours_{s}"] / out[s] for s in peer.SCHEDULES}
    out["ours_vs_peer_paired_median"] = {
        s: statistics.median(a / b for a, b in zip(per[f"ours_{s}"], per[s], strict=True))
        for s in peer.SCHEDULES}
    out["peer_check"] = checks[0]
    out["peer_checks_passed"] = all(c[k]["passed"] for c in checks for k in peer.SCHEDULES)
    out["settings"] = {
        "model": "chain", "ranks": 2, "stages": stages, "plan": plan.describe(),
        "batch": REAL_BATCH, "micro_batches": REAL_MICRO, "dtype": "float32",
        "warmup": PEER_WARMUP, "iters": PEER_ITERS, "repetitions": reps, "threads": 1,
        "ours": "crossover.pipeline.runner (mpi4py Isend/Irecv)",
        "peer": "torch.distributed.pipelining PipelineStage (manual split at the same "
                "op boundary) + ScheduleGPipe/Schedule1F1B, gloo backend, "
                f"torch {torch.__version__}",
        "stat": "samples/s = batch / median timed iteration; median (and best) over "
                "repetitions"}
    return out


def real_summary(models: dict[str, dict], real_ranks: list[int]) -> dict[str, float]:
    """Per rank count, over the models whose real row at that count has finished: the
    largest simulation errors and the least measured graph-over-sequential ratio (so a
    run cut short keeps the figures of what it finished)."""
    out: dict[str, float] = {}
    for r in real_ranks:
        rows = [m["real"][str(r)] for m in models.values() if str(r) in m.get("real", {})]
        if not rows:
            continue
        out[f"max_sim_error_{r}_ranks"] = max(row[k]["prediction_error"] for row in rows
                                              for k in ("graph", "sequential"))
        out[f"max_sim_error_given_compute_{r}_ranks"] = max(
            row[k]["error_given_compute"] for row in rows for k in ("graph", "sequential"))
        out[f"min_real_gpp_vs_spp_{r}_ranks"] = min(row["gpp_vs_spp"] for row in rows)
    if "min_real_gpp_vs_spp_2_ranks" in out:
        out["min_real_gpp_vs_spp"] = out["min_real_gpp_vs_spp_2_ranks"]
    return out
