"""What the freezing criterion's trackers cost a training step, before anything freezes.

    .venv/bin/python -m bench.freeze.tracker_cost [--reps 9] [--steps 200]

In one process (one thread, as a pipeline rank runs): the digits example's MLP (four
hidden layers of 256) and a wider one (four of 1024), SGD steps at batch 50 (the
freezing benchmark's batch); each step is timed with and without
`GradientTracker.accumulate()` after its backward, in alternation, so drift hits both
alike. `share` = the median extra seconds of a step that reads its gradients / the
median step without the tracker. The trainer reads only some steps' gradients
(`reads_gradients`: every `--sample-every`-th step of a `--freeze-every`-step interval
and its last; by default the trainer's default for 128-step intervals, every 8th), and a
read costs the same on whichever step: `sampled_share` = `share` x reads per interval /
interval, an estimate that leaves out the once-an-interval read-back. (Timing whole
intervals with and without the sampled tracker instead was too noisy on a 2-core VM
to see 1%: sums of steps keep every outlier a median drops.)
The weight-drift tracker (`DriftTracker`) reads nothing per step; closing its interval
copies the weights and takes two norms per layer: `drift_share` = the median time of
that close / (`--drift-every` x the median step without a tracker).
Then the same in the graph pipeline (`--pairs`): examples/pipeline_digits.py on 2 ranks
for 5 epochs, with freezing judged every 128 steps at a threshold nothing meets (the
sampled tracker and the criterion's exchange, no freezing) against without, in
alternating pairs; `pipeline_share` = the median over pairs of the extra training time.
Written to bench/results/freeze/tracker_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.harness.common import REPO, area_results, write_result
from crossover.freeze import (
    DriftTracker,
    GradientTracker,
    default_sample_every,
    reads_gradients,
)
from crossover.launch.local import mpi_env, mpirun

RESULTS = area_results("freeze")

BATCH = 50
NEVER = ["--freeze-threshold", "1e-12"]  # tracked, never frozen (+ the interval flags)


def mlp(width: int, depth: int = 4) -> nn.Sequential:
    sizes = [64] + [width] * depth
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def measure(width: int, reps: int, steps: int, every: int, sample_every: int,
            drift_every: int) -> dict:
    torch.manual_seed(0)
    model = mlp(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    layers = {f"layer{i}": list(m.parameters())
              for i, m in enumerate(model) if isinstance(m, nn.Linear)}
    tracker, drift = GradientTracker(layers), DriftTracker(layers)
    x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))

    def step(track: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if track:
            tracker.accumulate()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(20):  # warm-up
        step(True)
    plain, tracked, closes = [], [], []
    for _ in range(reps):
        a, b = [], []
        for i in range(steps):
            (b if i % 2 else a).append(step(bool(i % 2)))
            if i % drift_every == drift_every - 1:  # the drift tracker's interval ends
                t0 = time.perf_counter()
                drift.changes()
                closes.append(time.perf_counter() - t0)
        tracker.changes()  # an interval ends now and then, as in training
        plain.append(statistics.median(a))
        tracked.append(statistics.median(b))
    base, with_tracker = statistics.median(plain), statistics.median(tracked)
    share = (with_tracker - base) / base
    reads = sum(reads_gradients(i, every, sample_every) for i in range(1, every + 1))
    close = statistics.median(closes)
    return {"width": width, "step_s": base, "step_with_tracker_s": with_tracker,
            "share": share,
            "share_per_rep": [(t - p) / p for p, t in zip(plain, tracked, strict=True)],
            "freeze_every": every, "sample_every": sample_every, "reads_per_interval": reads,
            "sampled_share": share * reads / every,
            # weight drift: nothing per step, one copy and two norms per layer an interval
            "drift_every": drift_every, "drift_interval_close_s": close,
            "drift_share": close / (drift_every * base)}


def pipeline_seconds(tmp: Path, tracked: bool, every: int, sample_every: int) -> float:
    """Training seconds of 5 epochs of the digits example (4 x 256) on 2 ranks."""
    history = tmp / "h.json"
    cmd = mpirun(2, sys.executable, str(REPO / "examples/pipeline_digits.py"), "--epochs",
                 "5", "--depth", "4", "--width", "256", "--lr", "0.05", "--plot",
                 str(tmp / "p.png"), "--history", str(history), "--profile",
                 str(tmp / "costs.pkl"),
                 *(NEVER + ["--freeze-every", str(every), "--freeze-sample-every",
                            str(sample_every)] if tracked else []))
    res = subprocess.run(cmd, env={**os.environ, **mpi_env(), "CROSSOVER_ENABLE": "0"},
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"digits example failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    last = json.loads(history.read_text())[-1]
    if last["frozen"]:  # the arm must measure the tracker alone
        raise RuntimeError(f"layers froze at threshold 1e-12: {last['frozen']}")
    return last["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=7, help="pipeline runs with and without")
    ap.add_argument("--freeze-every", type=int, default=128,
                    help="the freezing interval (steps) of the sampled figure and the pipeline arm")
    ap.add_argument("--drift-every", type=int, default=14,
                    help="the weight-drift tracker's interval (steps; default 14, as "
                         "bench/freeze/time_to_accuracy.py's finetune-glyphs workload judges)")
    ap.add_argument("--sample-every", type=int, default=None,
                    help="the trainer's freeze_sample_every (default: the trainer's "
                         "default for the interval)")
    args = ap.parse_args()
    if args.sample_every is None:
        args.sample_every = default_sample_every(args.freeze_every)
    reads_gradients(1, args.freeze_every, args.sample_every)  # named errors
    torch.set_num_threads(1)
    rows = []
    for width in (256, 1024):
        rows.append(measure(width, args.reps, args.steps, args.freeze_every,
                            args.sample_every, args.drift_every))
        print(f"width {width}: step {rows[-1]['step_s'] * 1e3:.3f} ms, a read "
              f"{rows[-1]['share'] * 100:+.2f}%, sampled "
              f"{rows[-1]['sampled_share'] * 100:+.2f}%, weight drift "
              f"{rows[-1]['drift_share'] * 100:+.2f}%", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="crossover-tracker-"))
    pairs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {tracked: pipeline_seconds(tmp, tracked, args.freeze_every, args.sample_every)
               for tracked in order}
        pairs.append((got[False], got[True]))
        print(f"pipeline pair {i + 1}/{args.pairs}: {got[False]:.2f} s without, "
              f"{got[True]:.2f} s with the tracker", flush=True)
    shares = [(t - p) / p for p, t in pairs]
    write_result(RESULTS, "tracker_cost", {
        "batch": BATCH, "stat": "median of reps of the median step", "rows": rows,
        "max_share": max(r["share"] for r in rows),
        "max_sampled_share": max(r["sampled_share"] for r in rows),
        "max_drift_share": max(r["drift_share"] for r in rows),
        "pipeline": {"pairs_s": pairs, "share_per_pair": shares},
        "pipeline_share": statistics.median(shares)})
    print(f"pipeline: tracker {statistics.median(shares) * 100:+.2f}% (median of "
          f"{len(shares)} pairs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
