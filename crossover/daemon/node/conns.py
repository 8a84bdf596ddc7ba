"""The daemon's connections from ranks: accept, read frames, reply, close.

Sockets are non-blocking and frames bounded (MAX_REQUEST), so one client that stops
reading or sends garbage is dropped without stalling the others; a connection that says
nothing within the hello timeout is closed. What a message means, and what a closed
connection frees, is the daemon's (`service`): it hands `Connections` a handler for each
message and one for each close.
"""

from __future__ import annotations

import logging
import selectors
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from crossover import protocol as P
from crossover.daemon.credentials import peer_credentials
from crossover.daemon.node.users import Users, user_name
from crossover.scheduler import SchedulerError
from crossover.transport import FrameBuffer, send_msg

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
    uid: int | None = None  # the user of its process, from the kernel (SO_PEERCRED)
    pid: int | None = None
    #: a GPU rank's (reserved, peak, capacity) device memory, as it last said (`Memory`)
    memory: tuple[int, int, int] | None = None

    @property
    def open(self) -> bool:
        return self.sock.fileno() >= 0

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
    """Rank connections on the serve loop's selector.

    Args:
        sel: the serve loop's selector; a connection is registered with its `RankConn`.
        clock: monotonic clock.
        hello_timeout_s: a connection that says nothing within this long is closed.
        max_conns: the most connections open at once (the rest are refused).
        handle: called for each message read, as `handle(conn, msg)`; what it raises is
            answered (see `guard`), never passed on.
        closed: called once for each connection closed, as `closed(conn, why)`.
        users: who may connect (default: the daemon's own user).
    """

    def __init__(self, sel: selectors.BaseSelector, clock: Callable[[], float],
                 hello_timeout_s: float, max_conns: int,
                 handle: Callable[[RankConn, P.Message], None],
                 closed: Callable[[RankConn, str], None], users: Users | None = None) -> None:
        self.sel, self.clock = sel, clock
        self.users = users or Users()
        #: the most connections one user may hold open to a service for several users
        self.per_user = max(16, max_conns // 8)
        self._by_uid: Counter[int | None] = Counter()  # connections open, by user
        self.hello_timeout_s, self.max_conns = hello_timeout_s, max_conns
        self._handle, self._closed = handle, closed
        self._refused_at = -1e9  # when a connection over max_conns was last logged
        self._swept_at = clock()

    def count(self) -> int:
        """Connections open now."""
        return sum(isinstance(k.data, RankConn) for k in self.sel.get_map().values())

    def accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:  # gone already, or out of descriptors: the listener stays
            return
        uid, pid = peer_credentials(sock)
        why = None
        if not self.users.admits(uid):
            # The socket's mode (and a user's own daemon's 0700 directory) keeps other
            # users out; should it have been opened up, this keeps them out all the same
            # (and says who tried).
            why = self.users.refusal(uid)
            log.warning("refused a connection from uid %s (process %s): %s", uid, pid, why)
        elif self.users.shared and not self.users.manages(uid) \
                and self._by_uid[uid] >= self.per_user:
            # one user cannot take every descriptor of a service for several users
            why = (f"user {user_name(uid)} has {self.per_user} connections open to this "
                   f"node's crossover service, the most one user may: close some")
            if self.clock() - self._refused_at > 10:
                self._refused_at = self.clock()
                log.warning("refused a connection of process %s: %s", pid, why)
        if why is not None:
            try:
                sock.settimeout(0.1)
                send_msg(sock, P.Error(why, P.ErrorCode.REFUSED.value))
            except OSError:
                pass
            sock.close()
            return
        if len(self.sel.get_map()) >= self.max_conns:
            sock.close()
            if self.clock() - self._refused_at > 10:
                self._refused_at = self.clock()
                log.warning("%d connections open: refusing more (raise `ulimit -n`?)",
                            self.max_conns)
            return
        # Non-blocking: replies are tiny, so a send that would block means the client
        # stopped reading; it is dropped rather than allowed to stall every other job.
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ,
                          RankConn(sock, self.clock(), uid=uid, pid=pid))
        self._by_uid[uid] += 1

    def drop_silent(self, asking: set[int]) -> None:
        """Close connections that said nothing useful within hello_timeout_s, but those
        (by id) waiting for a status report (at most one sweep a second)."""
        now = self.clock()
        if now - self._swept_at < 1.0:
            return
        self._swept_at = now
        for key in list(self.sel.get_map().values()):
            conn = key.data
            if (isinstance(conn, RankConn) and conn.hello is None and id(conn) not in asking
                    and now - conn.opened > self.hello_timeout_s):
                self.close(conn, "no hello")

    def read(self, conn: RankConn) -> None:
        """Read what `conn` sent and handle each whole message."""
        try:
            data = conn.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.close(conn, "connection closed")
            return
        msgs: list[P.Message] = []
        if not self.guard(conn, lambda: msgs.extend(conn.frames.feed(data))):
            return
        for msg in msgs:
            if not self.guard(conn, lambda msg=msg: self._handle(conn, msg)):
                return

    def guard(self, conn: RankConn, work: Callable[[], None], close: bool = False) -> bool:
        """Run `work` for `conn`'s sake so that nothing it raises leaves the daemon: a
        request that does not fit the scheduler is refused (the rank stays, unless
        `close`); a malformed one, or an internal error, closes the connection.

        Returns:
            Whether the connection is still open.
        """
        try:
            work()
        except SchedulerError as exc:
            self.reply(conn, P.Error(str(exc), P.ErrorCode.REFUSED.value))
            if close:
                self.close(conn, f"refused: {exc}")
        except P.ProtocolError as exc:
            self._refuse(conn, exc)
        except Exception as exc:  # noqa: BLE001 - one client's message must not stop the daemon
            log.exception("internal error on a message from %s", conn.key or "a client")
            self.reply(conn, P.Error(f"internal error: {exc}", P.ErrorCode.PROTOCOL.value))
            self.close(conn, f"internal error: {exc}")
        return conn.open

    def _refuse(self, conn: RankConn, exc: P.ProtocolError) -> None:
        code = P.ErrorCode.VERSION if isinstance(exc, P.VersionMismatch) \
            else P.ErrorCode.PROTOCOL
        self.reply(conn, P.Error(str(exc), code.value))
        self.close(conn, f"protocol error: {exc}")

    def reply(self, conn: RankConn, msg: P.Message) -> None:
        try:
            send_msg(conn.sock, msg)
        except OSError as exc:
            self.close(conn, f"send failed: {exc}")

    def close(self, conn: RankConn, why: str) -> None:
        """Close `conn` (once) and tell the daemon, which frees what its rank held."""
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            return  # closed already
        conn.sock.close()
        self._by_uid[conn.uid] -= 1
        if not self._by_uid[conn.uid]:
            del self._by_uid[conn.uid]
        self._closed(conn, why)
