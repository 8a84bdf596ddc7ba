"""A Slurm cluster on the emulated hosts (`cluster.EmulatedCluster`): Debian's slurmctld
on the first host, one slurmd on each (named as the host, in its namespace), munge for
authentication, every file under one temporary directory.

    with EmulatedCluster(hosts=2) as c, SlurmCluster(c) as slurm:
        out = slurm.run(["sbatch", "--wait", "job.sh"], user="alice")

Commands such as `srun` and `sbatch` run on the first host (a login node): the others
are reached through its network only. Open MPI's settings for the emulated hosts do not
apply to what Slurm starts: its tasks run in their slurmd's namespace, on that host.
As root only; the packages come from `scripts/bootstrap.sh` (slurm-wlm, munge).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness.cluster import EmulatedCluster

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")

CONF = """\
ClusterName=crossover
SlurmctldHost={h0}({a0})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{extra}
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def on_host(cluster: EmulatedCluster, host: int, argv: list[str]) -> list[str]:
    """`argv` run on emulated host `host`, pinned to its core, its hostname the host's
    (as on a real node: no CROSSOVER_NODE, which srun would carry to the other hosts).
    It enters only the host's network namespace: `ip netns exec` mounts a sysfs of its
    own, without the cgroup file systems that slurmd needs to start."""
    name = cluster.hosts[host]
    return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "/bin/sh", "-c",
            'hostname "$0" && core=$1 && shift && exec taskset -c "$core" "$@"', name,
            str(cluster.cores[host]), *argv]


#: Run by slurmd's shell before it: a mount namespace of its own where /root (0700, the
#: home of this machine's Python and environment) can be searched by the users whose
#: jobs it runs; every entry of /root is bound back in place, each keeping its own mode.
OPEN_ROOT = """
stage=$(mktemp -d) && mount --bind /root "$stage" && mount -t tmpfs -o mode=0711 xo /root &&
for entry in "$stage"/.[!.]* "$stage"/*; do
  [ -e "$entry" ] || continue
  if [ -d "$entry" ]; then mkdir "/root/${entry##*/}"; else : > "/root/${entry##*/}"; fi
  mount --bind "$entry" "/root/${entry##*/}"
done && exec "$@"
"""


def with_open_root(argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own where other users can reach /root's
    entries (`OPEN_ROOT`); nothing changes outside it."""
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", OPEN_ROOT,
            "open-root", *argv]


def ensure_munge() -> None:
    """munged running (started once, as its user; it serves every namespace through its
    socket file)."""
    if MUNGE_SOCKET.exists() and subprocess.run(
            ["sh", "-c", "munge -n | unmunge"], capture_output=True, timeout=10).returncode == 0:
        return
    run_dir = MUNGE_SOCKET.parent
    run_dir.mkdir(exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True,
                   timeout=30)
    deadline = time.monotonic() + 10
    while not MUNGE_SOCKET.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("munged did not start: see /var/log/munge/munged.log")
        time.sleep(0.1)


class SlurmCluster:
    """slurmctld and one slurmd per emulated host of `cluster`.

    Args:
        cluster: the emulated hosts (entered).
        extra: more slurm.conf lines (Prolog=..., Epilog=...).
        env: the daemons' environment (their prolog and epilog inherit it).
    """

    def __init__(self, cluster: EmulatedCluster, extra: str = "",
                 env: dict[str, str] | None = None) -> None:
        self.cluster, self.extra = cluster, extra
        self.env = dict(os.environ if env is None else env)
        self.dir = Path(tempfile.mkdtemp(prefix="crossover-slurm-"))
        os.chmod(self.dir, 0o755)  # users' jobs read the configuration
        self.conf = self.dir / "slurm.conf"
        self.env["SLURM_CONF"] = str(self.conf)
        self._daemons: list[subprocess.Popen] = []
        self._log = None  # the daemons' output, once they start

    def __enter__(self) -> SlurmCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout_s: float = 60.0) -> None:
        ensure_munge()
        c = self.cluster
        nodes = "\n".join(f"NodeName={h} NodeAddr={a} CPUs=2 State=UNKNOWN"
                          for h, a in zip(c.hosts, c.addrs, strict=True))
        (self.dir / "state").mkdir()
        for host in c.hosts:
            (self.dir / "spool" / host).mkdir(parents=True)
        self.conf.write_text(CONF.format(h0=c.hosts[0], a0=c.addrs[0], d=self.dir,
                                         extra=self.extra, nodes=nodes))
        log = open(self.dir / "daemons.out", "a")  # noqa: SIM115 - closed with the daemons
        self._log = log
        self._daemons.append(subprocess.Popen(
            on_host(c, 0, ["slurmctld", "-D", "-i", "-f", str(self.conf)]), env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for i, host in enumerate(c.hosts):
            self._daemons.append(subprocess.Popen(
                on_host(c, i, with_open_root(["slurmd", "-D", "-N", host, "-f",
                                              str(self.conf)])),
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.run(["sinfo", "-h", "-o", "%n %t"], check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if sorted(states) == sorted(c.hosts) and set(states.values()) <= {"idle"}:
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._daemons):
                raise RuntimeError(f"Slurm did not come up in {timeout_s:g} s (nodes: "
                                   f"{states or out.stderr.strip()}); see {self.dir}")
            time.sleep(0.5)

    def run(self, argv: list[str], user: str | None = None, check: bool = True,
            timeout_s: float = 600.0, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
        """`argv` (a Slurm command) run on the first host, as `user` (default: root)."""
        if user is not None:
            argv = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", *argv]
        return subprocess.run(on_host(self.cluster, 0, argv), env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout_s, check=check)

    def down(self) -> None:
        """Stop the daemons (and the jobs' steps they run), then remove the files."""
        for proc in self._daemons:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self._daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons.clear()
        if self._log is not None:
            self._log.close()
            self._log = None
        if not os.environ.get("CROSSOVER_KEEP_SLURM"):
            shutil.rmtree(self.dir, ignore_errors=True)
