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
(bench/pipeline/torch_peer.py, which checks its gradients first). The multi-branch models
are simulated again with every width multiplied (`--sim-scale`), to see whether the
ratio is an artefact of small models. Finally, the graph partitioner's search time on a
synthetic 1000-op multi-branch graph.

    .venv/bin/python -m bench.pipeline.compare          # bench/results/pipeline/pipeline.json
    .venv/bin/python -m bench.pipeline.compare --quick  # fewer repeats, no real runs

Real runs are planned and predicted with the runner's costs on this machine
(`crossover.pipeline.calibrate`, cached; `--recalibrate` measures them again), and each
real row reports, per action kind, the measured against the simulated seconds.

The simulated rows are made in bench/pipeline/simulated.py, the real runs and the torch
pipelining peer in bench/pipeline/real.py; this module is the command: it reads the
flags, runs the parts in turn and writes the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.harness.common import area_results, code_version, command_line, machine
from bench.pipeline import torch_peer as peer
from bench.pipeline.real import (
    REAL_BATCH,
    REAL_BLOCK_ITERS,
    REAL_BLOCKS,
    REAL_MICRO,
    REAL_WARMUP,
    calibration,
    peer_comparison,
    real,
    real_summary,
)
from bench.pipeline.simulated import (
    BATCH,
    LINK,
    PROFILE_SIZES,
    model_entry,
    scaled_rows,
    search_rows,
)
from crossover.pipeline import Costs, Graph
from crossover.pipeline.models import MODELS
from crossover.pipeline.profile import Link, Runtime


def parse_args() -> tuple[argparse.Namespace, list[int]]:
    """The command line, and the rank counts of the real rows (exits on a bad one)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sim-scale", default="4",
                    help="comma-separated width multipliers for the extra simulated "
                         "comparison of the multi-branch models ('' to skip)")
    ap.add_argument("--peer-reps", type=int, default=5,
                    help="repetitions of the torch.distributed.pipelining comparison")
    ap.add_argument("--out", default=str(area_results("pipeline") / "pipeline.json"))
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
    return args, real_ranks


def header(repeats: int, profiles: int, cal: dict) -> dict[str, Any]:
    """The result before any row: command, machine, settings and the runner's costs."""
    return {
        "command": command_line(), "code": code_version(),
        "machine": {**machine(), "load_average_at_start": os.getloadavg()},
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


def real_rows(name: str, g: Graph, costs: Costs, entry: dict[str, Any], result: dict,
              real_ranks: list[int], pairs: int, out: str) -> None:
    """`entry["real"]`: a real row per rank count, each written to `out` as it finishes
    (so a run cut short keeps its finished rows)."""
    entry["real"] = {}
    for r in real_ranks:
        entry["real"][str(r)] = real(name, g, costs, r, pairs)
        print(name, r, "ranks", {k: round(v["prediction_error"], 3)
                                 for k, v in entry["real"][str(r)].items()
                                 if isinstance(v, dict)},
              "gpp_vs_spp", round(entry["real"][str(r)]["gpp_vs_spp"], 3), flush=True)
        result["models"][name] = entry
        result.update(real_summary(result["models"], real_ranks))
        write(out, result)


def peer_row(g: Graph, costs: Costs, reps: int, failures: list[str]) -> dict:
    """The torch pipelining comparison, or its error (also added to `failures`): a
    failed peer is recorded and reported, and the rest of the benchmark still runs."""
    try:
        return peer_comparison(g, costs, reps)
    except (peer.PeerError, RuntimeError) as exc:
        failures.append(f"torch pipelining peer: {exc}")
        print(f"PEER FAILED: {exc}", file=sys.stderr, flush=True)
        return {"error": str(exc)[-3000:]}


def write(out: str, result: dict) -> None:
    result["machine"]["load_average_at_end"] = os.getloadavg()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def main() -> None:
    args, real_ranks = parse_args()
    torch.set_num_threads(1)
    repeats, profiles = (3, 1) if args.quick else (7, 3)
    cal = calibration(Path(args.calibration), args.recalibrate)
    runtime, transport = Runtime(**cal["runtime"]), Link(**cal["link"])
    scales = [] if args.real_only else [int(s) for s in args.sim_scale.split(",") if s]
    result = header(repeats, profiles, cal)
    failures: list[str] = []
    for name in args.models.split(","):
        g, costs, entry = model_entry(name, runtime, repeats, profiles)
        if not args.quick:
            # real runs are planned and predicted with what this machine's runner and
            # transport pay (4 ranks on fewer cores: the stretch is modelled)
            here = replace(costs, link=transport, runtime=runtime)
            real_rows(name, g, here, entry, result, real_ranks, args.pairs, args.out)
            if name == "chain" and not args.real_only:
                result["torch_pipelining_peer"] = peer_row(g, costs, args.peer_reps, failures)
        result["models"][name] = entry
        print(name, {d: round(v["gpp_vs_spp"], 3) for d, v in entry["simulated"].items()},
              flush=True)
    if scales:
        result["simulated_scaled"] = scaled_rows(scales, repeats, profiles)
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
    result["search_1000_ops"] = search_rows(3 if args.quick else 5, 8, "search")
    result["search_s_1000_ops"] = result["search_1000_ops"]["unbounded memory"]["graph_s_median"]
    result["search_1000_ops_32_dev"] = search_rows(3, 32, "search 32 devices")
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
