"""Single-job overhead: one 2-rank job under the daemon vs the same job plain.

    .venv/bin/python bench/overhead_bench.py [--reps 5] [--framework ddp]

A Horovod PyTorch job under mpirun (examples/torch_mlp.py), or with `--framework ddp` a
PyTorch DDP job under torchrun (examples/ddp_mlp.py). Runs alternate (plain, crossover,
plain, ...) so drift on a shared machine hits both alike; reports medians of samples/s
and writes bench/results/overhead.json (overhead_ddp.json). For DDP it also measures what
the hooks add to a step inside one process (bench/ddp_step_cost.py, `--cost-runs`
launches): alternating steps of plain and wrapped models, far less noisy than whole runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from crossover.client import RankInfo, SlotClient  # noqa: E402
from crossover.launch.local import DaemonProcess, Job, mpirun, run_together  # noqa: E402
from crossover.protocol import Phase  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def samples_per_s(job: Job) -> float:
    (res,) = run_together([job], timeout_s=300)
    if res.returncode != 0:
        raise RuntimeError(f"{job.name} failed:\n{res.output}")
    line = next(ln for ln in res.output.splitlines() if ln.startswith('{"samples_per_s"'))
    return json.loads(line)["samples_per_s"]


def step_cost(runs: int, env: dict[str, str], hidden: int, layers: int) -> dict:
    """bench/ddp_step_cost.py `runs` times under torchrun, the wrapped model built first,
    second, third in turn: each run's median steps (wall and main-thread CPU) per role;
    crossover's cost in a run against the mean of its two plain models, and the two
    plain models' gap (the noise floor), each the median over the runs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(REPO / "bench/ddp_step_cost.py"),
           "--hidden", str(hidden), "--layers", str(layers)]
    per_run = []
    for i in range(runs):
        (res,) = run_together([Job("step-cost", [*cmd, "--wrapped", str(i % 3)], env)],
                              timeout_s=600)
        if res.returncode != 0:
            raise RuntimeError(f"ddp_step_cost failed:\n{res.output[-3000:]}")
        line = next(ln for ln in res.output.splitlines() if ln.startswith('{"step_cost"'))
        per_run.append(json.loads(line)["step_cost"])
        print(f"step cost run {i + 1}/{runs}: " + ", ".join(
            f"{k} {v['cpu_us']:.0f} us CPU" for k, v in per_run[-1].items()), flush=True)
    out: dict = {"runs": per_run}
    med = statistics.median
    for clock in ("wall_us", "cpu_us"):  # paired within each run, then the median
        cost = [r["crossover"][clock] / ((r["plain"][clock] + r["plain_again"][clock]) / 2)
                - 1 for r in per_run]
        floor = [abs(r["plain_again"][clock] / r["plain"][clock] - 1) for r in per_run]
        out[clock.replace("_us", "_overhead")] = med(cost)
        out[clock.replace("_us", "_noise_floor")] = med(floor)
    return out


def slot_cycle_us(runtime_dir: Path, company: bool, cycles: int = 2000,
                  batches: int = 5) -> list[float]:
    """Microseconds per step's slot calls (acquire + release for communication): what
    the hooks add to every training step. Alone on the device the rank keeps it (no
    messages); with `company` (another job registered, idle) each cycle is a real
    release and acquire round trip."""
    other = None
    if company:
        other = SlotClient("idle-neighbour", RankInfo(0, 1, 0, 1), runtime_dir=runtime_dir,
                           pin_cpu=False)
        other.acquire()
        other.release(Phase.IDLE)  # registered, not in the way
    client = SlotClient("cycle", RankInfo(0, 1, 0, 1), runtime_dir=runtime_dir, pin_cpu=False)
    assert client.coordinated, "no daemon"
    out = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(cycles):
            client.acquire()
            client.release(Phase.COMMUNICATE)
        out.append((time.perf_counter() - start) / cycles * 1e6)
    client.close()
    if other is not None:
        other.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    parser.add_argument("--cost-runs", type=int, default=6,
                        help="DDP: launches of bench/ddp_step_cost.py (0: none)")
    args = parser.parse_args()
    model = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers",
             str(args.layers)]
    if args.framework == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(REPO / "examples/ddp_mlp.py"), *model,
               "--bucket-mb", "25"]  # DDP's default bucket size
    else:
        cmd = mpirun(2, sys.executable, str(REPO / "examples/torch_mlp.py"), *model)
    plain, under = [], []
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(Path(tmp) / "run"):
        env = {"CROSSOVER_RUNTIME_DIR": str(Path(tmp) / "run"), "CROSSOVER_JOB": "solo",
               "OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "5"}
        for rep in range(args.reps):
            plain.append(samples_per_s(Job("plain", cmd, {**env, "CROSSOVER_ENABLE": "0"})))
            under.append(samples_per_s(Job("crossover", cmd, env)))
            print(f"rep {rep}: plain {plain[-1]:.0f}, crossover {under[-1]:.0f} samples/s",
                  flush=True)
        cost = (step_cost(args.cost_runs, env, args.hidden, args.layers)
                if args.framework == "ddp" and args.cost_runs else None)
        alone = slot_cycle_us(Path(tmp) / "run", company=False)
        cycle = slot_cycle_us(Path(tmp) / "run", company=True)
    p, c = statistics.median(plain), statistics.median(under)
    step_us = 32 * 2 / p * 1e6  # one step of the plain job: 2 ranks x 32 samples
    cycle_med = statistics.median(cycle)
    out = write_result("overhead" + ("_ddp" if args.framework == "ddp" else ""), {
        "workload": f"MLP 64-{args.hidden}x{args.layers}-10, batch 32/rank, 2 ranks, "
                    f"{args.steps} steps, {args.framework}",
        "plain_samples_per_s": plain, "crossover_samples_per_s": under,
        "median_plain": p, "median_crossover": c,
        "single_job_overhead": 1 - c / p,
        "slot_cycle_alone_us": alone, "median_slot_cycle_alone_us": statistics.median(alone),
        "slot_cycle_us": cycle, "median_slot_cycle_us": cycle_med,
        "median_step_us": step_us,
        "slot_cycle_share_of_step": cycle_med / step_us,
        **({"step_cost_in_process": cost} if cost else {}),
    })
    print(f"single-job overhead, end to end: {100 * (1 - c / p):.1f}% (median of "
          f"{args.reps}; noisy on a shared machine)")
    if cost:
        print(f"in one process, alternating steps: crossover adds "
              f"{100 * cost['cpu_overhead']:.1f}% main-thread CPU and "
              f"{100 * cost['wall_overhead']:.1f}% wall time to a step (noise floor "
              f"{100 * cost['cpu_noise_floor']:.1f}% / {100 * cost['wall_noise_floor']:.1f}%)")
    print(f"slot calls per step, alone: {statistics.median(alone):.1f} us; with another job "
          f"on the device: {cycle_med:.0f} us = {100 * cycle_med / step_us:.2f}% of a "
          f"{step_us / 1000:.1f} ms step -> {out}")


if __name__ == "__main__":
    main()
