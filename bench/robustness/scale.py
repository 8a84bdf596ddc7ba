"""The leader at cluster scale, simulated: the real leader (`crossover.daemon.world.leader.
Leader`) with its real grouping and mode decisions, fed the messages a world of N nodes
would send it, on a fake clock; what it sends is counted, not delivered.

Jobs come in groups that share nodes (each job on `--nodes-per-job` nodes, `--jobs-per-
group` jobs on the same nodes, one device each); the groups cover the nodes. Phases:

1. every job joins, node by node (join time at the leader, messages per join);
2. every group's jobs step for `--steps` steps, each job's nodes reporting each step
   (as a node's daemon does); half the groups compute faster in antiphase, half
   concurrently, so each group's probe decides (decision time: a progress report that
   ends in a decision);
3. churn: `--churn` times, a random job leaves its nodes and a new one takes its place
   (leave and join times, and what each sends).

Usage: .venv/bin/python -m bench.robustness.scale [--nodes 1000] [--devices 8] [--steps 100]
Writes bench/results/robustness/scale.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter

from bench.harness.common import area_results, write_result
from crossover.daemon.world.leader import Leader
from crossover.scheduler import ModeController

RESULTS = area_results("robustness")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Counting:
    """The leader's channel: counts what it would send, per kind."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent: Counter[str] = Counter()
        self.total = 0

    def send(self, dest: int, obj: tuple) -> None:
        self.sent[obj[0]] += 1
        self.total += 1

    def broadcast(self, obj: tuple, lost_too: bool = False) -> None:
        for dest in range(self.size):
            self.send(dest, obj)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1000


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99),
            "max_ms": round(max(values), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=8, help="devices per node")
    ap.add_argument("--nodes-per-job", type=int, default=4)
    ap.add_argument("--jobs-per-group", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100, help="ticks of 0.1 s")
    ap.add_argument("--churn", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scale")
    args = ap.parse_args()
    if args.jobs_per_group > args.devices or args.nodes % args.nodes_per_job:
        ap.error(f"need --jobs-per-group <= --devices ({args.devices}) and --nodes a "
                 f"multiple of --nodes-per-job ({args.nodes_per_job})")
    rng = random.Random(args.seed)
    clock, peers = Clock(), Counting(args.nodes)
    leader = Leader(peers, lambda: ModeController(clock, probe_s=1.0, hold_s=30.0), None,
                    None, clock)
    groups = [list(range(g, g + args.nodes_per_job))
              for g in range(0, args.nodes, args.nodes_per_job)]
    jobs = {f"g{g}j{j}": nodes for g, nodes in enumerate(groups)
            for j in range(args.jobs_per_group)}
    print(f"{args.nodes} nodes x {args.devices} devices, {len(groups)} groups, {len(jobs)} "
          f"jobs", flush=True)

    def join(job: str, nodes: list[int]) -> tuple[float, int]:
        before, took = peers.total, 0.0
        for node in nodes:
            took += timed(leader.handle, node, ("join", job))
        return took, peers.total - before

    join_ms, join_msgs = [], []
    for job, nodes in jobs.items():
        took, sent = join(job, nodes)
        join_ms.append(took)
        join_msgs.append(sent)
    print(f"joined: join p99 {pct(join_ms, 0.99):.3f} ms", flush=True)

    # Phase 2: steps. A group's step time depends on the mode its nodes are in.
    step_s = {g: (0.10, 0.08) if g % 2 else (0.08, 0.10) for g in range(len(groups))}
    mode_of: dict[int, str] = {}
    done: Counter[str] = Counter()  # each job's steps, fractional
    progress_ms, decision_ms, reports = [], [], 0
    for _ in range(args.steps):
        clock.now += 0.1
        for g, nodes in enumerate(groups):
            antiphase, concurrent = step_s[g]
            mode = leader._modes[leader.groups.group_of(f"g{g}j0")].mode.value
            mode_of[g] = mode
            rate = antiphase if mode == "antiphase" else concurrent
            for j in range(args.jobs_per_group):
                job = f"g{g}j{j}"
                done[job] += 0.1 / rate
                for node in nodes:  # each node's daemon reports the job's new count
                    decided = leader._modes[leader.groups.group_of(job)].snapshot()["state"]
                    took = timed(leader.handle, node, ("progress", job, int(done[job]),
                                                       False, 0))
                    reports += 1
                    progress_ms.append(took)
                    now = leader._modes[leader.groups.group_of(job)].snapshot()["state"]
                    if decided == "probe" and now == "hold":
                        decision_ms.append(took)
        leader.tick()
    decided = Counter(mode_of.values())
    print(f"stepped: {reports} progress reports; modes {dict(decided)}", flush=True)

    # Phase 3: churn, one job at a time.
    leave_ms, leave_msgs, churn_join_ms, churn_join_msgs, untouched = [], [], [], [], []
    names = list(jobs)
    for i in range(args.churn):
        old = rng.choice(names)
        nodes = jobs.pop(old)
        names.remove(old)
        others = {g for g in leader._modes if g != leader.groups.group_of(old)}
        states = {g: leader._modes[g].snapshot() for g in others}
        before, took = peers.total, 0.0
        for node in nodes:
            took += timed(leader.handle, node, ("leave", old))
        leave_ms.append(took)
        leave_msgs.append(peers.total - before)
        new = f"churn{i}"
        took, sent = join(new, nodes)
        churn_join_ms.append(took)
        churn_join_msgs.append(sent)
        jobs[new] = nodes
        names.append(new)
        untouched.append(all(leader._modes[g].snapshot() == states[g] for g in others
                             if g in leader._modes))
    print(f"churn: {args.churn} leave+join; other groups untouched in "
          f"{sum(untouched)}/{len(untouched)}", flush=True)

    nodes_per_job = args.nodes_per_job
    result = {
        "simulated_nodes": args.nodes,
        "devices_per_node": args.devices,
        "groups": len(groups),
        "jobs": len(jobs),
        "jobs_per_group": args.jobs_per_group,
        "join": summary(join_ms),
        "join_p99_ms": pct(join_ms + churn_join_ms, 0.99),
        "leave": summary(leave_ms),
        "decision": summary(decision_ms) if decision_ms else None,
        "decision_p99_ms": pct(decision_ms, 0.99) if decision_ms else None,
        "decisions": len(decision_ms),
        "progress_report": summary(progress_ms),
        "messages_per_join": statistics.median(join_msgs + churn_join_msgs),
        "messages_per_leave": statistics.median(leave_msgs),
        # a job's step: each of its nodes tells the leader its new count; grants and
        # releases never leave the node
        "cross_node_messages_per_step": nodes_per_job,
        "cross_node_messages_per_grant": 0,
        "other_groups_untouched_by_churn": f"{sum(untouched)}/{len(untouched)}",
        "modes_decided": dict(decided),
        "sent_by_kind": dict(peers.sent),
    }
    path = write_result(RESULTS, args.out, result)
    print(f"join p99 {result['join_p99_ms']} ms, decision p99 {result['decision_p99_ms']} ms, "
          f"{result['messages_per_join']} messages per join -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
