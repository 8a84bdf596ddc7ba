"""The main demo (`make demo`): two PyTorch Horovod jobs, 2 ranks each, on this host.

Runs each job alone, the two one after the other, the two together uncoordinated, and
the two together under crossover; prints each job's samples/s in every mode, writes the
merged Chrome trace of the crossover run and a Gantt chart of slot holds per device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from crossover import trace
from crossover.launch.local import DaemonProcess, Finished, Job, mpirun, run_together

REPO = Path(__file__).resolve().parents[1]


# On a CPU a waiting rank's MPI busy-poll and Horovod's 1 ms background cycle steal the
# core from whoever computes on it (a GPU has no such contention): yield and poll less.
QUIET_POLLING = {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "5"}


def job(name: str, seed: int, args: argparse.Namespace, env: dict[str, str]) -> Job:
    cmd = mpirun(2, sys.executable, str(REPO / "examples/torch_mlp.py"), "--seed", str(seed),
                 "--steps", str(args.steps), "--hidden", str(args.hidden),
                 "--layers", str(args.layers), "--batch", str(args.batch))
    return Job(name, cmd, {"CROSSOVER_JOB": name, **QUIET_POLLING, **env})


def samples_per_s(result: Finished) -> float:
    if result.returncode != 0:
        raise RuntimeError(f"job {result.name} failed ({result.returncode}):\n{result.output}")
    line = next(ln for ln in result.output.splitlines() if ln.startswith('{"samples_per_s"'))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "out/demo")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    plain = {"CROSSOVER_ENABLE": "0"}
    names = ["jobA", "jobB"]

    rows = {}
    print("running each job alone ...", flush=True)
    alone = [run_together([job(n, i, args, plain)])[0] for i, n in enumerate(names)]
    rows["alone"] = (alone, None)
    rows["sequential"] = (alone, sum(r.seconds for r in alone))
    print("running both together, uncoordinated ...", flush=True)
    together = run_together([job(n, i, args, plain) for i, n in enumerate(names)])
    rows["together, uncoordinated"] = (together, max(r.seconds for r in together))
    print("running both together under crossover ...", flush=True)
    traces = args.out / "traces"
    env = {"CROSSOVER_RUNTIME_DIR": str(args.out / "run"), "CROSSOVER_TRACE": str(traces)}
    with DaemonProcess(args.out / "run", log=args.out / "daemon.log"):
        crossed = run_together([job(n, i, args, env) for i, n in enumerate(names)])
    rows["together, crossover"] = (crossed, max(r.seconds for r in crossed))

    print(f"\n{'mode':<26}{'jobA samples/s':>16}{'jobB samples/s':>16}{'wall s (incl. start)':>22}")
    for mode, (results, wall) in rows.items():
        a, b = (samples_per_s(r) for r in results)
        if mode == "sequential":  # each runs at its solo speed, but only half the time
            total = wall
            a, b = a * results[0].seconds / total, b * results[1].seconds / total
        print(f"{mode:<26}{a:>16.0f}{b:>16.0f}{(f'{wall:.1f}' if wall else '-'):>22}")

    merged = args.out / "crossover.trace.json"
    events = trace.merge(sorted(traces.glob("*.json")), merged)
    gantt = args.out / "crossover_gantt.png"
    trace.plot_gantt(events, gantt, title="slot holds per device, two jobs under crossover")
    bad = trace.overlaps(events)
    print(f"\nmerged trace: {merged} (open in chrome://tracing or ui.perfetto.dev)")
    print(f"Gantt chart:  {gantt}")
    print(f"holds of two jobs overlapping on one device: {len(bad)}")


if __name__ == "__main__":
    main()
