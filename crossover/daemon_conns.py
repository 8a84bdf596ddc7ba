"""The daemon's connections from ranks: accept, read frames, reply, close.

A mixin of `Daemon`. Sockets are non-blocking and frames bounded (MAX_REQUEST), so one
client that stops reading or sends garbage is dropped without stalling the others; a
connection that says nothing within the hello timeout is closed; a closed connection
frees its rank's slot at once (the daemon's `_close` bookkeeping).
"""

from __future__ import annotations

import logging
import selectors
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crossover import protocol as P
from crossover.scheduler import SchedulerError
from crossover.transport import FrameBuffer, send_msg

if TYPE_CHECKING:
    from crossover.daemon import Daemon

log = logging.getLogger("crossover.daemon")

#: The longest frame a rank may send (a hello is about 200 bytes): a bigger length prefix
#: is refused before anything is buffered, so a client cannot make the daemon grow.
MAX_REQUEST = 1 << 16


@dataclass(eq=False)
class RankConn:
    """One rank's connection: its socket, frames read so far, and what it was told."""

    sock: socket.socket
    opened: float
    frames: FrameBuffer = field(default_factory=lambda: FrameBuffer(MAX_REQUEST))
    hello: P.Hello | None = None
    registered: bool = False
    seq: int = 0  # the rank's outstanding Acquire
    #: (other jobs on its device, mode, its job's cores), as last told
    told: tuple[int, str, list[int]] | None = None
    device: str | None = None  # where the scheduler placed the rank

    @property
    def key(self) -> tuple[str, int] | None:
        return (self.hello.job, self.hello.rank) if self.hello else None

    @property
    def on_host_cpu(self) -> bool:
        """The rank's job computes on CPUs with every rank on this host, so it allreduces
        in this host's memory, on the cores that compute."""
        h = self.hello
        return h is not None and h.gpu is None and h.local_size == h.size


class Connections:
    """Accepting, reading, replying to and closing rank connections (a mixin)."""

    def _accept(self: Daemon, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:  # gone already, or out of descriptors: the listener stays
            return
        if len(self._sel.get_map()) >= self.max_conns:
            sock.close()
            if self.clock() - self._refused_at > 10:
                self._refused_at = self.clock()
                log.warning("%d connections open: refusing more (raise `ulimit -n`?)",
                            self.max_conns)
            return
        # Non-blocking: replies are tiny, so a send that would block means the client
        # stopped reading; it is dropped rather than allowed to stall every other job.
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, RankConn(sock, self.clock()))

    def _drop_silent(self: Daemon) -> None:
        """Close connections that said nothing useful within hello_timeout_s (at most
        one sweep a second)."""
        now = self.clock()
        if now - self._swept_at < 1.0:
            return
        self._swept_at = now
        asking = {id(conn) for conn, _, _ in self._status_waits.values()}
        for key in list(self._sel.get_map().values()):
            conn = key.data
            if (isinstance(conn, RankConn) and conn.hello is None and id(conn) not in asking
                    and now - conn.opened > self.hello_timeout_s):
                self._close(conn, "no hello")

    def _read(self: Daemon, conn: RankConn) -> None:
        try:
            data = conn.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._close(conn, "connection closed")
            return
        try:
            msgs = conn.frames.feed(data)
        except P.ProtocolError as exc:
            self._refuse(conn, exc)
            return
        for msg in msgs:
            if not self._guard(conn, lambda msg=msg: self._handle(conn, msg)):
                return

    def _guard(self: Daemon, conn: RankConn, work: Callable[[], None],
               close: bool = False) -> bool:
        """Run `work` for `conn`'s sake so that nothing it raises leaves the daemon: a
        request that does not fit the scheduler is refused (the rank stays, unless
        `close`); a malformed one, or an internal error, closes the connection.

        Returns:
            Whether the connection is still open.
        """
        try:
            work()
        except SchedulerError as exc:
            self._reply(conn, P.Error(str(exc), P.ErrorCode.REFUSED.value))
            if close:
                self._close(conn, f"refused: {exc}")
        except P.ProtocolError as exc:
            self._refuse(conn, exc)
        except Exception as exc:  # noqa: BLE001 - one client's message must not stop the daemon
            log.exception("internal error on a message from %s", conn.key or "a client")
            self._reply(conn, P.Error(f"internal error: {exc}", P.ErrorCode.PROTOCOL.value))
            self._close(conn, f"internal error: {exc}")
        return conn.sock.fileno() >= 0

    def _refuse(self: Daemon, conn: RankConn, exc: P.ProtocolError) -> None:
        code = P.ErrorCode.VERSION if isinstance(exc, P.VersionMismatch) \
            else P.ErrorCode.PROTOCOL
        self._reply(conn, P.Error(str(exc), code.value))
        self._close(conn, f"protocol error: {exc}")

    def _reply(self: Daemon, conn: RankConn, msg: P.Message) -> None:
        try:
            send_msg(conn.sock, msg)
        except OSError as exc:
            self._close(conn, f"send failed: {exc}")

    def _close(self: Daemon, conn: RankConn, why: str) -> None:
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            return  # closed already
        conn.sock.close()
        key = conn.key
        if key is None:
            return
        job = key[0]
        if conn in self._pending.get(job, []):
            self._pending[job].remove(conn)
            if not self._pending[job]:
                del self._pending[job]
                if not any(j == job for j, _ in self._conns):
                    # The leader counts this node among the job's members since the
                    # join: without a leave it never forgets the job.
                    self.peers.send(0, ("leave", job))
            return
        if conn.registered and self._conns.get(key) is conn:
            del self._conns[key]
            log.info("job %s rank %d left node %s (%s)", job, key[1], self.node, why)
            device = self.sched.device_of(*key)
            self._change(device, lambda: self._unregister(key, device))
            if not any(j == job for j, _ in self._conns):
                self.peers.send(0, ("leave", job))

    def _unregister(self: Daemon, key: tuple[str, int], device: str | None) -> None:
        """Free a rank that left (after the table's events before it were applied)."""
        self._deliver(self.sched.unregister(*key))
        if self.fast is not None:
            self.fast.leave(key)
        if device is not None:
            self._tell_company()  # every device: the host's cores may be split anew
