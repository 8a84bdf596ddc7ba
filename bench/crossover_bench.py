"""Crossover on an emulated two-host cluster with a shaped network (as root).

    .venv/bin/python bench/crossover_bench.py [--quick] [--reps 3] [--mbit 2000,1000,500]
        [--jobs 2]

Two emulated hosts (network namespaces, one CPU core each, a veth link shaped with tc);
each job has one rank per host and averages its gradients over the link (Horovod's Gloo
over TCP); one crossover daemon per host. For each workload and link rate, side by side,
repeated:

    solo            each job alone, plain Horovod; sequential = their sum
    overhead        job A alone under the daemon, against the plain solo
    uncoordinated   the jobs at once, hooks on, daemon policy off
    plain together  the jobs at once, plain Horovod
    crossover       the jobs at once under the crossover daemon

and the bound max(sum of compute, sum of communication) from the solo runs' own split.
Medians over the repetitions; writes bench/results/crossover.json, crossover_speedup.png
and crossover_gantt.png (one crossover run, from its traces).
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import EmulatedCluster  # noqa: E402
from common import RESULTS, write_result  # noqa: E402

from crossover import trace  # noqa: E402
from crossover.launch.local import Job, run_together, terminate_group  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "bench" / "crossover_job.py"

#: Workloads: job-script arguments, sized so compute and communication are comparable
#: at the middle link rate (see docs/benchmark.md for the measured split).
WORKLOADS: dict[str, list[str]] = {
    "mlp": ["--model", "mlp", "--width", "640", "--layers", "4", "--batch", "512"],
    "cnn": ["--model", "cnn", "--width", "32", "--batch", "32"],
    "transformer": ["--model", "transformer", "--width", "256", "--layers", "2",
                    "--batch", "8"],
}

#: The jobs' transport: "gloo" (waits in the kernel) or "mpi" (Open MPI TCP, polls).
TRANSPORT = os.environ.get("CROSSOVER_BENCH_TRANSPORT", "gloo")

#: Horovod's background cycle: its default 1 ms polling competes for the host's only core.
JOB_ENV = {"HOROVOD_CYCLE_TIME": "5", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


class Daemons:
    """One crossover daemon per emulated host (one MPI world across the link).

    Args:
        cluster: the emulated cluster.
        runtime: socket directory (a filesystem path, so it is seen from every namespace).
        policy: the daemon's scheduling policy.
        log: file for the daemons' output.
        timeout_s: longest wait for both sockets.
    """

    def __init__(self, cluster: EmulatedCluster, runtime: Path, policy: str, log: Path,
                 timeout_s: float = 60.0) -> None:
        self.runtime = runtime
        cmd = cluster.mpirun([sys.executable, "-m", "crossover", "daemon", "--policy", policy,
                              "--runtime-dir", str(runtime)])
        self._log = log.open("w")
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        sockets = [runtime / f"node-{h}.sock" for h in cluster.hosts]
        deadline = time.monotonic() + timeout_s
        while not all(s.exists() for s in sockets):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemons did not start within {timeout_s:.0f} s; see {log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the daemons' process group, SIGKILL after 10 s."""
        terminate_group(self.proc)
        self._log.close()


def run_jobs(launch: EmulatedCluster | Callable[[list[str]], list[str]], names: list[str],
             workload: list[str], steps: int, env: dict[str, str], log_dir: Path,
             timeout_s: float = 300.0, job_env: dict[str, str] | None = None,
             first_seed: int = 1) -> list[dict]:
    """Run the named jobs at once and return their JSON lines (job i gets seed
    `first_seed + i`).

    Args:
        launch: the emulated cluster (one rank per host each), or a function that turns a
            job's command into its launch line (e.g. `cluster.local_gloo_run`).
        job_env: the jobs' base environment (default: JOB_ENV, for one core a host).

    Raises:
        RuntimeError: a job failed (its output is in the message).
    """
    if isinstance(launch, EmulatedCluster):
        launch = launch.gloo_run if TRANSPORT == "gloo" else launch.mpirun
    jobs = []
    for i, name in enumerate(names):
        cmd = launch([sys.executable, str(JOB), *workload, "--steps", str(steps),
                      "--seed", str(first_seed + i)])
        jobs.append(Job(name, cmd, {**(JOB_ENV if job_env is None else job_env), **env,
                                    "CROSSOVER_JOB": name}))
    out = []
    for res in run_together(jobs, timeout_s=timeout_s, log_dir=log_dir):
        line = next((ln for ln in res.output.splitlines() if ln.startswith('{"model"')), None)
        if res.returncode != 0 or line is None:
            raise RuntimeError(f"job {res.name} failed (rc {res.returncode}):\n{res.output}")
        if "CROSSOVER_RUNTIME_DIR" in env and "trains on uncoordinated" in res.output:
            # a fail-open run measures nothing about the scheduler: stop here
            raise RuntimeError(f"job {res.name} lost its daemon:\n{res.output}")
        out.append(json.loads(line))
    return out


