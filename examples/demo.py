"""The main demo (`make demo`): two 2-rank PyTorch Horovod jobs share two hosts.

Where it can (root, network namespaces), the demo builds two emulated hosts joined by a
shaped 1000 Mbit/s link (bench/harness/cluster.py): each job has one rank per host and averages
its gradients over the link, so communication leaves each host's core idle, as on a real
cluster. Where it cannot, it says why and runs both jobs' ranks on this host.

It runs each job alone, the two one after the other, the two together with plain
Horovod, and the two together under crossover (the default policy, auto); prints each
arm's per-job samples/s and makespan with the bound max(sum of compute, sum of
communication, the link's own transfer time), how much of the time crossover kept the
devices held and each job's hold against its compute alone, and writes the merged
Chrome trace of the crossover run and its Gantt chart. Every number printed is measured
in this run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from bench.harness import jobs
from bench.harness.cluster import EmulatedCluster
from bench.harness.common import REPO
from crossover import trace
from crossover.launch.local import DaemonProcess

MBIT = 1000.0


def arms(launch, runtime: Path, args: argparse.Namespace, job_env: dict, logs: Path,
         traces: Path) -> dict[str, list[dict]]:
    """Each job alone, both with plain Horovod, both under crossover: {arm: results}."""
    wl, plain = jobs.WORKLOADS[args.workload], {"CROSSOVER_ENABLE": "0"}

    def run(names: list[str], env: dict, first: int = 1) -> list[dict]:
        return jobs.run_jobs(launch, names, wl, args.steps, env, logs, job_env=job_env,
                        first_seed=first)

    out = {}
    for i, name in enumerate(("jobA", "jobB")):
        print(f"  {name} alone ...", flush=True)
        out[f"{name} alone"] = run([name], plain, first=1 + i)
    print("  both together, plain Horovod ...", flush=True)
    out["plain together"] = run(["jobA", "jobB"], plain)
    print("  both together under crossover ...", flush=True)
    out["crossover"] = run(["jobA", "jobB"], {"CROSSOVER_RUNTIME_DIR": str(runtime),
                                              "CROSSOVER_TRACE": str(traces)})
    return out


def report(results: dict[str, list[dict]], link_s: float) -> None:
    solo = [results["jobA alone"][0], results["jobB alone"][0]]
    sequential = sum(r["seconds"] for r in solo)
    bound = max(sum(r["compute_s"] for r in solo), sum(r["comm_s"] for r in solo), link_s)
    rows = [("each job alone", [r["samples_per_s"] for r in solo], None),
            # one after the other: each at its solo rate for half the makespan, in effect
            ("sequential", [r["samples_per_s"] * r["seconds"] / sequential for r in solo],
             sequential)]
    for arm, label in (("plain together", "together, plain Horovod"),
                       ("crossover", "together, crossover (auto)")):
        rows.append((label, [r["samples_per_s"] for r in results[arm]],
                     jobs.makespan(results[arm])))
    print(f"\n{'arm':<28}{'jobA samples/s':>15}{'jobB samples/s':>15}{'makespan s':>12}"
          f"{'x sequential':>14}")
    for name, (a, b), span in rows:
        speed = f"{sequential / span:.2f}" if span else "-"
        print(f"{name:<28}{a:>15.0f}{b:>15.0f}{(f'{span:.1f}' if span else '-'):>12}"
              f"{speed:>14}")
    print(f"{'bound (see below)':<58}{bound:>12.1f}{sequential / bound:>14.2f}")
    print("bound: max(sum of compute, sum of communication, the link's transfer time), "
          "from the solo runs;\n       it counts communication as free of CPU, which on "
          "a one-core host it is not (bench/colocation/comm_cpu.py)")


def explain_holds(events: list[dict], results: dict[str, list[dict]], steps: int,
                  own_core: bool) -> None:
    """Where crossover's makespan goes: how much of the time each device was held, each
    job's hold against its compute a step alone (a hold longer than that compute is the
    cost of sharing the device's host, which no order of turns removes) and, where host 0
    has a core of its own (`own_core`), at least how busy it was: the CPU time of the two
    jobs' training loops there (the daemon, the launchers and the kernel's network work
    add to it). Near 100 %, only less CPU work, not another order of turns, would make
    the run shorter."""
    held = ", ".join(f"{dev} {100 * share:.1f} %" for dev, share in trace.busy(events).items())
    print(f"\ndevices held under crossover: {held} of the time")
    if own_core:  # each job's rank 0 (the one that reports) runs on host 0
        runs = results["crossover"]
        cpu, span = sum(r["cpu_s"] for r in runs), jobs.makespan(runs)
        print(f"host 0's core under crossover: the jobs' training loops there used "
              f"{cpu:.1f} s of CPU in the {span:.1f} s run (at least {100 * cpu / span:.0f} "
              f"% busy)")
    holds: dict[str, list[float]] = {}
    for spans in trace.holds_by_device(events).values():
        for start, end, job, _ in spans:
            holds.setdefault(job, []).append((end - start) / 1e3)
    for job, ms in sorted(holds.items()):
        alone = results.get(f"{job} alone")
        compute = f", compute a step alone {1e3 * alone[0]['compute_s'] / steps:.1f} ms" \
            if alone else ""
        print(f"  {job}: median hold {statistics.median(ms):.1f} ms{compute}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workload", choices=list(jobs.WORKLOADS), default="mlp")
    parser.add_argument("--one-host", action="store_true",
                        help="skip the emulated hosts: both jobs' ranks on this host")
    parser.add_argument("--out", type=Path, default=REPO / "out/demo")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    logs, traces = args.out / "logs", args.out / "traces"
    logs.mkdir(parents=True)
    cluster = None
    if not args.one_host:
        try:
            cluster = EmulatedCluster(mbit=MBIT).__enter__()
        except Exception as exc:  # noqa: BLE001 - any reason: say it, run on one host
            print(f"emulated hosts unavailable ({exc}); running both jobs on this host")
    if cluster is not None:
        try:
            print(f"two emulated hosts, one core each, link {MBIT:g} Mbit/s "
                  f"(measured {cluster.measure_mbit(int(MBIT * 1e6 / 16)):.0f})", flush=True)
            daemons = jobs.Daemons(cluster, args.out / "run", "auto",
                                    args.out / "daemon.log")
            try:
                results = arms(cluster.gloo_run, daemons.runtime, args, jobs.JOB_ENV, logs,
                               traces)
            finally:
                daemons.stop()
        finally:
            cluster.__exit__(None, None, None)
        params = results["jobA alone"][0]["params"] + results["jobB alone"][0]["params"]
        link_s = args.steps * params * 4 * 8 / (MBIT * 1e6)  # each rank's gradient, each way
    else:
        print("one host: both ranks of each job here, no network between them", flush=True)
        runtime = args.out / "run"
        with DaemonProcess(runtime, "auto", log=args.out / "daemon.log"):
            results = arms(jobs.one_host_launch, runtime, args, jobs.ONE_HOST_ENV,
                           logs, traces)
        link_s = 0.0
    report(results, link_s)
    merged = args.out / "crossover.trace.json"
    events = trace.merge(sorted(traces.glob("*.json")), merged)
    gantt = args.out / "crossover_gantt.png"
    trace.plot_gantt(events, gantt, title="slot holds per device, two jobs under crossover")
    explain_holds(events, results, args.steps,
                  cluster is not None and len(set(cluster.cores)) == 2)
    modes = [ev["name"] for ev in events if ev.get("ph") == "i"]
    print(f"\nmode switches seen by the ranks: {len(modes)}; the daemon's decisions: "
          f"grep mode {args.out / 'daemon.log'}")
    print(f"merged trace: {merged} (open in chrome://tracing or ui.perfetto.dev)")
    print(f"Gantt chart:  {gantt}")


if __name__ == "__main__":
    main()
