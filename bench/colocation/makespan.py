"""Crossover on an emulated two-host cluster with a shaped network (as root), and on
one host.

    .venv/bin/python -m bench.colocation.makespan [--quick] [--reps 3] [--mbit 2000,1000,500]
        [--workloads mlp,cnn,mlp+cnn] [--one-host] [--jobs 2] [--steps 60]

Two emulated hosts (network namespaces, one CPU core each, a veth link shaped with tc);
each job has one rank per host and averages its gradients over the link (Horovod's Gloo
over TCP; a `ddp-` workload is a PyTorch DDP job, torchrun on each host meeting at a
static rendezvous, gloo over TCP); one crossover daemon per host. `--one-host` adds rows
with `mbit` 0: each job's two ranks on this host, no shaped link. A workload `a+b` pairs
two models (job A runs a, job B runs b). For each workload and setting, side by side:

    solo            each job alone, plain Horovod (or torchrun); sequential = their sum
    overhead        job A alone under the daemon, against the plain solo
    uncoordinated   the jobs at once, hooks on, daemon policy off
    plain together  the jobs at once, plain Horovod (or torchrun)
    crossover       the jobs at once, daemon policy crossover (always antiphase)
    auto            the jobs at once, daemon policy auto (the default)

and the bound max(sum of compute, sum of communication) from the solo runs' own split.
Medians over the repetitions; writes bench/results/colocation/crossover.json, crossover_speedup.png
and crossover_gantt.png (one auto run, from its traces).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.colocation.summary import (
    apart_note,
    headline,
    idle_gaps,
    jain,
    paired_vs_best,
    print_table,
    rank_skew,
)
from bench.harness.cluster import EmulatedCluster
from bench.harness.common import DecisionLog, area_results, arm_order, stop_all, write_result
from bench.harness.jobs import (
    JOB_ENV,
    ONE_HOST_ENV,
    TRANSPORT,
    WORKLOADS,
    Daemons,
    cluster_launch,
    job_workloads,
    makespan,
    one_host_launch,
    run_jobs,
)
from crossover import trace
from crossover.launch.local import DaemonProcess

RESULTS = area_results("colocation")

#: The arms run together under a daemon, and the daemon policy of each.
POLICY_ARMS = {"together": "off", "crossover": "crossover", "auto": "auto"}
#: `--aligned-arm`: always antiphase with the nodes' phases kept in step (emulated hosts).
ALIGNED_ARM = ("aligned", "crossover --align-phases")
#: `--turns-arm`: whole-step turns (a job holds its devices through its allreduce).
TURNS_ARM = ("turns", "round-robin")


def measure(launch: Callable[[list[str]], list[str]], runtimes: dict[str, Path], wl: str,
            mbit: float, measured_mbit: float | None, reps: int, steps: int, tmp: Path,
            trace_dir: Path | None, n_jobs: int = 2,
            job_env: dict[str, str] | None = None, auto_log: Path | None = None,
            policy_arms: dict[str, str] = POLICY_ARMS, start_together: bool = False) -> dict:
    """One workload in one setting: all arms, `reps` times, interleaved (each repetition
    in another order: `common.arm_order`), for `n_jobs`.

    Args:
        launch: turns a job's command into its launch line.
        runtimes: the socket directory of a daemon per policy of `policy_arms`.
        wl: a workload name, or names joined by "+" (job i runs the i-th, cycling).
        measured_mbit: the link's measured rate; None on one host (no link).
        auto_log: the auto daemon's log: each repetition's mode switches and their
            reasons go into the row (`auto_decisions`).
        policy_arms: the arms run together under a daemon, and each one's policy ("off":
            the hooks run, every request is granted at once: uncoordinated). Every arm but
            the uncoordinated one is traced (`rank_skew_ms`, `ranks_apart`).
        start_together: the jobs' loops start at one barrier once every job has set up
            (`jobs.run_jobs`), so a makespan holds no job's start-up, as the sequential
            sum of loops does not (jobs whose start-up differs: a DDP and a Horovod job).
    """
    traced = [arm for arm in policy_arms if arm != "together"]
    per_job = job_workloads(wl, n_jobs)
    plain = {"CROSSOVER_ENABLE": "0"}
    letters = "ABCDEFGH"[:n_jobs]
    solo_arms = [f"solo_{x.lower()}" for x in letters]
    arms: dict[str, list] = {k: [] for k in (*solo_arms, "solo_daemon", "plain_together",
                                             *policy_arms)}
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    decisions: list[list[str]] = []  # per repetition, the auto daemon's switches
    auto_decisions = DecisionLog(auto_log) if auto_log is not None else None
    if auto_decisions is not None:
        auto_decisions.new()  # the daemon serves every row: skip what earlier rows wrote

    def traces_of(arm: str, rep: int) -> Path:
        """Where a traced run writes: the last auto run's make the Gantt chart (main)."""
        assert trace_dir is not None
        return trace_dir if (arm, rep) == ("auto", reps - 1) else trace_dir / f"{arm}{rep}"

    def run(names: list[str], env: dict[str, str], first: int = 0) -> list[dict]:
        return run_jobs(launch, names, per_job[first], steps, env, logs, job_env=job_env,
                        first_seed=1 + first, workloads=per_job[first:first + len(names)],
                        start_together=start_together)

    def run_solos(tag: str) -> None:
        for i, (x, arm) in enumerate(zip(letters, solo_arms, strict=True)):
            arms[arm] += run([f"{tag}{x}"], plain, i)
        arms["solo_daemon"] += run([f"{tag}D"], {"CROSSOVER_RUNTIME_DIR": str(runtimes["auto"])})

    def run_arm(tag: str, arm: str, rep: int) -> None:
        if arm == "plain_together":
            arms[arm].append(run([f"{tag}P{x}" for x in letters], plain))
            return
        env = {"CROSSOVER_RUNTIME_DIR": str(runtimes[policy_arms[arm]])}
        if trace_dir is not None and arm in traced:
            env["CROSSOVER_TRACE"] = str(traces_of(arm, rep))
        letter = "L" if arm == ALIGNED_ARM[0] else arm[0].upper()  # (auto has "A")
        arms[arm].append(run([f"{tag}{letter}{x}" for x in letters], env))
        if arm == "auto" and auto_decisions is not None:
            decisions.append(auto_decisions.new())

    blocks = ["solos", "plain_together", *policy_arms]
    for rep in range(reps):
        tag = f"{wl.replace('+', '')}{int(mbit)}r{rep}{n_jobs}"
        for block in (blocks[i] for i in arm_order(len(blocks), rep)):  # (see `arm_order`)
            if block == "solos":
                run_solos(tag)
            else:
                run_arm(tag, block, rep)
        solo_s = "+".join(f"{arms[a][-1]['seconds']:.2f}" for a in solo_arms)
        print(f"  {wl} {mbit or 'one host'} rep {rep}: solo {solo_s} s, plain together "
              f"{makespan(arms['plain_together'][-1]):.2f} s, uncoordinated "
              f"{makespan(arms['together'][-1]):.2f} s, crossover "
              f"{makespan(arms['crossover'][-1]):.2f} s, auto "
              f"{makespan(arms['auto'][-1]):.2f} s"
              + "".join(f", {a} {makespan(arms[a][-1]):.2f} s" for a in ("aligned", "turns")
                        if a in arms)
              + (f" ({decisions[-1][-1]})" if decisions and decisions[-1] else ""), flush=True)
    med = statistics.median
    per_rep = list(zip(*(arms[a] for a in solo_arms), strict=True))  # the solos of a rep
    solos = [med(r["seconds"] for r in arms[a]) for a in solo_arms]
    sequential = med(sum(r["seconds"] for r in rep) for rep in per_rep)
    spans = {arm: med(makespan(r) for r in arms[arm])
             for arm in ("plain_together", *policy_arms)}
    compute = med(sum(r["compute_s"] for r in rep) for rep in per_rep)
    comm = med(sum(r["comm_s"] for r in rep) for rep in per_rep)
    bound = max(compute, comm)
    # What the link alone needs: a 2-rank ring allreduce sends each rank's whole gradient
    # (4 bytes a parameter) each way per step; the solo split hides part of this under
    # backward, so the link can bind before the split's communication sum does.
    params = [arms[a][0]["params"] for a in solo_arms]
    link = steps * sum(params) * 4 * 8 / (measured_mbit * 1e6) if measured_mbit else 0.0
    samples = sum(r["samples_per_s"] * r["seconds"] for r in arms["auto"][0])
    # Per job: its time in an arm against its time alone; speedup = the inverse.
    slow = {arm: [med(r[i]["seconds"] / solos[i] for r in arms[arm]) for i in range(n_jobs)]
            for arm in ("plain_together", *policy_arms)}
    overhead = 1 - med(r["samples_per_s"] for r in arms["solo_daemon"]) / \
        med(r["samples_per_s"] for r in arms["solo_a"])
    best_baseline = min(sequential, spans["plain_together"])
    sequential_wall = med(rep[-1]["end"] - rep[0]["start"] for rep in per_rep)
    skews = {} if trace_dir is None else {
        arm: [rank_skew(traces_of(arm, rep)) for rep in range(reps)] for arm in traced}
    return {
        "workload": wl, "mbit": mbit, "jobs": n_jobs, "params": params,
        "solo_s": solos, "sequential_s": sequential,
        # as a user runs them one after the other: the next job launched when one ends
        # (its start-up included, as the second job's is in the makespans together)
        "sequential_wall_s": sequential_wall,
        "uncoordinated_s": spans["together"],
        "plain_uncoordinated_s": spans["plain_together"], "crossover_s": spans["crossover"],
        "auto_s": spans["auto"], "aligned_s": spans.get("aligned"),
        "turns_s": spans.get("turns"), "bound_s": bound,
        "compute_s": compute, "comm_s": comm, "comm_share": comm / (compute + comm),
        "link_bound_s": link, "bound_with_link_s": max(bound, link),
        "bound_with_link_fraction": max(bound, link) / spans["auto"],
        "auto_vs_best_baseline": best_baseline / spans["auto"],
        # the same with sequential as a user waits for it (the key above stays the strict one)
        "auto_vs_best_baseline_wall": min(sequential_wall, spans["plain_together"])
        / spans["auto"],
        "auto_vs_best_baseline_reps": paired_vs_best(per_rep, arms["plain_together"],
                                                     arms["auto"]),
        # what the decision costs: auto against the faster of its two modes held fixed
        "auto_vs_best_fixed_mode": min(spans["crossover"], spans["plain_together"])
        / spans["auto"],
        "auto_vs_sequential": sequential / spans["auto"],
        "auto_vs_plain": spans["plain_together"] / spans["auto"],
        "crossover_vs_sequential": sequential / spans["crossover"],
        "crossover_vs_uncoordinated": spans["together"] / spans["crossover"],
        "crossover_vs_plain_uncoordinated": spans["plain_together"] / spans["crossover"],
        "uncoordinated_vs_sequential": sequential / spans["together"],
        "bound_vs_sequential": sequential / bound,
        "bound_fraction": bound / spans["auto"],
        "aggregate_samples_per_s": {"sequential": samples / sequential,
                                    **{arm: samples / span for arm, span in spans.items()}},
        "slowdown_vs_solo": slow,
        "jain_speedups": {arm: jain([1 / x for x in xs]) for arm, xs in slow.items()},
        "single_job_overhead": overhead,
        "auto_decisions": decisions,
        # per repetition: how far apart a job's ranks start their holds (median, ms), and
        # the share of holds more than half a hold apart (the hosts' phases crossed)
        "rank_skew_ms": {arm: [None if s is None else s[0] for s in runs]
                         for arm, runs in skews.items()},
        "ranks_apart": {arm: [None if s is None else s[1] for s in runs]
                        for arm, runs in skews.items()},
        "raw": arms,
    }


