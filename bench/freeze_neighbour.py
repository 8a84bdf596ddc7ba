"""A freezing pipeline beside a Horovod job: what the neighbour gains once the pipeline cuts.

    .venv/bin/python bench/freeze_neighbour.py [--reps 3] [--epochs 40]
                                               [--workload finetune] [--freeze-threshold T]

Two jobs on this host under one crossover daemon (the default policy), their loops
started at one barrier: the graph
pipeline of bench/freeze_bench.py (examples/pipeline_digits.py, 2 ranks, `--slots`) and
a Horovod job (bench/crossover_job.py, 2 ranks, recording when each step ends). Two arms
a repetition, run one after the other:

    freeze      the pipeline freezes, re-partitions and caches its frozen front
                (freeze_bench's graph_freeze_cache arm); a rank its plan leaves out
                gives its device up
    no_freeze   the same pipeline without freezing: the control

The neighbour's step rate is measured in two windows of the pipeline's training: before
its first re-partition (the cut) and after its last one, to the pipeline's end; in the
no_freeze arm, over the same offsets from the pipeline's start. `neighbour_speedup_after_cut`
is the freeze arm's rate after over before (median over repetitions), beside the
control's; `neighbour_device_s_gained` the device-seconds the neighbour's extra steps
after the cut cost it alone (its rate once the pipeline has ended);
`neighbour_speedup_over_control_span` its rate over as long as the pipeline ran without
freezing, against the control's (the cut and the pipeline's earlier end together). Writes
bench/results/freeze_neighbour.json and freeze_neighbour_gantt.png (the last freeze
run's slot holds, the cuts marked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402
from freeze_bench import WORKLOADS, arm_flags  # noqa: E402
from jobs import JOB, ONE_HOST_ENV  # noqa: E402

from crossover import trace  # noqa: E402
from crossover.launch.local import DaemonProcess, Job, mpirun, run_together  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: The neighbour: a small Horovod MLP, so that a window of a second holds tens of steps.
NEIGHBOUR = ["--model", "mlp", "--width", "256", "--batch", "64", "--step-times"]


def rate(step_ends: list[float], start: float, end: float) -> float | None:
    """Steps a second between `start` and `end`, from the steps' end times: the steps
    that ended in the window over the time from the first to the last of them (a window
    with fewer than three has no rate)."""
    inside = [t for t in step_ends if start <= t <= end]
    if len(inside) < 3 or inside[-1] <= inside[0]:
        return None
    return (len(inside) - 1) / (inside[-1] - inside[0])


def windows(rows: list[dict]) -> tuple[float, float, float, float]:
    """(start, first cut, last cut, end), wall clock, from a pipeline's epoch rows."""
    cuts = [t for r in rows for t in r.get("repartition_walls", [])]
    if not cuts:
        raise RuntimeError("the pipeline never re-partitioned: nothing froze, so there "
                           "is no cut to measure around (lower --freeze-threshold)")
    return rows[0]["wall_start"], cuts[0], cuts[-1], rows[-1]["wall_end"]


