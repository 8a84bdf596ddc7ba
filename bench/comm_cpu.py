"""What one allreduce of a job's gradients costs its host's CPU, on the emulated hosts.

    python bench/comm_cpu.py [--mbit 1000] [--runs 5] [--steps 50] [--name comm_cpu]

`make demo`'s bound, max(sum of compute, sum of communication, the link's time), counts
communication as free of CPU. On the emulated hosts (bench/cluster.py: one core each,
a shaped link) it is not: whatever CPU a job's allreduce takes comes out of the compute
of the job whose turn it is on that core. Here a 2-rank job, one rank per host,
allreduces a tensor the size of the demo's MLP gradients (the `mlp` workload), `--steps`
times a run, in three ways:

    horovod_wait    hvd.allreduce: Horovod's own wait for the handle (it spins)
    horovod_quiet   hvd.allreduce_async_ and the hooks' quiet wait (polls with sleeps),
                    as a job waits under crossover in turns
    torch_gloo      torch.distributed.all_reduce over gloo (what DDP's buckets use)
    horovod_idle    no allreduce: a 50 ms sleep in its place, with Horovod's background
                    cycle running (HOROVOD_CYCLE_TIME as the benchmark jobs set it), as
                    a job waiting for its turn costs the core

Rank 0 reports, per step (an allreduce, or the sleep), the wall time and its process's
CPU time (user and system); the result holds every run and the medians over `--runs`
runs, the ways in a balanced order (`common.arm_order`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import jobs  # noqa: E402
from cluster import EmulatedCluster  # noqa: E402
from common import arm_order, write_result  # noqa: E402

WAYS = ("horovod_wait", "horovod_quiet", "torch_gloo", "horovod_idle")
#: What horovod_idle does in place of each allreduce (s).
IDLE_STEP_S = 0.05
#: Allreduces before the timed ones (Horovod's first negotiation, gloo's connections).
WARMUP = 3


def gradient_floats() -> int:
    """How many floats the `mlp` workload's gradients hold (the demo's jobs)."""
    from crossover_job import build

    wl = jobs.WORKLOADS["mlp"]
    model, _ = build("mlp", int(wl[wl.index("--width") + 1]),
                     int(wl[wl.index("--layers") + 1]))
    return sum(p.numel() for p in model.parameters())


def worker(way: str, floats: int, steps: int) -> None:
    """One rank: `steps` timed allreduces of `floats` floats; rank 0 prints a JSON line."""
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
        from horovod.torch.mpi_ops import poll, synchronize

        from crossover.backoff import wait_until
        from crossover.hooks._lifecycle import QUIET_WAIT_S, quiet_poll

        hvd.init()
        rank = hvd.rank()

        def allreduce() -> None:
            if way == "horovod_idle":
                time.sleep(IDLE_STEP_S)
                return
            if way == "horovod_wait":
                hvd.allreduce_(tensor, name="grads")
                return
            handle = hvd.allreduce_async_(tensor, name="grads")
            wait_until(lambda: poll(handle), QUIET_WAIT_S, quiet_poll())
            synchronize(handle)

    for _ in range(WARMUP):
        allreduce()
    wall0, cpu0 = time.perf_counter(), os.times()
    for _ in range(steps):
        allreduce()
    wall, cpu = time.perf_counter() - wall0, os.times()
    if rank == 0:
        user, system = cpu.user - cpu0.user, cpu.system - cpu0.system
        print(json.dumps({"wall_ms": 1e3 * wall / steps, "user_ms": 1e3 * user / steps,
                          "sys_ms": 1e3 * system / steps,
                          "cpu_ms": 1e3 * (user + system) / steps}), flush=True)
    if way == "torch_gloo":
        dist.barrier()  # no rank tears its process group down while a peer still uses it
        dist.destroy_process_group()


def run_way(cluster: EmulatedCluster, way: str, floats: int, steps: int) -> dict:
    """One run of `way` on the emulated hosts: rank 0's figures."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", way,
            "--floats", str(floats), "--steps", str(steps)]
    line = cluster.torchrun(argv) if way == "torch_gloo" else cluster.gloo_run(argv)
    res = subprocess.run(line, env={**os.environ, **jobs.JOB_ENV}, capture_output=True,
                         text=True, timeout=300)
    out = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
    if res.returncode != 0 or out is None:
        raise RuntimeError(f"{way} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(out)


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
    floats = args.floats or gradient_floats()
    if args.worker:
        worker(args.worker, floats, args.steps)
        return
    if args.runs < 1 or args.steps < 1:
        parser.error(f"--runs {args.runs} and --steps {args.steps}: give at least 1 each")
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with EmulatedCluster(mbit=args.mbit) as cluster:
        for rep in range(args.runs):
            for i in arm_order(len(WAYS), rep):
                runs[WAYS[i]].append(run_way(cluster, WAYS[i], floats, args.steps))
                r = runs[WAYS[i]][-1]
                print(f"run {rep + 1}/{args.runs} {WAYS[i]:<14} wall {r['wall_ms']:6.1f} ms "
                      f"cpu {r['cpu_ms']:5.1f} ms (user {r['user_ms']:.1f}, "
                      f"sys {r['sys_ms']:.1f}) a step", flush=True)
    medians = {way: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for way, rs in runs.items()}
    for way, m in medians.items():
        print(f"median {way:<14} wall {m['wall_ms']:6.1f} ms, cpu {m['cpu_ms']:5.1f} ms "
              f"({100 * m['cpu_ms'] / m['wall_ms']:.0f} % of a core)")
    path = write_result(args.name, {
        "mbit": args.mbit, "floats": floats, "steps": args.steps, "runs": args.runs,
        "per_step_medians": medians, "per_run": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
