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
                 started_at: float, log_path: Path | None, secret: bytes = b"") -> None:
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

    @property
    def failed(self) -> bool:
        """Its mpirun could not start, or ended (before it formed, for the caller)."""
        return self.proc is None or self.proc.poll() is not None

    def ended(self) -> bool:
        """Whether its mpirun has ended (reaped)."""
        return self.proc is None or self.proc.poll() is not None

    def kill(self) -> None:
        """End every process of it (its relays say nothing more to their services)."""
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
