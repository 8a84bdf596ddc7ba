"""Chaos on a daemon world of several nodes: members and the leader killed and stopped
while jobs train on them.

    .venv/bin/python -m bench.robustness.chaos_world [--nodes 4] [--minutes 8] [--fault-every 4]
    .venv/bin/python -m bench.robustness.chaos_world --emulated [--minutes 8] [--fault-every 4]

N fake-node daemons under one mpirun (Open MPI's recovery on, as crossoverrun starts a
world); two 2-rank PyTorch jobs (examples/torch_mlp.py) at any time, each rank on a
random node (so jobs share some nodes and not others), a new one when one ends. Every
few seconds (exponentially distributed, mean --fault-every) one fault strikes:

    member_kill   SIGKILL a node service that does not lead (the leader's next
                  generation of the world starts a new one there)
    leader_kill   SIGKILL the leader's service (a successor takes over, and starts a new
                  one there)
    member_stop   SIGSTOP a service that does not lead for 1-10 s, then SIGCONT (past the
                  5 s silence it is lost; a new generation takes it back)
    leader_stop   SIGSTOP the leader's service for 1-10 s, then SIGCONT
    relay_kill    SIGKILL a node's relay, its MPI process (the service serves on; a new
                  generation takes the node back)
    node_kill     SIGKILL a node's service and relay at once, the leader's or another's
                  (the node is lost; a new generation starts a service there)
    rank_stop     SIGSTOP one rank for up to lease + 1 s, then SIGCONT
    link_cut      (--emulated) one host's link down for 2-12 s, then up: each side
                  serves on alone, and the world is one again after
    pair_cut      (--emulated, 3+ hosts) two hosts cannot reach each other, both ways,
                  for 2-12 s, while both reach the rest
    oneway_cut    (--emulated, 3+ hosts) what one host sends another is dropped for
                  2-12 s (TCP cannot connect or deliver either way then)
    loss          (--emulated) 10-50 % of one host's packets dropped for 2-12 s

Network faults come one at a time, and no job starts while one lasts or waits for the
running jobs' rendezvous (a job is cut neither in its first RENDEZVOUS_S nor before all
its ranks asked for a slot: a launch over a cut link fails with or without crossover);
the other faults strike meanwhile.

--emulated: emulated hosts of bench/harness/cluster.py (--hosts of them, network
namespaces on a bridge, 1000 Mbit/s links, root only) instead of fake nodes; every job
has a rank on each.

A daemon already down or stopped gets no second fault, and no kill leaves the world
without another node whose service answers with its relay: with no such node nothing
can bring the world back (crossoverrun's watcher starts a new one then; this storm has
none).
Checked and written to
bench/results/robustness/chaos_world.json (the keys of chaos.json, plus `nodes`):
    mismatches      finished jobs whose weights differ from the same job trained alone
                    without crossover (bit for bit): must be 0
    hangs           jobs that ran past --job-timeout: must be 0
    longest_stall_s the longest slot wait of any rank that overlaps no daemon fault
                    (from the fault to 15 s after its end) nor a stop of its own
    nodes_answering the fewest and the last count of nodes whose daemon answered
    world_whole_at_end  every node in the world, none lost, once the faults stopped
    order_checks    how often every node's jobs were compared (all along, beside the
                    faults): a job has one place, (start, name), on every node that has it
    order_disagreements  the jobs seen with different places on two nodes, or two jobs
                    with one place: must be 0
    generations     how many generations of the world formed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from bench.harness.cluster import LINK, EmulatedCluster
from bench.harness.common import area_results, write_result
from bench.harness.jobs import JOB_ENV, cluster_launch
from bench.robustness.chaos import (
    LENGTHS,
    SCRIPT,
    SEEDS,
    RunningJob,
    _load,
    compare_with_solo,
    let_finish,
)
from crossover.daemon.logfile import LOG_FILE
from crossover.daemon.relay.launch import relay_mca_env, relay_mca_flags
from crossover.launch.local import mpi_env, terminate_group
from crossover.probe import daemon_status, stop_world

RESULTS = area_results("robustness")

FAULTS = {"member_kill": 0.15, "leader_kill": 0.1, "member_stop": 0.15,
          "leader_stop": 0.1, "relay_kill": 0.15, "node_kill": 0.15, "rank_stop": 0.2,
          "link_cut": 0.1, "pair_cut": 0.1, "oneway_cut": 0.05, "loss": 0.1}
#: the faults of the network, one at a time (emulated hosts only); pair cuts need 3 hosts
NETWORK = {"link_cut": 2, "pair_cut": 3, "oneway_cut": 3, "loss": 2}
#: no network fault in a job's first seconds, nor before its ranks asked for a slot
RENDEZVOUS_S = 8.0
#: a daemon fault disturbs slot waits from its start to this long after its end
SETTLE_S = 15.0
#: how long the jobs' Gloo waits for a peer (Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS)
GLOO_TIMEOUT_S = 120


class World:
    """The daemons' world: who answers, who leads, and their processes."""

    def __init__(self, nodes: int, runtime: Path, env: dict, log: Path,
                 cluster: EmulatedCluster | None = None) -> None:
        self.cluster = cluster
        self.names = list(cluster.hosts) if cluster else [f"fake{i}" for i in range(nodes)]
        self.runtime = runtime
        daemon = [sys.executable, "-m", "crossover", "daemon", "--policy", "auto",
                  "--lease", "3", "--runtime-dir", str(runtime)]
        if cluster is not None:
            cmd = cluster.mpirun(daemon)
            env = {**env, **relay_mca_env()}
        else:
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", *relay_mca_flags(),
                   "-np", str(nodes), *daemon]
            env = {**env, "CROSSOVER_FAKE_NODES": str(nodes)}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        nodes = len(self.names)
        self.busy: set[str] = set()  # nodes whose daemon is down or stopped by a fault
        self.cut = False  # a host's link is down
        self.cut_due = False  # a cut waits for the running jobs' rendezvous to end
        self.order_checks, self.disagreements = 0, []
        self.answering = nodes  # as of the last check
        #: (monotonic time, node, pid, RSS bytes, open fds) of services and relays
        self.resources: list[tuple[float, str, int, int, int]] = []
        deadline = time.monotonic() + 60
        while len(self.status()) < nodes:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the daemon world did not start; see {log}")
            time.sleep(0.2)

    def status(self) -> dict:
        """The status as the first node that answers sees it."""
        for name in self.names:
            if name in self.busy:
                continue
            try:
                return daemon_status(self.runtime, name, timeout_s=3.0)
            except ConnectionError:
                continue
        return {}

    def stop(self) -> None:
        """Stop the world: its first mpirun, and the services and generations that
        outlive it (each names the runtime directory on its command line)."""
        for name in self.names:  # as `crossover stop` does: the leader tells every node
            try:
                stop_world(self.runtime, name, timeout_s=3.0)
                time.sleep(2.0)
                break
            except ConnectionError:
                continue
        terminate_group(self.proc, grace_s=5)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            procs = [p for p in psutil.process_iter(["cmdline"])
                     if str(self.runtime) in (p.info["cmdline"] or [])]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            psutil.wait_procs(procs, timeout=5)

    def check_orders(self) -> None:
        """Ask every node that answers for its jobs' places and count the disagreements:
        a job with two places on two nodes, or two jobs with one place on a node. Also
        samples the services' and relays' memory and open files."""
        with ThreadPoolExecutor(len(self.names)) as pool:
            own = dict(zip(self.names, pool.map(self._own, self.names), strict=True))
        self.answering = sum(snap is not None for snap in own.values())
        places: dict[str, tuple[str, list]] = {}
        now = time.monotonic()
        for name, snap in own.items():
            if snap is None:
                continue
            for pid in (snap["daemon"]["pid"], snap["world"].get("relay_pid")):
                with contextlib.suppress(psutil.Error, TypeError):
                    p = psutil.Process(pid)
                    self.resources.append((now, name, pid, p.memory_info().rss,
                                           p.num_fds()))
            jobs = snap["jobs"]
            seen: dict[tuple, str] = {}
            for job, entry in jobs.items():
                place = tuple(entry["order"])
                if seen.setdefault(place, job) != job:
                    self.disagreements.append(f"{job} and {seen[place]} share {place} "
                                              f"on {name}")
                first = places.setdefault(job, (name, list(place)))
                if first[1] != list(place):
                    self.disagreements.append(f"{job}: {first[1]} on {first[0]}, "
                                              f"{list(place)} on {name}")
        self.order_checks += 1

    def _own(self, name: str) -> dict | None:
        """Node `name`'s snapshot as it says it (None: busy, or it does not answer)."""
        if name in self.busy:
            return None
        try:
            return daemon_status(self.runtime, name, timeout_s=3.0)[name]
        except (ConnectionError, KeyError):
            return None

    def whole(self) -> bool:
        """Every node in the world under one leader, none lost."""
        nodes = self.status()
        return sorted(nodes) == sorted(self.names) and len(
            {(s["world"]["leader_node"], s["world"]["generation"]) for s in nodes.values()}
        ) == 1 and all(not s["world"]["lost"] and s["world"]["relay"]
                       for s in nodes.values())


