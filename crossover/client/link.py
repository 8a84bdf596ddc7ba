"""A rank's link to its node's daemon: register, map the slot table, fail open, heal.

Fail-open, then heal: if the daemon cannot be reached, dies, refuses the rank, or does
not grant within the wait limit (stopped, swapped out, stuck), the rank warns once and
trains on uncoordinated. Scheduling never changes the math, so a job loses nothing but
the sharing. While uncoordinated, the rank tries to reconnect whenever it next asks for
its device, at most every HEAL_FIRST_S doubling to HEAL_MOST_S, without blocking: an
attempt sends its hello and looks for the welcome at the next requests, so a daemon that
is stopped costs a step nothing, and one that comes back (restarted by crossoverrun or by
hand, or continued) takes the job back without a restart of the job. Only a version
mismatch and a duplicate rank stop a job: both are set-up errors that never heal.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import sys
import time
from pathlib import Path

from crossover import protocol as P
from crossover.backoff import Backoff
from crossover.client.fastpath import RankPath
from crossover.trace import TraceRecorder
from crossover.transport import (
    FrameBuffer,
    connect,
    frame,
    readable,
    recv_msg,
    runtime_dir,
    send_msg,
)

#: Reconnection attempts after losing the daemon: the first after this long, then
#: doubling up to HEAL_MOST_S; each attempt waits at most HEAL_TIMEOUT_S for a welcome.
HEAL_FIRST_S, HEAL_MOST_S, HEAL_TIMEOUT_S = 0.5, 10.0, 2.0
#: The longest lease a welcome may name (a day: no daemon grants for longer).
MAX_LEASE_S = 86400.0


class CrossoverVersionError(RuntimeError):
    """The daemon speaks another protocol version: a set-up error, never silenced."""


class CrossoverDuplicateError(RuntimeError):
    """Another process registered this job's rank already (two jobs with one name): a
    set-up error, never silenced."""


class DaemonRefused(RuntimeError):
    """The daemon refused the rank for another reason (an invalid hello, an internal
    error): the rank trains on uncoordinated."""


def refusal(error: P.Error, job: str) -> RuntimeError:
    """The exception for the daemon's refusal of `job`'s hello."""
    if error.code == P.ErrorCode.VERSION:
        return CrossoverVersionError(error.message)
    text = f"crossover daemon refused job {job!r}: {error.message}"
    if error.code == P.ErrorCode.DUPLICATE:
        return CrossoverDuplicateError(text)
    return DaemonRefused(text)


def not_admitted(path: Path, exc: OSError) -> str:
    """Why this user cannot connect to the daemon at `path`, and what to do."""
    try:
        st = path.stat()
        group = grp.getgrgid(st.st_gid).gr_name if st.st_mode & 0o070 else None
    except (OSError, KeyError):
        group = None
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = f"uid {os.getuid()}"
    only = f" (it admits group {group} only)" if group is not None else ""
    return (f"the crossover daemon at {path} does not admit user {user}"
            f"{only}: {exc.strerror}; ask its operator to admit you, or run your own "
            f"daemon (set CROSSOVER_RUNTIME_DIR to a directory of yours)")


class _Attempt:
    """A reconnection under way: its socket (hello sent) and what came back so far."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.frames = FrameBuffer()


