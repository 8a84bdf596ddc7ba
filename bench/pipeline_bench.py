"""Graph vs sequential pipeline: simulated (2, 4, 8 devices) and real (2, 4 ranks), and
torch.distributed.pipelining as a peer on the chain.

For each example model: profile the ops on this machine (one thread; the element-wise
median of several independent profiles, so one preempted timing on a shared machine does
not decide the plans), plan with the graph partitioner and the sequential baseline under
the same costs and memory limit, simulate both (`gpp_vs_spp` = graph throughput /
sequential throughput; the ratio under each single profile is kept too, as the noise
band), time both searches (`search_speedup` = sequential time / graph time), then run
one-device-per-stage plans for real under mpirun and compare with the simulator's
prediction. On the chain, 2 ranks, the same run also times our runner (GPipe and 1F1B)
against torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the same stages
(bench/torch_pipelining_peer.py, which checks its gradients first). The multi-branch models
are simulated again with every width multiplied (`--sim-scale`), to see whether the
ratio is an artefact of small models. Finally, the graph partitioner's search time on a
synthetic 1000-op multi-branch graph.

    .venv/bin/python bench/pipeline_bench.py            # writes bench/results/pipeline.json
    .venv/bin/python bench/pipeline_bench.py --quick    # fewer repeats, no real runs

Real runs are planned and predicted with the runner's costs on this machine
(`crossover.pipeline.calibrate`, cached; `--recalibrate` measures them again), and each
real row reports, per action kind, the measured against the simulated seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch_pipelining_peer as peer  # noqa: E402

from crossover.launch import local  # noqa: E402
from crossover.pipeline import (  # noqa: E402
    Costs,
    Graph,
    calibrate,
    graph_partition,
    plan_for,
    profile,
    schedule_for,
    sequential_partition,
    simulate,
    synthetic,
)
from crossover.pipeline.models import (  # noqa: E402
    DLRM,
    MODELS,
    CandleUno,
    TwoTowerTransformer,
    build,
)
from crossover.pipeline.plan import Plan  # noqa: E402
from crossover.pipeline.profile import Link, Runtime  # noqa: E402
from crossover.pipeline.simulate import SimResult  # noqa: E402

LINK = Link(bandwidth=2e9, latency=30e-6)
BATCH = 256
# Fit `fixed + per_sample * b` at the two ends of the candidate micro-batch range (4..128):
# the plans mostly pick 64-128, and a slope measured at 8 and 32 extrapolated to 128
# swung gpp_vs_spp by +-0.2 between runs.
PROFILE_SIZES = (8, 128)
REAL_BATCH, REAL_MICRO = 64, 8
PEER_WARMUP, PEER_ITERS = 2, 20
# A real run's first iterations pay its start-up (allocator, caches, lazy init): with one
# warm-up and five timed iterations the chain measured 30-40% above the same run's
# steady state. So each plan warms up for 10 iterations, then both plans of a row run in
# 8 alternating blocks of 4 (32 timed iterations each) in one launch.
REAL_WARMUP, REAL_BLOCKS, REAL_BLOCK_ITERS = 10, 8, 4
TIMED = ("fwd", "fwd_per_sample", "bwd", "bwd_per_sample")


def median_costs(runs: list[Costs]) -> Costs:
    """Element-wise median of independent profiles' times (sizes are deterministic)."""
    first = runs[0]
    ops = {n: replace(c, **{f: statistics.median(getattr(r.ops[n], f) for r in runs)
                            for f in TIMED}) for n, c in first.ops.items()}
    return replace(first, ops=ops)


def with_memory(costs: Costs) -> float:
    """Set the device memory limit; returns the model's parameter state in bytes."""
    state = sum(c.param_bytes for c in costs.ops.values()) * costs.param_factor
    # A device holds 60% of the model's parameter state (+4 MiB for activations): neither
    # one device nor (for Uno) pure data parallelism fits, so both partitioners pipeline.
    costs.memory = 0.6 * state + 4 * 1024 * 1024
    return state


