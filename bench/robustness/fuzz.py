"""Protocol fuzzing against a live daemon, with a well-behaved job's grant latency.

    .venv/bin/python -m bench.robustness.fuzz [--seconds 420] [--quiet-seconds 60]

A daemon under the default policy, with the native fast path. A good job (one rank, its
own process) takes and gives back its device in a loop and times every grant: first for
--quiet-seconds alone with the daemon (quiet), then for --seconds while this process
attacks the same daemon: hypothesis cases of every kind in bench/robustness/fuzz_cases.py
(random bytes, lying length prefixes, wrong field types, hellos with every field over its
whole range, every message kind in every connection state, requests out of order, truncated frames;
groups of ranks of one new job arriving together with different weights or over 1 to
300 devices), bursts of 200 connections opened and dropped, and clients that send half
a frame and stall. Written to bench/results/robustness/fuzz.json: cases tried of each kind, daemon
crashes (it is restarted and counted), the good job's grant latency p50/p99/max quiet
and under attack, and the daemon's descriptors and memory before, at most, and after.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from hypothesis import HealthCheck, given, seed, settings

from bench.harness.common import area_results, write_result
from bench.robustness.fuzz_cases import CASES, GROUPS, exchange, exchange_group, hello_frame
from crossover.environment import node_name
from crossover.launch.local import DaemonProcess
from crossover.transport import socket_path

RESULTS = area_results("robustness")

GOOD_JOB = """
import json, sys, time
from crossover.client import RankInfo, SlotClient
from crossover.protocol import Phase
c = SlotClient("good", RankInfo(0, 1, 0, 1), runtime_dir=sys.argv[1], pin_cpu=False)
end, lat, lost = time.monotonic() + float(sys.argv[2]), [], 0
while time.monotonic() < end:
    t0 = time.perf_counter()
    c.acquire()
    lat.append(time.perf_counter() - t0)
    lost += not c.coordinated
    c.release(Phase.IDLE)
    time.sleep(0.002)  # a step's compute, roughly