class DaemonLink:
    """A rank's connection to its daemon: register, map the table, fail open, heal.

    The base of `SlotClient`, which answers the hooks below and sets `path` and
    `_hello` before it connects; the link owns `_sock` and `_fast`.

    Args:
        job: the job's name, for the daemon and for warnings.
        trace: a recorder for the moments a rank is coordinated again, or None.
    """

    _said_socket_path = False  # the process said once why it uses the socket path
    _hello: P.Hello

    def __init__(self, job: str, trace: TraceRecorder | None) -> None:
        self.job, self.trace = job, trace
        self.path: Path | None = None  # the daemon's socket, once the node is known
        self._sock: socket.socket | None = None
        self._fast: RankPath | None = None  # the node's slot table, when mapped
        self._warned = False  # the loss of the daemon was said (once per loss)
        self._heal: Backoff | None = None  # reconnection attempts, while uncoordinated
        self._attempt: _Attempt | None = None  # the reconnection under way
        self._next_heal = 0.0
        self.reconnects = 0  # how often the rank took up coordination again

    # --- what the client answers ------------------------------------------------------
    def _welcomed(self, welcome: P.Welcome) -> None:
        """A (re)registration: take what the welcome says."""
        raise NotImplementedError

    def _on_notice(self, msg: P.Message) -> None:
        """A message the daemon sent unasked."""
        raise NotImplementedError

    def _place(self) -> None:
        """Coordination changed: pin or unpin the process."""
        raise NotImplementedError

    def _keep_alone(self) -> bool:
        """Read the daemon's pending notices (fails open on a closed socket)."""
        raise NotImplementedError

    def _rank(self) -> int:
        """The rank's place in its job, for messages."""
        raise NotImplementedError

    @property
    def coordinated(self) -> bool:
        """True while a daemon schedules this rank."""
        return self._sock is not None

    def _connect(self, hello: P.Hello, timeout_s: float) -> None:
        """Register with the daemon (`timeout_s`: the longest wait for its welcome, which
        waits for the leader's job order)."""
        sock = connect(self.path, timeout_s)
        try:
            send_msg(sock, hello)
            reply = recv_msg(sock)
        except BaseException:
            sock.close()
            raise
        self._registered(sock, reply, [])

    def _registered(self, sock: socket.socket, reply: P.Message,
                    after: list[P.Message]) -> None:
        """The daemon answered the hello on `sock` (`after`: notices read behind it)."""
        if not isinstance(reply, P.Welcome):
            sock.close()
            if isinstance(reply, P.Error):
                raise refusal(reply, self.job)
            raise P.ProtocolError(f"expected welcome, got {reply.kind}")
        if not 0 < reply.lease_s <= MAX_LEASE_S:  # the grant wait is twice that
            sock.close()
            raise P.ProtocolError(f"welcome with a lease of {reply.lease_s} s")
        sock.settimeout(None)
        self._sock = sock
        self._fast = self._attach(reply, sock)
        self._welcomed(reply)
        for notice in after:
            self._on_notice(notice)

    def _attach(self, welcome: P.Welcome, sock: socket.socket) -> RankPath | None:
        """Map the node's slot table if the daemon named one, and tell it whether that
        worked: the native fast path, or the socket path (said once)."""
        if not welcome.table:
            return None
        try:
            fast = RankPath(welcome.table, welcome.table_device, welcome.slot, sock)
        except (RuntimeError, OSError, ValueError) as exc:
            if not DaemonLink._said_socket_path:
                DaemonLink._said_socket_path = True
                print(f"crossover: native fast path off ({exc}); using the socket path",
                      file=sys.stderr, flush=True)
            fast = None
        send_msg(sock, P.Attached(fast is not None))
        return fast

    def _try_heal(self) -> None:
        """Uncoordinated: start a reconnection if one is due (see HEAL_FIRST_S), or look,
        without waiting, whether the one under way was welcomed."""
        if self._heal is None:
            return
        if self._attempt is None:
            if time.monotonic() < self._next_heal:
                return
            self._next_heal = time.monotonic() + self._heal.next()
            try:  # the directory again: it may have been made since, by anyone
                runtime_dir(self.path.parent, create=False)
            except PermissionError as exc:
                self._warn(f"not reconnecting: {exc}", again=True)
                return
            if not self.path.exists():  # no daemon yet: one stat, no connect
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(str(self.path))
                sock.sendall(frame(self._hello))  # ~200 bytes: fits the socket's buffer
            except OSError:
                sock.close()
                return  # no listener (yet), or its backlog is full: back off
            self._attempt = _Attempt(sock, time.monotonic() + HEAL_TIMEOUT_S)
        attempt = self._attempt
        try:
            got = []
            if readable(attempt.sock):
                data = attempt.sock.recv(65536)
                if not data:
                    raise ConnectionError("the daemon closed the connection")
                got = attempt.frames.feed(data)
            if not got:
                if time.monotonic() < attempt.deadline:
                    return  # no answer yet (a stopped daemon's backlog took the hello)
                raise TimeoutError(f"no welcome within {HEAL_TIMEOUT_S} s")
            self._attempt = None
            self._registered(attempt.sock, got[0], got[1:])
        except CrossoverVersionError as exc:
            self._heal = None  # the daemon was upgraded under the job: do not retry
            self._warn(f"not reconnecting: {exc}", again=True)
            return
        except (OSError, P.ProtocolError, RuntimeError):
            # Not back yet, or still busy with our old connection (a duplicate): back off.
            attempt.sock.close()
            self._attempt = None
            return
        self._heal = None
        self.reconnects += 1
        self._warned = False  # the next loss is news again
        print(f"crossover: reconnected to the crossover daemon at {self.path}; job "
              f"{self.job!r} rank {self._rank()} is coordinated again", file=sys.stderr,
              flush=True)
        if self.trace is not None:  # where in the trace its turns are the daemon's again
            self.trace.instant("coordinated again", time.time())

    def _daemon_alive(self) -> bool:
        """While waiting in the table: read the daemon's notices; False once it is gone."""
        self._keep_alone()  # reads pending notices, and fails open on a closed socket
        return self._sock is not None

    def _send(self, msg: P.Message) -> None:
        if self._sock is None:
            return
        try:
            send_msg(self._sock, msg)
        except OSError as exc:
            self._fail_open(f"lost the crossover daemon ({exc})")

    def _fail_open(self, why: str, heal: bool = True) -> None:
        """Go on uncoordinated (and, if `heal`, try to reconnect from time to time)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._fast = None
            self._place()
        then = "; it reconnects when the daemon is back" if heal else ""
        self._warn(f"{why}; job {self.job!r} rank {self._rank()} trains on "
                   f"uncoordinated{then}")
        if heal:
            self._heal = Backoff(HEAL_FIRST_S, HEAL_MOST_S)
            self._next_heal = time.monotonic() + self._heal.next()

    def _warn(self, message: str, again: bool = False) -> None:
        """Print a warning, once per loss of the daemon (`again`: whatever was said)."""
        if again or not self._warned:
            self._warned = True
            print(f"crossover: WARNING: {message}", file=sys.stderr, flush=True)
