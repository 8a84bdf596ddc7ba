"""A freezing pipeline beside a Horovod job: what the neighbour gains once the pipeline cuts.

    .venv/bin/python -m bench.freeze.neighbour [--reps 3] [--epochs 40]
                                               [--workload finetune] [--freeze-threshold T]
                                               [--neighbour-framework horovod|ddp]
                                               [--neighbour-device cpu|cuda] [--name N]

Two jobs on this host under one crossover daemon (the default policy), their loops
started at one barrier: the graph pipeline of bench/freeze/time_to_accuracy.py
(examples/pipeline_digits.py, 2 ranks, `--slots`) and a neighbour job
(bench/harness/training_job.py, 2 ranks, recording when each step ends): Horovod under mpirun,
or with `--neighbour-framework ddp` PyTorch DDP under torchrun (no Horovod needed); on
the CPU, or with `--neighbour-device cuda` on the GPU (the pipeline computes on the CPU
either way). Two arms a repetition, run one after the other:

    no_freeze   the pipeline without freezing: the control
    freeze      the same pipeline freezing, re-partitioning and caching its frozen front
                (time_to_accuracy's graph_freeze_cache arm); a rank its plan leaves out
                gives its device up

The neighbour trains until it has outlasted what is measured (the control's span, and a
second after the pipeline's exit), then stops at a step its ranks agree on
(`training_job.py --stop-file`); `--neighbour-steps` is the most it may take.

The neighbour's step rate is measured in windows of the pipeline's training: before
its first re-partition (the cut) and after its last one; beside the control, over the
same offsets from its start. Keys, each the median, least and most over repetitions:
`neighbour_speedup_after_cut` (after over before, freeze arm), `control_after_over_before`
(the same windows beside the control: what drift alone gives),
`neighbour_speedup_over_control_span` (the neighbour's rate over as long as the control
pipeline trained, against its rate beside the control: the cut and the earlier end
together) and `pipeline_speedup`; `core_shares` are the daemon's placements of the jobs
on the host's cores as it logged them. Writes bench/results/freeze/freeze_neighbour.json and
freeze_neighbour_gantt.png (the last freeze run's slot holds, the cuts marked), or
<name>.json and <name>_gantt.png with `--name`, in bench/results/<area>/ with `--area`
(bench/device_suite.sh: gpu).
A fine-tuning workload's pretrained body is made first (cached) in this process, on
the GPU where the neighbour runs on one: a pipeline rank would make it on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.freeze.time_to_accuracy import WORKLOADS, arm_flags, example_cmd
from bench.harness.common import REPO, area_results, module_argv, write_result
from bench.harness.jobs import JOB, ONE_HOST_ENV, result_line, torchrun_standalone
from crossover import trace
from crossover.launch.local import DaemonProcess, Job, mpi_env, mpirun

#: The neighbour: a small MLP, so that a window of a second holds tens of steps.
NEIGHBOUR = ["--model", "mlp", "--width", "256", "--batch", "64", "--step-times"]
#: How long the neighbour goes on after the pipeline's exit: its rate alone.
ALONE_S = 1.5
#: The longest a pair may run (the pipeline, then the neighbour's stop).
PAIR_TIMEOUT_S = 600.0


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


def started(job: Job, log: Path) -> subprocess.Popen:
    """`job` running in a process group of its own, its output to `log`."""
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(job.cmd, env={**os.environ, **mpi_env(), **job.env},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def ended(proc: subprocess.Popen, deadline: float) -> float | None:
    """Wait for `proc` until `deadline` (monotonic); when it ended (wall clock), or None."""
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return time.time()


def neighbour_cmd(args: argparse.Namespace, barrier: list[str], stop: Path) -> list[str]:
    """The neighbour's launch line: 2 ranks, under torchrun (DDP) or mpirun (Horovod)."""
    argv = [*module_argv(JOB), *NEIGHBOUR, "--framework", args.neighbour_framework,
            "--device", args.neighbour_device, "--steps", str(args.neighbour_steps),
            "--stop-file", str(stop), *barrier]
    return torchrun_standalone(2, argv) if args.neighbour_framework == "ddp" \
        else mpirun(2, *argv)


