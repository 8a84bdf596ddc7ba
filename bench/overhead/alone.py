"""Single-job overhead: one 2-rank job under the daemon vs the same job plain.

    .venv/bin/python -m bench.overhead.alone [--reps 9] [--framework ddp]

A Horovod PyTorch job under mpirun (examples/torch_mlp.py), or with `--framework ddp` a
PyTorch DDP job under torchrun (examples/ddp_mlp.py). Each repetition runs a pair, plain
and under the daemon, in the order `common.arm_order` gives (plain first in every other
pair), so that drift on a shared machine and whatever one run leaves to the next hit
both arms alike; reports the medians of samples/s and the median of the pairs' ratios,
and writes bench/results/overhead/overhead.json (overhead_ddp.json). Whole runs on a shared
machine differ by several percent from run to run, so it also measures what the hooks
add to a step inside one process (bench/overhead/horovod_step_cost.py,
bench/overhead/ddp_step_cost.py; `--cost-runs` launches): alternating steps of plain and
wrapped models.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness.common import REPO, area_results, arm_order, write_result
from crossover.client import RankInfo, SlotClient
from crossover.launch.local import DaemonProcess, Job, mpirun, run_together
from crossover.protocol import Phase

RESULTS = area_results("overhead")

#: Steps of a whole run: 9 pairs and 6 in-process launches take about 10 minutes on a
#: 2-core VM.
STEPS = 300
#: The in-process step-cost script per framework (three models, one wrapped).
STEP_COST = {"horovod": "bench.overhead.horovod_step_cost", "ddp": "bench.overhead.ddp_step_cost"}


def launcher(framework: str, script: str, *args: str) -> list[str]:
    """`script` (a path in the repository, or a bench module) with `args` on 2 ranks:
    mpirun for Horovod, torchrun for DDP; the ranks run where this runs, the repository."""
    program = [str(REPO / script)] if script.endswith(".py") else ["-m", script]
    if framework == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *program, *args]
    return mpirun(2, sys.executable, *program, *args)


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def samples_per_s(job: Job) -> float:
    (res,) = run_together([job], timeout_s=300)
    if res.returncode != 0:
        raise RuntimeError(f"{job.name} failed:\n{res.output}")
    line = next(ln for ln in res.output.splitlines() if ln.startswith('{"samples_per_s"'))
    return json.loads(line)["samples_per_s"]


def step_cost(framework: str, runs: int, steps: int, env: dict[str, str], hidden: int,
              layers: int) -> dict:
    """The framework's step-cost script `runs` times, the wrapped model built first,
    second, third in turn: each run's median steps (wall and main-thread CPU) per role;
    crossover's cost in a run against the mean of its two plain models, and the two
    plain models' gap (the noise floor), each the median over the runs."""
    script = STEP_COST[framework]
    args = ["--steps", str(steps), "--hidden", str(hidden), "--layers", str(layers)]
    per_run = []
    for i in range(runs):
        cmd = launcher(framework, script, *args, "--wrapped", str(i % 3))
        (res,) = run_together([Job("step-cost", cmd, env)], timeout_s=600)
        if res.returncode != 0:
            raise RuntimeError(f"{script} failed:\n{res.output[-3000:]}")
        line = next(ln for ln in res.output.splitlines() if ln.startswith('{"step_cost"'))
        found = json.loads(line)
        if not found["coordinated"]:
            raise RuntimeError(f"{script}: the wrapped model ran without the daemon:\n"
                               f"{res.output[-3000:]}")
        per_run.append({**found["step_cost"], "kept_device": found["kept_device"]})
        print(f"step cost run {i + 1}/{runs}: " + ", ".join(
            f"{k} {v['wall_us']:.0f} us wall, {v['cpu_us']:.0f} us CPU"
            for k, v in found["step_cost"].items()), flush=True)
    out: dict = {"command": shlex.join(launcher(framework, script, *args)).replace(
                     f"{REPO}/", "") + " --wrapped 0|1|2",
                 "runs": per_run}
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
    parser.add_argument("--reps", type=int, default=9, help="pairs of whole runs")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of a whole run")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    parser.add_argument("--cost-runs", type=int, default=12,
                        help="launches of the in-process step-cost script (0: none)")
    parser.add_argument("--cost-steps", type=int, default=300,
                        help="timed steps per model in each of those launches")
    args = parser.parse_args()
    model = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers",
             str(args.layers)]
    if args.framework == "ddp":
        cmd = launcher("ddp", "examples/ddp_mlp.py", *model,
                       "--bucket-mb", "25")  # DDP's default bucket size
    else:
        cmd = launcher("horovod", "examples/torch_mlp.py", *model)
    arms = ("plain", "crossover")
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    daemon_cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    orders = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(Path(tmp) / "run") as daemon:
        env = {"CROSSOVER_RUNTIME_DIR": str(Path(tmp) / "run"), "CROSSOVER_JOB": "solo",
               "OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "5"}
        arm_env = {"plain": {**env, "CROSSOVER_ENABLE": "0"}, "crossover": env}
        for rep in range(args.reps):
            order = [arms[i] for i in arm_order(len(arms), rep)]
            orders.append(order)
            for arm in order:
                before = cpu_s(daemon.proc.pid)
                rates[arm].append(samples_per_s(Job(arm, cmd, arm_env[arm])))
                daemon_cpu[arm].append(cpu_s(daemon.proc.pid) - before)
            ratio = rates["crossover"][-1] / rates["plain"][-1]
            print(f"pair {rep + 1}/{args.reps} ({' first, '.join(order)} second): plain "
                  f"{rates['plain'][-1]:.0f}, crossover {rates['crossover'][-1]:.0f} "
                  f"samples/s ({100 * (1 - ratio):+.1f} %), "
                  f"{time.monotonic() - started:.0f} s so far", flush=True)
        cost = (step_cost(args.framework, args.cost_runs, args.cost_steps, env, args.hidden,
                          args.layers) if args.cost_runs else None)
        alone = slot_cycle_us(Path(tmp) / "run", company=False)
        cycle = slot_cycle_us(Path(tmp) / "run", company=True)
    plain, under = rates["plain"], rates["crossover"]
    p, c = statistics.median(plain), statistics.median(under)
    pairs = [1 - u / q for q, u in zip(plain, under, strict=True)]
    step_us = 32 * 2 / p * 1e6  # one step of the plain job: 2 ranks x 32 samples
    cycle_med = statistics.median(cycle)
    out = write_result(RESULTS, "overhead" + ("_ddp" if args.framework == "ddp" else ""), {
        "workload": f"MLP 64-{args.hidden}x{args.layers}-10, batch 32/rank, 2 ranks, "
                    f"{args.steps} steps, {args.framework}",
        "job_command": shlex.join(cmd).replace(f"{REPO}/", ""),
        "pair_orders": orders,
        "plain_samples_per_s": plain, "crossover_samples_per_s": under,
        "median_plain": p, "median_crossover": c,
        "single_job_overhead": 1 - c / p,
        "pair_overhead": pairs, "median_pair_overhead": statistics.median(pairs),
        "daemon_cpu_s_per_run": daemon_cpu,
        "slot_cycle_alone_us": alone, "median_slot_cycle_alone_us": statistics.median(alone),
        "slot_cycle_us": cycle, "median_slot_cycle_us": cycle_med,
        "median_step_us": step_us,
        "slot_cycle_share_of_step": cycle_med / step_us,
        "seconds": time.monotonic() - started,
        **({"step_cost_in_process": cost} if cost else {}),
    })
    print(f"single-job overhead, whole runs: {100 * (1 - c / p):+.1f} % (medians of "
          f"{args.reps} runs each; median of the pairs {100 * statistics.median(pairs):+.1f} "
          f"%, from {100 * min(pairs):+.1f} to {100 * max(pairs):+.1f} %)")
    if cost:
        print(f"in one process, alternating steps: crossover adds "
              f"{100 * cost['wall_overhead']:+.1f} % wall time and "
              f"{100 * cost['cpu_overhead']:+.1f} % main-thread CPU to a step (noise floor "
              f"{100 * cost['wall_noise_floor']:.1f} % / {100 * cost['cpu_noise_floor']:.1f} %)")
    print(f"slot calls per step, alone: {statistics.median(alone):.1f} us; with another job "
          f"on the device: {cycle_med:.0f} us = {100 * cycle_med / step_us:.2f}% of a "
          f"{step_us / 1000:.1f} ms step -> {out}")


if __name__ == "__main__":
    main()
