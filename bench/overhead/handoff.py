"""Release-to-grant latency of a device handoff: the socket path against the native one.

    .venv/bin/python -m bench.overhead.handoff [--cycles 3000] [--reps 3] [--pipeline-reps 7]

Two one-rank jobs share one device under the crossover policy and hand it back and
forth: each holds it for `--hold-us` of busy compute, stamps the time and releases for
communication, then asks again. A handoff's latency is the time from one job's release
call to the other's `acquire()` returning: the full client path a training step pays,
Python included. Measured with the daemon offering its slot table (native) and without
(CROSSOVER_NATIVE=0: socket), with the other core idle and with both cores busy (two
spinning processes), in alternating repetitions; medians over repetitions of each run's
p50 and p99, and the daemon's CPU time per handoff. Beside them, the machine's floor: the
same ping-pong between two C++ processes over one futex word (bench/overhead/handoff_floor.cpp,
built here with g++), with no Python, table or daemon.

Then the graph pipeline with slots, where a slot is taken per stage per micro-batch: a
2-stage pipeline (`python -m crossover.pipeline --model chain`, 8 micro-batches) without
slots, and with slots over each path beside a neighbour job registered on both devices
and idle: dormant once idle for the daemon's patience, so the pipeline keeps its devices
through communication as if alone (at most 2 % lost is the aim). And the same
with CROSSOVER_KEEP_WHEN_ALONE=0, where every micro-batch really releases its device and
asks again: the cost of a handoff per micro-batch. Iterations per second, medians; each
loss is the median over repetitions of a run against the run without slots beside it.
Writes bench/results/overhead/handoff.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness.common import REPO, area_results, module_argv, write_result
from crossover.launch.local import DaemonProcess

RESULTS = area_results("overhead")


WARMUP = 200  # handoffs dropped at the start (the jobs meet, the daemon learns them)


def worker(job: str, runtime: str, cycles: int, hold_us: float, out: str) -> None:
    """One job's loop: acquire, hold (spin), release; writes its grant/release times."""
    from crossover.client import RankInfo, SlotClient
    from crossover.protocol import Phase

    client = SlotClient(job, RankInfo(0, 1, 0, 1), runtime_dir=runtime, pin_cpu=False)
    assert client.coordinated, "no daemon"
    deadline = time.monotonic() + 30
    # Wait for the other job: alone, a rank keeps its device and hands nothing over.
    client.acquire()
    while client.keeps_device() and time.monotonic() < deadline:
        time.sleep(0.01)
    grants, releases = [], []
    for _ in range(cycles):
        client.acquire()
        grants.append(time.monotonic())
        end = time.perf_counter() + hold_us * 1e-6
        while time.perf_counter() < end:
            pass
        releases.append(time.monotonic())
        client.release(Phase.COMMUNICATE)
    client.close()
    Path(out).write_text(json.dumps({"grants": grants, "releases": releases,
                                     "fast": client._fast is not None}))


def latencies(a: dict, b: dict) -> list[float]:
    """Each grant's wait since the other job's latest release before it, in us."""
    events = sorted([(t, "grant", "a") for t in a["grants"]] +
                    [(t, "release", "a") for t in a["releases"]] +
                    [(t, "grant", "b") for t in b["grants"]] +
                    [(t, "release", "b") for t in b["releases"]])
    last: dict[str, float] = {}
    out = []
    for t, kind, who in events:
        other = "b" if who == "a" else "a"
        if kind == "release":
            last[who] = t
        elif other in last:
            out.append((t - last.pop(other)) * 1e6)
    return out[WARMUP:]


def run(native: bool, busy: bool, cycles: int, hold_us: float) -> dict:
    env = {**os.environ, "CROSSOVER_NATIVE": "1" if native else "0"}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 if busy else 0)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runtime = Path(tmp) / "run"
            os.environ["CROSSOVER_NATIVE"] = env["CROSSOVER_NATIVE"]
            with DaemonProcess(runtime, policy="crossover") as daemon:
                cpu = psutil.Process(daemon.proc.pid).cpu_times()
                procs = [subprocess.Popen([*module_argv(__spec__.name, "--worker", job),
                                           str(runtime), str(cycles), str(hold_us),
                                           str(Path(tmp) / f"{job}.json")], env=env, cwd=REPO)
                         for job in ("a", "b")]
                for p in procs:
                    if p.wait(timeout=600) != 0:
                        raise RuntimeError(f"worker exited with {p.returncode}")
                end = psutil.Process(daemon.proc.pid).cpu_times()
                daemon_s = end.user + end.system - cpu.user - cpu.system
            a, b = (json.loads((Path(tmp) / f"{j}.json").read_text()) for j in ("a", "b"))
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    lat = sorted(latencies(a, b))
    assert a["fast"] == native and b["fast"] == native, "the path asked for was not used"
    return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
            "max_us": lat[-1], "handoffs": len(lat),
            "daemon_cpu_us_per_handoff": daemon_s / (2 * cycles) * 1e6}