def run_pair(arm: str, flags: list[str], args: argparse.Namespace, daemon: DaemonProcess,
             tmp: Path, rep: int, keep_s: float) -> PipelineRun:
    """Both jobs at once, their loops started at one barrier; the neighbour is stopped
    once it has run `keep_s` past the pipeline's start and ALONE_S past its exit.

    Raises:
        RuntimeError: a job failed or ran past PAIR_TIMEOUT_S (its log named).
    """
    name = f"{arm}{rep}"
    history, stop = tmp / f"{name}.history.json", tmp / f"stop-{name}"
    barrier = ["--start-barrier", str(tmp / f"start-{name}"), "--start-jobs", "2"]
    # the suite's install first (crossover.hooks is only there), this clone after it
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    env = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir),
           "CROSSOVER_TRACE": str(tmp / f"trace-{name}"), "PYTHONPATH": path}
    jobs = [Job(f"pipeline-{name}",
                example_cmd(["--slots", *barrier, *flags], args.epochs, tmp, name, history),
                {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "pipeline"}),
            Job(f"neighbour-{name}", neighbour_cmd(args, barrier, stop),
                {**ONE_HOST_ENV, **env, "CROSSOVER_JOB": "neighbour"})]
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    procs = [started(job, tmp / f"{job.name}.log") for job in jobs]
    try:
        exit_wall = ended(procs[0], deadline)
        if exit_wall is not None and procs[0].returncode == 0:
            rows = json.loads(history.read_text())
            until = max(exit_wall + ALONE_S, rows[0]["wall_start"] + keep_s)
            time.sleep(max(0.0, min(until - time.time(), deadline - time.monotonic())))
            stop.touch()
            ended(procs[1], deadline)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    outputs = [(tmp / f"{job.name}.log").read_text() for job in jobs]
    # the neighbour is read for its step times only: torch's exit abort after its
    # result line (now and then, in gloo's teardown) does not void them
    line = result_line(outputs[1], procs[1].returncode, reference=True)
    for job, proc, output in zip(jobs, procs, outputs, strict=True):
        if proc.returncode != 0 and not (job is jobs[1] and line):
            raise RuntimeError(f"{job.name} failed (rc {proc.returncode}, -9: past "
                               f"{PAIR_TIMEOUT_S:.0f} s): see {tmp / job.name}.log:\n"
                               f"{output[-3000:]}")
    if line is None:
        raise RuntimeError(f"{jobs[1].name} printed no result line: see {tmp / jobs[1].name}.log")
    return PipelineRun(rows, exit_wall, json.loads(line)["step_ends"])


