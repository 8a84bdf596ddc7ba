"""How messages travel: length-prefixed frames on a node-local Unix socket, and an MPI
channel between the daemon processes of different nodes.

The Unix socket lives in a directory only its owner can open (0700), so only the same
user's jobs reach the daemon.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

from crossover import environment as E
from crossover.backoff import Backoff
from crossover.protocol import Message, ProtocolError, decode, encode

_HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 24  # a status report of a big cluster stays far below 16 MiB


def default_runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/crossover where the session has one (private to the user by
    construction), else /tmp/crossover-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "crossover" if xdg else Path(f"/tmp/crossover-{os.getuid()}")


def runtime_dir(path: str | os.PathLike | None = None, create: bool = True) -> Path:
    """The private directory that holds the daemons' sockets; created 0700 if missing.

    The directory itself is checked without following a symbolic link: any local user
    may create a path in /tmp before us, and a link there would point our sockets and
    slot table wherever its owner likes. Once it is ours and 0700, nobody else can add,
    rename or replace an entry in it, so the names inside resolve to what we made.

    Args:
        path: an explicit directory; default $CROSSOVER_RUNTIME_DIR, else
            `default_runtime_dir()`.
        create: make it if missing (the daemon); clients only look.

    Raises:
        PermissionError: the path is a symbolic link or not a directory, belongs to
            another user, or others can open it; the message names the fix.
    """
    d = Path(path or E.runtime_dir_setting() or default_runtime_dir())
    fix = "remove it, or set CROSSOVER_RUNTIME_DIR to a directory of your own"
    if create:
        d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return d
    except OSError as exc:  # ELOOP: a symbolic link; ENOTDIR: a file
        kind = "a symbolic link" if os.path.islink(d) else "not a directory"
        raise PermissionError(f"crossover runtime directory {d} is {kind} ({exc.strerror}); "
                              f"{fix}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"crossover runtime directory {d} must belong to uid {os.getuid()} with mode "
            f"0700 (it has uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}): another "
            f"user may have made it first; {fix}"
        )
    return d


def socket_path(node: str, directory: str | os.PathLike | None = None,
                create: bool = False) -> Path:
    """Where the daemon of `node` listens (`create`: make the directory, for the daemon)."""
    return runtime_dir(directory, create) / f"node-{node}.sock"


def connect(path: str | os.PathLike, timeout_s: float) -> socket.socket:
    """A Unix socket connected to `path`, with `timeout_s` as its timeout.

    A socket with a timeout is non-blocking underneath, and its connect to a listener
    whose backlog is full fails at once with EAGAIN (ranks that start together, or a
    daemon that is stopped): that is tried again with backoff until `timeout_s`.

    Raises:
        OSError: no listener, or its backlog stayed full for `timeout_s`.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(0.001, 0.05)
    while True:
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            if time.monotonic() >= deadline:
                sock.close()
                raise
            time.sleep(backoff.next())
        except BaseException:
            sock.close()
            raise


def frame(msg: Message) -> bytes:
    """One message as the bytes of its frame (length prefix and JSON)."""
    data = encode(msg)
    return _HEADER.pack(len(data)) + data


