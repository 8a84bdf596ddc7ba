"""How busy Horovod's allreduce keeps the emulated link, and the ceiling that follows for
jobs that take turns on their devices.

    .venv/bin/python -m bench.colocation.link_ceiling [--mbit 500] [--reps 3] [--steps 100]
    (as root)

`makespan.py` counts a comm-heavy row's bound with the link's own transfer time:
every gradient byte at the rate one TCP stream gets (`link_bound_s`). Horovod's
allreduce does not keep the link that busy. Each repetition here runs, on the same
emulated hosts and with the jobs' environment (`jobs.JOB_ENV`), nothing but `--steps`
allreduces of the MLP workload's gradient back to back: one job alone (one stream: each
allreduce waits for Horovod's cycle, then runs Gloo's ring, whose phases leave the link
idle between them), then two such jobs at once (two streams fill each other's gaps;
timed from the first one's first allreduce to the last one's end). Each gives an
efficiency: the link's own time for the bytes over the time taken.

Jobs that take turns compute one at a time, and while one computes only the other's
allreduce can use the link (one stream); the rest of the time both can (two streams).
For a pair whose compute is C seconds in all and whose link time is L, that leaves

    T >= C + max(0, L - e1 * C) / e2

(e1, e2: the one- and two-stream efficiencies), so at most L / T of the link bound. It is
an estimate, not a proof: a job's own early gradients also stream during its backward.
The result names, for the comm-heavy rows of bench/results/colocation/crossover.json at the same
rate, this ceiling beside what always antiphase and auto reached there.
Writes bench/results/colocation/link_ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.harness import jobs
from bench.harness.cluster import EmulatedCluster
from bench.harness.common import area_results, module_argv, write_result
from crossover.launch.local import Job, run_together

RESULTS = area_results("colocation")

#: The gradient streamed: the MLP workload's parameters (crossover.json `params`; the
#: CNN's 1147466 are within 11% of it).
GRADIENT = 1278730


def stream(params: int, count: int) -> None:
    """(Run as a Horovod job.) `count` allreduces of `params` floats back to back; rank 0
    prints when they started and ended (epoch seconds) as a JSON line."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    grad = torch.ones(params)
    for _ in range(3):  # the connections and Horovod's first negotiation, not timed
        hvd.allreduce(grad, name="grad")
    start = time.time()
    for _ in range(count):
        hvd.allreduce(grad, name="grad")
    if hvd.rank() == 0:
        print(json.dumps({"stream_start": start, "stream_end": time.time()}), flush=True)


def run_streams(cluster: EmulatedCluster, n_jobs: int, params: int, count: int) -> float:
    """`n_jobs` streaming jobs at once: from the first one's first timed allreduce to the
    last one's end (seconds)."""
    cmd = module_argv(__spec__.name, "stream", "--params", str(params), "--count", str(count))
    launch = jobs.cluster_launch(cluster)
    spans = []
    for res in run_together([Job(f"stream{i}", launch(cmd), jobs.JOB_ENV)
                             for i in range(n_jobs)], timeout_s=300):
        line = next((ln for ln in res.output.splitlines() if ln.startswith('{"stream')), None)
        if res.returncode != 0 or line is None:
            raise RuntimeError(f"allreduce stream {res.name} failed (rc {res.returncode}):\n"
                               f"{res.output[-2000:]}")
        spans.append(json.loads(line))
    return max(s["stream_end"] for s in spans) - min(s["stream_start"] for s in spans)


def ceiling(compute_s: float, link_s: float, one: float, two: float) -> float:
    """The makespan floor of a turn-taking pair (see the module's doc): the compute, plus
    what of the link's time one stream could not send meanwhile, at two streams' rate."""
    return compute_s + max(0.0, link_s - one * compute_s) / two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=500.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="allreduces per job")
    args = parser.parse_args()
    if args.reps < 1 or args.steps < 1 or args.mbit <= 0:
        parser.error("--reps and --steps must be at least 1 and --mbit above 0")
    one: list[float] = []
    two: list[float] = []
    with EmulatedCluster(mbit=args.mbit) as cluster:
        for rep in range(args.reps):
            rate = cluster.measure_mbit(nbytes=int(args.mbit * 1e6 / 8 * 0.5))
            link = args.steps * GRADIENT * 4 * 8 / (rate * 1e6)
            alone = run_streams(cluster, 1, GRADIENT, args.steps)
            pair = run_streams(cluster, 2, GRADIENT, args.steps)
            one.append(link / alone)
            two.append(2 * link / pair)
            print(f"rep {rep + 1}/{args.reps}: link {rate:.0f} Mbit/s; one stream "
                  f"{alone:.2f} s ({100 * one[-1]:.1f}% of the link's time), two at once "
                  f"{pair:.2f} s ({100 * two[-1]:.1f}%)", flush=True)
    e1, e2 = statistics.median(one), statistics.median(two)
    rows = []
    source = RESULTS / "crossover.json"
    if source.exists():
        for r in json.loads(source.read_text())["rows"]:
            if r["mbit"] != args.mbit or r["comm_s"] < r["compute_s"]:
                continue
            floor = ceiling(r["compute_s"], r["link_bound_s"], e1, e2)
            rows.append({
                "workload": r["workload"], "compute_s": r["compute_s"],
                "link_bound_s": r["link_bound_s"], "ceiling_s": floor,
                "ceiling_fraction": r["link_bound_s"] / floor,
                "always_antiphase_fraction": r["link_bound_s"] / r["crossover_s"],
                "auto_fraction": r["bound_with_link_fraction"],
                "plain_over_ceiling": r["plain_uncoordinated_s"] / floor})
            print(f"{r['workload']} at {args.mbit:g} Mbit/s: ceiling {floor:.2f} s = "
                  f"{100 * rows[-1]['ceiling_fraction']:.1f}% of the link bound; always "
                  f"antiphase reached {100 * rows[-1]['always_antiphase_fraction']:.1f}%, "
                  f"auto {100 * rows[-1]['auto_fraction']:.1f}%; at the ceiling "
                  f"{rows[-1]['plain_over_ceiling']:.2f}x plain together", flush=True)
    out = write_result(RESULTS, "link_ceiling", {
        "mbit": args.mbit, "steps": args.steps, "params": GRADIENT,
        "one_stream_efficiency": e1, "two_stream_efficiency": e2,
        "one_stream_reps": one, "two_stream_reps": two, "rows": rows})
    print(f"one stream {100 * e1:.1f}%, two streams {100 * e2:.1f}% of the link's time "
          f"(medians of {args.reps}) -> {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "stream":
        sub = argparse.ArgumentParser()
        sub.add_argument("--params", type=int, required=True)
        sub.add_argument("--count", type=int, required=True)
        opts = sub.parse_args(sys.argv[2:])
        stream(opts.params, opts.count)
    else:
        main()
