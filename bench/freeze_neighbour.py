"""A freezing pipeline beside a Horovod job: what the neighbour gains once the pipeline cuts.

    .venv/bin/python bench/freeze_neighbour.py [--reps 3] [--epochs 40]
                                               [--workload finetune] [--freeze-threshold T]

Two jobs on this host under one crossover daemon (the default policy), their loops
started at one barrier: the graph pipeline of bench/freeze_bench.py
(examples/pipeline_digits.py, 2 ranks, `--slots`) and a Horovod job
(bench/crossover_job.py, 2 ranks, recording when each step ends). Two arms a
repetition, run one after the other:

    freeze      the pipeline freezes, re-partitions and caches its frozen front
                (freeze_bench's graph_freeze_cache arm); a rank its plan leaves out
                gives its device up
    no_freeze   the same pipeline without freezing: the control

The neighbour's step rate is measured in windows of the pipeline's training: before
its first re-partition (the cut) and after its last one; beside the control, over the
same offsets from its start. Keys, each the median, least and most over repetitions:
`neighbour_speedup_after_cut` (after over before, freeze arm), `control_after_over_before`
(the same windows beside the control: what drift alone gives),
`neighbour_speedup_over_control_span` (the neighbour's rate over as long as the control
pipeline trained, against its rate beside the control: the cut and the earlier end
together) and `pipeline_speedup`; `core_shares` are the daemon's placements of the jobs
on the host's cores as it logged them. Writes bench/results/freeze_neighbour.json and
freeze_neighbour_gantt.png (the last freeze run's slot holds, the cuts marked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402
from freeze_bench import WORKLOADS, arm_flags, example_cmd  # noqa: E402
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


@dataclass
class PipelineRun:
    """One pipeline run beside the neighbour: its epoch rows, when its process ended
    (wall clock; it keeps its cores through the last evaluation, the plot and MPI's
    shutdown), and the neighbour's step ends."""

    rows: list[dict]
    exit_wall: float
    step_ends: list[float]


def compare(frozen: PipelineRun, control: PipelineRun) -> dict:
    """One repetition's figures: the neighbour's step rate beside the freezing pipeline
    before its first cut and after its last, beside the control over the same offsets
    from its start, over as long as the control's training took, and alone.

    Raises:
        RuntimeError: no cut, a neighbour that did not outlast what is measured, or a
            window with too few steps, each naming the fix.
    """
    start, first_cut, last_cut, end = windows(frozen.rows)
    c0, c_end = control.rows[0]["wall_start"], control.rows[-1]["wall_end"]
    ends, ctl = frozen.step_ends, control.step_ends
    need = max(frozen.exit_wall + 1.0, start + (c_end - c0))
    for what, last, needed in (("freeze", ends[-1], need), ("no_freeze", ctl[-1], c_end)):
        if last < needed:
            raise RuntimeError(f"{what}: the neighbour's last step ended {needed - last:.1f} "
                               f"s before what is measured ends (the pipeline's run, a "
                               f"second alone after its exit, the control's span): raise "
                               f"--neighbour-steps")
    out = {"before": rate(ends, start, first_cut), "after": rate(ends, last_cut, end),
           "alone": rate(ends, frozen.exit_wall, ends[-1]),
           "control_before": rate(ctl, c0, c0 + (first_cut - start)),
           "control_after": rate(ctl, c0 + (last_cut - start), c0 + (end - start)),
           # as long as the pipeline without freezing trained: what the neighbour gets
           # from a pipeline that freezes, its cut and its earlier end together
           "over_control_span": rate(ends, start, start + (c_end - c0)),
           "control_span": rate(ctl, c0, c_end)}
    short = [k for k, v in out.items() if v is None]
    if short:
        raise RuntimeError(f"windows {short} held fewer than three neighbour steps: give "
                           f"the pipeline more --epochs or the neighbour shorter steps")
    return {**out, "cut_after_s": first_cut - start, "after_window_s": end - last_cut,
            "pipeline_s": end - start, "control_pipeline_s": c_end - c0,
            "pipeline_accuracy": frozen.rows[-1]["accuracy"],
            "control_accuracy": control.rows[-1]["accuracy"],
            "frozen": frozen.rows[-1]["frozen"], "devices_at_end": frozen.rows[-1]["devices"],
            "spare_device_s": frozen.rows[-1]["spare_device_s"]}


def run_pair(arm: str, flags: list[str], epochs: int, steps: int, daemon: DaemonProcess,
             tmp: Path, rep: int) -> PipelineRun:
    """Both jobs at once, their loops started at one barrier."""
    name = f"{arm}{rep}"
    history = tmp / f"{name}.history.json"
    barrier = ["--start-barrier", str(tmp / f"start-{name}"), "--start-jobs", "2"]
    env = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir),
           "CROSSOVER_TRACE": str(tmp / f"trace-{name}"), "PYTHONPATH": str(REPO)}
    pipeline = Job(f"pipeline-{name}",
                   example_cmd(["--slots", *barrier, *flags], epochs, tmp, name, history),
                   {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "pipeline"})
    neighbour = Job(f"neighbour-{name}", mpirun(2, sys.executable, str(JOB), *NEIGHBOUR,
                                                "--steps", str(steps), *barrier),
                    {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "neighbour"})
    launched = time.time()
    done = run_together([pipeline, neighbour], timeout_s=600, log_dir=tmp)
    for res in done:
        if res.returncode != 0:
            raise RuntimeError(f"{res.name} failed (rc {res.returncode}):\n{res.output[-3000:]}")
    line = next((ln for ln in done[1].output.splitlines() if ln.startswith('{"model"')), None)
    if line is None:
        raise RuntimeError(f"{done[1].name} printed no result line: see {tmp / done[1].name}.log")
    return PipelineRun(json.loads(history.read_text()), launched + done[0].seconds,
                       json.loads(line)["step_ends"])