def readable(sock: socket.socket) -> bool:
    """Whether `sock` has data (or its end) to read now. poll, not select: select fails
    on descriptors of 1024 and more, which a rank reaches with data loader workers,
    NCCL and a raised `ulimit -n`."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def send_msg(sock: socket.socket, msg: Message) -> None:
    """Write one framed message (blocking)."""
    sock.sendall(frame(msg))


def recv_msg(sock: socket.socket) -> Message:
    """Read one framed message (blocking, subject to the socket's timeout).

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame is malformed.
    """
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return decode(_recv_exact(sock, length))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


class FrameBuffer:
    """Reassembles frames from a non-blocking socket's byte stream (daemon side).

    Args:
        max_frame: the longest frame accepted; a longer length prefix is refused as soon
            as it arrives, before any of its bytes are buffered.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return the complete messages they finish.

        Raises:
            ProtocolError: a malformed frame.
        """
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self.max_frame:
                raise ProtocolError(f"frame of {length} bytes exceeds {self.max_frame}")
            if len(self._buf) < _HEADER.size + length:
                break
            frame = bytes(self._buf[_HEADER.size : _HEADER.size + length])
            del self._buf[: _HEADER.size + length]
            out.append(decode(frame))
        return out


class PeerChannel:
    """Messages between daemon processes over MPI, received on a polling thread.

    MPI's blocking receive spins a core; on a machine where a core is an accelerator's
    worth of compute that would be theft. A thread tests a nonblocking receive with
    backoff (1 ms to 50 ms) instead: cross-node traffic is membership, step counts and
    mode switches, never the grant hot path, so tens of milliseconds of latency cost
    nothing (a mode switch reaches a follower within 50 ms; a probe window is 2 s and
    skips its first steps). Idle, the polls cost the cores the jobs compute on: each
    daemon's thread took 0.7 % of a core at a 20 ms cap, 0.25 % at 50 ms.

    A peer may die, stop or be cut off at any time (`crossover.daemon.membership` finds
    out which): sends are nonblocking, so one to a peer that no longer reads never stalls
    the serve loop, and MPI errors on the channel are returned, not fatal, so they cost
    that message only. `leader` is the rank this daemon follows, and `broadcast` skips
    the ranks in `lost`.

    The world may be re-formed (`crossover.daemon.reform`): `swap` moves the channel to
    the new communicator and keeps receiving on the old ones, where a sender's old rank
    is read as its new one. A sender left out of the new world (it was lost, and is back
    now) is answered ("retire",) there: its node has another daemon now.

    Args:
        comm: the daemons' communicator (one process per node).
        wakeup: called after a message is queued (e.g. to wake a selector).
    """

    TAG = 7
    #: sends still in flight beyond this many are dropped (a peer that reads nothing)
    MAX_IN_FLIGHT = 4096

    def __init__(self, comm: Any, wakeup) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.leader = 0
        self.lost: set[int] = set()
        self.send_errors = 0
        # when the receiving thread last looked (a collective call of a re-formation can
        # hold MPI, and so this thread, for seconds: silence then is not the peers')
        self.polled_at = time.monotonic()
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._wakeup = wakeup
        self._in_flight: list[Any] = []
        self._sending = threading.Lock()  # the serve loop and the poll thread send
        # (communicator, old rank -> rank now; None: the current one)
        self._receivers: list[tuple[Any, dict[int, int] | None]] = [(comm, None)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="crossover-peers", daemon=True)
        if self.size > 1:
            from mpi4py import MPI

            # a peer's death must not abort this daemon (MPI's default handler would)
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self._thread.start()

    def send(self, dest: int, obj: Any) -> None:
        """Send a small picklable object to daemon `dest` (to self: queued directly).
        Never blocks and never raises: a message to a peer that is gone is lost."""
        if dest == self.rank:
            self.inbox.put((self.rank, obj))
            self._wakeup()
            return
        self._isend(self.comm, dest, obj)

    def send_leader(self, obj: Any) -> None:
        """Send to the leader this daemon follows."""
        self.send(self.leader, obj)

    def broadcast(self, obj: Any) -> None:
        """Send to every daemon not known to be lost, this one included."""
        for dest in range(self.size):
            if dest not in self.lost:
                self.send(dest, obj)

    def swap(self, comm: Any, ranks_now: dict[int, int]) -> None:
        """Use the re-formed world `comm` from now on; `ranks_now`: each member's rank
        in it by its rank in the world before."""
        old = [(self.comm, dict(ranks_now))]
        old += [(c, {o: ranks_now[n] for o, n in m.items() if n in ranks_now})
                for c, m in self._receivers[1:]]
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.leader, self.lost = 0, set()
        self._receivers = [(comm, None), *old]
        if self.size > 1 and not self._thread.is_alive():
            self._thread = threading.Thread(target=self._poll, name="crossover-peers",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _isend(self, comm: Any, dest: int, obj: Any) -> None:
        from mpi4py import MPI

        with self._sending:
            try:
                req = comm.isend(obj, dest=dest, tag=self.TAG)
            except MPI.Exception:
                self.send_errors += 1
                return
            self._in_flight.append(req)
            if len(self._in_flight) >= 64:
                self._reap()

    def _reap(self) -> None:
        """Forget the sends that completed; past MAX_IN_FLIGHT, the oldest too."""
        from mpi4py import MPI

        kept = []
        for req in self._in_flight:
            try:
                done = req.Test()
            except MPI.Exception:
                self.send_errors += 1
                done = True
            if not done:
                kept.append(req)
        self._in_flight = kept[-self.MAX_IN_FLIGHT:]

    def _poll(self) -> None:
        from mpi4py import MPI

        pending: dict[int, Any] = {}  # id(comm) -> its receive
        backoff = Backoff(0.001, 0.05)
        status = MPI.Status()
        while not self._stop.is_set():
            self.polled_at = time.monotonic()
            got = False
            for comm, ranks_now in self._receivers:
                req = pending.get(id(comm))
                if req is None:
                    req = pending[id(comm)] = comm.irecv(source=MPI.ANY_SOURCE, tag=self.TAG)
                try:
                    done, obj = req.test(status=status)
                except MPI.Exception:  # a message from a peer that died while sending
                    done, obj = False, None
                    pending.pop(id(comm))
                if not done:
                    continue
                got = True
                pending.pop(id(comm))
                source = status.Get_source()
                if ranks_now is not None:
                    if source not in ranks_now:  # left out of the world that followed
                        self._isend(comm, source, ("retire",))
                        continue
                    source = ranks_now[source]
                self.inbox.put((source, obj))
                self._wakeup()
            if got:
                backoff.reset()
            else:
                self._stop.wait(backoff.next())
        for req in pending.values():
            req.Cancel()
