"""What one allreduce of a job's gradients costs its host's CPU, on the emulated hosts.

    python -m bench.colocation.comm_cpu [--mbit 1000] [--runs 5] [--steps 50] [--name comm_cpu]

`make demo`'s bound, max(sum of compute, sum of communication, the link's time), counts
communication as free of CPU. On the emulated hosts (bench/harness/cluster.py: one core each,
a shaped link) it is not: whatever CPU a job's allreduce takes comes out of the compute
of the job whose turn it is on that core. Here a 2-rank job, one rank per host,
allreduces a tensor the size of the demo's MLP gradients (the `mlp` workload), `--steps`
times a run, in four ways:

    horovod_wait    hvd.allreduce_ (a sum): Horovod's own wait for the handle (it spins)
    horovod_quiet   hvd.allreduce_async_ and the hooks' quiet wait (polls with sleeps),
                    as a job waits under crossover in turns
    torch_gloo      torch.distributed.all_reduce over gloo (what DDP's buckets use)
    horovod_idle    no allreduce: a 50 ms sleep in its place, with Horovod's background
                    cycle running (HOROVOD_CYCLE_TIME as the benchmark jobs set it), as
                    a job waiting for its turn costs the core

Each rank reports, per step (an allreduce, or the sleep), the wall time and its
process's CPU time (user and system, from getrusage: microseconds, every thread). The
result holds every run's figures of both ranks and, per way, the median of each figure
over all of them (each figure's median taken on its own); the ways run in a balanced
order (`common.arm_order`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import time

from bench.harness import jobs
from bench.harness.cluster import EmulatedCluster
from bench.harness.common import area_results, arm_order, module_argv, write_result

RESULTS = area_results("colocation")

WAYS = ("horovod_wait", "horovod_quiet", "torch_gloo", "horovod_idle")
#: What horovod_idle does in place of each allreduce (s).
IDLE_STEP_S = 0.05
#: A run's limit (s): the rank launcher's, which kills every rank when it passes.
RUN_LIMIT_S = 240.0
#: Allreduces before the timed ones (Horovod's first negotiation, gloo's connections).
WARMUP = 3


def gradient_floats() -> int:
    """How many floats the `mlp` workload's gradients hold (the demo's jobs)."""
    from bench.harness.training_job import build

    wl = jobs.WORKLOADS["mlp"]
    model, _ = build("mlp", int(wl[wl.index("--width") + 1]),
                     int(wl[wl.index("--layers") + 1]))
    return sum(p.numel() for p in model.parameters())


def worker(way: str, floats: int, steps: int) -> None:
    """One rank: `steps` timed allreduces of `floats` floats; prints its figures as JSON."""
    import torch

    tensor = torch.ones(floats)
    if way == "torch_gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def allreduce() -> None:
            dist.all_reduce(tensor)
    else:
        import horovod.torch as hvd
        from horovod.torch.mpi_ops import synchronize

        from crossover.hooks._lifecycle import wait_quietly

        hvd.init()
        rank = hvd.rank()

        def allreduce() -> None:
            if way == "horovod_idle":
                time.sleep(IDLE_STEP_S)
                return
            if way == "horovod_wait":
                hvd.allreduce_(tensor, name="grads", op=hvd.Sum)
                return
            handle = hvd.allreduce_async_(tensor, name="grads", op=hvd.Sum)
            wait_quietly([handle])
            synchronize(handle)

    for _ in range(WARMUP):
        allreduce()
    wall0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        allreduce()
    wall, cpu = time.perf_counter() - wall0, resource.getrusage(resource.RUSAGE_SELF)
    user, system = cpu.ru_utime - cpu0.ru_utime, cpu.ru_stime - cpu0.ru_stime
    print(json.dumps({"rank": rank, "wall_ms": 1e3 * wall / steps,
                      "user_ms": 1e3 * user / steps, "sys_ms": 1e3 * system / steps,
                      "cpu_ms": 1e3 * (user + system) / steps}), flush=True)
    if way == "torch_gloo":
        dist.barrier()  # no rank tears its process group down while a peer still uses it
        dist.destroy_process_group()


def run_way(cluster: EmulatedCluster, way: str, floats: int, steps: int) -> list[dict]:
    """One run of `way` on the emulated hosts: each rank's figures, by rank."""
    argv = [*module_argv(__spec__.name, "--worker", way),
            "--floats", str(floats), "--steps", str(steps)]
    line = (cluster.torchrun(argv, timeout_s=RUN_LIMIT_S) if way == "torch_gloo"
            else cluster.gloo_run(argv, timeout_s=RUN_LIMIT_S))
    # the launcher's own limit comes first and stops every rank; this one is a backstop
    res = subprocess.run(line, env={**os.environ, **jobs.JOB_ENV}, capture_output=True,
                         text=True, timeout=RUN_LIMIT_S + 60)
    # the ranks share the launcher's stdout: their lines may run into each other
    ranks = sorted((json.loads(m) for m in re.findall(r'\{"rank"[^{}]*\}', res.stdout)),
                   key=lambda r: r["rank"])
    if res.returncode != 0 or len(ranks) != 2:
        raise RuntimeError(f"{way} failed (exit {res.returncode}, {len(ranks)} of 2 ranks "
                           f"reported): {res.stderr[-2000:]}")
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=1000.0, help="the link's rate")
    parser.add_argument("--runs", type=int, default=5, help="runs of each way")
    parser.add_argument("--steps", type=int, default=50, help="timed allreduces a run")
    parser.add_argument("--floats", type=int, default=0,
                        help="tensor size (default: the mlp workload's gradients)")
    parser.add_argument("--name", default="comm_cpu", help="bench/results/<name>.json")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs < 1 or args.steps < 1 or args.floats < 0 or not args.mbit > 0:
        parser.error(f"--runs {args.runs}, --steps {args.steps}, --floats {args.floats}, "
                     f"--mbit {args.mbit:g}: give runs and steps >= 1, floats >= 0 (0: the "
                     f"mlp workload's gradients) and a rate > 0")
    floats = args.floats or gradient_floats()
    if args.worker:
        worker(args.worker, floats, args.steps)
        return
    runs: dict[str, list[list[dict]]] = {way: [] for way in WAYS}
    with EmulatedCluster(mbit=args.mbit) as cluster:
        for rep in range(args.runs):
            for i in arm_order(len(WAYS), rep):
                runs[WAYS[i]].append(run_way(cluster, WAYS[i], floats, args.steps))
                print(f"run {rep + 1}/{args.runs} {WAYS[i]:<14} " + "; ".join(
                    f"rank {r['rank']} wall {r['wall_ms']:5.1f} ms cpu {r['cpu_ms']:5.1f} ms "
                    f"(user {r['user_ms']:.1f}, sys {r['sys_ms']:.1f})"
                    for r in runs[WAYS[i]][-1]) + " a step", flush=True)
    medians = {way: {key: statistics.median(r[key] for run in rs for r in run)
                     for key in ("wall_ms", "cpu_ms", "user_ms", "sys_ms")}
               for way, rs in runs.items()}
    for way, m in medians.items():
        print(f"median {way:<14} wall {m['wall_ms']:6.1f} ms, cpu {m['cpu_ms']:5.1f} ms "
              f"({100 * m['cpu_ms'] / m['wall_ms']:.0f} % of a core)")
    path = write_result(RESULTS, args.name, {
        "mbit": args.mbit, "floats": floats, "steps": args.steps, "runs": args.runs,
        "per_step_medians": medians, "per_run": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
