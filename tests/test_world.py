"""A daemon world that outlives its members: worlds of 4 fake-node daemons under mpirun
(with Open MPI's recovery on, as crossoverrun starts them), a member or the leader
SIGKILLed or stopped while 2-rank jobs train on other nodes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from crossover import trace
from crossover.daemon.world.generation import GENERATION_TIMEOUT_S
from crossover.probe import daemon_status
from tests.conftest import PY, REPO, Cluster, Proc, assert_ran_together, same_weights, wait_for

pytestmark = pytest.mark.mpi

def status(cluster: Cluster, node: str) -> dict:
    return daemon_status(cluster.runtime, node, timeout_s=5.0)


def daemon_pid(cluster: Cluster, node: str, asking: str = "fake1") -> int:
    return status(cluster, asking)[node]["daemon"]["pid"]


def job_on(cluster: Cluster, name: str, nodes: list[str], seed: int, steps: int,
           extra: tuple[str, ...] = (), crossover: bool = True) -> Proc:
    """A job with one rank on each of `nodes` (MPMD: each rank names its node)."""
    env = dict(cluster.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(cluster.traces))
    if not crossover:
        env["CROSSOVER_ENABLE"] = "0"
    out = cluster.tmp / f"{name}.pt"
    script = [PY, str(REPO / "examples/torch_mlp.py"), "--seed", str(seed), "--steps",
              str(steps), "--out", str(out), *extra]
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none"]
    for i, node in enumerate(nodes):
        cmd += [*([":"] if i else []), "-np", "1", "-x", f"CROSSOVER_NODE={node}", *script]
    proc = Proc(cmd, env, cluster.tmp / f"{name}.log")
    proc.weights = out
    cluster.procs.append(proc)
    return proc


def joined(cluster: Cluster, job: str, nodes: list[str]) -> bool:
    log = (cluster.tmp / "daemon.log").read_text()
    return all(re.search(rf"job {job} rank \d+ on node {n} ", log) for n in nodes)


def lost_seen(cluster: Cluster, asking: str, node: str) -> bool:
    try:
        return node in status(cluster, asking)[asking]["world"]["lost"]
    except (ConnectionError, KeyError):
        return False


def follows(cluster: Cluster, asking: str) -> str | None:
    """The node `asking` follows, as it says."""
    try:
        return status(cluster, asking)[asking]["world"]["leader_node"]
    except (ConnectionError, KeyError):
        return None


def check_jobs(cluster: Cluster, jobs: list[Proc], references: list[Proc],
               fell_open_ranks: set[int] = frozenset(),
               uncoordinated: tuple[str, float, float] | None = None) -> None:
    """Every job finished with the weights it has alone, only `fell_open_ranks` fell
    open (the ranks on a lost node), and the jobs took turns on their devices without
    ever holding one at once, except on `uncoordinated` = (node, from, to) (wall clock
    seconds) while that node had no daemon."""
    for job, ref in zip(jobs, references, strict=True):
        out = job.wait(300)
        ref.wait(300)
        name = job.log.stem
        assert {r for r in (0, 1) if fell_open(job, name, r)} == set(fell_open_ranks), \
            out[-2000:]
        assert same_weights(job.weights, ref.weights)
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    assert_ran_together(events)
    overlaps = trace.overlaps(events)
    if uncoordinated is not None:
        node, since, until = uncoordinated
        # two holds overlap from the later start (spans come sorted by start) to the
        # earlier end; a hold granted before the kill may overlap one taken after it
        overlaps = [o for o in overlaps if not (
            o[0].startswith(f"{node}/") and since <= o[2][0] / 1e6
            and min(o[1][1], o[2][1]) / 1e6 <= until)]
    assert overlaps == []


def references(cluster: Cluster, specs: list[tuple[str, int, int]]) -> list[Proc]:
    return [job_on(cluster, f"{name}-alone", ["fake1", "fake2"], seed, steps,
                   crossover=False) for name, seed, steps in specs]


def fell_open(proc: Proc, job: str, rank: int) -> bool:
    return f"job {job!r} rank {rank} trains on uncoordinated" in proc.output()


def registrations(cluster: Cluster, job: str, node: str) -> int:
    log = (cluster.tmp / "daemon.log").read_text()
    return len(re.findall(rf"job {job} rank \d+ on node {node} ", log))


def test_a_members_death_costs_only_its_node_and_a_new_daemon_rejoins(cluster: Cluster):
    """SIGKILL the daemon of fake3, its service and its relay, while two jobs train with
    a rank on fake1 and one on fake3: the other three answer status without waiting for
    fake3 and say it is lost; the jobs' fake1 ranks stay coordinated; the leader forms a
    new generation with a new daemon on fake3, and the fake3 ranks are coordinated again
    within 20 s of it (their reconnects back off to 10 s). Both jobs train to the weights
    they have alone."""
    specs = [("A", 1, 4000), ("B", 2, 4000)]  # long enough to outlast the rejoin
    with cluster.daemon(nodes=4):
        together = cluster.start_args(2)
        jobs = [job_on(cluster, name, ["fake1", "fake3"], seed, steps, together)
                for name, seed, steps in specs]
        wait_for(lambda: all(joined(cluster, n, ["fake1", "fake3"]) for n, *_ in specs),
                 120, "both jobs to join")
        snap = status(cluster, "fake1")["fake3"]
        old = snap["daemon"]["pid"]
        killed = time.time()
        os.kill(snap["world"]["relay_pid"], signal.SIGKILL)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: lost_seen(cluster, "fake0", "fake3"), 20,
                 "the leader to find fake3 lost")
        for node in ("fake0", "fake1", "fake2"):
            took = []
            for _ in range(3):  # (waiting for the lost node costs every try 2 s; load, one)
                start = time.monotonic()
                nodes = status(cluster, node)
                took.append(time.monotonic() - start)
                assert sorted(nodes) == ["fake0", "fake1", "fake2"]
            assert min(took) < 1.5, (node, took)

        def rejoined() -> bool:
            try:
                nodes = status(cluster, "fake0")
            except ConnectionError:
                return False
            return "fake3" in nodes and nodes["fake3"]["daemon"]["pid"] != old
        wait_for(rejoined, 30, "a new daemon on fake3 in the world")
        back = time.time()
        # (a rank's reconnect backs off to HEAL_MOST_S, and a try may take HEAL_TIMEOUT_S)
        wait_for(lambda: all(registrations(cluster, n, "fake3") == 2 for n, *_ in specs),
                 20, "the fake3 ranks to register again")
        assert all(p.popen.poll() is None for p in jobs), "the jobs ended too soon"
        check_jobs(cluster, jobs, references(cluster, specs), fell_open_ranks={1},
                   uncoordinated=("fake3", killed, float("inf")))
    # when each fake3 rank took up coordination again (its trace says), and no overlap
    # on fake3 after that
    healed = max(e["ts"] / 1e6 for name, _, _ in specs
                 for e in trace.load(cluster.traces / f"{name}.rank1.json")
                 if e.get("name") == "coordinated again")
    assert healed - back < 20, healed - back
    events = trace.merge(sorted(cluster.traces.glob("*.json")), cluster.tmp / "merged.json")
    late = [o for o in trace.overlaps(events) if o[0].startswith("fake3/")
            and max(o[1][0], o[2][0]) / 1e6 > healed]
    assert late == []
    log = (cluster.tmp / "daemon.log").read_text()
    assert "daemon 3 (node fake3) is lost" in log and "leads from epoch" not in log
    assert re.search(r"forming generation \d+ of the world: .*\(new: fake3\)", log)


def test_a_relays_death_costs_nothing_and_its_node_is_taken_back(cluster: Cluster):
    """SIGKILL the relay (the node's MPI process) of fake1, then the leader's (fake0),
    while two jobs train on fake1 and fake2: the node services serve on (no rank falls
    open, no two holds ever overlap, the weights are those of the jobs alone), and a new
    generation of the world takes each node back with the service it had. Then SIGKILL
    fake3's service alone: its relay starts another, and the world stays as it was."""
    specs = [("A", 1, 3000), ("B", 2, 3000)]  # ~30 s of kills in ~140 s of training
    with cluster.daemon(nodes=4):
        together = cluster.start_args(2)
        jobs = [job_on(cluster, name, ["fake1", "fake2"], seed, steps, together)
                for name, seed, steps in specs]
        wait_for(lambda: all(joined(cluster, n, ["fake1", "fake2"]) for n, *_ in specs),
                 120, "both jobs to join")
        for node in ("fake1", "fake0"):
            snap = status(cluster, "fake2")[node]
            service, generation = snap["daemon"]["pid"], snap["world"]["generation"]
            os.kill(snap["world"]["relay_pid"], signal.SIGKILL)

            def taken_back(node: str = node, generation: int = generation) -> bool:
                nodes = status(cluster, "fake2")
                world = nodes.get(node, {}).get("world", {})
                return world.get("generation", -1) > generation and world["relay"] and \
                    all(s["world"]["lost"] == [] for s in nodes.values())
            wait_for(taken_back, 30, f"{node} in a new generation")
            assert status(cluster, "fake2")[node]["daemon"]["pid"] == service

        def one_world() -> bool:  # a member may have succeeded the leader meanwhile, and
            # be forming a generation to take its node back: the newest one wins
            worlds = [s["world"] for s in status(cluster, "fake2").values()]
            return len(worlds) == 4 and all(
                (w["generation"], w["leader_node"], w["lost"], w["relay"], w["forming"])
                == (worlds[0]["generation"], worlds[0]["leader_node"], [], True, None)
                for w in worlds)
        wait_for(one_world, 45, "one generation and one leader on every node, none forming")
        # a service killed alone is started again by its relay, in the same generation
        snap = status(cluster, "fake2")["fake3"]
        os.kill(snap["daemon"]["pid"], signal.SIGKILL)

        settled: list[dict] = []

        def restarted() -> bool:  # and every node's status in (a busy node may miss one)
            nodes = status(cluster, "fake2")
            if len(nodes) == 4 and nodes["fake3"]["daemon"]["pid"] != snap["daemon"]["pid"] \
                    and all(s["world"]["lost"] == [] for s in nodes.values()):
                settled.append(nodes["fake3"])
            return bool(settled)
        wait_for(restarted, 15, "a new service on fake3")
        log = (cluster.tmp / "daemon.log").read_text()
        assert settled[0]["world"]["generation"] == snap["world"]["generation"], \
            [ln for ln in log.splitlines() if "fake3" in ln]
        assert all(p.popen.poll() is None for p in jobs), "the jobs ended too soon"
        check_jobs(cluster, jobs, references(cluster, specs))


def test_a_leaders_death_is_taken_over_and_new_jobs_are_coordinated(cluster: Cluster):
    """SIGKILL the leader's node (fake0: its service and its relay) and start two jobs
    on fake1 and fake2 at once: their joins wait for the successor (fake1), which
    rebuilds the order from what the members hold; both jobs are coordinated within 15 s
    of the kill and train to the weights they have alone; the new leader starts a
    daemon on fake0, which joins the world. (A leader's service killed alone is started
    again by its relay, and leads again: bench/robustness/chaos_world.py's leader_kill.)"""
    specs = [("C", 3, 150), ("D", 4, 150)]
    with cluster.daemon(nodes=4):
        snap = status(cluster, "fake1")["fake0"]
        os.kill(snap["world"]["relay_pid"], signal.SIGKILL)
        os.kill(snap["daemon"]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        together = cluster.start_args(2)
        jobs = [job_on(cluster, name, ["fake1", "fake2"], seed, steps, together)
                for name, seed, steps in specs]
        wait_for(lambda: all(joined(cluster, n, ["fake1", "fake2"]) for n, *_ in specs),
                 60, "both jobs to join")
        assert time.monotonic() - killed < 15

        def whole() -> bool:  # the new leader started a daemon on fake0 too
            nodes = status(cluster, "fake2")
            return len(nodes) == 4 and all(
                (s["world"]["leader_node"], s["world"]["lost"]) == ("fake1", [])
                for s in nodes.values())
        # within one generation that does not form and the next try (a slow machine's)
        wait_for(whole, GENERATION_TIMEOUT_S + 40, "fake0 back in the world, under the "
                 "new leader")
        check_jobs(cluster, jobs, references(cluster, specs))
    log = (cluster.tmp / "daemon.log").read_text()
    assert "daemon 1 (node fake1) leads from epoch 1" in log
    assert re.search(r"forming generation \d+ of the world: .*\(new: fake0\)", log)


def test_a_stopped_leader_that_resumes_steps_down_and_is_taken_back(cluster: Cluster):
    """SIGSTOP the leader past the silence limit: fake1 succeeds it; once resumed, the
    old leader steps down and the world is whole again, with one leader."""
    with cluster.daemon(nodes=4):
        pid = daemon_pid(cluster, "fake0")
        os.kill(pid, signal.SIGSTOP)
        try:
            # stopped until its successor leads (resumed as soon as a member finds it
            # silent, it may speak again before fake1 has asked the others and led)
            wait_for(lambda: follows(cluster, "fake1") == "fake1", 30,
                     "fake1 to lead in the stopped leader's place")
        finally:
            os.kill(pid, signal.SIGCONT)

        def whole() -> bool:
            nodes = status(cluster, "fake0")
            worlds = [snap["world"] for snap in nodes.values()]
            return len(nodes) == 4 and all((w["leader_node"], w["lost"]) == ("fake1", [])
                                           for w in worlds)
        wait_for(whole, 30, "the old leader to follow the new one")
    log = (cluster.tmp / "daemon.log").read_text()
    # it steps down (told by a member, or by the new leader's generation)
    assert re.search(r"daemon 0 follows .* no longer the leader", log)


def test_a_job_on_nodes_outside_the_world_gets_them(cluster: Cluster, monkeypatch):
    """A world of fake0 and fake1; a launcher for a job on fake2 and fake3 asks it to
    grow (`ensure_daemon`): the leader starts daemons there, which join the world, and
    the launcher returns within 10 s, and the job is coordinated there from its start."""
    from crossover.launch.daemons import ensure_daemon

    specs = [("E", 5, 150), ("F", 6, 150)]
    with cluster.daemon(nodes=2):
        monkeypatch.setenv("CROSSOVER_FAKE_NODES", "2")
        monkeypatch.setenv("CROSSOVER_RUNTIME_DIR", str(cluster.runtime))
        start = time.monotonic()
        ensure_daemon(str(cluster.runtime), None, ["fake2", "fake3"], 120)
        grown = time.monotonic() - start
        assert sorted(status(cluster, "fake0")) == ["fake0", "fake1", "fake2", "fake3"]
        assert grown < 10, grown  # so the job starts coordinated on every node
        together = cluster.start_args(2)
        jobs = [job_on(cluster, name, ["fake2", "fake3"], seed, steps, together)
                for name, seed, steps in specs]
        wait_for(lambda: all(joined(cluster, n, ["fake2", "fake3"]) for n, *_ in specs),
                 60, "both jobs to join on the new nodes")
        refs = [job_on(cluster, f"{name}-alone", ["fake2", "fake3"], seed, steps,
                       crossover=False) for name, seed, steps in specs]
        check_jobs(cluster, jobs, refs)
    log = (cluster.tmp / "daemon.log").read_text()
    assert re.search(r"forming generation \d+ of the world: .*\(new: fake2, fake3\)", log)


STRANGER = r"""
import json, os, socket, struct, sys
os.setgid(65534); os.setuid(65534)  # nobody
body = json.dumps({"v": int(sys.argv[2]), "kind": "grow", "nodes": ["fake7"]}).encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
    s.sendall(struct.pack("!I", len(body)) + body)
    head = s.recv(4)
    if not head:
        print("closed")
    else:  # what kind of answer: a refusal says why
        data = b""
        while len(data) < struct.unpack("!I", head)[0] and (part := s.recv(65536)):
            data += part
        print("answered", json.loads(data)["kind"])
except OSError as exc:
    print(type(exc).__name__)
"""


def test_only_the_worlds_own_user_can_ask_it_to_grow(cluster: Cluster):
    """A process of another user (nobody) cannot reach a daemon through its 0700
    runtime directory; with the directory opened up, the daemon refuses it by its
    credentials, as a launcher and as a relay, and logs the refusals; the world does
    not grow."""
    from crossover import protocol as P

    with cluster.daemon(nodes=2):
        sock = cluster.runtime / "node-fake0.sock"
        args = ["/usr/bin/python3", "-c", STRANGER, str(sock), str(P.PROTOCOL_VERSION)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "PermissionError", out
        # As if someone opened it up: the socket where anyone may reach it (a hard link
        # in a world-readable directory of the same file system).
        opened = Path(tempfile.mkdtemp(prefix="opened-", dir="/tmp"))
        try:
            opened.chmod(0o755)
            os.link(sock, opened / "node.sock")
            (opened / "node.sock").chmod(0o666)
            args[3] = str(opened / "node.sock")
            out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        finally:
            shutil.rmtree(opened)
        assert out.stdout.strip() in ("answered error", "closed", "ConnectionResetError",
                                      "BrokenPipeError"), out
        wait_for(lambda: "refused a connection from uid 65534" in
                 (cluster.tmp / "daemon.log").read_text(), 10, "the refusal in the log")
        # nor pose as a member: a relay of another user is refused the same way
        opened = Path(tempfile.mkdtemp(prefix="opened-", dir="/tmp"))
        try:
            opened.chmod(0o755)
            os.link(cluster.runtime / "node-fake0.relay", opened / "node.relay")
            (opened / "node.relay").chmod(0o666)
            args[3] = str(opened / "node.relay")
            out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        finally:
            shutil.rmtree(opened)
        wait_for(lambda: "refused a relay of user 65534" in
                 (cluster.tmp / "daemon.log").read_text(), 10, "the relay's refusal")
        time.sleep(2)  # a new generation would have formed by now
        assert sorted(status(cluster, "fake0")) == ["fake0", "fake1"]
    assert "forming generation" not in (cluster.tmp / "daemon.log").read_text()


def test_a_join_in_one_group_changes_nothing_in_another(cluster: Cluster):
    """Policy auto on four nodes: A and B on fake0-fake1 form one group and get its
    mode; C and D then start on fake2-fake3. Their arrival is decided for their group
    alone: no mode message for the first group's nodes, which keep their mode."""
    first, second = [("A", 1, 200), ("B", 2, 200)], [("C", 3, 100), ("D", 4, 100)]
    log = cluster.tmp / "daemon.log"
    with cluster.daemon(nodes=4, policy="auto"):
        together = cluster.start_args(2)
        jobs = [job_on(cluster, n, ["fake0", "fake1"], seed, steps, together)
                for n, seed, steps in first]
        wait_for(lambda: re.search(r"mode \w+ for group 0 \(nodes [^)]*\): job [AB] joined",
                                   log.read_text()), 120, "the first group's mode")
        decided = log.read_text().count(" for group ")
        together = cluster.start_args(2)
        jobs += [job_on(cluster, n, ["fake2", "fake3"], seed, steps, together)
                 for n, seed, steps in second]
        wait_for(lambda: re.search(r"mode \w+ for group 1 \(nodes [^)]*\): job [CD] joined",
                                   log.read_text()), 120, "the second group's mode")
        modes = {node: status(cluster, node)[node]["mode"] for node in ("fake0", "fake1")}
        for job in jobs:
            job.wait(300)
    later = [line for line in log.read_text().splitlines() if " for group " in line]
    # (a group's first decision may come before its jobs' second node has joined)
    assert all(re.search(r"for group 1 \(nodes (2|3|2-3)\)", line)
               for line in later[decided:]), later
    assert set(modes.values()) == {"concurrent"}  # one host's CPU: served at once


def test_crossover_stop_on_one_node_stops_every_nodes_daemon(cluster: Cluster):
    """`crossover stop` on fake2 of a three-node world: the leader tells every node, and
    every node's service ends (a signal to the world's mpirun would end only relays)."""
    import psutil

    with cluster.daemon(nodes=3):
        # whoever started the world by hand is told it outlives their mpirun, and how to
        # stop it
        said = (cluster.tmp / "daemon.log").read_text()
        assert said.count("serve on when this mpirun ends") == 1, said[-3000:]
        assert f"crossover stop --runtime-dir {cluster.runtime}" in said
        pids = [snap["daemon"]["pid"] for snap in status(cluster, "fake1").values()]
        out = subprocess.run([PY, "-m", "crossover", "stop"], capture_output=True,
                             text=True, timeout=60, cwd=REPO,
                             env={**cluster.env, "CROSSOVER_NODE": "fake2"})
        assert out.returncode == 0 and "3 nodes" in out.stdout, out

        def alive(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def ended() -> bool:
            return not any(map(alive, pids))
        wait_for(ended, 15, "every node's service to stop")