def job_env(cluster: EmulatedCluster) -> dict[str, str]:
    """A job's environment on the emulated hosts. Over 3+ ranks, Horovod's fused
    allreduce sums each element in an order set by where it falls in the fusion buffer,
    and what is fused in a cycle depends on timing, which faults change: the weights
    would differ from the solo run's in the last bits. Each tensor reduced alone sums in
    one order.

    Gloo's default timeout (30 s) is shorter than a cut of up to 12 s plus TCP's
    retransmission backoff (0.2 s doubling: the segment after a 12 s cut may go out
    25 s after the first try), so a job of plain Horovod dies under such a cut with or
    without crossover; the storm's jobs wait GLOO_TIMEOUT_S, as a job on a flaky
    network would be told to."""
    return {**JOB_ENV, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S),
            **({"HOROVOD_FUSION_THRESHOLD": "0"} if len(cluster.hosts) > 2 else {})}


class Repeat:
    """Calls `action` again and again on a thread of its own until `stop`: the order
    checks run beside the faults (each asks every node, which under a fault can take
    seconds) instead of delaying the next one."""

    def __init__(self, action: Callable[[], None], pause_s: float = 0.5) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(action, pause_s),
                                        daemon=True)
        self._thread.start()

    def _run(self, action: Callable[[], None], pause_s: float) -> None:
        while not self._done.is_set():
            action()
            self._done.wait(pause_s)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)


