"""Node services that form their world from the cluster's host list (`crossover daemon
--system --hosts ...`, each started by the system, as systemd would on each host): fake
nodes of this machine, real services and relays under mpirun."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from crossover import trace
from crossover.daemon.relay.launch import relay_mca_env
from crossover.probe import daemon_status
from tests.conftest import PY, REPO, Proc, assert_shared_in_turns, same_weights, wait_for

pytestmark = pytest.mark.mpi

HOSTS = ["fake0", "fake1", "fake2"]


class Services:
    """One node service a fake node, each started on its own (no mpirun, no launcher),
    all given the same host list and key."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "sys").mkdir(mode=0o755)
        self.tmp, self.dir = tmp, tmp / "sys" / "crossover"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("CROSSOVER_RUNTIME_DIR", "XDG_RUNTIME_DIR")}
        # Open MPI's settings a unit would set for the generations' mpirun
        self.env.update(relay_mca_env(), CROSSOVER_SYSTEM_DIR=str(self.dir),
                        CROSSOVER_FAKE_NODES=str(len(HOSTS)),
                        CROSSOVER_WORLD_KEY=secrets.token_hex(32))
        self.procs: dict[str, Proc] = {}

    def start(self, node: str) -> Proc:
        proc = Proc([PY, "-m", "crossover", "daemon", "--system", "--policy", "crossover",
                     "--hosts", "fake[0-2]", "--node", node], self.env,
                    self.tmp / f"service-{node}.log")
        self.procs[node] = proc
        return proc

    def world(self, asking: str) -> dict:
        """What `asking`'s service says of every node ({} while it does not answer)."""
        try:
            return daemon_status(None, asking, timeout_s=5.0)  # found as ranks find it
        except ConnectionError:
            return {}

    def whole(self, asking: str) -> bool:
        """Every host in one world under one leader, with its relay, none lost."""
        nodes = self.world(asking)
        worlds = [s.get("world", {}) for s in nodes.values()]
        return sorted(nodes) == HOSTS and all(
            w.get("relay") and not w.get("lost") and w.get("size") == len(HOSTS)
            and w.get("leader_node") == worlds[0].get("leader_node") for w in worlds)

    def log(self) -> str:
        path = self.dir / "daemon.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.kill(signal.SIGTERM)
        for proc in _ours(self.dir):  # the generations' mpiruns and relays
            proc.kill()


def _ours(directory: Path) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            if (proc.info["environ"] or {}).get("CROSSOVER_SYSTEM_DIR") == str(directory):
                found.append(proc)
        except psutil.Error:
            pass
    return [p for p in found if p.pid != os.getpid()]


@pytest.fixture
def services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made = Services(tmp_path)
    for name in ("CROSSOVER_RUNTIME_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CROSSOVER_SYSTEM_DIR", str(made.dir))
    monkeypatch.setenv("CROSSOVER_FAKE_NODES", str(len(HOSTS)))
    try:
        yield made
    finally:
        made.stop()


@pytest.mark.timeout(300)
def test_the_services_of_a_host_list_form_one_world_and_take_back_one_started_again(
        services):
    """Three services started on their own form one world (the first host leads), with
    the services the system started, not new ones. One stopped (`systemctl stop`) is not
    started again by the world (the system owns its life), and once the system starts it
    again the world takes it back."""
    for node in HOSTS:
        services.start(node)
    wait_for(lambda: services.whole("fake2"), 90, f"one world of {HOSTS}:\n"
             + services.log()[-3000:], interval=0.5)
    nodes = services.world("fake1")
    assert {n: s["daemon"]["pid"] for n, s in nodes.items()} == {
        n: services.procs[n].popen.pid for n in HOSTS}
    assert all(s["world"]["leader_node"] == "fake0" for s in nodes.values())

    services.procs["fake1"].kill(signal.SIGTERM)
    wait_for(lambda: "fake1" in services.world("fake0").get("fake0", {}).get(
        "world", {}).get("lost", []), 30, "fake1 lost to the leader", interval=0.5)
    # the leader tries to bring it back: its relay waits for the system's service and
    # starts none
    wait_for(lambda: "the system starts it" in services.log(), 90,
             "a relay that waited for fake1's service:\n" + services.log()[-3000:],
             interval=0.5)
    assert not (services.dir / "node-fake1.sock").exists()

    again = services.start("fake1")
    wait_for(lambda: services.whole("fake0"), 120, "fake1 back in the world:\n"
             + services.log()[-3000:], interval=0.5)
    assert services.world("fake1")["fake1"]["daemon"]["pid"] == again.popen.pid


