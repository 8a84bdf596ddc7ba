"""Chaos soak: jobs come and go while ranks and the daemon are killed, stopped, restarted.

    .venv/bin/python -m bench.robustness.chaos [--minutes 10] [--seed 0] [--fault-every 2]

Two 2-rank PyTorch jobs (examples/torch_mlp.py, random seed and length) run at any
time under one daemon on this host (the default policy, the native fast path on); a new
one starts when one ends, every other one with its ranks' descriptors above 1024
(bench/robustness/high_fds.py). Every few seconds (exponentially distributed, mean --fault-every)
one fault strikes at random; a fault's second half (SIGCONT, the restart) comes later
from the main loop, so faults overlap:

    rank_kill     SIGKILL one rank of a running job (the job dies: it is not compared)
    rank_stop     SIGSTOP one rank for up to lease + 1 s, then SIGCONT
    daemon_kill   SIGKILL the daemon; a new one starts 0-3 s later
    daemon_term   SIGTERM the daemon (a clean exit); a new one starts 0-3 s later
    daemon_stop   SIGSTOP the daemon for up to its ranks' grant timeout + 3 s, then
                  SIGCONT: the ranks go on uncoordinated after one grant timeout and
                  take up coordination again

Checked and written to bench/results/robustness/chaos.json:
    mismatches      jobs that were not killed whose weights differ from the same job
                    trained alone without crossover (bit for bit): must be 0
    hangs           jobs that ran past --job-timeout: must be 0
    longest_stall_s the longest slot wait any rank saw (from the ranks' traces), less
                    the time that rank itself was stopped and the time no daemon
                    listened (neither is a device nobody holds), among the waits
                    that overlap no daemon stop; bound: lease + patience (a stopped
                    holder loses its device at lease end). longest_stall_raw_s is
                    the same without the deductions.
    longest_stall_daemon_stopped_s  the longest wait that overlaps a daemon stop;
                    bound: the grant timeout (2 x lease + 5 s), once per stop
    daemon          descriptors and memory of each daemon run (psutil), first and last
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.harness.common import REPO, area_results, write_result
from crossover import trace
from crossover.backoff import Backoff, wait_until
from crossover.launch.local import mpi_env, mpirun, terminate_group
from crossover.probe import daemon_listens

RESULTS = area_results("robustness")

SCRIPT = REPO / "examples/torch_mlp.py"
#: run as a script by path: it imports only the standard library
HIGH_FDS = Path(__file__).with_name("high_fds.py")
SEEDS, LENGTHS = (1, 2, 3), (400, 900)  # few distinct jobs: few solo references to train
FAULTS = {"rank_kill": 0.15, "rank_stop": 0.35, "daemon_kill": 0.2, "daemon_term": 0.1,
          "daemon_stop": 0.2}
STOPS: list[tuple[str, int, float, float]] = []  # (job, rank, from, to): a rank stopped
OUTAGES: list[tuple[float, float]] = []  # (from, to): no daemon listened
DAEMON_STOPS: list[tuple[float, float]] = []  # (from, to): the daemon was stopped
#: A fault's second half, due later: (when, what to do)
LATER: list[tuple[float, Callable[[], None]]] = []


@dataclass
class RunningJob:
    name: str
    seed: int
    steps: int
    proc: subprocess.Popen
    started: float
    weights: Path
    log: Path
    high_fds: bool
    killed: bool = False
    stopped: list[int] = field(default_factory=list)  # pids under SIGSTOP
    size: int = 2  # ranks: the solo run it is compared with has as many

    def ranks(self) -> list[psutil.Process]:
        try:
            return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if "torch_mlp" in " ".join(p.cmdline()) and "mpirun" not in p.name()]
        except psutil.Error:
            return []


class Daemon:
    """The daemon under test, restartable; its descriptors and memory are sampled."""

    def __init__(self, runtime: Path, args: argparse.Namespace, log: Path) -> None:
        self.runtime, self.args, self.log = runtime, args, log
        self.proc: subprocess.Popen | None = None
        self.runs: list[dict] = []  # per daemon run: first and last fds / RSS
        self.busy = False  # stopped, or down until its restart: no new fault on it

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "crossover", "daemon", "--policy", self.args.policy,
                 "--lease", str(self.args.lease), "--patience", str(self.args.patience),
                 "--runtime-dir", str(self.runtime)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        if not wait_until(lambda: self.proc.poll() is not None
                          or daemon_listens(self.runtime), 60, Backoff(0.01, 0.2)) \
                or self.proc.poll() is not None:
            raise RuntimeError(f"the daemon did not start; see {self.log}")
        self.runs.append({"start_s": round(time.monotonic() - t0, 2)})
        self.sample()

    def sample(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            p = psutil.Process(self.proc.pid)
            now = {"fds": p.num_fds(), "rss_mb": round(p.memory_info().rss / 2**20, 1)}
        except psutil.Error:
            return
        run = self.runs[-1]
        run.setdefault("first", now)
        run["last"] = now
        run["max_fds"] = max(run.get("max_fds", 0), now["fds"])

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGSTOP, signal.SIGCONT):
                return
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            terminate_group(self.proc)
        self.proc = None


def start_job(n: int, rng: random.Random, env: dict, tmp: Path) -> RunningJob:
    seed, steps = rng.choice(SEEDS), rng.choice(LENGTHS)
    name = f"j{n}"
    weights, log = tmp / f"{name}.pt", tmp / f"{name}.log"
    high = n % 2 == 0  # every other job's ranks hold their sockets above descriptor 1024
    wrap = [str(HIGH_FDS)] if high else []
    cmd = mpirun(2, sys.executable, *wrap, str(SCRIPT), "--seed", str(seed), "--steps",
                 str(steps), "--out", str(weights))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**env, "CROSSOVER_JOB": name}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return RunningJob(name, seed, steps, proc, time.monotonic(), weights, log, high)


def solo_weights(seed: int, steps: int, tmp: Path, env: dict, size: int = 2,
                 launch: Callable[[list[str]], list[str]] | None = None) -> bytes:
    """The weights of the job trained without crossover, on `size` ranks under local
    mpirun, or launched by `launch` as the job was (emulated hosts: a reduction over 3+
    ranks sums in the order of its transport, so only the same launch compares)."""
    out = tmp / f"solo-{seed}-{steps}-{size}.pt"
    if not out.exists():
        argv = [sys.executable, str(SCRIPT), "--seed", str(seed), "--steps", str(steps),
                "--out", str(out)]
        subprocess.run(launch(argv) if launch else mpirun(size, *argv),
                       env={**env, "CROSSOVER_ENABLE": "0", "CROSSOVER_TRACE": ""}, check=True,
                       timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out.read_bytes()


def same(a: Path, b: bytes) -> bool:
    import torch

    x = torch.load(a, map_location="cpu", weights_only=True)
    y = torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def inject(kind: str, jobs: list[RunningJob], daemon: Daemon, rng: random.Random,
           args: argparse.Namespace) -> str | None:
    """Strike once; returns what happened (None: no target for this kind now)."""
    live = [j for j in jobs if j.proc.poll() is None and not j.killed]
    if kind in ("rank_kill", "rank_stop"):
        targets = [(j, r) for j in live for r in j.ranks() if r.pid not in j.stopped]
        if not targets:
            return None
        job, rank = rng.choice(targets)
        if kind == "rank_kill":
            job.killed = True
            rank.send_signal(signal.SIGKILL)
            return f"SIGKILL rank pid {rank.pid} of {job.name}"
        pause = rng.uniform(0.2, args.lease + 1)
        try:
            index = int(rank.environ().get("OMPI_COMM_WORLD_RANK", -1))
        except psutil.Error:
            index = -1
        stopped_at = time.time()
        rank.send_signal(signal.SIGSTOP)
        job.stopped.append(rank.pid)

        def cont() -> None:
            try:
                rank.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
            job.stopped.remove(rank.pid)
            STOPS.append((job.name, index, stopped_at, time.time()))

        LATER.append((time.monotonic() + pause, cont))
        return f"SIGSTOP {pause:.1f} s rank pid {rank.pid} of {job.name}"
    if daemon.busy:
        return None
    daemon.busy = True
    daemon.sample()
    down = time.time()
    if kind == "daemon_stop":
        pause = rng.uniform(0.5, 2 * args.lease + 5 + 3)
        daemon.signal(signal.SIGSTOP)

        def resume() -> None:
            daemon.signal(signal.SIGCONT)
            DAEMON_STOPS.append((down, time.time()))
            daemon.busy = False

        LATER.append((time.monotonic() + pause, resume))
        return f"SIGSTOP the daemon for {pause:.1f} s"
    daemon.signal(signal.SIGKILL if kind == "daemon_kill" else signal.SIGTERM)
    gap = rng.uniform(0, 3)

    def restart() -> None:
        daemon.start()
        OUTAGES.append((down, time.time()))
        daemon.busy = False

    LATER.append((time.monotonic() + gap, restart))
    return f"{kind}, back after {gap:.1f} s"


def let_finish(jobs: list[RunningJob], job_timeout: float) -> list[str]:
    """Wait for the jobs still running, each until `job_timeout` after its start;
    returns the names of those stopped at that limit (hangs)."""
    hangs = []
    for j in jobs:
        try:
            j.proc.wait(timeout=max(1.0, job_timeout - (time.monotonic() - j.started)))
        except subprocess.TimeoutExpired:
            hangs.append(j.name)
            terminate_group(j.proc, grace_s=2)
    return hangs


def compare_with_solo(finished: list[RunningJob], tmp: Path, env: dict, who: str,
                      launch: Callable[[list[str]], list[str]] | None = None,
                      ) -> tuple[list[str], list[str]]:
    """The finished jobs whose weights differ from a solo run (`solo_weights`), and those
    that failed."""
    mismatches, failed = [], []
    for j in finished:
        if j.proc.returncode != 0 or not j.weights.exists():
            failed.append(j.name)
            print(f"{who}: FAILED {j.name} (exit {j.proc.returncode}); see {j.log}",
                  flush=True)
        elif not same(j.weights, solo_weights(j.seed, j.steps, tmp, env, j.size, launch)):
            mismatches.append(j.name)
    return mismatches, failed


def run_due() -> None:
    """Do the second halves of faults that are due (all of them at the end)."""
    now = time.monotonic()
    for item in sorted(LATER, key=lambda x: x[0]):
        if item[0] <= now:
            LATER.remove(item)
            item[1]()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every", type=float, default=2.0, metavar="S",
                    help="mean seconds between faults (default 2: over 150 in 10 minutes; "
                         "a fault with no target then, or on a daemon still down, waits)")
    ap.add_argument("--policy", default="auto",
                    help="daemon policy (default auto, the daemon's default)")
    ap.add_argument("--lease", type=float, default=3.0)
    ap.add_argument("--patience", type=float, default=0.5)
    ap.add_argument("--job-timeout", type=float, default=180.0)
    ap.add_argument("--out", default="chaos", help="result name under bench/results/")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="crossover-chaos-"))
    runtime, traces = tmp / "run", tmp / "traces"
    env = {**os.environ, **mpi_env(), "CROSSOVER_RUNTIME_DIR": str(runtime),
           "CROSSOVER_TRACE": str(traces), "OMPI_MCA_mpi_yield_when_idle": "1"}
    daemon = Daemon(runtime, args, tmp / "daemon.log")
    daemon.start()
    jobs: list[RunningJob] = []
    faults: Counter = Counter()
    hangs, n = [], 0
    end = time.monotonic() + args.minutes * 60
    next_fault = time.monotonic() + rng.expovariate(1 / args.fault_every)
    print(f"chaos: {args.minutes:g} min, a fault every ~{args.fault_every:g} s, "
          f"work in {tmp}", flush=True)
    try:
        while time.monotonic() < end:
            running = [j for j in jobs if j.proc.poll() is None]
            for j in running:
                if time.monotonic() - j.started > args.job_timeout:
                    hangs.append(j.name)
                    terminate_group(j.proc, grace_s=2)
                    print(f"chaos: HANG {j.name} ran past {args.job_timeout:g} s", flush=True)
            while len([j for j in jobs if j.proc.poll() is None]) < 2:
                n += 1
                jobs.append(start_job(n, rng, env, tmp))
            if time.monotonic() >= next_fault:
                kind = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
                t0 = time.monotonic()
                what = inject(kind, jobs, daemon, rng, args)
                if what is not None:
                    faults[kind] += 1
                    left = (end - time.monotonic()) / 60
                    print(f"chaos: fault {sum(faults.values())}: {what} in "
                          f"{time.monotonic() - t0:.1f} s ({len(jobs)} jobs so far, "
                          f"{left:.1f} min left)", flush=True)
                next_fault = time.monotonic() + rng.expovariate(1 / args.fault_every)
            run_due()
            daemon.sample()
            time.sleep(0.1)
        while LATER:  # the faults under way end (the daemon runs again)
            time.sleep(0.1)
            run_due()
        print("chaos: time is up; letting the running jobs finish", flush=True)
        hangs += let_finish(jobs, args.job_timeout)
        daemon.sample()
    finally:
        for j in jobs:
            if j.proc.poll() is None:
                terminate_group(j.proc, grace_s=2)
        daemon.stop()

    finished = [j for j in jobs if not j.killed and j.name not in hangs]
    print(f"chaos: comparing {len(finished)} jobs with their solo runs", flush=True)
    mismatches, failed = compare_with_solo(finished, tmp, env, "chaos")
    waits = slot_waits(traces)
    stalls = [s for s, _, _, stopped in waits if not stopped]
    stopped_daemon = [s for s, _, _, stopped in waits if stopped]
    reconnects = sum(j.log.read_text().count("is coordinated again") for j in jobs)
    result = {
        "minutes": args.minutes, "seed": args.seed, "policy": args.policy,
        "lease_s": args.lease, "patience_s": args.patience,
        "jobs_run": len(jobs), "jobs_killed": sum(j.killed for j in jobs),
        "jobs_compared": len(finished) - len(failed), "jobs_failed": failed,
        "faults_injected": dict(faults), "faults_total": sum(faults.values()),
        "mismatches": len(mismatches), "mismatched_jobs": mismatches,
        "hangs": len(hangs), "longest_stall_s": round(max(stalls, default=0.0), 3),
        "longest_stall_raw_s": round(max((raw for _, raw, _, s in waits if not s),
                                         default=0.0), 3),
        "longest_stall_where": max((w for w in waits if not w[3]),
                                   default=(0, 0, "", False))[2],
        "stall_bound_s": args.lease + args.patience, "slot_waits": len(waits),
        "longest_stall_daemon_stopped_s": round(max(stopped_daemon, default=0.0), 3),
        "stall_bound_daemon_stopped_s": 2 * args.lease + 5,
        "jobs_high_fds": sum(j.high_fds for j in jobs),
        "reconnects": reconnects, "daemon_runs": daemon.runs,
    }
    out = write_result(RESULTS, args.out, result)
    print(json.dumps({k: result[k] for k in ("jobs_run", "faults_injected", "mismatches",
                                              "hangs", "longest_stall_s", "reconnects")}))
    print(f"chaos: wrote {out}")
    ok = not mismatches and not hangs and not failed
    return 0 if ok else 1


def slot_waits(traces: Path) -> list[tuple[float, float, str, bool]]:
    """Every rank's slot waits: (seconds less its own stops and daemon outages, raw
    seconds, which rank and when, whether it overlaps a daemon stop)."""
    out = []
    for path in sorted(traces.glob("*.rank*.json")):
        job, rank = path.name[:-5].rsplit(".rank", 1)
        own = [(a, b) for j, r, a, b in STOPS if j == job and r == int(rank)]
        for e in _load(path):
            if e.get("ph") != "X" or e["name"] != "slot wait":
                continue
            start, raw = e["ts"] / 1e6, e["dur"] / 1e6
            lost = sum(max(0.0, min(start + raw, b) - max(start, a)) for a, b in own + OUTAGES)
            stopped = any(start < b and a < start + raw for a, b in DAEMON_STOPS)
            out.append((max(0.0, raw - lost), raw, f"{job} rank {rank} at {start:.1f}",
                         stopped))
    return out


def _load(path: Path) -> list[dict]:
    try:
        return trace.load(path)
    except (ValueError, OSError):  # a rank killed mid-write leaves a broken file
        return []


if __name__ == "__main__":
    sys.exit(main())