def makespan(results: list[dict]) -> float:
    """From the first job's start to the last job's end (wall clock)."""
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def measure(cluster: EmulatedCluster, daemons: Daemons, off: Daemons, wl: str, mbit: float,
            measured_mbit: float, reps: int, steps: int, tmp: Path,
            trace_dir: Path | None, n_jobs: int = 2) -> dict:
    """One workload at one link rate: all arms, `reps` times, interleaved, for `n_jobs`.

    Args:
        daemons: crossover-policy daemons; off: policy-off daemons (the hooks run, the
            scheduler grants everything at once: uncoordinated).
    """
    args = WORKLOADS[wl]
    plain = {"CROSSOVER_ENABLE": "0"}
    under = {"CROSSOVER_RUNTIME_DIR": str(daemons.runtime)}
    letters = "ABCDEFGH"[:n_jobs]
    solo_arms = [f"solo_{x.lower()}" for x in letters]
    arms: dict[str, list] = {k: [] for k in (*solo_arms, "solo_daemon", "together",
                                             "plain_together", "crossover")}
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    for rep in range(reps):
        tag = f"{wl}{int(mbit)}r{rep}{n_jobs}"
        for x, arm in zip(letters, solo_arms, strict=True):
            arms[arm] += run_jobs(cluster, [f"{tag}{x}"], args, steps, plain, logs)
        arms["solo_daemon"] += run_jobs(cluster, [f"{tag}D"], args, steps, under, logs)
        arms["together"].append(run_jobs(cluster, [f"{tag}T{x}" for x in letters], args, steps,
                                         {"CROSSOVER_RUNTIME_DIR": str(off.runtime)}, logs))
        arms["plain_together"].append(run_jobs(cluster, [f"{tag}P{x}" for x in letters], args,
                                               steps, plain, logs))
        cx_env = dict(under)
        if trace_dir is not None and rep == reps - 1:
            cx_env["CROSSOVER_TRACE"] = str(trace_dir)
        arms["crossover"].append(run_jobs(cluster, [f"{tag}X{x}" for x in letters], args, steps,
                                          cx_env, logs))
        solo_s = "+".join(f"{arms[a][-1]['seconds']:.2f}" for a in solo_arms)
        print(f"  {wl} {mbit:g} Mbit/s rep {rep}: solo {solo_s} s, together "
              f"{makespan(arms['together'][-1]):.2f} s (plain "
              f"{makespan(arms['plain_together'][-1]):.2f} s), crossover "
              f"{makespan(arms['crossover'][-1]):.2f} s", flush=True)
    med = statistics.median
    per_rep = list(zip(*(arms[a] for a in solo_arms), strict=True))  # the solos of a rep
    solos = [med(r["seconds"] for r in arms[a]) for a in solo_arms]
    sequential = med(sum(r["seconds"] for r in rep) for rep in per_rep)
    together = med(makespan(r) for r in arms["together"])
    plain_together = med(makespan(r) for r in arms["plain_together"])
    cx = med(makespan(r) for r in arms["crossover"])
    compute = med(sum(r["compute_s"] for r in rep) for rep in per_rep)
    comm = med(sum(r["comm_s"] for r in rep) for rep in per_rep)
    bound = max(compute, comm)
    # What the link alone needs: a 2-rank ring allreduce sends each rank's whole gradient
    # (4 bytes a parameter) each way per step; the solo split hides part of this under
    # backward, so the link can bind before the split's communication sum does.
    params = arms["solo_a"][0]["params"]
    link = n_jobs * steps * params * 4 * 8 / (measured_mbit * 1e6)
    samples = sum(r["samples_per_s"] * r["seconds"] for r in arms["crossover"][0])
    slow = {arm: med(statistics.fmean(r[i]["seconds"] / solos[i] for i in range(n_jobs))
                     for r in arms[arm]) for arm in ("together", "crossover")}
    overhead = 1 - med(r["samples_per_s"] for r in arms["solo_daemon"]) / \
        med(r["samples_per_s"] for r in arms["solo_a"])
    return {
        "workload": wl, "mbit": mbit, "jobs": n_jobs, "params": params,
        "solo_s": solos, "sequential_s": sequential, "uncoordinated_s": together,
        "plain_uncoordinated_s": plain_together, "crossover_s": cx, "bound_s": bound,
        "compute_s": compute, "comm_s": comm, "comm_share": comm / (compute + comm),
        "link_bound_s": link, "bound_with_link_s": max(bound, link),
        "bound_with_link_fraction": max(bound, link) / cx,
        "crossover_vs_sequential": sequential / cx,
        "crossover_vs_uncoordinated": together / cx,
        "crossover_vs_plain_uncoordinated": plain_together / cx,
        "uncoordinated_vs_sequential": sequential / together,
        "bound_vs_sequential": sequential / bound,
        "bound_fraction": bound / cx,
        "aggregate_samples_per_s": {"sequential": samples / sequential,
                                    "uncoordinated": samples / together,
                                    "plain_uncoordinated": samples / plain_together,
                                    "crossover": samples / cx},
        "slowdown_vs_solo": {"uncoordinated": slow["together"],
                             "crossover": slow["crossover"]},
        "single_job_overhead": overhead,
        "raw": arms,
    }