def start_job(n: int, rng: random.Random, world: World, env: dict, tmp: Path) -> RunningJob:
    seed, steps = rng.choice(SEEDS), rng.choice(LENGTHS)
    name = f"j{n}"
    weights, log = tmp / f"{name}.pt", tmp / f"{name}.log"
    script = [sys.executable, str(SCRIPT), "--seed", str(seed), "--steps", str(steps),
              "--out", str(weights)]
    if world.cluster is not None:  # a rank on each host
        cmd, env = cluster_launch(world.cluster)(script), {**env, **job_env(world.cluster)}
    else:
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none"]
        for i, node in enumerate(rng.sample(world.names, 2)):
            cmd += [*([":"] if i else []), "-np", "1", "-x", f"CROSSOVER_NODE={node}",
                    *script]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**env, "CROSSOVER_JOB": name}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    size = len(world.cluster.hosts) if world.cluster is not None else 2
    return RunningJob(name, seed, steps, proc, time.monotonic(), weights, log, False,
                      size=size)


def past_rendezvous(job: RunningJob, runtime: Path) -> bool:
    """Every rank of `job` has asked its node's daemon for a slot: Horovod's start (the
    rendezvous in Gloo's store, over the network) is over. Until then a network fault
    would fail the job without crossover too. At least RENDEZVOUS_S after its launch."""
    if time.monotonic() - job.started < RENDEZVOUS_S:
        return False
    if job.name not in _RENDEZVOUS_DONE:
        said = "".join(p.read_text(errors="replace") for p in
                       (runtime / f"{LOG_FILE}.1", runtime / LOG_FILE) if p.exists())
        ranks = set(re.findall(rf"job {re.escape(job.name)} rank (\d+) on node ", said))
        if len(ranks) < job.size:
            return False
        _RENDEZVOUS_DONE.add(job.name)
    return True


_RENDEZVOUS_DONE: set[str] = set()