def core_shares(daemon_log: Path) -> list[str]:
    """The daemon's placements of the jobs on this host's cores, as it logged them."""
    return [ln.split("cores on node ", 1)[1].strip() for ln in
            daemon_log.read_text().splitlines() if "cores on node " in ln]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pretrain(workload: str, device: str) -> None:
    """Make the workload's pretrained body now (cached; nothing to do for digits), on the
    GPU when the neighbour runs on one: a pipeline rank would make it on one core (about
    3.5 minutes for the 1024-wide body)."""
    model = WORKLOADS[workload][0]
    if "--finetune" not in model:
        return
    from examples import pipeline_digits

    depth, width = (int(model[model.index(flag) + 1]) for flag in ("--depth", "--width"))
    pipeline_digits.pretrained_body(depth, width, device=device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workload", default="finetune", choices=sorted(WORKLOADS))
    ap.add_argument("--freeze-threshold", type=float, default=None,
                    help="the criterion's threshold (default: the workload's, as in "
                         "bench/freeze/time_to_accuracy.py)")
    ap.add_argument("--neighbour-steps", type=int, default=100_000,
                    help="the most steps the neighbour may take (it stops once it has "
                         "outlasted what is measured)")
    ap.add_argument("--neighbour-framework", choices=("horovod", "ddp"), default="horovod",
                    help="the neighbour job: Horovod under mpirun, or DDP under torchrun")
    ap.add_argument("--neighbour-device", choices=("cpu", "cuda"), default="cpu",
                    help="where the neighbour computes: cuda puts it on the GPU")
    ap.add_argument("--name", default="freeze_neighbour", help="result name")
    ap.add_argument("--area", default="freeze",
                    help="the folder under bench/results (the device suite's run: gpu)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep logs, histories and traces in this new directory "
                         "(default: a temporary one, removed)")
    args = ap.parse_args()
    for flag, value, least in (("--reps", args.reps, 1), ("--epochs", args.epochs, 2),
                               ("--neighbour-steps", args.neighbour_steps, 10)):
        if value < least:
            ap.error(f"{flag} {value}: give {least} or more")
    if args.neighbour_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--neighbour-device cuda: torch {torch.__version__} sees no CUDA "
                     f"device; run on a GPU machine or leave the neighbour on the cpu")
    pretrain(args.workload, args.neighbour_device)
    freeze = arm_flags(args.workload, "graph_freeze_cache",
                       {"--freeze-threshold": args.freeze_threshold})
    flags = {"freeze": freeze, "no_freeze": arm_flags(args.workload, "graph")}
    with tempfile.TemporaryDirectory(prefix="crossover-neighbour-") as tmp_s:
        tmp = args.work or Path(tmp_s)
        tmp.mkdir(parents=True, exist_ok=args.work is None)
        per_rep, shares = measure(args, flags, tmp)
    med = statistics.median
    result = {
        "workload": args.workload, "flags": flags,
        "neighbour": [*NEIGHBOUR, "--framework", args.neighbour_framework,
                      "--device", args.neighbour_device],
        "epochs": args.epochs, "reps": args.reps, "policy": "the daemon's default (auto)",
        "pipeline_device": "cpu",
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
    out = write_result(area_results(args.area), args.name, result)
    print(json.dumps({k: v for k, v in result.items() if k != "reps_detail"}, indent=1))
    print(f"freeze neighbour: wrote {out} and {area_results(args.area) / args.name}_gantt.png")
    return 0


def measure(args: argparse.Namespace, flags: dict[str, list[str]], tmp: Path
            ) -> tuple[list[dict], list[str]]:
    """Every repetition's figures (`compare`) and the daemon's core placements; the
    Gantt chart of the last freeze run. The control runs first: the freezing pipeline's
    neighbour must outlast the control's span."""
    per_rep: list[dict] = []
    with DaemonProcess(tmp / "run", log=tmp / "daemon.log") as daemon:
        for rep in range(args.reps):
            control = run_pair("no_freeze", flags["no_freeze"], args, daemon, tmp, rep, 0.0)
            span = control.rows[-1]["wall_end"] - control.rows[0]["wall_start"]
            frozen = run_pair("freeze", flags["freeze"], args, daemon, tmp, rep, span + 0.5)
            r = compare(frozen, control)
            per_rep.append(r)
            print(f"freeze neighbour: rep {rep + 1}/{args.reps}: neighbour "
                  f"{r['before']:.1f} -> {r['after']:.1f} steps/s at the cut "
                  f"({r['cut_after_s']:.1f} s in), {r['alone']:.1f} alone; control "
                  f"{r['control_before']:.1f} -> {r['control_after']:.1f}", flush=True)
    events = trace.merge(sorted((tmp / f"trace-freeze{args.reps - 1}").glob("*.json")),
                         tmp / "freeze.trace.json")
    cuts = sorted(t for row in frozen.rows for t in row["repartition_walls"])
    gantt = area_results(args.area) / f"{args.name}_gantt.png"
    gantt.parent.mkdir(parents=True, exist_ok=True)
    where = "on the GPU" if args.neighbour_device == "cuda" else "on one host"
    trace.plot_gantt(events, gantt,
                     title=f"a freezing pipeline and a {args.neighbour_framework} job "
                           f"({where}): slot holds",
                     marks=[(f"cut {i + 1}", t) for i, t in enumerate(cuts)])
    return per_rep, core_shares(tmp / "daemon.log")


if __name__ == "__main__":
    sys.exit(main())