print(json.dumps({"grants": len(lat), "uncoordinated": lost, "lat": lat}))
"""


def good_job(runtime: Path, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", GOOD_JOB, str(runtime), str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def latency(proc: subprocess.Popen, seconds: float) -> dict:
    out, _ = proc.communicate(timeout=seconds + 120)
    res = json.loads(out.strip().splitlines()[-1])
    lat = sorted(res["lat"])
    q = statistics.quantiles(lat, n=100)
    return {"grants": res["grants"], "uncoordinated": res["uncoordinated"],
            "p50_us": round(q[49] * 1e6, 1), "p99_us": round(q[98] * 1e6, 1),
            "max_ms": round(lat[-1] * 1e3, 2)}


class Watched:
    """The daemon under attack: its figures sampled, restarted (and counted) if it dies."""

    def __init__(self, runtime: Path, log: Path) -> None:
        self.runtime, self.log = runtime, log
        self.crashes = 0
        self.figures: list[dict] = []
        self._start()

    def _start(self) -> None:
        self.daemon = DaemonProcess(self.runtime, policy="auto", log=self.log)
        self.proc = psutil.Process(self.daemon.proc.pid)

    def check(self) -> None:
        if self.daemon.proc.poll() is not None:
            self.crashes += 1
            print(f"fuzz: DAEMON DIED (exit {self.daemon.proc.returncode}); see {self.log}",
                  flush=True)
            self._start()
        try:
            self.figures.append({"fds": self.proc.num_fds(),
                                 "rss_mb": round(self.proc.memory_info().rss / 2**20, 1)})
        except psutil.Error:
            pass

    def summary(self) -> dict:
        first, last = self.figures[0], self.figures[-1]
        return {"fds": {"before": first["fds"], "max": max(f["fds"] for f in self.figures),
                        "after": last["fds"]},
                "rss_mb": {"before": first["rss_mb"],
                           "max": max(f["rss_mb"] for f in self.figures),
                           "after": last["rss_mb"]}}


def _cases(name: str, strategy, rnd: int, path: str, tried: Counter):
    """100 hypothesis cases of one kind (seeded by the round), as a callable."""

    @seed(rnd)
    @settings(max_examples=100, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        opening, payload, _bad = case
        tried[name] += 1
        try:
            exchange(path, payload, opening)
        except OSError as exc:  # refused because the daemon died: counted by check()
            print(f"fuzz: {name}: {exc}", flush=True)

    return run


def _groups(name: str, strategy, rnd: int, path: str, tried: Counter):
    """3 hypothesis cases of one group kind (several ranks at once, up to 300), as a
    callable."""

    @seed(rnd)
    @settings(max_examples=3, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(hellos):
        tried[name] += 1
        try:
            exchange_group(path, hellos)
        except OSError as exc:  # refused because the daemon died: counted by check()
            print(f"fuzz: {name}: {exc}", flush=True)

    return run


def attack(path: str, watched: Watched, until: float, tried: Counter) -> None:
    """Hypothesis cases, round after round with new seeds, plus floods and stallers."""
    rnd = 0
    while time.monotonic() < until:
        rnd += 1
        for name, strategy in CASES.items():
            _cases(name, strategy, rnd, path, tried)()
            watched.check()
            if time.monotonic() >= until:
                return
        for name, strategy in GROUPS.items():
            _groups(name, strategy, rnd, path, tried)()
            watched.check()
        socks = []
        for _ in range(200):  # a flood of connections, then all dropped at once
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)
        tried["connection_flood"] += len(socks)
        stalled = socks[:5]
        for s in stalled:  # half a frame, then silence (the daemon drops them)
            s.sendall(hello_frame("stall")[:9])
        tried["half_frame_stall"] += len(stalled)
        watched.check()
        for s in socks:
            s.close()
        print(f"fuzz: round {rnd}: {sum(tried.values())} cases, "
              f"{max(0, until - time.monotonic()):.0f} s left", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=420.0,
                    help="length of the attack (default 420: over 100 000 cases on 2 "
                         "cores)")
    ap.add_argument("--quiet-seconds", type=float, default=60.0,
                    help="length of the quiet phase (default 60)")
    ap.add_argument("--out", default="fuzz", help="result name under bench/results/")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crossover-fuzz-"))
    runtime = tmp / "run"
    watched = Watched(runtime, tmp / "daemon.log")
    path = str(socket_path(node_name(), runtime))
    tried: Counter = Counter()
    try:
        watched.check()
        print(f"fuzz: quiet phase, {args.quiet_seconds:g} s", flush=True)
        quiet = latency(good_job(runtime, args.quiet_seconds), args.quiet_seconds)
        watched.check()
        print(f"fuzz: attack phase, {args.seconds:g} s", flush=True)
        job = good_job(runtime, args.seconds)
        time.sleep(1.0)  # the job is connected and granting before the first case
        attacker = threading.Thread(target=attack, args=(path, watched,
                                                         time.monotonic() + args.seconds - 1,
                                                         tried))
        attacker.start()
        under = latency(job, args.seconds)
        attacker.join()
        time.sleep(2.0)  # dropped connections are closed by now
        watched.check()
    finally:
        watched.daemon.stop()
    result = {"seconds": args.seconds, "quiet_seconds": args.quiet_seconds,
              "policy": "auto", "cases_tried": dict(tried),
              "cases_total": sum(tried.values()), "daemon_crashes": watched.crashes,
              "good_job": {"quiet": quiet, "attack": under}, "daemon": watched.summary()}
    out = write_result(RESULTS, args.out, result)
    print(json.dumps({k: result[k] for k in ("cases_total", "daemon_crashes", "good_job")}))
    print(f"fuzz: wrote {out}")
    return 0 if watched.crashes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
