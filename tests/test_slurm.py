"""Crossover under Slurm, for real: Debian's slurmctld and one slurmd per emulated host
(`bench.harness.slurm`), the node services started by the shipped prolog and stopped by
its epilog (examples/slurm/), and two users' sbatch jobs sharing both nodes: a Horovod
job (mpirun inside the allocation) and a DDP job (srun + crossover-torchrun)."""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.harness.cluster import EmulatedCluster
from bench.harness.rank_launch import LINK
from bench.harness.slurm import SlurmCluster
from crossover import trace
from tests.conftest import PY, REPO, assert_shared_in_turns, same_weights

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(os.getuid() != 0, reason="Slurm's daemons and users need root"),
]

ALICE, BOB = "xo-slurm-alice", "xo-slurm-bob"
#: steps of each job: enough for both to train at once for a while, whichever starts
#: first (mpirun and torchrun take different times to start)
HOROVOD_STEPS, DDP_STEPS = 2000, 1000


@pytest.fixture(scope="module")
def users() -> Iterator[None]:
    made = []
    for name in (ALICE, BOB):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", name], check=True)
            made.append(name)
    yield
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


class Site:
    """The shared directories of the cluster (as a shared file system would hold them):
    the prolog and epilog with their settings, each user's directory, the traces."""

    def __init__(self, base: Path, cluster: EmulatedCluster) -> None:
        self.base = base
        self.system = base / "sys" / "crossover"  # /run/crossover on a real node
        (base / "sys").mkdir(mode=0o755)
        self.traces = base / "traces"
        self.traces.mkdir()
        os.chmod(self.traces, 0o1777)  # (not through mkdir: the umask would take o+w)
        self.scripts = base / "slurm"
        self.scripts.mkdir(mode=0o755)
        for name in ("prolog.sh", "epilog.sh"):
            shutil.copy(REPO / "examples/slurm" / name, self.scripts / name)
        self.services_log = base / "services.log"
        self.key = secrets.token_hex(32)
        self.path = f"{Path(PY).parent}:/usr/sbin:/usr/bin:/sbin:/bin"
        (self.scripts / "crossover.env").write_text("\n".join([
            f"CROSSOVER_WORLD_KEY={self.key}", f"PATH={self.path}",
            f"CROSSOVER_SYSTEM_DIR={self.system}", 'CROSSOVER_SERVICE_ARGS="--policy crossover"',
            f"CROSSOVER_SERVICE_LOG={self.services_log}",
            # the world's mpirun reaches the emulated hosts through their agent (ssh on
            # a real cluster)
            f"OMPI_MCA_plm_rsh_agent={cluster.agent}", "OMPI_MCA_plm_rsh_no_tree_spawn=1",
            "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1", ""]))
        os.chmod(self.scripts / "crossover.env", 0o600)
        self.job_env = {
            "PATH": self.path, "CROSSOVER_SYSTEM_DIR": str(self.system),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": LINK, "OMPI_MCA_btl": "tcp,self", "OMPI_MCA_pml": "ob1",
            "OMPI_MCA_btl_tcp_if_include": cluster.subnet,
            "OMPI_MCA_oob_tcp_if_include": cluster.subnet, "OMPI_MCA_mpi_yield_when_idle": "1",
            "HOROVOD_CYCLE_TIME": "5", "PYTHONPATH": str(REPO)}

    def home(self, user: str) -> Path:
        d = self.base / user
        d.mkdir(exist_ok=True)
        os.chown(d, pwd.getpwnam(user).pw_uid, -1)
        return d

    def ours(self) -> list[psutil.Process]:
        """Every process of the node services' worlds still running."""
        found = []
        for proc in psutil.process_iter(["environ"]):
            try:
                if (proc.info["environ"] or {}).get("CROSSOVER_SYSTEM_DIR") == \
                        str(self.system) and "CROSSOVER_TRACE" not in proc.info["environ"]:
                    found.append(proc)
            except psutil.Error:
                pass
        return found


