"""Single-job overhead: one 2-rank Horovod PyTorch job under the daemon vs plain Horovod.

    .venv/bin/python bench/overhead_bench.py [--reps 5]

Runs alternate (plain, crossover, plain, ...) so drift on a shared machine hits both
alike; reports medians of samples/s and writes bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from crossover.launch.local import DaemonProcess, Job, mpirun, run_together  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def samples_per_s(job: Job) -> float:
    (res,) = run_together([job], timeout_s=300)
    if res.returncode != 0:
        raise RuntimeError(f"{job.name} failed:\n{res.output}")
    line = next(ln for ln in res.output.splitlines() if ln.startswith('{"samples_per_s"'))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    cmd = mpirun(2, sys.executable, str(REPO / "examples/torch_mlp.py"), "--steps",
                 str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers))
    plain, under = [], []
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(Path(tmp) / "run"):
        env = {"CROSSOVER_RUNTIME_DIR": str(Path(tmp) / "run"), "CROSSOVER_JOB": "solo"}
        for rep in range(args.reps):
            plain.append(samples_per_s(Job("plain", cmd, {**env, "CROSSOVER_ENABLE": "0"})))
            under.append(samples_per_s(Job("crossover", cmd, env)))
            print(f"rep {rep}: plain {plain[-1]:.0f}, crossover {under[-1]:.0f} samples/s",
                  flush=True)
    p, c = statistics.median(plain), statistics.median(under)
    out = write_result("overhead", {
        "workload": f"MLP 64-{args.hidden}x{args.layers}-10, batch 32/rank, 2 ranks, "
                    f"{args.steps} steps",
        "plain_samples_per_s": plain, "crossover_samples_per_s": under,
        "median_plain": p, "median_crossover": c,
        "single_job_overhead": 1 - c / p,
    })
    print(f"single-job overhead: {100 * (1 - c / p):.1f}% (median of {args.reps}) -> {out}")


if __name__ == "__main__":
    main()
