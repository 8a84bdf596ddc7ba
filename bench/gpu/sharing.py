"""Two PyTorch jobs sharing one GPU: the figures of bench/results/gpu/.

    python -m bench.gpu.sharing [--framework horovod|ddp] [--reps 3] [--steps 40]
                              [--check-steps 300] [--device cuda|cpu]
    (bash bench/gpu/sharing.sh sets up Horovod first, for --framework horovod, and runs this)

Each job has 2 ranks on this host, both on the GPU (local rank i takes GPU i mod the
GPUs present, so on one GPU every rank shares it); NCCL refuses two ranks of one
communicator on one GPU, so the gradients are averaged over Gloo:

    horovod  Horovod built without HOROVOD_GPU_ALLREDUCE copies CUDA gradients to host
             memory, sums them there and copies them back (launched by horovodrun's Gloo)
    ddp      DistributedDataParallel on the gloo process group, whose allreduce takes
             CUDA tensors (launched by torchrun; crossover.hooks.ddp)

One crossover daemon under the default policy. Interleaved in each repetition,
deterministic algorithms on in every arm:

    solo A, solo B    each job alone, plain (no crossover); sequential = their sum
    plain together    both at once, plain
    crossover         both at once under the daemon

Then the release check (bench/harness/release_check.py): both jobs under crossover for
`--check-steps` steps with the torch profiler, and again without the device sync before
release (the negative control). Writes bench/results/gpu/sharing.json, release.json and
gantt.png (the last crossover run's holds); with --framework ddp, ddp_sharing.json,
ddp_release.json and ddp_gantt.png.

`--device cpu` is a toy run of the sharing arms on this CPU (a small MLP), to check the
bench's plumbing where there is no GPU (bench/device_suite.sh --dry-run): its files are
prefixed `cpu_`, so they never stand in for GPU figures, and it refuses the release
check, which needs a GPU's kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.common import area_results, write_result
from bench.harness.jobs import is_ddp, makespan, run_jobs, torchrun_standalone
from bench.harness.rank_launch import local_gloo_run
from bench.harness.release_check import check_run
from crossover import trace
from crossover.launch.local import DaemonProcess

RESULTS = area_results("gpu")

RANKS = 2

#: The workload: an MLP of 50 M parameters (200 MB of fp32 gradients a step), batch
#: sized so a step's GPU compute takes tens of milliseconds on an H100.
WORKLOAD = ["--model", "mlp", "--width", "4096", "--layers", "4", "--batch", "8192",
            "--device", "cuda", "--deterministic"]

#: Every arm: deterministic cuBLAS (needed by use_deterministic_algorithms on CUDA);
#: Horovod's own defaults otherwise, as a user would run it.
JOB_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
#: `--device cpu`: a step of a few milliseconds, so a toy run takes seconds.
CPU_WORKLOAD = ["--model", "mlp", "--width", "64", "--layers", "2", "--batch", "16",
                "--device", "cpu", "--deterministic"]


@dataclass(frozen=True)
class Bench:
    """What the arms run: the jobs' framework, on the GPU or (a toy run) on the CPU."""

    framework: str
    device: str = "cuda"

    @property
    def workload(self) -> list[str]:
        """The job script's arguments, but for steps and seed."""
        return [*(WORKLOAD if self.device == "cuda" else CPU_WORKLOAD),
                "--framework", self.framework]

    @property
    def prefix(self) -> str:
        """Result files' prefix: none for Horovod on the GPU (the first GPU figures),
        `ddp_` for DDP, and `cpu_` before either for a toy run on the CPU."""
        own = "" if self.framework == "horovod" else f"{self.framework}_"
        return own if self.device == "cuda" else f"cpu_{own}"


def launch(argv: list[str]) -> list[str]:
    """A job's launch line: RANKS ranks on this host, under torchrun or horovodrun (Gloo)."""
    return torchrun_standalone(RANKS, argv) if is_ddp(argv) else local_gloo_run(RANKS, argv)