def floor(busy: bool, cycles: int, hold_us: float, binary: Path) -> dict:
    """The C++ futex ping-pong under the same load."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 if busy else 0)]
    try:
        out = subprocess.run([str(binary), str(hold_us), str(2 * cycles)], check=True,
                             capture_output=True, text=True, timeout=600).stdout
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return json.loads(out)


def pipeline(mode: str, iters: int) -> float:
    """Median seconds per pipeline iteration. `mode`: "none" (no slots), or
    "<path>_<neighbour>" with path "socket" or "native" and neighbour "dormant" (an idle
    job on both devices: company until it has idled for --patience) or "handoffs" (the
    same, and CROSSOVER_KEEP_WHEN_ALONE=0: every micro-batch releases and asks again)."""
    from crossover.client import RankInfo, SlotClient
    from crossover.launch.local import mpi_env, mpirun
    from crossover.protocol import Phase

    with tempfile.TemporaryDirectory() as tmp:
        runtime, out = Path(tmp) / "run", Path(tmp) / "times.json"
        cmd = mpirun(2, sys.executable, "-m", "crossover.pipeline", "--model", "chain",
                     "--batch", "64", "--micro", "8", "--iters", str(iters), "--out", str(out))
        env = {**os.environ, **mpi_env(), "CROSSOVER_RUNTIME_DIR": str(runtime),
               "CROSSOVER_JOB": "pipe",
               "CROSSOVER_NATIVE": "0" if mode.startswith("socket") else "1",
               "CROSSOVER_KEEP_WHEN_ALONE": "0" if mode.endswith("handoffs") else "1"}
        os.environ["CROSSOVER_NATIVE"] = env["CROSSOVER_NATIVE"]
        if mode == "none":
            subprocess.run(cmd, env=env, check=True, timeout=600, capture_output=True)
            return json.loads(out.read_text())["median_s"]
        with DaemonProcess(runtime, policy="crossover"):
            neighbours = [SlotClient("neighbour", RankInfo(i, 2, i, 2), runtime_dir=runtime,
                                     pin_cpu=False) for i in range(2)]
            for n in neighbours:  # registered on both devices, then out of the way
                n.acquire()
                n.release(Phase.IDLE)
            time.sleep(1.5)  # the daemon's patience (1 s): dormant when the pipeline starts
            subprocess.run(cmd + ["--slots"], env=env, check=True, timeout=600,
                           capture_output=True)
            for n in neighbours:
                n.close()
        return json.loads(out.read_text())["median_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hold-us", type=float, default=500.0)
    parser.add_argument("--pipeline-iters", type=int, default=200)
    # whole runs of the same arm differ by 5-10 % on this VM: more of them than above
    parser.add_argument("--pipeline-reps", type=int, default=7)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.reps, args.pipeline_reps, args.cycles, args.pipeline_iters) < 1:
        parser.error("--reps, --pipeline-reps, --cycles and --pipeline-iters must be at "
                     "least 1 (each figure is a median over them)")
    if args.worker:
        job, runtime, cycles, hold_us, out = args.worker
        worker(job, runtime, int(cycles), float(hold_us), out)
        return
    if shutil.which("g++") is None:
        raise SystemExit("g++ is needed for the floor (make env installs it)")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "handoff_floor"
        source = Path(__file__).with_name("handoff_floor.cpp")
        subprocess.run(["g++", "-O2", "-o", str(binary), str(source)], check=True)
        for rep in range(args.reps):
            for busy in (False, True):
                load = "busy" if busy else "idle"
                for path in ("socket", "native", "floor"):
                    r = floor(busy, args.cycles, args.hold_us, binary) if path == "floor" \
                        else run(path == "native", busy, args.cycles, args.hold_us)
                    runs.setdefault(f"{path}_{load}", []).append(r)
                    print(f"rep {rep + 1}/{args.reps} {path}_{load}: p50 {r['p50_us']:.0f} us,"
                          f" p99 {r['p99_us']:.0f} us", flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                      if k != "handoffs"}
               for name, rs in runs.items()}
    pipe: dict[str, list[float]] = {}
    modes = ("none", "socket_dormant", "native_dormant", "socket_handoffs", "native_handoffs")
    for rep in range(args.pipeline_reps):
        for mode in modes:
            pipe.setdefault(mode, []).append(pipeline(mode, args.pipeline_iters))
            print(f"rep {rep + 1}/{args.pipeline_reps} pipeline slots={mode}: "
                  f"{1 / pipe[mode][-1]:.1f} iterations/s", flush=True)
    per_s = {mode: 1 / statistics.median(ts) for mode, ts in pipe.items()}
    # The VM's speed drifts by 20-30 % over minutes, alike for every arm; each arm's loss
    # is the median over repetitions of its rate against the run without slots just
    # before it, so the drift cancels out.
    loss = {mode: 1 - statistics.median(none / t for none, t
                                        in zip(pipe["none"], ts, strict=True))
            for mode, ts in pipe.items() if mode != "none"}
    out = write_result(RESULTS, "handoff", {
        "workload": f"2 one-rank jobs on one device, policy crossover, hold {args.hold_us:g}"
                    f" us, {args.cycles} cycles each, first {WARMUP} handoffs dropped",
        "runs": runs, **summary,
        "pipeline": {"workload": f"chain model, 2 stages, batch 64, 8 micro-batches, "
                                 f"{args.pipeline_iters} iterations, {args.pipeline_reps} "
                                 f"runs each; a neighbour job on both "
                                 f"devices, idle (dormant after --patience)",
                     "iteration_s": pipe, "iterations_per_s": per_s,
                     # the aim: <= 2 % lost against no slots
                     "loss_with_slots": {p: loss[f"{p}_dormant"]
                                         for p in ("socket", "native")},
                     "loss_with_a_handoff_per_micro_batch": {
                         p: loss[f"{p}_handoffs"] for p in ("socket", "native")}},
        # the headline keys: both cores busy
        "socket": summary["socket_busy"], "native": summary["native_busy"],
    })
    for name, s in summary.items():
        print(f"{name:12s} p50 {s['p50_us']:7.0f} us  p99 {s['p99_us']:7.0f} us")
    for mode in modes[1:]:
        print(f"pipeline with slots ({mode}): {100 * loss[mode]:.1f}% slower than without "
              f"(median of paired runs)")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