def plot_speedup(rows: list[dict], png: Path, n_jobs: int = 2) -> None:
    """Speedup over sequential against link rate: one colour per workload, one line style
    per arm (the default policy, always antiphase, plain Horovod together, the bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    styles = {"auto_s": ("auto (default)", "-o", 1.0),
              "crossover_s": ("always antiphase", "-.d", 0.6),
              "plain_uncoordinated_s": ("plain together", "--s", 0.6),
              "bound_with_link_s": ("bound", ":^", 0.4)}
    for i, wl in enumerate(sorted({r["workload"] for r in rows})):
        pts = sorted((r for r in rows if r["workload"] == wl), key=lambda r: r["mbit"])
        for key, (label, style, alpha) in styles.items():
            ax.plot([r["mbit"] for r in pts], [r["sequential_s"] / r[key] for r in pts], style,
                    color=f"C{i}", label=f"{wl}: {label}", alpha=alpha)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s, each direction)")
    ax.set_ylabel(f"speedup over sequential ({n_jobs} jobs)")
    ax.set_title(f"{n_jobs} jobs on two emulated hosts (1 core each)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    """Build the cluster, run the sweep, write the JSON and the plots; always tear down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="MLP at 500 Mbit/s and on one host, 1 repetition (~4 minutes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="steps per job")
    parser.add_argument("--mbit", default="2000,1000,500",
                        help="link rates to sweep, Mbit/s, comma-separated ('' for none)")
    parser.add_argument("--one-host", action="store_true",
                        help="add rows with both jobs' ranks on this host, no link")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way link delay (needs tc netem in the kernel)")
    parser.add_argument("--workloads", default="mlp,cnn,transformer",
                        help="comma-separated; a+b pairs two models; ddp-<model> runs the "
                             "model as a PyTorch DDP job under torchrun (mlp+ddp-mlp: a "
                             "Horovod job beside a DDP job)")
    parser.add_argument("--jobs", type=int, choices=range(2, 9), default=2,
                        help="jobs sharing the two hosts (each has one rank per host)")
    parser.add_argument("--name", default=None, help="result name (default crossover, "
                        "crossover_<N>jobs for N != 2, with _quick under --quick)")
    parser.add_argument("--start-together", action="store_true",
                        help="start the jobs' training loops at one barrier once all have "
                             "set up (makespans without start-up, as the sequential sum)")
    parser.add_argument("--aligned-arm", action="store_true",
                        help="add an arm: always antiphase with the nodes' phases aligned "
                             "(daemon --align-phases; emulated hosts only)")
    parser.add_argument("--turns-arm", action="store_true",
                        help="add an arm: whole-step turns (daemon --policy round-robin)")
    args = parser.parse_args()
    policy_arms = dict(POLICY_ARMS)
    if args.turns_arm:
        policy_arms[TURNS_ARM[0]] = TURNS_ARM[1]
    if args.aligned_arm:
        policy_arms[ALIGNED_ARM[0]] = ALIGNED_ARM[1]
        if args.one_host:
            parser.error("--aligned-arm aligns nodes' phases: it needs the emulated hosts, "
                         "not --one-host")
    if args.quick:
        args.reps, args.workloads, args.mbit, args.one_host = 1, "mlp", "500", True
    workloads = args.workloads.split(",")
    unknown = {k for wl in workloads for k in wl.split("+")} - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s) {sorted(unknown)}; choose from {list(WORKLOADS)}, "
                     f"or pair two with +")
    name = args.name or ("crossover" + (f"_{args.jobs}jobs" if args.jobs != 2 else "")
                         + ("_quick" if args.quick else ""))
    rates = [float(x) for x in args.mbit.split(",") if x]
    rows: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crossover-bench-") as tmp_s:
        tmp = Path(tmp_s)
        traces = tmp / "traces"
        if rates:
            with EmulatedCluster(mbit=rates[0], delay_ms=args.delay_ms) as cluster:
                daemons = [Daemons(cluster, tmp / f"run-{p}", p, tmp / f"daemons-{p}.log")
                           for p in policy_arms.values()]
                launch = cluster_launch(cluster)
                try:
                    for mbit in rates:
                        cluster.shape(mbit, args.delay_ms)
                        measured = cluster.measure_mbit(nbytes=int(mbit * 1e6 / 8 * 0.5))
                        print(f"link {mbit:g} Mbit/s (measured {measured:.0f})", flush=True)
                        for wl in workloads:
                            rows.append(_row(launch, {d.policy: d.runtime for d in daemons},
                                             wl, mbit, measured, args, tmp, traces,
                                             auto_log=tmp / "daemons-auto.log",
                                             policy_arms=policy_arms))
                finally:
                    stop_all(daemons)
        if args.one_host:
            print("one host (no shaped link)", flush=True)
            local = [DaemonProcess(tmp / f"local-{p}", p, log=tmp / f"local-{p}.log")
                     for p in policy_arms.values()]
            try:
                for wl in workloads:
                    rows.append(_row(one_host_launch,
                                     {p: tmp / f"local-{p}" for p in policy_arms.values()},
                                     wl, 0.0, None, args, tmp, traces, ONE_HOST_ENV,
                                     auto_log=tmp / "local-auto.log",
                                     policy_arms=policy_arms))
            finally:
                stop_all(local)
        RESULTS.mkdir(parents=True, exist_ok=True)
        # The Gantt chart: the comm-heaviest setting of the first workload.
        first = rows[0]["workload"]
        pick = max((r for r in rows if r["workload"] == first), key=lambda r: r["comm_share"])
        tdir = traces / f"{first}-{pick['mbit']:g}"
        events = trace.merge(sorted(tdir.glob("*.json")), tdir / "merged.json")
        gantt = RESULTS / f"{name}_gantt.png"
        where = f"{pick['mbit']:g} Mbit/s" if pick["mbit"] else "one host"
        ranks = "one rank per host" if pick["mbit"] else "both ranks on this host"
        trace.plot_gantt(events, gantt, title=f"{first}, {where}: {args.jobs} jobs under "
                         f"policy auto ({ranks})")
        gaps = idle_gaps(events)
    speedup_png = RESULTS / f"{name}_speedup.png"
    linked = [r for r in rows if r["mbit"]]
    if linked:
        plot_speedup(linked, speedup_png, args.jobs)
    out = write_result(RESULTS, name, {
        **headline(rows),
        "setup": {"hosts": 2, "cores_per_host": 1, "ranks_per_job": 2, "jobs": args.jobs,
                  "reps": args.reps, "steps": args.steps, "delay_ms": args.delay_ms,
                  "start_together": args.start_together,
                  "link": "a tc tbf-shaped veth pair between two network namespaces",
                  "one_host": "mbit 0: both ranks of each job on this host under mpirun, "
                              f"environment {ONE_HOST_ENV}",
                  "job_env": JOB_ENV,
                  "arms": {"uncoordinated": "the jobs at once under the daemon with --policy "
                                            "off (hooks on, every request granted at once)",
                           "plain_uncoordinated": "the jobs at once, plain Horovod "
                                                  "(CROSSOVER_ENABLE=0)",
                           "crossover": "daemon --policy crossover (always antiphase)",
                           "auto": "daemon --policy auto (the default)",
                           "aligned": "--aligned-arm: daemon --policy crossover "
                                      "--align-phases",
                           "turns": "--turns-arm: daemon --policy round-robin (whole-step "
                                    "turns)"},
                  "transport_used": TRANSPORT,
                  "workloads": WORKLOADS},
        "gantt": {"png": gantt.name, "workload": first, "mbit": pick["mbit"], **gaps},
        "speedup_png": speedup_png.name if linked else None,
        "rows": rows,
        "wall_s": time.monotonic() - started,
    })
    print_table(rows)
    print(f"-> {out}")