def gpu_preconditions() -> str:
    """The GPU's name; exits with what is missing when torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"bench.gpu.sharing: torch {torch.__version__} sees no CUDA device "
                 f"(CUDA build: {torch.version.cuda}); run it on a machine with an NVIDIA GPU")
    return torch.cuda.get_device_name(0)


def jobs(names: list[str], bench: Bench, env: dict[str, str], logs: Path, steps: int,
         extra: list[str] | None = None, first_seed: int = 1) -> list[dict]:
    """Run the named jobs at once (seeds first_seed, first_seed + 1, ...); jobs launched
    together start their loops at one barrier, so a makespan holds no launch skew. Jobs
    without crossover are references: one that printed its result and then hit torch's
    exit abort (jobs.TORCH_EXIT_ABORT) counts as done."""
    return run_jobs(launch, names, [*bench.workload, *(extra or [])],
                    steps, env, logs, timeout_s=600.0, job_env=JOB_ENV, first_seed=first_seed,
                    start_together=len(names) > 1,
                    reference=env.get("CROSSOVER_ENABLE") == "0")


def measure(daemon: DaemonProcess, bench: Bench, reps: int, steps: int, tmp: Path) -> dict:
    """All arms, `reps` times, interleaved; medians, slowdowns, weight equality."""
    plain = {"CROSSOVER_ENABLE": "0"}
    under = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir)}
    logs = tmp / "logs"
    logs.mkdir(parents=True)
    arms: dict[str, list] = {"solo_a": [], "solo_b": [], "plain_together": [], "crossover": []}
    traces = tmp / "traces"
    for rep in range(reps):
        arms["solo_a"] += jobs([f"r{rep}soloA"], bench, plain, logs, steps, first_seed=1)
        arms["solo_b"] += jobs([f"r{rep}soloB"], bench, plain, logs, steps, first_seed=2)
        arms["plain_together"].append(jobs([f"r{rep}plainA", f"r{rep}plainB"], bench,
                                           plain, logs, steps))
        env = {**under, **({"CROSSOVER_TRACE": str(traces)} if rep == reps - 1 else {})}
        arms["crossover"].append(jobs([f"r{rep}xA", f"r{rep}xB"], bench, env, logs,
                                      steps))
        print(f"rep {rep + 1}/{reps}: solo {arms['solo_a'][-1]['seconds']:.2f} + "
              f"{arms['solo_b'][-1]['seconds']:.2f} s, plain together "
              f"{makespan(arms['plain_together'][-1]):.2f} s, crossover "
              f"{makespan(arms['crossover'][-1]):.2f} s", flush=True)
    return summarize(arms, bench, traces, tmp)


def summarize(arms: dict[str, list], bench: Bench, traces: Path, tmp: Path) -> dict:
    """Medians, slowdowns and weight equality of the arms' job results (each job's JSON
    line); the Gantt chart of the crossover run traced into `traces`."""
    med = statistics.median
    solos = [med(r["seconds"] for r in arms[a]) for a in ("solo_a", "solo_b")]
    sequential = med(a["seconds"] + b["seconds"] for a, b in zip(arms["solo_a"],
                                                                 arms["solo_b"], strict=True))
    plain_s = med(makespan(r) for r in arms["plain_together"])
    cx_s = med(makespan(r) for r in arms["crossover"])
    compute = med(a["compute_s"] + b["compute_s"] for a, b in zip(arms["solo_a"],
                                                                 arms["solo_b"], strict=True))
    comm = med(a["comm_s"] + b["comm_s"] for a, b in zip(arms["solo_a"], arms["solo_b"],
                                                         strict=True))

    def slowdown(arm: str) -> list[float]:  # per job: its time together over its time alone
        return [med(run[i]["seconds"] for run in arms[arm]) / solos[i] for i in range(2)]

    solo_digests = [{r["weights_sha256"] for r in arms[a]} for a in ("solo_a", "solo_b")]
    equal = {arm: all({run[i]["weights_sha256"] for run in arms[arm]} == solo_digests[i]
                      for i in range(2)) for arm in ("plain_together", "crossover")}
    merged = trace.merge(sorted(traces.glob("*.json")), tmp / "crossover.trace.json")
    where = "one GPU" if bench.device == "cuda" else "the CPU (toy run)"
    trace.plot_gantt(merged, RESULTS / f"{bench.prefix}gantt.png",
                     title=f"two 2-rank {bench.framework} jobs on {where} under crossover: "
                           "slot holds")
    return {
        "solo_s": solos, "sequential_s": sequential, "plain_together_s": plain_s,
        "crossover_s": cx_s, "compute_s": compute, "comm_s": comm,
        "bound_s": max(compute, comm),
        "crossover_vs_sequential": sequential / cx_s,
        "crossover_vs_plain_together": plain_s / cx_s,
        "plain_together_vs_sequential": sequential / plain_s,
        "slowdown_vs_solo": {"plain_together": slowdown("plain_together"),
                             "crossover": slowdown("crossover")},
        "weights_equal_solo": equal,
        "weight_digests_solo": [sorted(d) for d in solo_digests],
        "overlapping_holds": len(trace.overlaps(merged)),
        "devices_in_trace": sorted(trace.holds_by_device(merged)),
        "raw": arms,
    }


def release_check(daemon: DaemonProcess, bench: Bench, steps: int, tmp: Path) -> dict:
    """Both jobs under crossover with the profiler: with the device sync, and without."""
    out = {}
    for arm, extra in (("with_device_sync", []), ("without_device_sync",
                                                  ["--skip-device-sync"])):
        pdir, tdir = tmp / f"profile-{arm}", tmp / f"trace-{arm}"
        names = [f"{arm}A", f"{arm}B"]
        env = {"CROSSOVER_RUNTIME_DIR": str(daemon.runtime_dir), "CROSSOVER_TRACE": str(tdir)}
        runs = jobs(names, bench, env, tmp / "logs", steps,
                    [*extra, "--profile-dir", str(pdir)])
        out[arm] = {**check_run(pdir, tdir, names, RANKS),
                    "seconds": [r["seconds"] for r in runs]}
        c = out[arm]
        print(f"release check, {arm.replace('_', ' ')}: {c['kernel_overruns']} of "
              f"{c['kernels']} kernels and {c['copy_overruns']} of {c['copies']} copies ran "
              f"past their hold (max {c['max_overrun_us']:.0f} us), "
              f"{c['kernels_released']} kernels started while "
              f"released; kernels of both jobs at once "
              f"{c['kernels_of_two_jobs_at_once_s'] * 1e3:.1f} ms", flush=True)
    return out


def nvidia_smi() -> dict:
    """The GPU, its driver and memory, as nvidia-smi reports them."""
    res = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    name, driver, memory = (x.strip() for x in res.stdout.splitlines()[0].split(","))
    return {"gpu": name, "driver": driver, "gpu_memory": memory}


def main() -> None:
    """Run the arms and the release check; write the JSON files and the Gantt chart."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--check-steps", type=int, default=300)
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--skip-sharing", action="store_true", help="the release check only")
    skip.add_argument("--skip-release", action="store_true", help="the sharing arms only")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep logs, traces and profiles in this new directory "
                             "(default: a temporary one, removed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a toy run of the sharing arms on this CPU, to check the "
                             "bench where there is no GPU (files prefixed cpu_)")
    args = parser.parse_args()
    bench = Bench(args.framework, args.device)
    if bench.device == "cpu" and not args.skip_release:
        parser.error("--device cpu: the release check needs a GPU's kernels; add "
                     "--skip-release")
    import torch

    if bench.device == "cuda":
        gpu_preconditions()
        versions = {**nvidia_smi(), "torch_cuda": torch.version.cuda}
    else:
        versions = {"gpu": None, "toy_run": "on the CPU, to check the bench; no GPU figure"}
    versions["framework"] = args.framework
    if args.framework == "horovod":
        import horovod

        versions.update(horovod=horovod.__version__,
                        horovod_allreduce_of_cuda_tensors="host memory over Gloo "
                                                          "(no HOROVOD_GPU_ALLREDUCE)")
    elif bench.device == "cuda":
        versions.update(ddp_allreduce_of_cuda_tensors="torch.distributed's gloo process "
                                                      "group, on the CUDA tensors")
    setup = {"ranks_per_job": RANKS, "hosts": "one (localhost): the two ranks of a job and "
             f"both jobs share the one {'GPU' if bench.device == 'cuda' else 'CPU'}",
             "workload": bench.workload, "job_env": JOB_ENV}
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crossover-gpu-") as tmp_s:
        tmp = args.work or Path(tmp_s)
        (tmp / "logs").mkdir(parents=True)
        if not args.skip_release:
            # Always antiphase for the release check: a release at every step, the most
            # releases to check (auto may serve the jobs concurrently, releasing nothing).
            with DaemonProcess(tmp / "run-check", policy="crossover",
                               log=tmp / "daemon-check.log") as daemon:
                check = release_check(daemon, bench, args.check_steps, tmp)
            write_result(RESULTS, f"{bench.prefix}release", {**versions, "setup": {
                **setup, "policy": "crossover (always antiphase)", "steps": args.check_steps,
                "start_together": True},
                **check})
        if not args.skip_sharing:
            with DaemonProcess(tmp / "run", log=tmp / "daemon.log") as daemon:
                shared = measure(daemon, bench, args.reps, args.steps, tmp / "sharing")
            write_result(RESULTS, f"{bench.prefix}sharing", {**versions, "setup": {
                **setup, "policy": "the daemon's default (auto)", "steps": args.steps,
                "reps": args.reps, "start_together": True}, **shared,
                "wall_s": time.monotonic() - started})
            print(f"sequential {shared['sequential_s']:.2f} s, plain together "
                  f"{shared['plain_together_s']:.2f} s, crossover "
                  f"{shared['crossover_s']:.2f} s: {shared['crossover_vs_sequential']:.2f}x "
                  f"sequential, {shared['crossover_vs_plain_together']:.2f}x plain "
                  f"together; weights equal solo: {shared['weights_equal_solo']}", flush=True)
    print(f"-> {RESULTS}", flush=True)


if __name__ == "__main__":
    if os.environ.get("CROSSOVER_ENABLE") == "0":
        sys.exit("bench.gpu.sharing: unset CROSSOVER_ENABLE; the bench sets it per arm")
    main()
