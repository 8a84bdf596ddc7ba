"""How fine a difference a matrix of `crossover_bench.py` can resolve on the machine it ran on.

    .venv/bin/python bench/resolution.py [RESULT.json ...] [--target 0.99] [--name NAME]

A row compares medians of a few repetitions per arm, and the arms of one repetition run
minutes apart on a machine whose speed drifts. `auto_vs_best_fixed_mode` divides the
faster of two noisy medians (always antiphase, plain together) by auto's: even an auto
exactly as fast as the better mode reads below 1 on average, since the faster of two
noisy figures is biased low. This script estimates one run's noise from the result
file's own repetitions (the spread of each arm's runs around the arm's mean, in logs,
pooled over the arms) and simulates the row under that null: auto as fast as the better
fixed mode, the other mode as much slower as measured. Per row it writes what the ratio
then reads (median and 5th percentile), how often it reaches `--target`, and `p_null`:
how often it reads as low as measured or lower (small: auto did lose; large: what was
measured is the noise). Paired runs (`ab_bench.py`) resolve finer differences.

Writes bench/results/<name>.json (default resolution).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402
from jobs import makespan  # noqa: E402

#: The two modes auto chooses between, as arms that hold one fixed.
FIXED_MODES = ("crossover", "plain_together")


def run_times(row: dict) -> dict[str, list[float]]:
    """Each repetition's time per arm of a row: sequential (the solos' sum), and the
    makespans of plain together, always antiphase and auto."""
    raw = row["raw"]
    solos = [arm for arm in raw if arm.startswith("solo_") and arm != "solo_daemon"]
    times = {"sequential": [sum(r["seconds"] for r in rep)
                            for rep in zip(*(raw[a] for a in solos), strict=True)]}
    for arm in (*FIXED_MODES, "auto"):
        times[arm] = [makespan(run) for run in raw[arm]]
    return times


def pooled_noise(times: dict[str, list[float]]) -> float:
    """One run's relative noise: the standard deviation of the runs' log times around
    their arm's mean, pooled over the arms with two runs or more.

    Raises:
        ValueError: no arm has two runs, or a time is not positive.
    """
    squares, dof = 0.0, 0
    for arm, xs in times.items():
        if any(x <= 0 for x in xs):
            raise ValueError(f"arm {arm!r}: times must be > 0, got {xs}")
        if len(xs) < 2:
            continue
        logs = [math.log(x) for x in xs]
        mean = statistics.fmean(logs)
        squares += sum((v - mean) ** 2 for v in logs)
        dof += len(xs) - 1
    if dof == 0:
        raise ValueError(f"no arm has two runs to measure the noise from: {times}")
    return math.sqrt(squares / dof)


def null_ratios(reps: int, sigma: float, other_slower: float, trials: int = 20000,
                seed: int = 1) -> list[float]:
    """`auto_vs_best_fixed_mode` as `trials` rows of `reps` repetitions would read it
    if auto were exactly as fast as the better fixed mode and the other mode
    `other_slower` times its time (>= 1), each run off by a log-normal factor of
    `sigma`."""
    if reps < 1 or sigma < 0 or other_slower < 1:
        raise ValueError(f"need reps >= 1, sigma >= 0, other_slower >= 1; got {reps}, "
                         f"{sigma}, {other_slower}")
    rng = random.Random(seed)

    def median_of(mean: float) -> float:
        return statistics.median(mean * rng.lognormvariate(0, sigma) for _ in range(reps))

    return [min(median_of(1.0), median_of(other_slower)) / median_of(1.0)
            for _ in range(trials)]


def assess(row: dict, target: float) -> dict:
    """The noise of one row and what its `auto_vs_best_fixed_mode` can tell."""
    times = run_times(row)
    sigma = pooled_noise(times)
    med = {arm: statistics.median(xs) for arm, xs in times.items()}
    fixed = sorted(med[a] for a in FIXED_MODES)
    measured = fixed[0] / med["auto"]
    null = sorted(null_ratios(len(times["auto"]), sigma, fixed[1] / fixed[0]))
    return {"workload": row["workload"], "mbit": row["mbit"], "reps": len(times["auto"]),
            "run_noise": round(sigma, 4), "auto_vs_best_fixed_mode": round(measured, 3),
            "null_median": round(statistics.median(null), 3),
            "null_p5": round(null[len(null) // 20], 3),
            "null_reaches_target": round(sum(x >= target for x in null) / len(null), 3),
            "p_null": round(sum(x <= measured for x in null) / len(null), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path,
                        help="crossover_bench.py result files (default: crossover*.json)")
    parser.add_argument("--target", type=float, default=0.99,
                        help="the ratio auto should reach on every row (default 0.99)")
    parser.add_argument("--name", default="resolution")
    args = parser.parse_args()
    files = args.results or sorted(RESULTS.glob("crossover*.json"))
    rows = []
    for path in files:
        for row in json.loads(path.read_text()).get("rows", []):
            if "auto" not in row.get("raw", {}):
                continue
            rows.append({"file": path.name, **assess(row, args.target)})
            r = rows[-1]
            print(f"{r['file']:28s} {r['workload']:12s} {r['mbit'] or 'one host'!s:>9} "
                  f"noise {100 * r['run_noise']:4.1f} %  "
                  f"measured {r['auto_vs_best_fixed_mode']:.2f}"
                  f"  null median {r['null_median']:.2f} p5 {r['null_p5']:.2f}"
                  f"  reaches {args.target} {100 * r['null_reaches_target']:.0f} %"
                  f"  p_null {r['p_null']:.2f}", flush=True)
    if not rows:
        sys.exit(f"no rows with an auto arm in {', '.join(map(str, files)) or 'no files'}: "
                 f"give crossover_bench.py result files")
    every = math.prod(r["null_reaches_target"] for r in rows)
    print(f"a perfect auto reaches {args.target} on all {len(rows)} rows "
          f"{100 * every:.1f} % of the time")
    out = write_result(args.name, {"target": args.target, "rows": rows,
                                   "null_reaches_target_every_row": round(every, 4)})
    print(f"-> {out}")


if __name__ == "__main__":
    main()