def submit(slurm: SlurmCluster, site: Site, user: str, name: str, script: str,
           argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """`sbatch --wait` of one of examples/slurm/'s scripts as `user`; its output in the
    returned stdout."""
    home = site.home(user)
    out = home / f"{name}.out"
    res = slurm.run(["sbatch", "--wait", "--job-name", name, "-o", str(out), "-D", str(REPO),
                     str(REPO / "examples/slurm" / script), *argv], user=user, check=False,
                    timeout_s=600, env={**site.job_env, "HOME": str(home), **env})
    res.stdout = out.read_text() if out.exists() else ""
    return res


def horovod(slurm, site, user, name, seed, **env) -> subprocess.CompletedProcess:
    return submit(slurm, site, user, name, "horovod.sbatch",
                  [PY, "examples/torch_mlp.py", "--seed", str(seed), "--steps",
                   str(HOROVOD_STEPS), "--out", str(site.home(user) / f"{name}.pt")], **env)


def ddp(slurm, site, user, name, seed, **env) -> subprocess.CompletedProcess:
    return submit(slurm, site, user, name, "ddp.sbatch",
                  ["examples/ddp_tutorial.py", "--seed", str(seed), "--steps", str(DDP_STEPS)],
                  **env)


def checksum(res: subprocess.CompletedProcess) -> str:
    found = re.findall(r"weights checksum (\S+)", res.stdout)
    assert len(found) == 1, res.stdout[-3000:] + res.stderr
    return found[0]


@pytest.mark.timeout(1500)
def test_two_users_sbatch_jobs_share_two_slurm_nodes_and_leave_nothing(users):
    """Alice's Horovod job and Bob's DDP job, both on both nodes at once: the prolog
    starts each node's service (one world, from Slurm's node list), the jobs take turns
    on both nodes' devices and train what they train alone, and once they end the
    epilog stops the services: no process, socket or lock of them is left."""
    base = Path(tempfile.mkdtemp(prefix="xo-slurm-test-"))
    os.chmod(base, 0o755)
    try:
        with EmulatedCluster(mbit=1000) as cluster:
            site = Site(base, cluster)
            extra = (f"Prolog={site.scripts / 'prolog.sh'}\n"
                     f"Epilog={site.scripts / 'epilog.sh'}\nPrologFlags=Alloc")
            with SlurmCluster(cluster, extra=extra) as slurm:
                alone = horovod(slurm, site, ALICE, "hvd-alone", 1, CROSSOVER_ENABLE="0")
                assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr
                ddp_alone = checksum(ddp(slurm, site, BOB, "ddp-alone", 2,
                                         CROSSOVER_ENABLE="0"))
                done: dict[str, subprocess.CompletedProcess] = {}
                traced = {"CROSSOVER_TRACE": str(site.traces)}
                jobs = [threading.Thread(target=lambda: done.update(hvd=horovod(
                            slurm, site, ALICE, "hvd", 1, **traced))),
                        threading.Thread(target=lambda: done.update(ddp=ddp(
                            slurm, site, BOB, "ddp", 2, **traced)))]
                for job in jobs:
                    job.start()
                for job in jobs:
                    job.join(timeout=700)
                for res in done.values():
                    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
                assert same_weights(site.home(ALICE) / "hvd.pt",
                                    site.home(ALICE) / "hvd-alone.pt")
                assert checksum(done["ddp"]) == ddp_alone
                said = site.services_log.read_text() + (site.system / "daemon.log").read_text() \
                    if (site.system / "daemon.log").exists() else site.services_log.read_text()
                for host in cluster.hosts:  # each user's job on each node's service
                    for user in (ALICE, BOB):
                        assert re.search(rf"job {user}/\S+ rank \d on node {host} ", said), \
                            said[-3000:]
                assert re.search(r"generation \d+ of the world: 2 members", said), said[-3000:]
                events = trace.merge(sorted(site.traces.glob("*.json")), base / "merged.json")
                jobs_seen = {job for spans in trace.holds_by_device(events).values()
                             for _, _, job, _ in spans}
                assert len(jobs_seen) == 2, jobs_seen
                assert_shared_in_turns(events, jobs_seen, devices=2)
                # the epilogs stopped the services: nothing of them is left
                left = site.ours()
                assert left == [], [p.cmdline() for p in left]
                assert list(site.system.glob("node-*.sock")) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
