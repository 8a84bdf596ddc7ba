"""Graph vs sequential pipeline: simulated (2, 4, 8 devices) and real (2, 4 ranks).

For each example model: profile the ops on this machine (one thread), plan with the graph
partitioner and the sequential baseline under the same costs and memory limit, simulate
both (`gpp_vs_spp` = graph throughput / sequential throughput), time both searches
(`search_speedup` = sequential time / graph time), then run one-device-per-stage plans
for real under mpirun and compare with the simulator's prediction. Finally, the graph
partitioner's search time on a synthetic 1000-op multi-branch graph.

    .venv/bin/python bench/pipeline_bench.py            # writes bench/results/pipeline.json
    .venv/bin/python bench/pipeline_bench.py --quick    # fewer repeats, no real runs
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
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from crossover.pipeline import (  # noqa: E402
    Graph,
    graph_partition,
    plan_for,
    profile,
    schedule_for,
    sequential_partition,
    simulate,
    synthetic,
)
from crossover.pipeline.models import MODELS, build  # noqa: E402
from crossover.pipeline.profile import Link  # noqa: E402

LINK = Link(bandwidth=2e9, latency=30e-6)
BATCH = 256
REAL_BATCH, REAL_MICRO = 64, 8


def model_costs(name: str, repeats: int):
    spec = build(name)
    g = Graph.from_fx(spec.module)
    costs = profile(g, lambda b: spec.make_batch(b, 0)[0], sizes=(8, 32), repeats=repeats,
                    link=LINK)
    state = sum(c.param_bytes for c in costs.ops.values()) * costs.param_factor
    # A device holds 60% of the model's parameter state: pure data parallelism does not
    # fit, so both partitioners must pipeline (the regime both papers address).
    costs.memory = 0.6 * state + 4 * 1024 * 1024
    return g, costs, state


def simulated(g, costs, devices: int) -> dict:
    row = {}
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
    return row


def real(name: str, g, costs, ranks: int, iters: int) -> dict:
    row = {}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONWARNINGS="ignore")
    for kind in ("graph", "sequential"):
        plan = plan_for(g, ranks, REAL_BATCH, REAL_MICRO, kind, costs)
        pred = simulate(g, costs, plan, schedule_for(plan))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "t.json"
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks),
                   sys.executable, "-m", "crossover.pipeline.runner", "--model", name,
                   "--dtype", "float32", "--batch", str(REAL_BATCH), "--micro",
                   str(REAL_MICRO), "--partitioner", kind, "--iters", str(iters + 1),
                   "--plan", json.dumps([list(s.ops) for s in plan.stages]),
                   "--out", str(out)]
            subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=300,
                           capture_output=True)
            res = json.loads(out.read_text())
        measured = statistics.median(res["times"][1:])  # the first iteration warms up
        row[kind] = {"plan": plan.describe(), "measured_s": measured,
                     "predicted_s": pred.iteration_s,
                     "prediction_error": abs(pred.iteration_s - measured) / measured}
    row["gpp_vs_spp"] = row["sequential"]["measured_s"] / row["graph"]["measured_s"]
    row["gpp_vs_spp_predicted"] = (row["sequential"]["predicted_s"]
                                   / row["graph"]["predicted_s"])
    return row


def big_graph(ops: int = 1000, seed: int = 0):
    """A multi-branch graph of `ops` ops: blocks of 3-4 parallel chains joined in series."""
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
    return g, synthetic(g, per, fixed=2e-5, act_per_sample=4096.0, link=LINK)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench/results/pipeline.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats, iters = (3, 3) if args.quick else (7, 5)
    result = {
        "command": "bench/pipeline_bench.py" + (" --quick" if args.quick else ""),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "settings": {"batch": BATCH, "link": {"bandwidth": LINK.bandwidth,
                                              "latency": LINK.latency},
                     "memory": "0.6 x model parameter state (x4 copies) + 4 MiB",
                     "real": {"batch": REAL_BATCH, "micro_batches": REAL_MICRO,
                              "iterations": iters, "stat": "median"}},
        "models": {},
    }
    for name in MODELS:
        g, costs, state = model_costs(name, repeats)
        entry = {"ops": len(g), "param_state_bytes": state, "memory_limit": costs.memory,
                 "simulated": {str(d): simulated(g, costs, d) for d in (2, 4, 8)}}
        if not args.quick:
            entry["real"] = {str(r): real(name, g, costs, r, iters) for r in (2, 4)}
        result["models"][name] = entry
        print(name, {d: round(v["gpp_vs_spp"], 3) for d, v in entry["simulated"].items()},
              flush=True)
    g, costs = big_graph()
    times = []
    for _ in range(3 if args.quick else 5):
        t0 = time.perf_counter()
        plan = graph_partition(g, costs, 8, BATCH, micro_batches=[8, 32])
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sequential_partition(g, costs, 8, BATCH, micro_batches=[8, 32])
    seq_s = time.perf_counter() - t0
    result["search_1000_ops"] = {"ops": len(g), "devices": 8, "graph_s_median":
                                 statistics.median(times), "graph_s_all": times,
                                 "sequential_s": seq_s, "notes": plan.notes[:3],
                                 "search_speedup": seq_s / statistics.median(times)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["search_1000_ops"], indent=1))


if __name__ == "__main__":
    main()
