"""How fine a difference a matrix of `makespan.py` can resolve on the machine it ran on.

    .venv/bin/python -m bench.colocation.resolution RESULT.json [RESULT.json ...] [--target 0.99]
        [--name NAME]

A row compares medians of a few repetitions per arm, and the machine's speed drifts.
`auto_vs_best_fixed_mode` divides the faster of two noisy medians (always antiphase,
plain together) by auto's: even an auto exactly as fast as the better mode reads below 1
on average, since the faster of two noisy figures is biased low.

The noise model, fitted per row to the makespans of the arms that run the jobs together
(not sequential, a sum of solo runs that the ratio does not use): log time = arm +
repetition + residual. A repetition's effect is shared by its arms (they run minutes
apart, so a slow stretch of the machine slows them all) and largely cancels in a ratio;
the residual is each run's own. The script simulates each row with an auto exactly as
fast as the better fixed mode, the other mode as much slower as measured (`p_null`) or
as fast (`p_null_even`: the pessimistic null, since the measured gap between two noisy
medians overstates the true one). `p_null` is how often such an auto reads as low as
measured or lower: small, unlikely from a perfect auto (with several rows, one small
value is expected by chance); large, the row cannot tell. The noise figures come from a
few runs each (8 degrees of freedom for 3 repetitions of 5 arms) and are themselves
uncertain by about a quarter. Paired runs (`paired.py`) resolve finer differences.

Writes bench/results/<name>.json (default resolution). Without `--name` it will not
replace a resolution.json of other result files (README cites that one).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from bench.harness.common import area_results, write_result
from bench.harness.jobs import makespan

RESULTS = area_results("colocation")

#: The two modes auto chooses between, as arms that hold one fixed.
FIXED_MODES = ("crossover", "plain_together")
#: Arms that run the jobs together under the daemon or without it, when a row has them.
TOGETHER_ARMS = (*FIXED_MODES, "auto", "together", "aligned", "turns")


def run_times(row: dict) -> dict[str, list[float]]:
    """Each repetition's makespan per arm that ran the jobs together, in `TOGETHER_ARMS`
    order, for the arms the row has."""
    raw = row["raw"]
    return {arm: [makespan(run) for run in raw[arm]] for arm in TOGETHER_ARMS if arm in raw}


def noise(times: dict[str, list[float]]) -> tuple[float, float]:
    """(residual, repetition) standard deviations of the log times, from a two-way fit
    log t = arm + repetition + residual over arms with one run per repetition each.

    Raises:
        ValueError: the arms' run counts differ, there are fewer than two arms or two
            repetitions, or a time is not positive.
    """
    counts = {arm: len(xs) for arm, xs in times.items()}
    reps = next(iter(counts.values()), 0)
    if len(counts) < 2 or reps < 2 or set(counts.values()) != {reps}:
        raise ValueError(f"need two arms or more with the same number of runs, two or "
                         f"more each, got {counts}: run bench.colocation.makespan with --reps 2 "
                         f"or more")
    if any(x <= 0 for xs in times.values() for x in xs):
        raise ValueError(f"times must be > 0, got {times}")
    logs = [[math.log(x) for x in xs] for xs in times.values()]
    arms, grand = len(logs), statistics.fmean(v for row in logs for v in row)
    arm_mean = [statistics.fmean(row) for row in logs]
    rep_mean = [statistics.fmean(row[k] for row in logs) for k in range(reps)]
    resid = sum((logs[i][k] - arm_mean[i] - rep_mean[k] + grand) ** 2
                for i in range(arms) for k in range(reps))
    ms_resid = resid / ((arms - 1) * (reps - 1))
    ms_rep = arms * sum((m - grand) ** 2 for m in rep_mean) / (reps - 1)
    return math.sqrt(ms_resid), math.sqrt(max(ms_rep - ms_resid, 0.0) / arms)


def null_ratios(reps: int, residual: float, shared: float, other_slower: float,
                trials: int = 20000, seed: int = 1) -> list[float]:
    """`auto_vs_best_fixed_mode` as `trials` rows of `reps` repetitions would read it
    if auto were exactly as fast as the better fixed mode and the other mode
    `other_slower` times its time (>= 1): each run off by a log-normal factor of
    `residual`, and by one of `shared` for all the runs of its repetition."""
    if reps < 1 or residual < 0 or shared < 0 or other_slower < 1:
        raise ValueError(f"need reps >= 1, residual and shared >= 0, other_slower >= 1; "
                         f"got {reps}, {residual}, {shared}, {other_slower}")
    rng = random.Random(seed)
    out = []
    for _ in range(trials):
        slow = [rng.gauss(0, shared) for _ in range(reps)]

        def median_of(mean: float, slow: list[float] = slow) -> float:
            return statistics.median(mean * math.exp(s + rng.gauss(0, residual))
                                     for s in slow)

        best, other, auto = median_of(1.0), median_of(other_slower), median_of(1.0)
        out.append(min(best, other) / auto)
    return out


def _share_at_most(null: list[float], measured: float) -> float:
    """How often the null reads `measured` or lower, counting the measurement itself
    (never 0: the simulation cannot rule out what it never drew)."""
    return (sum(x <= measured for x in null) + 1) / (len(null) + 1)


def assess(row: dict, target: float) -> dict:
    """The noise of one row and what its `auto_vs_best_fixed_mode` can tell."""
    times = run_times(row)
    residual, shared = noise(times)
    med = {arm: statistics.median(xs) for arm, xs in times.items()}
    fixed = sorted(med[a] for a in FIXED_MODES)
    measured = fixed[0] / med["auto"]
    reps = len(times["auto"])
    null = sorted(null_ratios(reps, residual, shared, fixed[1] / fixed[0]))
    even = null_ratios(reps, residual, shared, 1.0)
    return {"workload": row["workload"], "mbit": row["mbit"], "reps": reps,
            "residual_noise": residual, "repetition_noise": shared,
            "auto_vs_best_fixed_mode": measured,
            "null_median": statistics.median(null), "null_p5": null[len(null) // 20],
            "null_reaches_target": sum(x >= target for x in null) / len(null),
            "p_null": _share_at_most(null, measured),
            "p_null_even": _share_at_most(even, measured)}


def rows_of(path: Path) -> list[dict]:
    """The rows of a result file that ran auto and both fixed modes.

    Raises:
        ValueError: the file cannot be read or is not a makespan result.
    """
    try:
        rows = json.loads(path.read_text())["rows"]
        return [row for row in rows
                if {"auto", *FIXED_MODES} <= set(row.get("raw", {}))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a readable result of bench/colocation/makespan.py "
                         f"({type(exc).__name__}: {exc}); give its bench/results/*.json"
                         ) from None


def replaces_other_files(out: Path, files: list[str]) -> str | None:
    """Why writing the resolution of `files` to `out` would replace that of other result
    files, with the fix; None if `out` is new, unreadable, or of the same files."""
    try:
        before = sorted({row["file"] for row in json.loads(out.read_text())["rows"]})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if before == sorted(set(files)):
        return None
    return (f"{out} holds the resolution of {', '.join(before)}; to keep it, give this "
            f"one a name of its own (--name resolution_<setting>), or replace it with "
            f"--name {out.stem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path,
                        help="makespan result files, of one code version")
    parser.add_argument("--target", type=float, default=0.99,
                        help="the ratio auto should reach on every row (default 0.99)")
    parser.add_argument("--name", default=None,
                        help="result name (default resolution, which it will not replace "
                             "with the resolution of other files)")
    args = parser.parse_args()
    if args.name is None:
        args.name = "resolution"
        refused = replaces_other_files(RESULTS / "resolution.json",
                                       [p.name for p in args.results])
        if refused:
            sys.exit(refused)
    rows = []
    try:
        for path in args.results:
            for row in rows_of(path):
                rows.append(r := {"file": path.name, **assess(row, args.target)})
                print(f"{r['file']:24s} {r['workload']:12s} {r['mbit'] or 'one host'!s:>9} "
                      f"noise {100 * r['residual_noise']:4.1f} % a run, "
                      f"{100 * r['repetition_noise']:4.1f} % a repetition; measured "
                      f"{r['auto_vs_best_fixed_mode']:.2f}, null median "
                      f"{r['null_median']:.2f} p5 {r['null_p5']:.2f}, reaches {args.target} "
                      f"{100 * r['null_reaches_target']:.0f} %, p_null {r['p_null']:.3f} "
                      f"({r['p_null_even']:.3f} modes even)", flush=True)
    except ValueError as exc:
        sys.exit(str(exc))
    if not rows:
        sys.exit(f"no rows with auto, always antiphase and plain together in "
                 f"{', '.join(map(str, args.results))}: give result files of "
                 f"bench/colocation/makespan.py")
    every = math.prod(r["null_reaches_target"] for r in rows)
    print(f"a perfect auto reaches {args.target} on all {len(rows)} rows "
          f"{100 * every:.1f} % of the time")
    out = write_result(RESULTS, args.name, {"target": args.target, "rows": rows,
                                   "null_reaches_target_every_row": every})
    print(f"-> {out}")


if __name__ == "__main__":
    main()
