"""A new generation of the daemons' world: a fresh `mpirun` of relays (`relay`) over
the nodes the leader wants in it, started by the leader's service.

The leader forms one when a node is lost (to start its service again), comes back, or
is asked for by a job, and when its own relay is gone. Every node's relay connects to
its node's service (a service that lives keeps everything it held) or starts one; the
generation has formed when the leader's own relay says hello, which it does only once
every member started (an allgather). One that has not formed within
`GENERATION_TIMEOUT_S` (and `PER_NODE_S` a node) is killed whole (its mpirun's process
group: MPI's calls are never cancelled, their processes are) and the leader tries again
later, without the nodes that were new to it.

Each generation's mpirun is recorded in the runtime directory of the service that
started it (`record`), with that service: a service killed while its generation runs
leaves the mpirun behind, and one whose relays all ended waits for ever where an Open
MPI daemon of it died with its host. A service that attaches to a newer generation ends
the older ones whose service is gone (`reap_orphans`); a live service ends its own.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from crossover import environment as E
from crossover.daemon.relay.launch import daemon_flags, relay_mca_flags, service_env
from crossover.daemon.world.wire import KEY_ENV

log = logging.getLogger("crossover.daemon")

#: a generation whose leader's relay has not said hello by then is killed (plus
#: PER_NODE_S a node: an mpirun starts its relays host by host)
GENERATION_TIMEOUT_S = 20.0
PER_NODE_S = 0.5
_FAKE = re.compile(r"fake\d+")
_RECORD = re.compile(r"generation-(\d+)-\d+\.mpirun")


def is_fake(node: str) -> bool:
    """A fake node of this machine (`CROSSOVER_FAKE_NODES`): its relay runs here."""
    return bool(E.fake_nodes()) and bool(_FAKE.fullmatch(node))


def generation_command(nodes: list[str], epoch: int, leader: str,
                       argv: list[str]) -> list[str]:
    """The mpirun of one relay per node of `nodes` (in rank order), of generation
    `epoch`, led by the service of node `leader`."""
    # the world's key goes to every relay in the environment (`Generation`), never on
    # the command line; -x takes it to the other hosts
    cmd = ["mpirun", *relay_mca_flags(), "-x", KEY_ENV, "--bind-to", "none",
           "--oversubscribe", "-np", str(len(nodes))]
    if not all(map(is_fake, nodes)):
        cmd += ["--map-by", "ppr:1:node", "-H", ",".join(f"{n}:1" for n in nodes)]
    return [*cmd, sys.executable, "-m", "crossover", "daemon", *daemon_flags(argv),
            "--generation", str(epoch), "--leader", leader, "--nodes", ",".join(nodes)]


class Generation:
    """One generation's mpirun, started by this (the leader's) service, whose relays
    get the world's key `secret` (their services sign and check messages with it)."""

    def __init__(self, nodes: list[str], epoch: int, leader: str, argv: list[str],
                 started_at: float, log_path: Path | None, secret: bytes = b"",
                 run_dir: Path | None = None) -> None:
        self.nodes, self.epoch, self.started_at = nodes, epoch, started_at
        self.timeout_s = GENERATION_TIMEOUT_S + PER_NODE_S * len(nodes)
        cmd = generation_command(nodes, epoch, leader, argv)
        out = open(log_path, "a") if log_path is not None else None  # noqa: SIM115
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                cmd, env={**service_env(), KEY_ENV: secret.hex()},
                stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=True)
        except OSError as exc:  # no mpirun on PATH, say
            log.error("cannot start generation %d (%s: %s)", epoch, cmd[0], exc.strerror)
            self.proc = None
        finally:
            if out is not None:
                out.close()
        self._record = record(run_dir, epoch, self.proc.pid) \
            if run_dir is not None and self.proc is not None else None

    @property
    def failed(self) -> bool:
        """Its mpirun could not start, or ended (before it formed, for the caller)."""
        return self.proc is None or self.proc.poll() is not None

    def ended(self) -> bool:
        """Whether its mpirun has ended (reaped)."""
        return self.proc is None or self.proc.poll() is not None

    def kill(self) -> None:
        """End every process of it (its relays say nothing more to their services)."""
        if self._record is not None:
            self._record.unlink(missing_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.warning("generation %d's mpirun (process %d) did not end after SIGKILL",
                        self.epoch, self.proc.pid)


def _started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (its identity, with the
    pid: pids are reused; unlike a wall-clock start, no clock step moves it); None where
    no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # (the command in parentheses may hold spaces and parentheses: fields follow the last)
    return int(stat[stat.rindex(")") + 2:].split()[19])


def record(run_dir: Path, epoch: int, pid: int) -> Path | None:
    """Write down that this process started generation `epoch`'s mpirun `pid` (written
    whole or not at all: a reader never sees half a record)."""
    me, started = os.getpid(), _started(pid)
    if started is None:
        return None  # it ended already
    path = run_dir / f"generation-{epoch}-{me}.mpirun"
    try:
        part = path.with_suffix(".part")
        part.write_text(f"{pid} {started} {me} {_started(me)}\n")
        os.replace(part, path)
    except OSError as exc:
        log.warning("cannot record generation %d's mpirun in %s: %s", epoch, run_dir, exc)
        return None
    return path


def reap_orphans(run_dir: Path, before: int) -> list[int]:
    """End the mpiruns of the generations before `before` recorded in `run_dir` whose
    starting service is gone, and forget the records of those generations whose mpirun
    ended; returns the pids ended. Never raises: a record it cannot read or remove is
    logged and left."""
    ended = []
    for path in run_dir.glob("generation-*.mpirun"):
        match = _RECORD.fullmatch(path.name)
        if match is None or int(match[1]) >= before:
            continue
        try:
            pid, started, starter, starter_started = map(int, path.read_text().split())
            if _started(pid) == started:
                if _started(starter) == starter_started:
                    continue  # its service lives and ends it itself
                os.killpg(pid, signal.SIGKILL)  # its own process group
                ended.append(pid)
                log.warning("generation %s's mpirun (process %d) outlived the service "
                            "that started it, and generation %d replaced it: ended",
                            match[1], pid, before)
            path.unlink(missing_ok=True)
        except ProcessLookupError:  # it ended just now
            path.unlink(missing_ok=True)
        except (OSError, ValueError) as exc:  # another user's, or not a record
            log.warning("generation record %s left: %s", path, exc)
    return ended
