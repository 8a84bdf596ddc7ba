"""How messages travel: length-prefixed frames on a node-local Unix socket, and an MPI
channel between the daemon processes of different nodes.

A user's own daemon's Unix socket lives in a directory only its owner can open (0700),
so only the same user's jobs reach it; a node service for every user lives in a
directory only root could have made, and checks each connection's user itself
(`crossover.daemon.node.users`).
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import time
from pathlib import Path

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


def system_dir() -> Path:
    """Where a node service for every user lives (`crossover daemon --system`):
    $CROSSOVER_SYSTEM_DIR, else /run/crossover (systemd's RuntimeDirectory=crossover)."""
    return Path(E.get(E.SYSTEM_DIR))


def system_service_dir() -> Path | None:
    """The system service's directory when one serves this machine (a ranks' socket
    is published there, in a directory only root could have made), else None."""
    d = system_dir()
    try:
        if not any(d.glob("node-*.sock")):
            return None
    except OSError:  # missing, or not ours to list
        return None
    return d if shared_dir_problem(d) is None else None


def system_service_in_use() -> Path | None:
    """The system service's directory where ranks and launchers use it: one serves this
    machine (`system_service_dir`) and CROSSOVER_RUNTIME_DIR names no daemon of the
    user's own."""
    return None if E.runtime_dir_setting() else system_service_dir()


def shared_dir_problem(d: Path) -> str | None:
    """Why `d` cannot hold a node service for several users, or None. It must be a
    directory (not a link) that only its owner may change, in a parent that only root
    may change: then root made it, or gave it to the service's user, and nobody else
    can put a socket of their own under a name that ranks trust."""
    try:
        st, parent = os.lstat(d), os.stat(d.parent)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"may be changed by users other than its owner (mode {oct(st.st_mode & 0o777)})"
    if parent.st_uid != 0 or stat.S_IMODE(parent.st_mode) & 0o022:
        return (f"is in {d.parent}, which users other than root may change (uid "
                f"{parent.st_uid}, mode {oct(parent.st_mode & 0o777)})")
    return None


def runtime_dir(path: str | os.PathLike | None = None, create: bool = True) -> Path:
    """The directory that holds the daemons' sockets; created if missing.

    A user's own daemon's directory is private (0700, theirs). The directory itself is
    checked without following a symbolic link: any local user may create a path in /tmp
    before us, and a link there would point our sockets and slot table wherever its
    owner likes. Once it is ours and 0700, nobody else can add, rename or replace an
    entry in it, so the names inside resolve to what we made. The system service's
    directory (`system_dir`) is checked as `shared_dir_problem` says instead.

    Args:
        path: an explicit directory; default $CROSSOVER_RUNTIME_DIR, else (for a client
            that looks) the system service's where one serves this machine, else
            `default_runtime_dir()`.
        create: make it if missing (a user's daemon, which never takes the system
            service's directory unless it is named); clients only look.

    Raises:
        PermissionError: the path is a symbolic link or not a directory, belongs to
            another user, or others can open it; the message names the fix.
    """
    if path is None and not create and (shared := system_service_in_use()) is not None:
        return shared
    explicit = path or E.runtime_dir_setting()
    d = Path(explicit or default_runtime_dir())
    if d == system_dir():
        return _system_runtime_dir(d, create)
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


def _system_runtime_dir(d: Path, create: bool) -> Path:
    """The system service's directory (made 0755 by the service where missing)."""
    if create:
        try:
            d.mkdir()
            d.chmod(0o755)  # whatever the umask: every user's ranks look in it
        except FileExistsError:
            pass
    elif not os.path.lexists(d):
        return d
    problem = shared_dir_problem(d)
    if problem is not None:
        raise PermissionError(f"crossover system directory {d} {problem}: remove it and "
                              f"let the service make it (systemd: RuntimeDirectory="
                              f"crossover), or set CROSSOVER_SYSTEM_DIR")
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
    (length,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return decode(recv_exact(sock, length))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes; ConnectionError once the peer closed."""
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