def model_costs(module: torch.nn.Module, make_inputs: Callable[[int], dict], repeats: int,
                profiles: int) -> tuple[Graph, Costs, list[Costs], float]:
    """Graph, median costs, the single profiles (each with the memory limit), state bytes."""
    g = Graph.from_fx(module)
    runs = [profile(g, make_inputs, sizes=PROFILE_SIZES, repeats=repeats, link=LINK)
            for _ in range(profiles)]
    for c in runs:
        with_memory(c)
    costs = median_costs(runs)
    return g, costs, runs, with_memory(costs)


def simulated(g: Graph, costs: Costs, devices: int, runs: list[Costs] | None = None) -> dict:
    """Both partitioners on the identical graph and costs; `runs`: also the ratio under
    each single profile (how much the answer moves with measurement noise)."""
    row: dict[str, Any] = {}
    for kind, fn in (("graph", graph_partition), ("sequential", sequential_partition)):
        plan = fn(g, costs, devices, BATCH)
        sim = simulate(g, costs, plan, schedule_for(plan))
        row[kind] = {"plan": plan.describe(), "search_s": plan.search_s,
                     "iteration_s": sim.iteration_s, "samples_per_s": sim.samples_per_s,
                     "bubble": sim.bubble, "peak_memory": max(sim.peak_memory),
                     "stages": len(plan.stages), "micro_batch": plan.micro_batch,
                     "notes": plan.notes}
    row["gpp_vs_spp"] = row["graph"]["samples_per_s"] / row["sequential"]["samples_per_s"]
    row["search_speedup"] = row["sequential"]["search_s"] / row["graph"]["search_s"]
    if runs:
        row["gpp_vs_spp_per_profile"] = [simulated(g, c, devices)["gpp_vs_spp"] for c in runs]
    return row