def plot_speedup(rows: list[dict], png: Path, n_jobs: int = 2) -> None:
    """Speedup over sequential against link rate, one line per workload and arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"crossover_vs_sequential": ("crossover", "-o"),
              "uncoordinated_vs_sequential": ("uncoordinated", "--s"),
              "bound_vs_sequential": ("bound", ":^")}
    for i, wl in enumerate(sorted({r["workload"] for r in rows})):
        pts = sorted((r for r in rows if r["workload"] == wl), key=lambda r: r["mbit"])
        for key, (label, style) in styles.items():
            ax.plot([r["mbit"] for r in pts], [r[key] for r in pts], style, color=f"C{i}",
                    label=f"{wl}: {label}", alpha=1.0 if label == "crossover" else 0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.3, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s, each direction)")
    ax.set_ylabel(f"speedup over sequential ({n_jobs} jobs)")
    ax.set_title(f"{n_jobs} jobs on two emulated hosts (1 core each)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    """Build the cluster, run the sweep, write the JSON and the plots; always tear down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="MLP only, 1 repetition, fewer steps (under 3 minutes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--mbit", default="2000,1000,500",
                        help="link rates to sweep, Mbit/s, comma-separated")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way link delay (needs tc netem in the kernel)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--jobs", type=int, choices=range(2, 9), default=2,
                        help="jobs sharing the two hosts (each has one rank per host)")
    parser.add_argument("--name", default=None, help="result name (default crossover, "
                        "crossover_<N>jobs for N != 2, with _quick under --quick)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.workloads = 1, 10, "mlp"
    name = args.name or ("crossover" + (f"_{args.jobs}jobs" if args.jobs != 2 else "")
                         + ("_quick" if args.quick else ""))
    rates = [float(x) for x in args.mbit.split(",")]
    rows: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crossover-bench-") as tmp_s, \
            EmulatedCluster(mbit=rates[0], delay_ms=args.delay_ms) as cluster:
        tmp = Path(tmp_s)
        daemons = Daemons(cluster, tmp / "run", "crossover", tmp / "daemons.log")
        off = Daemons(cluster, tmp / "run-off", "off", tmp / "daemons-off.log")
        gantt_dir = tmp / "traces"
        try:
            for mbit in rates:
                cluster.shape(mbit, args.delay_ms)
                measured = cluster.measure_mbit(nbytes=int(mbit * 1e6 / 8 * 0.5))
                print(f"link {mbit:g} Mbit/s (measured {measured:.0f})", flush=True)
                for wl in args.workloads.split(","):
                    tdir = gantt_dir / f"{wl}-{mbit:g}"
                    tdir.mkdir(parents=True)
                    row = measure(cluster, daemons, off, wl, mbit, measured, args.reps,
                                  args.steps, tmp, tdir, args.jobs)
                    row["measured_mbit"] = measured
                    rows.append(row)
                    print(f"{wl} {mbit:g}: crossover {row['crossover_vs_sequential']:.2f}x seq,"
                          f" {row['crossover_vs_uncoordinated']:.2f}x uncoord, "
                          f"{100 * row['bound_fraction']:.0f}% of bound; comm share "
                          f"{100 * row['comm_share']:.0f}%", flush=True)
        finally:
            daemons.stop()
            off.stop()
        RESULTS.mkdir(parents=True, exist_ok=True)
        # The Gantt chart: the comm-heaviest setting of the first workload.
        first = rows[0]["workload"]
        pick = min((r for r in rows if r["workload"] == first), key=lambda r: r["mbit"])
        tdir = gantt_dir / f"{first}-{pick['mbit']:g}"
        events = trace.merge(sorted(tdir.glob("*.json")), tdir / "merged.json")
        gantt = RESULTS / f"{name}_gantt.png"
        trace.plot_gantt(events, gantt, title=f"{first}, {pick['mbit']:g} Mbit/s: "
                         f"{args.jobs} jobs under crossover (one rank per host)")
        gaps = idle_gaps(events)
    speedup_png = RESULTS / f"{name}_speedup.png"
    plot_speedup(rows, speedup_png, args.jobs)
    summary = headline(rows)
    out = write_result(name, {
        **summary,
        "setup": {"hosts": 2, "cores_per_host": 1, "ranks_per_job": 2, "jobs": args.jobs,
                  "reps": args.reps, "steps": args.steps, "delay_ms": args.delay_ms,
                  "link": "a tc tbf-shaped veth pair between two network namespaces",
                  "job_env": JOB_ENV,
                  "uncoordinated": "both jobs at once under the daemon with --policy off "
                                   "(hooks on, every request granted at once)",
                  "plain_uncoordinated": "both jobs at once, plain Horovod "
                                         "(CROSSOVER_ENABLE=0)",
                  "transport_used": TRANSPORT,
                  "workloads": WORKLOADS},
        "gantt": {"png": gantt.name, "workload": first, "mbit": pick["mbit"], **gaps},
        "speedup_png": speedup_png.name,
        "rows": rows,
        "wall_s": time.monotonic() - started,
    })
    print_table(rows)
    print(f"-> {out}")


def idle_gaps(events: list[dict]) -> dict:
    """From a merged trace: per device, the time no job held it while some job waited."""
    holds = trace.holds_by_device(events)
    out = {}
    for dev, spans in holds.items():
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name") == "slot wait" and e.get("ph") == "X"
                 and e.get("args", {}).get("device") == dev]
        spans = sorted(spans)
        gaps = 0.0
        for (_, end, *_), (start, *_) in zip(spans, spans[1:], strict=False):
            if start > end and any(ws < start and we > end for ws, we in waits):
                gaps += start - end
        busy = sum(e - s for s, e, *_ in spans)
        out[dev] = {"held_s": busy / 1e6, "idle_while_waiting_s": gaps / 1e6,
                    "span_s": (max(e for _, e, *_ in spans) - spans[0][0]) / 1e6}
    return {"devices": out}


