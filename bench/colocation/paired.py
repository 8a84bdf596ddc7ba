"""Two arms of the crossover benchmark, paired: is one faster than the other, or is the
difference within the machine's drift?

    .venv/bin/python -m bench.colocation.paired --arms plain,auto --mbit 2000 --workload mlp
        [--pairs 8] [--steps 100] [--name NAME]

`makespan.py` runs five arms a repetition, so two arms of one repetition can run
minutes apart; on this project's VM the same arm took 46-51 s in the three repetitions
of one 300-step row (docs/benchmarks.md), more than most differences between the arms.
Here the two arms run back to back, in alternating order (A B, B A, A B, ...: a
steady drift biases the pairs in opposite directions), and each pair gives one ratio,
A's time over B's (above 1: B is faster). The verdict is a sign test over the pairs:
how likely as many pairs or more would favour one arm if the arms were equally fast.

Arms: `sequential` (each job alone, plain Horovod, one after the other: the sum of
their times), `plain` (the jobs at once, plain Horovod), and the daemon policies `off`
(hooks on, every request granted), `crossover` (always antiphase), `aligned` (always
antiphase, the hosts' phases aligned: `--align-phases`), `auto` (the default) and
`unshared` (auto, concurrent CPU jobs on one host left without core shares:
`--no-core-shares`). `--mbit 0` runs both jobs on this host; otherwise on the emulated
two-host cluster of `makespan.py`, with its jobs and environment (`bench/harness/jobs.py`).
Writes bench/results/ab_<name>.json (default name: the arms, workload and setting).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from bench.harness import jobs
from bench.harness.cluster import EmulatedCluster
from bench.harness.common import DecisionLog, area_results, arm_order, stop_all, write_result
from crossover.launch.local import DaemonProcess

RESULTS = area_results("colocation")

#: The arms that run under a daemon, and its policy (`aligned`: always antiphase with
#: the hosts' phases kept in step, `--align-phases`; emulated hosts only; `unshared`:
#: auto, concurrent CPU jobs on one host left where their launchers put them,
#: `--no-core-shares`).
POLICIES = {"off": "off", "crossover": "crossover", "auto": "auto",
            "aligned": "crossover --align-phases", "unshared": "auto --no-core-shares"}
ARMS = ("sequential", "plain", *POLICIES)


def sign_test(wins: int, n: int) -> float:
    """Two-sided exact sign test: the chance that a fair coin gives a split of `n`
    tosses at least as uneven as `wins` against `n - wins`.

    Raises:
        ValueError: `wins` is not between 0 and `n`.
    """
    if not 0 <= wins <= n:
        raise ValueError(f"sign test of {wins} wins in {n} pairs: need 0 <= wins <= n")
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, n - wins) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def summarize(arms: tuple[str, str], times: list[tuple[float, float]]) -> dict:
    """The verdict on paired times, one (A's seconds, B's seconds) per pair.

    Returns:
        each arm's median, the pairs' ratios (A over B), their median, how many pairs
        B won, and the sign test's p-value (ties count for neither arm).
    """
    a, b = arms
    ratios = [ta / tb for ta, tb in times]
    wins, losses = sum(r > 1 for r in ratios), sum(r < 1 for r in ratios)
    return {f"{a}_s": [ta for ta, _ in times], f"{b}_s": [tb for _, tb in times],
            f"{a}_median_s": statistics.median(ta for ta, _ in times),
            f"{b}_median_s": statistics.median(tb for _, tb in times),
            f"{a}_over_{b}": ratios, f"{a}_over_{b}_median": statistics.median(ratios),
            f"{b}_faster_pairs": wins, f"{a}_faster_pairs": losses,
            "sign_test_p": sign_test(wins, wins + losses)}


def runner(arm: str, launch: Callable[[list[str]], list[str]], runtime: Path | None,
           workload: str, steps: int, job_env: dict[str, str], logs: Path,
           start_together: bool = False) -> Callable[[str], float]:
    """A function that runs `arm` once (its jobs named with the given tag) and returns
    its time: the makespan of the jobs together, or the sum of their solo times.
    `start_together`: jobs launched together start their loops together (`jobs.run_jobs`)."""
    per_job = jobs.job_workloads(workload, 2)
    plain = {"CROSSOVER_ENABLE": "0"}

    def run(names: list[str], env: dict[str, str], first: int = 0) -> list[dict]:
        return jobs.run_jobs(launch, names, per_job[first], steps, env, logs, job_env=job_env,
                        first_seed=1 + first, workloads=per_job[first:first + len(names)],
                        start_together=start_together)

    def once(tag: str) -> float:
        if arm == "sequential":
            return sum(run([f"{tag}S{x}"], plain, i)[0]["seconds"] for i, x in enumerate("AB"))
        env = plain if runtime is None else {"CROSSOVER_RUNTIME_DIR": str(runtime)}
        return jobs.makespan(run([f"{tag}{arm[0].upper()}{x}" for x in "AB"], env))

    return once


def main() -> None:
    """Build the setting, run the pairs, write the verdict; always tear down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="plain,auto",
                        help=f"two of {', '.join(ARMS)}, comma-separated (A,B)")
    parser.add_argument("--mbit", type=float, default=2000.0,
                        help="link rate of the emulated hosts; 0: both jobs on this host")
    parser.add_argument("--workload", default="mlp", help="a workload, or a+b for a pair")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="steps per job")
    parser.add_argument("--name", default=None)
    parser.add_argument("--start-together", action="store_true",
                        help="jobs launched together start their training loops together, "
                             "after every rank has set up: makespans without start-up, like "
                             "the solo loops that sequential adds up")
    args = parser.parse_args()
    arms = tuple(args.arms.split(","))
    if len(arms) != 2 or arms[0] == arms[1] or not set(arms) <= set(ARMS):
        parser.error(f"--arms {args.arms!r}: give two different arms of {', '.join(ARMS)}, "
                     f"e.g. --arms plain,auto")
    if "aligned" in arms and not args.mbit:
        parser.error("--arms aligned aligns the hosts' phases: give --mbit (emulated hosts)")
    if "unshared" in arms and args.mbit:
        parser.error("--arms unshared differs from auto only where jobs share one host's "
                     "cores: give --mbit 0")
    unknown = set(args.workload.split("+")) - set(jobs.WORKLOADS)
    if unknown or args.workload.count("+") > 1:
        parser.error(f"--workload {args.workload!r}: one of {list(jobs.WORKLOADS)}, or two "
                     f"joined by +")
    if args.pairs < 1 or args.steps < 1 or args.mbit < 0:
        parser.error(f"--pairs {args.pairs}, --steps {args.steps}, --mbit {args.mbit:g}: "
                     f"need pairs and steps >= 1 and a rate >= 0")
    where = f"{args.mbit:g}mbit" if args.mbit else "onehost"
    name = args.name or (f"{arms[0]}_{arms[1]}_{args.workload.replace('+', '')}_{where}"
                         + ("_start_together" if args.start_together else ""))
    started = time.monotonic()
    times: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="crossover-ab-") as tmp_s, ExitStack() as stack:
        tmp = Path(tmp_s)
        daemons: list = []
        stack.callback(lambda: stop_all(daemons))
        if args.mbit:
            cluster = stack.enter_context(EmulatedCluster(mbit=args.mbit))
            measured = cluster.measure_mbit(nbytes=int(args.mbit * 1e6 / 8 * 0.5))
            print(f"link {args.mbit:g} Mbit/s (measured {measured:.0f})", flush=True)
            launch, job_env = jobs.cluster_launch(cluster), jobs.JOB_ENV
        else:
            launch, job_env = jobs.one_host_launch, jobs.ONE_HOST_ENV
        runs, logs = [], {}
        for arm in arms:
            runtime = None
            if arm in POLICIES:
                runtime = tmp / f"run-{arm}"
                log = tmp / f"daemon-{arm}.log"
                logs[arm] = DecisionLog(log)
                if arm == "aligned":
                    delays = DecisionLog(log, DecisionLog.DELAYS)
                policy, *options = POLICIES[arm].split()
                daemons.append(jobs.Daemons(cluster, runtime, POLICIES[arm], log) if args.mbit
                               else DaemonProcess(runtime, policy, log=log, options=options))
            runs.append(runner(arm, launch, runtime, args.workload, args.steps, job_env, tmp,
                               args.start_together))
        decided: dict[str, list[list[str]]] = {arm: [] for arm in logs}
        delayed: list[list[int]] = []  # the aligned arm's corrections a run: leads, ms
        for pair in range(args.pairs):
            pair_times = [0.0, 0.0]
            for i in arm_order(2, pair):
                pair_times[i] = runs[i](f"p{pair}")
                if arms[i] in logs:
                    decided[arms[i]].append(logs[arms[i]].new())
                if arms[i] == "aligned":
                    delayed.append([int(ms) for ms in delays.new()])
            times.append((pair_times[0], pair_times[1]))
            print(f"  pair {pair + 1}/{args.pairs}: {arms[0]} {pair_times[0]:.2f} s, "
                  f"{arms[1]} {pair_times[1]:.2f} s ({pair_times[0] / pair_times[1]:.2f}x)",
                  flush=True)
    verdict = summarize(arms, times)
    out = write_result(RESULTS, f"ab_{name}", {
        "arms": list(arms), "workload": args.workload, "mbit": args.mbit,
        "steps": args.steps, "pairs": args.pairs, "start_together": args.start_together,
        "order": "pair i runs A then B for even i, B then A for odd i", **verdict,
        "decisions": {arm: d for arm, d in decided.items() if any(d)},
        **({"aligned_delays_ms": delayed} if delayed else {}),
        "wall_s": time.monotonic() - started})
    a, b = arms
    print(f"{a} {verdict[f'{a}_median_s']:.2f} s, {b} {verdict[f'{b}_median_s']:.2f} s "
          f"(medians); {a}/{b} per pair median {verdict[f'{a}_over_{b}_median']:.3f}; "
          f"{b} faster in {verdict[f'{b}_faster_pairs']} of {args.pairs} pairs, sign test "
          f"p = {verdict['sign_test_p']:.3f}\n-> {out}")


if __name__ == "__main__":
    main()