def job_across(services: Services, name: str, nodes: list[str], seed: int,
               crossover: bool = True) -> Proc:
    """A job with a rank on each of `nodes` that finds each node's service as any
    user's job does (nothing names a daemon or a world)."""
    env = dict(services.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(services.tmp / "traces"))
    env.pop("CROSSOVER_WORLD_KEY")  # the services' secret, not the jobs'
    if not crossover:
        env["CROSSOVER_ENABLE"] = "0"
        name += "-alone"
    script = [PY, str(REPO / "examples/torch_mlp.py"), "--seed", str(seed), "--steps",
              str(STEPS), "--out", str(services.tmp / f"{name}.pt")]
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none"]
    for i, node in enumerate(nodes):
        cmd += [*([":"] if i else []), "-np", "1", "-x", f"CROSSOVER_NODE={node}", *script]
    return Proc(cmd, env, services.tmp / f"{name}.log")


STEPS = 300


@pytest.mark.timeout(300)
def test_jobs_across_the_hosts_of_the_world_take_turns_on_each_and_keep_their_math(
        services):
    """Two jobs with a rank on fake0 and on fake2, launched with plain mpirun and nothing
    started for them: each node's service serves its rank, the jobs take turns on both
    nodes' devices, and each trains what it trains alone."""
    for node in HOSTS:
        services.start(node)
    wait_for(lambda: services.whole("fake0"), 90, "one world", interval=0.5)
    jobs = [job_across(services, name, ["fake0", "fake2"], seed)
            for name, seed in (("one", 1), ("two", 2))]
    for job in jobs:
        job.wait(240)
    for name, seed in (("one", 1), ("two", 2)):
        job_across(services, name, ["fake0", "fake2"], seed, crossover=False).wait(240)
        assert same_weights(services.tmp / f"{name}.pt", services.tmp / f"{name}-alone.pt")
    events = trace.merge(sorted((services.tmp / "traces").glob("*.json")),
                         services.tmp / "merged.json")
    assert_shared_in_turns(events, {"one", "two"}, devices=2)


def _daemon(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "crossover", "daemon", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize(("args", "key", "says"), [
    (("--hosts", "fake[0-1]", "--node", "fake0"), True,
     r"--hosts and --hostfile form a world of node services \(--system\)"),
    (("--system", "--hosts", "fake[0-1]", "--node", "fake5"), True,
     r"do not name this node \(fake5\)"),
    (("--system", "--hosts", "fake[0-1]", "--node", "fake0"), False,
     "give each the same CROSSOVER_WORLD_KEY"),
    (("--system", "--hosts", "a", "--hostfile", "f", "--node", "a"), True,
     "--hosts or --hostfile, not both"),
    (("--system", "--hosts", "n[1-", "--node", "n1"), True, "a '\\[' without its '\\]'"),
    (("--system", "--hosts", "", "--node", "n1"), True, "has an empty name"),  # a failed $(...)
])
def test_a_world_of_services_that_cannot_be_formed_is_refused_saying_why(
        tmp_path, args, key, says):
    (tmp_path / "sys").mkdir(mode=0o755)
    env = {k: v for k, v in os.environ.items() if k != "CROSSOVER_WORLD_KEY"}
    env.update(CROSSOVER_SYSTEM_DIR=str(tmp_path / "sys" / "crossover"),
               CROSSOVER_FAKE_NODES="2")
    if key:
        env["CROSSOVER_WORLD_KEY"] = secrets.token_hex(32)
    out = _daemon(env, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(says, out.stderr), out.stderr