def _row(launch: Callable[[list[str]], list[str]], runtimes: dict[str, Path], wl: str,
         mbit: float, measured: float | None, args: argparse.Namespace, tmp: Path,
         traces: Path, job_env: dict[str, str] | None = None,
         auto_log: Path | None = None, policy_arms: dict[str, str] = POLICY_ARMS) -> dict:
    tdir = traces / f"{wl}-{mbit:g}"
    tdir.mkdir(parents=True)
    row = measure(launch, runtimes, wl, mbit, measured, args.reps, args.steps, tmp, tdir,
                  args.jobs, job_env, auto_log, policy_arms, args.start_together)
    row["measured_mbit"] = measured
    where = f"{mbit:g} Mbit/s" if mbit else "one host"
    print(f"{wl} {where}: auto {row['auto_vs_sequential']:.2f}x sequential, "
          f"{row['auto_vs_plain']:.2f}x plain together ({row['auto_vs_best_baseline']:.2f}x "
          f"the better; per repetition "
          f"{'/'.join(f'{x:.2f}' for x in row['auto_vs_best_baseline_reps'])}); "
          f"crossover {row['crossover_vs_sequential']:.2f}x sequential; "
          f"comm share {100 * row['comm_share']:.0f}%{apart_note(row)}", flush=True)
    return row


if __name__ == "__main__":
    main()
