"""Where a node's daemon is found: the socket its ranks connect to, the socket its
relays connect to (a world's node service, see `relay`), and the lock that makes one
daemon per node and runtime directory.

The lock is held for the daemon's lifetime; the kernel drops it when the daemon dies,
so a stale socket file never blocks a restart. The ranks' socket appears under its name
only once it accepts connections (`publish`), and a world's node service publishes it
only once its first relay said hello: a job that finds the socket finds the world
formed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("crossover.daemon")

#: a node service started by a relay that no relay reached by then ends (its generation
#: failed as it started it; the next one starts another)
FIRST_RELAY_S = 60.0


#: the exit status of a daemon that found another serving its node: a relay whose
#: service exits so waits for that one's listener (it was starting, its lock taken)
RUNNING_EXIT = 3


class DaemonRunning(RuntimeError):
    """Another daemon serves this node and runtime directory (one per node)."""


class NodeSockets:
    """A daemon's sockets.

    Args:
        path: the ranks' socket (`transport.socket_path`).
        relay: the relays' socket, for a world's node service; None for a daemon alone.
    """

    def __init__(self, path: Path, relay: Path | None) -> None:
        self.path, self.relay = path, relay
        self._started = time.monotonic()
        self._lock = None

    def open(self) -> tuple[socket.socket, socket.socket | None]:
        """The ranks' listener and the relays' (None for a daemon alone).

        Raises:
            DaemonRunning: another daemon holds this node's lock.
        """
        self._lock = open(self.path.with_suffix(".lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DaemonRunning(
                f"a crossover daemon already listens on {self.path}: use it, stop it "
                f"(`crossover stop`), or give this one another --runtime-dir"
            ) from None
        self.path.unlink(missing_ok=True)
        ranks = _listener(self.path.with_suffix(".new"), socket.SOMAXCONN)
        relays = None
        if self.relay is not None:
            relays = _listener(self.relay.with_suffix(".relay-new"), 16)
            self.relay.with_suffix(".relay-new").rename(self.relay)
        else:
            self.publish()
        return ranks, relays

    @property
    def published(self) -> bool:
        return self.path.exists()

    def publish(self) -> None:
        """Let ranks find this daemon."""
        if not self.published:
            self.path.with_suffix(".new").rename(self.path)

    def unreached(self) -> bool:
        """A node service that no relay reached within FIRST_RELAY_S: it should end."""
        if self.relay is None or self.published or \
                time.monotonic() - self._started < FIRST_RELAY_S:
            return False
        log.error("%s: no relay connected within %.0f s of this service's start: "
                  "stopping", self.path.name, FIRST_RELAY_S)
        return True

    def close(self) -> None:
        """Remove the sockets' names (the listeners are the caller's to close)."""
        for path in (self.path, self.path.with_suffix(".new")):
            path.unlink(missing_ok=True)
        if self.relay is not None:
            self.relay.unlink(missing_ok=True)


def _listener(path: Path, backlog: int) -> socket.socket:
    """A non-blocking Unix listener at `path`, which only its user may connect to."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(backlog)  # ranks that start together connect at once
    sock.setblocking(False)
    return sock
