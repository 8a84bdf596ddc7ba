"""Two Horovod PyTorch jobs x 2 ranks and the daemon, all real processes under mpirun.

Job A trains with seed 1 and job B with seed 2; each is compared with the same job
trained alone with crossover off (`CROSSOVER_ENABLE=0`): weights must be bit-identical.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from crossover import trace
from tests.conftest import Cluster, Proc, assert_ran_together, held, same_weights, wait_for
from tests.test_metrics import free_port, get, samples

pytestmark = pytest.mark.mpi

STEPS = 150
LONG_STEPS = 2500  # outlasts a daemon restart (seconds)
# Two probe windows and a decision while both jobs run: STEPS (about 1 s together) once
# ended before the third decision, and 3 x STEPS once before the first antiphase window
# (a job slow to start on a loaded host).
MODE_STEPS = 6 * STEPS
SEEDS = {"A": 1, "B": 2}


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict:
    """Each job's final weights trained alone, without crossover."""
    c = Cluster(tmp_path_factory.mktemp("solo"))
    out = {}
    try:
        for name, seed in SEEDS.items():
            job = c.job(name, seed, STEPS, crossover=False)
            job.wait(120)
            out[name] = job.weights
        acc = c.job("acc", 3, STEPS // 2, crossover=False, extra=("--accumulate", "2"))
        acc.wait(120)
        out["acc"] = acc.weights
        long = c.job("Blong", SEEDS["B"], LONG_STEPS, crossover=False)
        long.wait(120)
        out["Blong"] = long.weights
        for name, seed in SEEDS.items():
            job = c.job(f"{name}mode", seed, MODE_STEPS, crossover=False)
            job.wait(120)
            out[f"{name}mode"] = job.weights
    finally:
        c.cleanup()
    return out


def registered(c: Cluster, job: str, ranks: int = 2):
    log = c.tmp / "daemon.log"
    pattern = rf"job {job} rank \d+ on node"
    return lambda: log.exists() and len(re.findall(pattern, log.read_text())) >= ranks


def test_two_jobs_share_devices_without_overlap_and_keep_their_math(cluster: Cluster, solo):
    with cluster.daemon():
        a, b = cluster.jobs_together(("A", 1, STEPS), ("B", 2, STEPS))
        a.wait(180)
        b.wait(180)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert len(trace.holds_by_device(events)) == 2, "expected two CPU devices"
    # While both run they take turns: many hand-overs, not a few long holds.
    assert_ran_together(events, min_handovers=STEPS // 2)
    assert trace.overlaps(events) == []
    assert same_weights(a.weights, solo["A"])
    assert same_weights(b.weights, solo["B"])


def test_mode_switches_mid_run_keep_the_math(cluster: Cluster, solo):
    """The default policy with short probes and holds switches between antiphase and
    concurrent grants while the jobs train; the weights stay bit-identical.
    (Holds overlap in concurrent windows by design; tests/test_mode.py proves that
    antiphase stays exclusive across switches.)"""
    # (--mode-probe-local: these jobs' ranks share this host, which is otherwise not probed)
    port = free_port()
    with cluster.daemon(policy="auto", extra=("--mode-probe", "0.2", "--mode-hold", "0.5",
                                              "--mode-probe-local", "--metrics-port",
                                              str(port))):
        began = time.monotonic()
        a, b = cluster.jobs_together(("A", 1, MODE_STEPS), ("B", 2, MODE_STEPS))
        a.wait(180)
        b.wait(180)
        ran_s = time.monotonic() - began
        log = (cluster.tmp / "daemon.log").read_text()
        took = [float(s) for s in re.findall(r"\(decided in ([0-9.]+) s\)", log)]

        def histogram() -> tuple[float, float]:  # (the leader's thread copies it when free)
            got = samples(get(f"http://127.0.0.1:{port}/metrics")[1])
            return tuple(next(v for (n, _), v in got.items() if n == name) for name in (
                "crossover_mode_decision_seconds_count",
                "crossover_mode_decision_seconds_sum"))
        wait_for(lambda: histogram()[0] == len(took), 10, "the histogram to count them")
        count, sum_s = histogram()
    decided = re.findall(r"mode (antiphase|concurrent) for group \d+ \(nodes [^)]*\): ", log)
    # concurrent (probe), antiphase (probe), then a decision: both directions of switch
    assert {"antiphase", "concurrent"} <= set(decided) and len(decided) >= 3, log
    # the leader's decisions as its log times them, in its histogram
    assert took and count == len(took) and max(took) < ran_s, (took, count, ran_s)
    assert sum_s == pytest.approx(sum(took), abs=0.001 * len(took)), (sum_s, took)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    seen = {ev["name"] for ev in events if ev.get("ph") == "i"}
    assert {"mode antiphase", "mode concurrent"} <= seen, "the ranks' traces show the switches"
    # Concurrent, the jobs ran on shares of the host's cores; antiphase took them back:
    # each rank's own affinity (read back after pinning, in its trace) was its share,
    # then, after the switch to antiphase, the whole host.
    host = sorted(os.sched_getaffinity(0))
    for job, rank in ((j, r) for j in ("A", "B") for r in (0, 1)):
        seq = [(ev["name"], ev["args"].get("applied"), ev["args"].get("share"))
               for ev in sorted(trace.load(cluster.traces / f"{job}.rank{rank}.json"),
                                key=lambda e: e.get("ts", 0))
               if ev.get("ph") == "i" and ev["name"].split()[0] in ("cores", "mode")]
        shared = next(i for i, (name, applied, share) in enumerate(seq)
                      if name.startswith("cores ") and share and applied == share)
        back = next(i for i, (name, _, _) in enumerate(seq) if name == "mode antiphase"
                    and i > shared)
        assert ("cores all", host, []) in seq[back:], (job, rank, seq)
    assert same_weights(a.weights, solo["Amode"])
    assert same_weights(b.weights, solo["Bmode"])


def rank_processes(job: Proc) -> list[psutil.Process]:
    """The job's rank processes (mpirun's children running the script)."""
    return [p for p in psutil.Process(job.popen.pid).children(recursive=True)
            if any(arg.endswith("torch_mlp.py") for arg in p.cmdline())]


def test_cores_are_given_back_when_the_daemon_is_lost(cluster: Cluster, solo):
    """Under auto, CPU jobs on one host run on disjoint shares of its cores. A share holds
    only while the daemon is there to change it: with the daemon gone, every rank runs
    on the whole host again (read from the ranks' own affinity)."""
    host = frozenset(os.sched_getaffinity(0))
    with cluster.daemon(policy="auto") as daemon:
        a, b = cluster.jobs_together(("A", 1, 100_000), ("B", 2, LONG_STEPS))
        ranks = {"A": rank_processes(a), "B": rank_processes(b)}
        assert all(len(r) == 2 for r in ranks.values()), ranks

        def split() -> bool:
            cores = {job: {frozenset(p.cpu_affinity()) for p in ps} for job, ps in ranks.items()}
            if not all(len(c) == 1 for c in cores.values()):
                return False
            (share_a,), (share_b,) = cores["A"], cores["B"]
            return not share_a & share_b and share_a | share_b == host

        wait_for(split, 60, "each job's ranks to run on a share of the cores of its own")
        daemon.kill(signal.SIGKILL)
    wait_for(lambda: all(frozenset(p.cpu_affinity()) == host
                         for ps in ranks.values() for p in ps),
             30, "every rank to run on the whole host again")
    out_b = b.wait(180)
    a.kill()
    assert "trains on uncoordinated" in out_b
    assert same_weights(b.weights, solo["Blong"])


def test_backward_passes_per_step_keeps_the_math(cluster: Cluster, solo):
    with cluster.daemon():
        acc, other = cluster.jobs_together(("acc", 3, STEPS // 2, "--accumulate", "2"),
                                           ("B", 2, STEPS))
        acc.wait(180)
        other.wait(180)
    assert same_weights(acc.weights, solo["acc"])
    assert same_weights(other.weights, solo["B"])
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert_ran_together(events)
    assert trace.overlaps(events) == []


@pytest.mark.parametrize("policy", ["crossover", "auto"])
def test_killed_job_frees_its_slots_and_the_other_finishes(cluster: Cluster, solo, policy):
    with cluster.daemon(policy=policy, extra=("--mode-probe", "0.2", "--mode-hold", "0.5",
                                              "--mode-probe-local")
                        if policy == "auto" else ()):
        # B starts once A is in: started together, B's short run could end before the
        # kill (A's launch was slower on a loaded machine), and the log was read before
        # the daemon had seen A's sockets close (a failure seen once)
        doomed = cluster.job("A", 1, 100_000)
        wait_for(registered(cluster, "A"), 60, "job A to register")
        survivor = cluster.job("B", 2, STEPS)
        wait_for(held(cluster.runtime, "B"), 60, "job B to hold a device")
        doomed.kill(signal.SIGKILL)
        # freed when A's sockets closed (at once), not when its 30 s lease ran out
        wait_for(lambda: "job A rank 0 left node" in (cluster.tmp / "daemon.log").read_text(),
                 10, "the daemon to see job A's rank 0 leave")
        survivor.wait(120)
    log = (cluster.tmp / "daemon.log").read_text()
    assert not re.search(r"job A rank \d held \S+ past its", log), log[-3000:]
    assert same_weights(survivor.weights, solo["B"])


@pytest.mark.parametrize("policy", ["crossover", "auto"])
def test_daemon_death_falls_back_to_uncoordinated_training(cluster: Cluster, solo, policy):
    with cluster.daemon(policy=policy) as daemon:
        a, b = cluster.jobs_together(("A", 1, STEPS), ("B", 2, STEPS))
        daemon.kill(signal.SIGKILL)
        out_a, out_b = a.wait(180), b.wait(180)
    for out in (out_a, out_b):
        assert "trains on uncoordinated" in out
    assert same_weights(a.weights, solo["A"])
    assert same_weights(b.weights, solo["B"])


def test_jobs_reconnect_to_a_restarted_daemon_and_keep_their_math(cluster: Cluster, solo):
    """A daemon that dies and comes back takes its running jobs back: they heal (reconnect
    with backoff, re-register) instead of training on uncoordinated to the end."""
    with cluster.daemon(policy="auto") as daemon:
        a, b = cluster.jobs_together(("A", 1, 100_000), ("B", 2, LONG_STEPS))
        daemon.kill(signal.SIGKILL)
    with cluster.daemon(policy="auto"):  # a fresh daemon on the same runtime directory
        wait_for(registered(cluster, "A"), 60, "job A to re-register")
        wait_for(registered(cluster, "B"), 60, "job B to re-register")
        out_b = b.wait(180)
        a.kill()
    assert "trains on uncoordinated; it reconnects when the daemon is back" in out_b
    assert out_b.count("is coordinated again") == 2, out_b  # both of B's ranks
    assert same_weights(b.weights, solo["Blong"])


@pytest.mark.parametrize("extra", [(), ("--align-phases",)], ids=["", "align-phases"])
def test_daemons_on_two_nodes_agree_on_the_job_order(cluster: Cluster, solo, extra):
    """Two daemon processes (fake nodes, one MPI world); each job rank on its own node.
    Aligning the nodes' phases (delayed hand-overs) keeps the math and the exclusion."""
    with cluster.daemon(nodes=2, extra=extra):
        a, b = cluster.jobs_together(("A", 1, STEPS), ("B", 2, STEPS))
        a.wait(180)
        b.wait(180)
        log = (cluster.tmp / "daemon.log").read_text()
    # each job's place (its start, and its name) is the same on both nodes
    starts = re.findall(r"job (\w+) rank (\d) on node (fake\d) -> (\w+) \(started (\d+)\)",
                        log)
    by_job = {}
    for job, rank, node, _device, start in starts:
        assert node == f"fake{rank}", "local rank l must reach fake node l"
        by_job.setdefault(job, set()).add(start)
    assert set(by_job) == {"A", "B"}
    assert all(len(s) == 1 for s in by_job.values()), f"nodes disagree on order: {by_job}"
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert set(trace.holds_by_device(events)) == {"fake0/cpu0", "fake1/cpu0"}
    assert_ran_together(events)
    assert trace.overlaps(events) == []
    assert same_weights(a.weights, solo["A"])
    assert same_weights(b.weights, solo["B"])
    for job in (a, b):  # the ranks' wait reports are part of the protocol
        assert "uncoordinated" not in job.output()


def mode_switches(c: Cluster, job: str, rank: int) -> list[str]:
    """The mode changes a rank was told of, in order (its trace's instants)."""
    events = sorted(trace.load(c.traces / f"{job}.rank{rank}.json"), key=lambda e: e.get("ts", 0))
    return [ev["name"] for ev in events if ev.get("ph") == "i" and ev["name"].startswith("mode ")]


def test_auto_on_two_nodes_switches_every_node_alike_and_keeps_the_math(cluster: Cluster, solo):
    """Two daemons (fake nodes) under the default policy: the leader probes and decides,
    every node applies each switch (with the request points it carries), and the jobs,
    each with a rank on either node, keep their math."""
    # (--mode-probe-local: the fake nodes share this host, which is otherwise not probed)
    with cluster.daemon(nodes=2, policy="auto", extra=("--mode-probe", "0.2", "--mode-hold",
                                                       "0.5", "--mode-probe-local")):
        a, b = cluster.jobs_together(("A", 1, MODE_STEPS), ("B", 2, MODE_STEPS))
        a.wait(180)
        b.wait(180)
        log = (cluster.tmp / "daemon.log").read_text()
    # the leader's log alone
    decided = re.findall(r"mode (antiphase|concurrent) for group \d+ \(nodes [^)]*\): ", log)
    assert {"antiphase", "concurrent"} <= set(decided) and len(decided) >= 3, log
    for job in ("A", "B"):
        # rank r runs on node fake<r>: both nodes told the job the same modes in order
        # (a job may end before it hears the last one)
        short, long = sorted((mode_switches(cluster, job, r) for r in (0, 1)), key=len)
        assert long[:len(short)] == short, (job, short, long)
        # a switch in each direction: out of antiphase (where a rank starts), and back
        assert "mode concurrent" in short, (job, short)
        assert "mode antiphase" in short[short.index("mode concurrent"):], (job, short)
    assert same_weights(a.weights, solo["Amode"])
    assert same_weights(b.weights, solo["Bmode"])
    for job in (a, b):
        assert "uncoordinated" not in job.output()
