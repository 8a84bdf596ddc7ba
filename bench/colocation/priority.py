"""Priority weights in per-job slowdowns: two jobs on the emulated two-host cluster under
`--policy priority`, weighted 1:1, w:1 and 1:w (as root).

    .venv/bin/python -m bench.colocation.priority [--reps 3] [--mbit 1000] [--weight 3]
        [--workload mlp] [--steps 60]

The cluster is `cluster.py`, the jobs and the daemons those of `jobs.py` (one rank per
emulated host, one core each, a shaped link). Each repetition runs, interleaved: each job
alone with plain Horovod (its solo time), both at once with plain Horovod, and both at
once under the priority policy for each pair of weights (CROSSOVER_PRIORITY per job).
A job's slowdown in an arm is its time there over its median time alone; the weights
show when the heavier job's slowdown is the smaller, and the two swap when the weights
swap (1:w against w:1: the jobs are otherwise the same, so it is the weight and not the
job's place in the global order). The makespans are set against sequential and plain
together, the baselines a user compares with. Writes bench/results/colocation/priority.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.cluster import EmulatedCluster
from bench.harness.common import area_results, write_result
from bench.harness.jobs import TRANSPORT, WORKLOADS, Daemons, makespan, run_jobs

RESULTS = area_results("colocation")


def weight_pairs(w: float) -> dict[str, tuple[float, float]]:
    """The arms' weights for jobs A and B, by arm name."""
    return {"priority_1:1": (1.0, 1.0), f"priority_{w:g}:1": (w, 1.0),
            f"priority_1:{w:g}": (1.0, w)}


def summarise(arms: dict[str, list[list[dict]]], weights: dict[str, tuple[float, float]]
              ) -> dict:
    """Medians of the repetitions: solo times, sequential, and per arm the makespan and
    each job's slowdown against its own median solo time.

    Args:
        arms: per arm, per repetition, the jobs' result lines (job A first).
        weights: the weighted arms' (A, B) weights.
    """
    med = statistics.median
    solos = [med(rep[0]["seconds"] for rep in arms[f"solo_{x}"]) for x in "ab"]
    sequential = med(a[0]["seconds"] + b[0]["seconds"]
                     for a, b in zip(arms["solo_a"], arms["solo_b"], strict=True))
    plain = med(makespan(rep) for rep in arms["plain_together"])
    out: dict = {"solo_s": solos, "sequential_s": sequential, "plain_together_s": plain,
                 "arms": {}}
    for arm in ("plain_together", *weights):
        slow = [med(rep[i]["seconds"] / solos[i] for rep in arms[arm]) for i in range(2)]
        span = med(makespan(rep) for rep in arms[arm])
        out["arms"][arm] = {"weights": list(weights[arm]) if arm in weights else None,
                            "makespan_s": span, "slowdown_vs_solo": slow,
                            "vs_best_baseline": min(sequential, plain) / span}
    # The weights' effect: the lighter job's slowdown over the heavier one's.
    for arm, (wa, wb) in weights.items():
        if wa != wb:
            heavy, light = (0, 1) if wa > wb else (1, 0)
            s = out["arms"][arm]["slowdown_vs_solo"]
            out["arms"][arm]["light_over_heavy_slowdown"] = s[light] / s[heavy]
    return out


def main() -> None:
    """Build the cluster, run the arms interleaved, write the JSON; always tear down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mbit", type=float, default=1000.0,
                        help="link rate, Mbit/s (1000: compute-heavy, the device is contended)")
    parser.add_argument("--weight", type=float, default=3.0, help="the heavier job's weight")
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.reps < 1 or args.steps < 1 or not args.weight > 1 or not args.mbit > 0:
        parser.error(f"need --reps >= 1, --steps >= 1, --weight > 1, --mbit > 0; got "
                     f"{args.reps}, {args.steps}, {args.weight}, {args.mbit}")
    weights = weight_pairs(args.weight)
    workload = WORKLOADS[args.workload]
    arms: dict[str, list[list[dict]]] = {k: [] for k in ("solo_a", "solo_b", "plain_together",
                                                         *weights)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crossover-priority-") as tmp_s:
        tmp = Path(tmp_s)
        logs = tmp / "logs"
        logs.mkdir()
        with EmulatedCluster(mbit=args.mbit) as cluster:
            measured = cluster.measure_mbit(nbytes=int(args.mbit * 1e6 / 8 * 0.5))
            print(f"link {args.mbit:g} Mbit/s (measured {measured:.0f})", flush=True)
            daemons = Daemons(cluster, tmp / "run", "priority", tmp / "daemons.log")
            launch = cluster.gloo_run if TRANSPORT == "gloo" else cluster.mpirun
            plain = {"CROSSOVER_ENABLE": "0"}
            under = {"CROSSOVER_RUNTIME_DIR": str(daemons.runtime)}
            def run(names: list[str], env: dict[str, str],
                    job_envs: list[dict[str, str]] | None = None, first: int = 0
                    ) -> list[dict]:
                return run_jobs(launch, names, workload, args.steps, env, logs,
                                first_seed=1 + first, job_envs=job_envs)

            try:
                for rep in range(args.reps):
                    arms["solo_a"].append(run([f"r{rep}SA"], plain))
                    arms["solo_b"].append(run([f"r{rep}SB"], plain, first=1))
                    arms["plain_together"].append(run([f"r{rep}PA", f"r{rep}PB"], plain))
                    for i, (arm, (wa, wb)) in enumerate(weights.items()):
                        arms[arm].append(run([f"r{rep}W{i}A", f"r{rep}W{i}B"], under,
                                             [{"CROSSOVER_PRIORITY": str(wa)},
                                              {"CROSSOVER_PRIORITY": str(wb)}]))
                    line = ", ".join(f"{arm} " + "/".join(f"{r['seconds']:.2f}" for r in
                                                           arms[arm][-1]) for arm in arms)
                    print(f"rep {rep + 1}/{args.reps} (s): {line}", flush=True)
            finally:
                daemons.stop()
    summary = summarise(arms, weights)
    out = write_result(RESULTS, "priority", {
        "setup": {"hosts": 2, "cores_per_host": 1, "ranks_per_job": 2, "jobs": 2,
                  "workload": args.workload, "mbit": args.mbit, "measured_mbit": measured,
                  "reps": args.reps, "steps": args.steps, "transport_used": TRANSPORT,
                  "policy": "priority", "weights": {k: list(v) for k, v in weights.items()}},
        **summary, "raw": arms, "wall_s": time.monotonic() - started})
    print("| arm | weights A:B | makespan (s) | slowdown A | slowdown B | x best baseline |")
    print("|---|---|---:|---:|---:|---:|")
    for arm, r in summary["arms"].items():
        ws = ":".join(f"{w:g}" for w in r["weights"]) if r["weights"] else "-"
        print(f"| {arm} | {ws} | {r['makespan_s']:.2f} | "
              f"{r['slowdown_vs_solo'][0]:.2f} | {r['slowdown_vs_solo'][1]:.2f} | "
              f"{r['vs_best_baseline']:.2f} |")
    print(f"sequential {summary['sequential_s']:.2f} s; -> {out}")


if __name__ == "__main__":
    main()