def headline(rows: list[dict]) -> dict:
    """The required keys: medians over the comm-heavy rows (comm >= compute), per the issue.

    Falls back to all rows when none is comm-heavy.
    """
    heavy = [r for r in rows if r["comm_s"] >= r["compute_s"]] or rows
    med = statistics.median
    return {
        "crossover_vs_sequential": med(r["crossover_vs_sequential"] for r in heavy),
        "crossover_vs_uncoordinated": med(r["crossover_vs_uncoordinated"] for r in heavy),
        "bound_fraction": med(r["bound_fraction"] for r in heavy),
        "single_job_overhead": med(r["single_job_overhead"] for r in rows),
        "headline_rows": [f"{r['workload']}@{r['mbit']:g}" for r in heavy],
    }


def print_table(rows: list[dict]) -> None:
    """The README table, in Markdown."""
    print("| workload | Mbit/s | compute/comm (s) | sequential (s) | uncoordinated (s) | "
          "plain together (s) | crossover (s) | bound (s) | x seq | x uncoord | of bound | "
          "overhead |")
    print("|" + "---|" * 12)
    for r in rows:
        print(f"| {r['workload']} | {r['mbit']:g} | {r['compute_s']:.2f}/{r['comm_s']:.2f} | "
              f"{r['sequential_s']:.2f} | {r['uncoordinated_s']:.2f} | "
              f"{r['plain_uncoordinated_s']:.2f} | {r['crossover_s']:.2f} | "
              f"{r['bound_s']:.2f} | {r['crossover_vs_sequential']:.2f} | "
              f"{r['crossover_vs_uncoordinated']:.2f} | {100 * r['bound_fraction']:.0f}% | "
              f"{100 * r['single_job_overhead']:+.1f}% |")


if __name__ == "__main__":
    main()