def run_pair(arm: str, flags: list[str], epochs: int, steps: int, daemon: DaemonProcess,
             tmp: Path, rep: int) -> tuple[list[dict], dict]:
    """Both jobs at once; the pipeline's epoch rows and the neighbour's JSON line."""
    name = f"{arm}{rep}"
    history = tmp / f"{name}.history.json"
    barrier = ["--start-barrier", str(tmp / f"start-{name}"), "--start-jobs", "2"]
    env = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir),
           "CROSSOVER_TRACE": str(tmp / f"trace-{name}"), "PYTHONPATH": str(REPO)}
    pipeline = Job(f"pipeline-{name}", mpirun(
        2, sys.executable, str(REPO / "examples/pipeline_digits.py"), "--slots",
        "--epochs", str(epochs), "--plot", str(tmp / f"{name}.png"), "--history",
        str(history), "--profile", str(tmp / "costs.pkl"), *barrier, *flags),
        {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "pipeline"})
    neighbour = Job(f"neighbour-{name}", mpirun(2, sys.executable, str(JOB), *NEIGHBOUR,
                                                "--steps", str(steps), *barrier),
                    {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "neighbour"})
    done = run_together([pipeline, neighbour], timeout_s=600, log_dir=tmp)
    for res in done:
        if res.returncode != 0:
            raise RuntimeError(f"{res.name} failed (rc {res.returncode}):\n{res.output[-3000:]}")
    line = next(ln for ln in done[1].output.splitlines() if ln.startswith('{"model"'))
    return json.loads(history.read_text()), json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workload", default="finetune", choices=sorted(WORKLOADS))
    ap.add_argument("--freeze-threshold", type=float, default=None,
                    help="the criterion's threshold (default: the workload's, as in "
                         "bench/freeze_bench.py)")
    ap.add_argument("--neighbour-steps", type=int, default=2000,
                    help="the Horovod job's steps: enough to outlast the pipeline")
    args = ap.parse_args()
    freeze = arm_flags(args.workload, "graph_freeze_cache")
    if args.freeze_threshold is not None:
        at = freeze.index("--freeze-threshold")
        freeze[at + 1] = str(args.freeze_threshold)
    flags = {"freeze": freeze, "no_freeze": arm_flags(args.workload, "graph")}
    tmp = Path(tempfile.mkdtemp(prefix="crossover-neighbour-"))
    per_rep: list[dict] = []
    with DaemonProcess(tmp / "run", log=tmp / "daemon.log") as daemon:
        for rep in range(args.reps):
            rows, hvd = run_pair("freeze", flags["freeze"], args.epochs,
                                 args.neighbour_steps, daemon, tmp, rep)
            start, first_cut, last_cut, end = windows(rows)
            ctl_rows, ctl_hvd = run_pair("no_freeze", flags["no_freeze"], args.epochs,
                                         args.neighbour_steps, daemon, tmp, rep)
            c0, c_end = ctl_rows[0]["wall_start"], ctl_rows[-1]["wall_end"]
            ends, ctl_ends = hvd["step_ends"], ctl_hvd["step_ends"]
            for what, last, p0, p1 in (("freeze", ends[-1], start, end),
                                       ("no_freeze", ctl_ends[-1], c0, c_end)):
                if last < p1 + 1.0:  # and a second alone after it
                    raise RuntimeError(
                        f"{what}: the neighbour's last step ended {last - p0:.1f} s after "
                        f"the pipeline started, which ended at {p1 - p0:.1f} s: the "
                        f"neighbour must outlast it by a second (raise --neighbour-steps "
                        f"above {args.neighbour_steps})")
            r = {"before": rate(ends, start, first_cut), "after": rate(ends, last_cut, end),
                 "alone": rate(ends, end, ends[-1]),
                 # over as long as the pipeline without freezing took: what the neighbour
                 # gets from a pipeline that freezes, cut and early end together
                 "over_control_span": rate(ends, start, start + c_end - c0),
                 "control_span": rate(ctl_ends, c0, c_end),
                 "control_before": rate(ctl_ends, c0, c0 + first_cut - start),
                 "control_after": rate(ctl_ends, c0 + last_cut - start, c_end),
                 "cut_after_s": first_cut - start, "after_window_s": end - last_cut,
                 "pipeline_s": end - start, "control_pipeline_s": c_end - c0,
                 "pipeline_accuracy": rows[-1]["accuracy"],
                 "control_accuracy": ctl_rows[-1]["accuracy"],
                 "frozen": rows[-1]["frozen"], "devices_at_end": rows[-1]["devices"],
                 "spare_device_s": rows[-1]["spare_device_s"]}
            if None in r.values():
                raise RuntimeError(f"a window held too few neighbour steps: {r}")
            per_rep.append(r)
            print(f"freeze neighbour: rep {rep + 1}/{args.reps}: neighbour "
                  f"{r['before']:.1f} -> {r['after']:.1f} steps/s at the cut "
                  f"({r['cut_after_s']:.1f} s in), {r['alone']:.1f} alone; control "
                  f"{r['control_before']:.1f} -> {r['control_after']:.1f}", flush=True)
        events = trace.merge(sorted((tmp / f"trace-freeze{args.reps - 1}").glob("*.json")),
                             tmp / "freeze.trace.json")
        trace.plot_gantt(events, RESULTS / "freeze_neighbour_gantt.png",
                         title="a freezing pipeline and a Horovod job on one host: slot holds",
                         marks=[("cut", t) for t in
                                sorted({t for row in rows for t in row["repartition_walls"]})])
    med = statistics.median
    gained = [(r["after"] - r["before"]) * r["after_window_s"] for r in per_rep]
    result = {
        "workload": args.workload, "flags": flags, "neighbour": NEIGHBOUR,
        "epochs": args.epochs, "reps": args.reps, "policy": "the daemon's default (auto)",
        "neighbour_speedup_after_cut": med(r["after"] / r["before"] for r in per_rep),
        "control_speedup_same_offsets": med(r["control_after"] / r["control_before"]
                                            for r in per_rep),
        "neighbour_speedup_over_control_span": med(r["over_control_span"] / r["control_span"]
                                                   for r in per_rep),
        "neighbour_steps_gained": med(gained),
        # what those steps cost the neighbour's two ranks alone
        "neighbour_device_s_gained": med(2 * g / r["alone"] for g, r in zip(gained, per_rep,
                                                                          strict=True)),
        "pipeline_s": med(r["pipeline_s"] for r in per_rep),
        "control_pipeline_s": med(r["control_pipeline_s"] for r in per_rep),
        "accuracy_loss_points": round(100 * med(r["control_accuracy"] - r["pipeline_accuracy"]
                                                for r in per_rep), 2),
        "reps_detail": per_rep,
    }
    out = write_result("freeze_neighbour", result)
    print(json.dumps({k: v for k, v in result.items() if k != "reps_detail"}, indent=1))
    print(f"freeze neighbour: wrote {out} and {RESULTS / 'freeze_neighbour_gantt.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