def inject(kind: str, world: World, jobs: list[RunningJob], rng: random.Random,
           later: list, windows: list, stops: list) -> str | None:
    """Strike once; returns what happened (None: no target now)."""
    if kind == "rank_stop":
        live = [(j, r) for j in jobs if j.proc.poll() is None for r in j.ranks()
                if r.pid not in j.stopped]
        if not live:
            return None
        job, rank = rng.choice(live)
        pause, at = rng.uniform(0.2, 4.0), time.time()
        rank.send_signal(signal.SIGSTOP)
        job.stopped.append(rank.pid)

        def cont() -> None:
            try:
                rank.send_signal(signal.SIGCONT)
            except Exception:  # noqa: BLE001 - it may have ended meanwhile
                pass
            job.stopped.remove(rank.pid)
            stops.append((job.name, at, time.time()))
        later.append((time.monotonic() + pause, cont))
        return f"SIGSTOP {pause:.1f} s a rank of {job.name}"
    if kind in NETWORK:
        # one network fault at a time, and only past the jobs' rendezvous: a job that
        # cannot reach its peers while it starts fails without crossover too (Gloo's
        # store). Until the running jobs are past theirs, the fault is due and no job
        # starts.
        if world.cut:
            return None
        world.cut_due = any(not past_rendezvous(j, world.runtime)
                            for j in jobs if j.proc.poll() is None)
        if world.cut_due:
            return None
        cluster, pause, at = world.cluster, rng.uniform(2.0, 12.0), time.time()
        host = rng.randrange(len(world.names))
        other = rng.choice([i for i in range(len(world.names)) if i != host])
        if kind == "link_cut":
            link = ["ip", "-n", world.names[host], "link", "set", LINK]
            subprocess.run([*link, "down"], check=True, timeout=30)
            what = f"link of {world.names[host]} down"

            def undo() -> None:
                subprocess.run([*link, "up"], check=True, timeout=30)
        else:
            if kind == "loss":
                fraction = rng.uniform(0.1, 0.5)
                cluster.lose(host, fraction)
                what = f"{fraction:.0%} of {world.names[host]}'s packets lost"
            else:
                cluster.cut(host, other, both=kind == "pair_cut")
                what = f"{world.names[host]} {'<' if kind == 'pair_cut' else ''}-/-> " \
                       f"{world.names[other]}"

            def undo() -> None:
                cluster.heal()
        world.cut = True

        def heal() -> None:
            undo()
            world.cut = False
            windows.append((at, time.time() + SETTLE_S))
        later.append((time.monotonic() + pause, heal))
        return f"{what} for {pause:.1f} s"
    nodes = world.status()
    leader = next((s["world"]["leader_node"] for s in nodes.values()), None)
    targets = [n for n in nodes if n not in world.busy
               and (kind == "node_kill" or (n == leader) == kind.startswith("leader"))]
    if not targets:
        return None
    node = rng.choice(targets)
    # A kill leaves at least one other node whose service answers with its relay: a
    # world with no such node has nothing to come back from (each relay restarts its
    # service a few times a minute, and only a leader forms a new generation; what a
    # cluster runs, crossoverrun's watcher or systemd, starts a new world then: this
    # storm has none). The storm once killed every service in turn at a fault every
    # 0.8 s on 3 hosts.
    whole = [n for n, snap in nodes.items() if snap["world"].get("relay_pid")
             and n not in world.busy and n != node]
    if kind.endswith("kill") and not whole:
        return None
    pid = nodes[node]["daemon"]["pid"]
    at = time.time()
    if kind in ("relay_kill", "node_kill"):
        relay = nodes[node]["world"].get("relay_pid")
        if relay is None:
            return None
        for victim in (relay, pid) if kind == "node_kill" else (relay,):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        windows.append((at, time.time() + SETTLE_S))
        what = "relay" if kind == "relay_kill" else "service and relay"
        return f"SIGKILL the {what} of {node}{' (the leader)' if node == leader else ''}"
    world.busy.add(node)
    if kind.endswith("kill"):
        os.kill(pid, signal.SIGKILL)

        def back() -> None:  # its new daemon: the leader's (after the loss is found)
            world.busy.discard(node)
            windows.append((at, time.time() + SETTLE_S))
        later.append((time.monotonic() + 10.0, back))
        return f"SIGKILL the daemon of {node}{' (the leader)' if node == leader else ''}"
    pause = rng.uniform(1.0, 10.0)
    os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        world.busy.discard(node)
        windows.append((at, time.time() + SETTLE_S))
    later.append((time.monotonic() + pause, resume))
    return f"SIGSTOP {pause:.1f} s the daemon of {node}" + \
        (" (the leader)" if node == leader else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every", type=float, default=4.0, metavar="S")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    ap.add_argument("--out", default="chaos_world")
    ap.add_argument("--emulated", action="store_true",
                    help="emulated hosts (root), with network faults, not fake nodes")
    ap.add_argument("--hosts", type=int, default=3, help="emulated hosts (default 3)")
    args = ap.parse_args()
    with EmulatedCluster(mbit=1000, hosts=args.hosts) if args.emulated else \
            contextlib.nullcontext() as c:
        return run(args, c)


def run(args: argparse.Namespace, cluster: EmulatedCluster | None) -> int:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="crossover-chaos-world-"))
    runtime, traces = tmp / "run", tmp / "traces"
    env = {**os.environ, **mpi_env(), "CROSSOVER_RUNTIME_DIR": str(runtime),
           "CROSSOVER_TRACE": str(traces), "OMPI_MCA_mpi_yield_when_idle": "1"}
    env.pop("CROSSOVER_FAKE_NODES", None)
    world = World(args.nodes, runtime, env, tmp / "daemon.log", cluster)
    hosts = len(cluster.hosts) if cluster else 0
    faults_here = {k: w for k, w in FAULTS.items() if hosts >= NETWORK.get(k, 0)}
    jobs: list[RunningJob] = []
    faults: Counter = Counter()
    later: list = []
    windows: list[tuple[float, float]] = []  # daemon faults: (from, settled)
    stops: list[tuple[str, float, float]] = []  # rank stops: (job, from, to)
    hangs, n, answering = [], 0, []
    checker = Repeat(world.check_orders)
    began = time.monotonic()
    end = began + args.minutes * 60
    next_fault = time.monotonic() + rng.expovariate(1 / args.fault_every)
    print(f"chaos_world: {len(world.names)} nodes, {args.minutes:g} min, a fault every "
          f"~{args.fault_every:g} s, work in {tmp}", flush=True)
    try:
        while time.monotonic() < end:
            for j in jobs:
                if j.proc.poll() is None and time.monotonic() - j.started > args.job_timeout:
                    hangs.append(j.name)
                    terminate_group(j.proc, grace_s=2)
                    print(f"chaos_world: HANG {j.name}", flush=True)
            while len([j for j in jobs if j.proc.poll() is None]) < 2 and not (
                    world.cut or world.cut_due):
                n += 1
                jobs.append(start_job(n, rng, world, env, tmp))
            if time.monotonic() >= next_fault:
                # (a network fault that waits for the jobs' rendezvous lets the others
                # strike meanwhile: it lands at its kind's next draw)
                kind = rng.choices(list(faults_here), weights=list(faults_here.values()))[0]
                what = inject(kind, world, jobs, rng, later, windows, stops)
                if what is not None:
                    faults[kind] += 1
                    answering.append(world.answering)
                    print(f"chaos_world: fault {sum(faults.values())}: {what} "
                          f"({answering[-1]} nodes answer, {len(jobs)} jobs so far, "
                          f"{(end - time.monotonic()) / 60:.1f} min left)", flush=True)
                next_fault = time.monotonic() + rng.expovariate(1 / args.fault_every)
            for item in sorted(later, key=lambda x: x[0]):
                if item[0] <= time.monotonic():
                    later.remove(item)
                    item[1]()
            time.sleep(0.1)
        for when, action in sorted(later, key=lambda x: x[0]):
            time.sleep(max(0.0, when - time.monotonic()))
            action()
        print("chaos_world: time is up; letting the running jobs finish", flush=True)
        hangs += let_finish(jobs, args.job_timeout)
        deadline = time.monotonic() + 60
        while not world.whole() and time.monotonic() < deadline:
            time.sleep(1.0)
        whole = world.whole()
        checker.stop()
        world.check_orders()
        answering.append(world.answering)
        generations = daemon_log(tmp).count("forming generation")
    finally:
        checker.stop()
        for j in jobs:
            if j.proc.poll() is None:
                terminate_group(j.proc, grace_s=2)
        world.stop()

    finished = [j for j in jobs if j.name not in hangs]
    if cluster is not None:  # trained alone the way the job was launched
        mismatches, failed = compare_with_solo(finished, tmp, {**env, **job_env(cluster)},
                                               "chaos_world", cluster_launch(cluster))
    else:
        mismatches, failed = compare_with_solo(finished, tmp, env, "chaos_world")
    waits = []
    for path in sorted(traces.glob("*.rank*.json")):
        job = path.name.rsplit(".rank", 1)[0]
        for e in _load(path):
            if e.get("ph") == "X" and e["name"] == "slot wait":
                a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
                quiet = not any(a < y and x < b for x, y in windows) and not any(
                    a < y and x < b for jj, x, y in stops if jj == job)
                waits.append((b - a, quiet))
    result = {
        "nodes": len(world.names), "emulated_hosts": cluster is not None,
        "minutes": args.minutes, "seed": args.seed,
        "jobs_run": len(jobs), "jobs_compared": len(finished) - len(failed),
        "jobs_failed": failed, "faults_injected": dict(faults),
        "faults_total": sum(faults.values()), "mismatches": len(mismatches),
        "mismatched_jobs": mismatches, "hangs": len(hangs), "hung_jobs": hangs,
        "job_timeout_s": args.job_timeout, "longest_job_s": longest_job_s(finished),
        "longest_stall_s": round(max((w for w, q in waits if q), default=0.0), 3),
        "longest_stall_raw_s": round(max((w for w, _ in waits), default=0.0), 3),
        "slot_waits": len(waits),
        "nodes_answering": {"fewest": min(answering, default=0),
                            "at_end": answering[-1] if answering else 0},
        "world_whole_at_end": whole, "generations": generations,
        "order_checks": world.order_checks,
        "order_disagreements": len(world.disagreements),
        "order_disagreement_examples": world.disagreements[:10],
        "resources": resource_drift(world.resources, began, began + args.minutes * 60),
        "reconnects": sum(j.log.read_text().count("is coordinated again") for j in jobs),
    }
    out = write_result(RESULTS, args.out, result)
    print(json.dumps({k: result[k] for k in ("jobs_run", "faults_total", "mismatches",
                                              "hangs", "longest_stall_s",
                                              "nodes_answering", "world_whole_at_end")}))
    print(f"chaos_world: wrote {out}")
    return 0 if not (mismatches or hangs or failed or world.disagreements) and whole else 1