def wider_space(g: Graph, costs: Costs, devices: int = 8) -> dict:
    """The graph search with and without stages that cut inside branches, each
    simulated against the sequential plan (`gpp_vs_spp`) on the same costs."""
    seq = sequential_partition(g, costs, devices, BATCH)
    seq_s = simulate(g, costs, seq, schedule_for(seq)).iteration_s
    row: dict[str, Any] = {"devices": devices, "sequential_iteration_s": seq_s}
    for key, wider in (("with", True), ("without", False)):
        plan = graph_partition(g, costs, devices, BATCH, wider=wider)
        sim = simulate(g, costs, plan, schedule_for(plan)).iteration_s
        row[key] = {"plan": plan.describe(), "iteration_s": sim, "gpp_vs_spp": seq_s / sim,
                    "search_s": plan.search_s}
    row["with_over_without"] = row["without"]["iteration_s"] / row["with"]["iteration_s"]
    return row


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
    """Both plans in one launch (`bench/pipeline_pairs.py`), in alternating blocks of
    iterations starting with `first`: per plan, the timed iterations' seconds and, per
    stage, the median seconds per iteration in each action kind."""
    order = [first, *[k for k in plans if k != first]]
    spec = {k: {"kind": plans[k].kind, "stages": [list(s.ops) for s in plans[k].stages]}
            for k in order}
    got = launch(plans[first].devices,
                 [str(REPO / "bench/pipeline_pairs.py"), "--model", name, "--batch",
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


def scaled_model(name: str, scale: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    """A multi-branch example model with every width (and DLRM's vocabulary) x `scale`;
    the same structure as `models.build(name)`, which is scale 1."""
    torch.manual_seed(0)
    if name == "two_tower":
        m = TwoTowerTransformer(d=64 * scale, ff=128 * scale)
    elif name == "dlrm":
        m = DLRM(vocab=1000 * scale, d=32 * scale, bottom=256 * scale, top=256 * scale)
    elif name == "uno":
        m = CandleUno(tuple(d * scale for d in (128, 256, 256)), 256 * scale, 3, 256 * scale, 2)
    else:
        raise KeyError(f"no scaled variant of {name!r}")

    def make_inputs(b: int) -> dict:
        gen = torch.Generator().manual_seed(0)
        if name == "two_tower":
            return {"tokens": torch.randint(0, m.embed.num_embeddings, (b, 16), generator=gen),
                    "patches": torch.randn(b, 16, m.patch.in_features, generator=gen)}
        if name == "dlrm":
            return {"dense": torch.randn(b, m.bottom[0].in_features, generator=gen),
                    "sparse": torch.randint(0, m.embs[0][0].num_embeddings, (b, m.tables),
                                            generator=gen)}
        return {k: torch.randn(b, t[0].in_features, generator=gen)
                for k, t in zip(("cell", "drug1", "drug2"), m.towers, strict=True)}

    return m, make_inputs


def big_graph(ops: int = 1000, seed: int = 0, memory_share: float | None = None):
    """A multi-branch graph of `ops` ops: blocks of 3-4 parallel chains joined in series.
    With `memory_share`, ops hold parameters (none, 100 kB or 1 MB each) and a device
    holds that share of the model's parameter state, so plans must pipeline."""
    rng = random.Random(seed)
    nodes, prev, i = [], "x", 0
    while i < ops - 60:
        outs = []
        for _br in range(rng.choice([3, 4])):
            p = prev
            for _ in range(rng.randint(15, 40)):
                name = f"op{i}"
                nodes.append((name, lambda *xs: xs[0], [p]))
                p, i = name, i + 1
            outs.append(p)
        name = f"join{i}"
        nodes.append((name, lambda *xs: xs[0], outs))
        prev, i = name, i + 1
    g = Graph.from_modules(["x"], nodes)
    per = {n: rng.uniform(1e-5, 1e-4) for n in g.ops}
    if memory_share is None:
        return g, synthetic(g, per, fixed=2e-5, act_per_sample=4096.0, link=LINK)
    params = {n: rng.choice([0.0, 1e5, 1e6]) for n in g.ops}
    costs = synthetic(g, per, fixed=2e-5, act_per_sample=4096.0, param_bytes=params,
                      link=LINK)
    costs.memory = memory_share * costs.param_factor * sum(params.values())
    return g, costs


def search_times(g: Graph, costs: Costs, reps: int, devices: int = 8) -> dict:
    """Both searches on one graph at `devices` devices (micro-batches of 8 and 32): wall
    times (medians of `reps`), the plans' estimates and simulated iterations."""
    rows: dict[str, list] = {"graph": [], "sequential": []}
    plans = {}
    for _ in range(reps):
        for kind, fn in (("graph", graph_partition), ("sequential", sequential_partition)):
            t0 = time.perf_counter()
            plans[kind] = fn(g, costs, devices, BATCH, micro_batches=[8, 32])
            rows[kind].append(time.perf_counter() - t0)
    graph_s, seq_s = statistics.median(rows["graph"]), statistics.median(rows["sequential"])
    sims = {kind: simulate(g, costs, p, schedule_for(p)).iteration_s
            for kind, p in plans.items()}
    return {"ops": len(g), "devices": devices, "micro_batches": [8, 32],
            "graph_simulated_s": sims["graph"], "sequential_simulated_s": sims["sequential"],
            "graph_s_median": graph_s, "graph_s_all": rows["graph"],
            "sequential_s_median": seq_s, "sequential_s_all": rows["sequential"],
            "search_speedup": seq_s / graph_s,
            "graph_estimate_s": plans["graph"].estimate,
            "sequential_estimate_s": plans["sequential"].estimate,
            "gpp_vs_spp_estimate": plans["sequential"].estimate / plans["graph"].estimate,
            "graph_plan": [[len(s.ops), s.replicas] for s in plans["graph"].stages],
            "notes": plans["graph"].notes[:3]}


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


def write(out: str, result: dict) -> None:
    result["machine"]["load_average_at_end"] = os.getloadavg()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sim-scale", default="4",
                    help="comma-separated width multipliers for the extra simulated "
                         "comparison of the multi-branch models ('' to skip)")
    ap.add_argument("--peer-reps", type=int, default=5,
                    help="repetitions of the torch.distributed.pipelining comparison")
    ap.add_argument("--out", default=str(REPO / "bench/results/pipeline.json"))
    ap.add_argument("--pairs", type=int, default=5,
                    help="launches per real row, each timing both partitioners' plans in "
                         "alternating blocks")
    ap.add_argument("--calibration", default=str(Path.home() / ".cache/crossover/"
                                                 "pipeline-runtime.json"),
                    help="where the runner's calibrated costs are cached")
    ap.add_argument("--recalibrate", action="store_true",
                    help="measure the runner's costs again even if cached")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated example models to run")
    ap.add_argument("--real-ranks", default="2,4",
                    help="comma-separated rank counts of the real rows (one rank per stage)")
    ap.add_argument("--real-only", action="store_true",
                    help="only profiles, plans and real rows: no scaled simulation, search "
                         "timing or torch pipelining peer (for a short run on a bigger "
                         "machine)")
    args = ap.parse_args()
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; use some of {sorted(MODELS)}")
    try:
        real_ranks = [int(r) for r in args.real_ranks.split(",") if r]
    except ValueError:
        real_ranks = []
    if any(r < 2 for r in real_ranks) or (args.real_ranks and not real_ranks):
        ap.error(f"--real-ranks {args.real_ranks!r}: give rank counts of 2 or more, "
                 f"comma-separated, e.g. 2,4")
    torch.set_num_threads(1)
    repeats, profiles = (3, 1) if args.quick else (7, 3)
    cal = calibration(Path(args.calibration), args.recalibrate)
    runtime, transport = Runtime(**cal["runtime"]), Link(**cal["link"])
    scales = [] if args.real_only else [int(s) for s in args.sim_scale.split(",") if s]
    result: dict[str, Any] = {
        "command": " ".join(["bench/pipeline_bench.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_average_at_start": os.getloadavg()},
        "settings": {"batch": BATCH, "link": {"bandwidth": LINK.bandwidth,
                                              "latency": LINK.latency},
                     "memory": "0.6 x model parameter state (x4 copies) + 4 MiB",
                     "profile": {"sizes": PROFILE_SIZES, "repeats": repeats,
                                 "profiles": profiles,
                                 "costs": "element-wise median of the profiles"},
                     "real": {"batch": REAL_BATCH, "micro_batches": REAL_MICRO,
                              "warm_up_iterations": REAL_WARMUP,
                              "blocks": REAL_BLOCKS, "iterations_per_block": REAL_BLOCK_ITERS,
                              "pairing": "both plans in one launch, alternating blocks",
                              "stat": "median"}},
        "models": {},
        "calibration": cal,
    }
    failures = []
    for name in args.models.split(","):
        spec = build(name)
        g, costs, runs, state = model_costs(spec.module, lambda b, s=spec: s.make_batch(b, 0)[0],
                                            repeats, profiles)
        # simulated devices each have their own core: the runner's costs, no stretch
        per_device = replace(runtime, cores=0)
        costs = replace(costs, runtime=per_device)
        runs = [replace(c, runtime=per_device) for c in runs]
        entry: dict[str, Any] = {
            "ops": len(g), "param_state_bytes": state, "memory_limit": costs.memory,
            "simulated": {str(d): simulated(g, costs, d, runs if profiles > 1 else None)
                          for d in (2, 4, 8)}}
        if name in ("uno", "dlrm"):
            entry["wider_space"] = wider_space(g, costs)
            print(name, "8 devices, with and without cuts inside branches",
                  {k: round(entry["wider_space"][k]["gpp_vs_spp"], 3)
                   for k in ("with", "without")}, flush=True)
        if not args.quick:
            # real runs are planned and predicted with what this machine's runner and
            # transport pay (4 ranks on fewer cores: the stretch is modelled)
            local = replace(costs, link=transport, runtime=runtime)
            entry["real"] = {}
            for r in real_ranks:
                entry["real"][str(r)] = real(name, g, local, r, args.pairs)
                print(name, r, "ranks", {k: round(v["prediction_error"], 3)
                                         for k, v in entry["real"][str(r)].items()
                                         if isinstance(v, dict)},
                      "gpp_vs_spp", round(entry["real"][str(r)]["gpp_vs_spp"], 3), flush=True)
                # written as it goes: a run cut short keeps its finished rows
                result["models"][name] = entry
                result.update(real_summary(result["models"], real_ranks))
                write(args.out, result)
            if name == "chain" and not args.real_only:
                try:
                    result["torch_pipelining_peer"] = peer_comparison(g, costs, args.peer_reps)
                except (peer.PeerError, RuntimeError) as exc:
                    # recorded and reported; the rest of the benchmark still runs
                    result["torch_pipelining_peer"] = {"error": str(exc)[-3000:]}
                    failures.append(f"torch pipelining peer: {exc}")
                    print(f"PEER FAILED: {exc}", file=sys.stderr, flush=True)
        result["models"][name] = entry
        print(name, {d: round(v["gpp_vs_spp"], 3) for d, v in entry["simulated"].items()},
              flush=True)
    if scales:
        result["simulated_scaled"] = {}
    for scale in scales:
        for name in ("two_tower", "dlrm", "uno"):
            module, make_inputs = scaled_model(name, scale)
            g, costs, runs, state = model_costs(module, make_inputs, repeats, profiles)
            sims = {}
            for d in (2, 4, 8):
                try:
                    sims[str(d)] = simulated(g, costs, d, runs if profiles > 1 else None)
                except ValueError as exc:  # PartitionError: nothing fits on so few devices
                    sims[str(d)] = {"error": str(exc)}
            result["simulated_scaled"][f"{name}_x{scale}"] = {
                "scale": scale, "ops": len(g), "param_state_bytes": state,
                "memory_limit": costs.memory, "simulated": sims}
            print(f"{name} x{scale}", {d: round(v["gpp_vs_spp"], 3) for d, v in sims.items()
                                       if "gpp_vs_spp" in v}, flush=True)
    models = result["models"]
    result["gpp_vs_spp_8_dev"] = {n: m["simulated"]["8"]["gpp_vs_spp"] for n, m in models.items()}
    result["wider_space_8_dev"] = {
        n: {k: m["wider_space"][k]["gpp_vs_spp"] for k in ("with", "without")}
        for n, m in models.items() if "wider_space" in m}
    if not args.quick:
        result.update(real_summary(models, real_ranks))
    if args.real_only:
        write(args.out, result)
        return
    result["search_1000_ops"] = {}
    for variant, memory_share in (("unbounded memory", None), ("memory-bound", 0.3)):
        g, costs = big_graph(memory_share=memory_share)
        row = search_times(g, costs, 3 if args.quick else 5)
        result["search_1000_ops"][variant] = row
        print("search", variant, {k: row[k] for k in ("graph_s_median", "sequential_s_median",
                                                      "gpp_vs_spp_estimate")}, flush=True)
    result["search_s_1000_ops"] = result["search_1000_ops"]["unbounded memory"]["graph_s_median"]
    result["search_1000_ops_32_dev"] = {}
    for variant, memory_share in (("unbounded memory", None), ("memory-bound", 0.3)):
        g, costs = big_graph(memory_share=memory_share)
        row = search_times(g, costs, 3, devices=32)
        result["search_1000_ops_32_dev"][variant] = row
        print("search 32 devices", variant, {k: row[k] for k in (
            "graph_s_median", "sequential_s_median", "gpp_vs_spp_estimate")}, flush=True)
    # the slowest of both searches on both variants: what a user at 32 devices waits
    result["search_s_1000_ops_32_dev"] = max(
        r[k] for r in result["search_1000_ops_32_dev"].values()
        for k in ("graph_s_median", "sequential_s_median"))
    write(args.out, result)
    if "torch_pipelining_peer" in result and "error" not in result["torch_pipelining_peer"]:
        print("torch_pipelining_peer", json.dumps(
            {k: v for k, v in result["torch_pipelining_peer"].items()
             if k in ("gpipe", "1f1b", "ours_gpipe", "ours_1f1b", "best", "ours_vs_peer",
                      "ours_vs_peer_paired_median")}))
    if failures:
        sys.exit("FAILED: " + "; ".join(f[:300] for f in failures))


if __name__ == "__main__":
    main()