def core_shares(daemon_log: Path) -> list[str]:
    """The daemon's placements of the jobs on this host's cores, as it logged them."""
    return [ln.split("cores on node ", 1)[1].strip() for ln in
            daemon_log.read_text().splitlines() if "cores on node " in ln]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
    ap.add_argument("--work", type=Path, default=None,
                    help="keep logs, histories and traces in this new directory "
                         "(default: a temporary one, removed)")
    args = ap.parse_args()
    for flag, value, least in (("--reps", args.reps, 1), ("--epochs", args.epochs, 2),
                               ("--neighbour-steps", args.neighbour_steps, 10)):
        if value < least:
            ap.error(f"{flag} {value}: give {least} or more")
    freeze = arm_flags(args.workload, "graph_freeze_cache",
                       {"--freeze-threshold": args.freeze_threshold})
    flags = {"freeze": freeze, "no_freeze": arm_flags(args.workload, "graph")}
    with tempfile.TemporaryDirectory(prefix="crossover-neighbour-") as tmp_s:
        tmp = args.work or Path(tmp_s)
        tmp.mkdir(parents=True, exist_ok=args.work is None)
        per_rep, shares = measure(args, flags, tmp)
    med = statistics.median
    result = {
        "workload": args.workload, "flags": flags, "neighbour": NEIGHBOUR,
        "epochs": args.epochs, "reps": args.reps, "policy": "the daemon's default (auto)",
        "neighbour_speedup_after_cut": spread([r["after"] / r["before"] for r in per_rep]),
        "control_after_over_before": spread([r["control_after"] / r["control_before"]
                                             for r in per_rep]),
        "neighbour_speedup_over_control_span": spread([r["over_control_span"]
                                                       / r["control_span"] for r in per_rep]),
        "pipeline_speedup": spread([r["control_pipeline_s"] / r["pipeline_s"]
                                    for r in per_rep]),
        "pipeline_s": med(r["pipeline_s"] for r in per_rep),
        "control_pipeline_s": med(r["control_pipeline_s"] for r in per_rep),
        "accuracy_loss_points": round(100 * med(r["control_accuracy"] - r["pipeline_accuracy"]
                                                for r in per_rep), 2),
        # the cores the daemon gave each job, every time they changed (in concurrent
        # service on one host's CPU each job gets its own, at least one)
        "core_shares": shares,
        "reps_detail": per_rep,
    }
    out = write_result("freeze_neighbour", result)
    print(json.dumps({k: v for k, v in result.items() if k != "reps_detail"}, indent=1))
    print(f"freeze neighbour: wrote {out} and {RESULTS / 'freeze_neighbour_gantt.png'}")
    return 0


def measure(args: argparse.Namespace, flags: dict[str, list[str]], tmp: Path
            ) -> tuple[list[dict], list[str]]:
    """Every repetition's figures (`compare`) and the daemon's core placements; the
    Gantt chart of the last freeze run."""
    per_rep: list[dict] = []
    with DaemonProcess(tmp / "run", log=tmp / "daemon.log") as daemon:
        for rep in range(args.reps):
            frozen = run_pair("freeze", flags["freeze"], args.epochs, args.neighbour_steps,
                              daemon, tmp, rep)
            windows(frozen.rows)  # no cut: say so before the control runs
            control = run_pair("no_freeze", flags["no_freeze"], args.epochs,
                               args.neighbour_steps, daemon, tmp, rep)
            r = compare(frozen, control)
            per_rep.append(r)
            print(f"freeze neighbour: rep {rep + 1}/{args.reps}: neighbour "
                  f"{r['before']:.1f} -> {r['after']:.1f} steps/s at the cut "
                  f"({r['cut_after_s']:.1f} s in), {r['alone']:.1f} alone; control "
                  f"{r['control_before']:.1f} -> {r['control_after']:.1f}", flush=True)
    events = trace.merge(sorted((tmp / f"trace-freeze{args.reps - 1}").glob("*.json")),
                         tmp / "freeze.trace.json")
    cuts = sorted(t for row in frozen.rows for t in row["repartition_walls"])
    trace.plot_gantt(events, RESULTS / "freeze_neighbour_gantt.png",
                     title="a freezing pipeline and a Horovod job on one host: slot holds",
                     marks=[(f"cut {i + 1}", t) for i, t in enumerate(cuts)])
    return per_rep, core_shares(tmp / "daemon.log")


if __name__ == "__main__":
    sys.exit(main())