def longest_job_s(finished: list[RunningJob]) -> float | None:
    """The longest training time a finished job printed ("seconds" of its result line):
    how close the slowest job came to --job-timeout."""
    said = [float(m) for j in finished if j.log.exists()
            for m in re.findall(r'"seconds": ([0-9.]+)', j.log.read_text(errors="replace"))]
    return round(max(said), 1) if said else None


def resource_drift(samples: list[tuple[float, str, int, int, int]], start: float,
                   end: float) -> dict | None:
    """The services' and relays' RSS and open fds from minute 10 to the end: the
    medians of the samples in minutes 10-12 and in the last two minutes, and the change
    (None for a storm shorter than 14 minutes). Kills replace processes, so these are
    the figures of whichever processes serve then; those that lived through both
    windows are also compared one by one."""
    if end - start < 14 * 60:
        return None
    first = [x for x in samples if start + 600 <= x[0] < start + 720]
    last = [x for x in samples if x[0] >= end - 120]
    if not first or not last:
        return None

    def change(a: float, b: float) -> float:
        return round(b / a - 1, 3) if a else 0.0
    out = {}
    for key, i in (("rss_bytes", 3), ("fds", 4)):
        a, b = statistics.median(x[i] for x in first), statistics.median(x[i] for x in last)
        out[key] = {"minute_10_12": a, "last_2_min": b, "change": change(a, b)}
    both = {x[2] for x in first} & {x[2] for x in last}
    out["survivors"] = {
        str(pid): {key: change(statistics.median(x[i] for x in first if x[2] == pid),
                               statistics.median(x[i] for x in last if x[2] == pid))
                   for key, i in (("rss_bytes", 3), ("fds", 4))}
        for pid in sorted(both)}
    return out


def daemon_log(tmp: Path) -> str:
    """The world's log: its first mpirun's output, and its services' and relays' (they
    log to the runtime directory, whose log may have been rotated once)."""
    return "".join(p.read_text(errors="replace") for p in (
        tmp / "daemon.log", tmp / "run" / "daemon.log.1", tmp / "run" / "daemon.log")
        if p.exists())


if __name__ == "__main__":
    sys.exit(main())
