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
        mode: the ranks' socket's mode (`Users.socket_mode`; relays' is always 0600).
        gid: the ranks' socket's group (`Users.gid`), or None to leave it.
        serve_alone: a node service of a cluster's world (`--hosts`): it serves its
            ranks at once, and until a generation takes it in, as a node alone.
    """

    def __init__(self, path: Path, relay: Path | None, mode: int = 0o600,
                 gid: int | None = None, serve_alone: bool = False) -> None:
        self.path, self.relay, self.serve_alone = path, relay, serve_alone
        self.mode, self.gid = mode, gid
        self._started = time.monotonic()
        self._lock = None

    def open(self) -> tuple[socket.socket, socket.socket | None]:
        """The ranks' listener and the relays' (None for a daemon alone).

        Raises:
            DaemonRunning: another daemon holds this node's lock.
        """
        # 0600: a user who could open the lock could also hold it, and keep the
        # service from starting
        lock = self.path.with_suffix(".lock")
        self._lock = os.fdopen(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600),
                               "w")
        os.fchmod(self._lock.fileno(), 0o600)  # made by an older version, say
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DaemonRunning(
                f"a crossover daemon already listens on {self.path}: use it, stop it "
                f"(`crossover stop`), or give this one another --runtime-dir"
            ) from None
        self.path.unlink(missing_ok=True)
        ranks = _listener(self.path.with_suffix(".new"), socket.SOMAXCONN, self.mode,
                          self.gid)
        relays = None
        if self.relay is not None:
            relays = _listener(self.relay.with_suffix(".relay-new"), 16)
            self.relay.with_suffix(".relay-new").rename(self.relay)
        if self.relay is None or self.serve_alone:
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


def _listener(path: Path, backlog: int, mode: int = 0o600,
              gid: int | None = None) -> socket.socket:
    """A non-blocking Unix listener at `path` of `mode` (and group `gid`): who may
    connect (its user only, by default). It is made under a name no rank looks for and
    renamed once its mode is set."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    sock.listen(backlog)  # ranks that start together connect at once
    sock.setblocking(False)
    return sock
