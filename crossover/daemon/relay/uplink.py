"""The node service's side of its relay (`relay`): the other nodes' services, by their
rank in the current generation of the daemons' world.

It offers what the rest of the daemon sends and receives through (`send`, `broadcast`,
`send_leader`, `inbox`): a message (kind, *args) goes out signed (`wire`) in a "to"
frame to the relay (`frames`) and comes in as (source rank, message) once checked: what
another generation's relay sent, or a sender not at that rank now, is dropped as stale;
a forged, unsigned, replayed or malformed one is refused and logged.

A relay says hello first; the service takes a relay of a newer generation (a higher
(epoch, leader node)) and drops the one it had, which ends it; an older one is refused.
Between relays (the relay died, or the leader
is forming a new generation) the service is *detached*: what it sends is dropped, and
its membership waits (`member`), while its ranks go on being served.

Nothing here blocks the serve loop: a thread reads the relay, another writes to it from
a bounded queue (a relay that stops reading costs only the messages past the bound).
Only a process of this daemon's own user is taken as a relay (SO_PEERCRED; the socket
is 0600 in the 0700 runtime directory as well).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from crossover.daemon.credentials import peer_credentials
from crossover.daemon.relay.frames import FrameError, parse_hello, read_frame, write_frame
from crossover.daemon.world.wire import BadMessage, Reader, encode

log = logging.getLogger("crossover.daemon")

#: frames queued for a relay beyond this many are dropped
MAX_QUEUED = 4096
#: a relay that reads nothing for this long is dropped (the node is detached)
SEND_TIMEOUT_S = 5
#: how long a stopping service waits for its queued messages to go out
FLUSH_S = 2.0
#: refused messages logged one by one, then one in REFUSALS_LOGGED (a flood of them
#: must not fill the log)
REFUSALS_LOGGED = 1000


class Uplink:
    """The service's connection to the other nodes, through its relay.

    Args:
        wakeup: called after a message is queued in `inbox`.
        relayed: a relay is expected (the service of a world's node); False: a daemon of
            one node (started by hand, without mpirun), which is its own world.
        node: this service's node name, which its messages carry.
        secret: the world's key (`wire.world_key`), which signs and checks them.
    """

    def __init__(self, wakeup: Callable[[], None], relayed: bool, node: str = "",
                 secret: bytes = b"") -> None:
        self.relayed, self.node = relayed, node
        self.rank, self.size, self.leader = 0, 1, 0
        self.lost: set[int] = set()
        # (source, message, the generation it came in, None for this node's own)
        self.inbox: queue.Queue[tuple[int, Any, int | None]] = queue.Queue()
        self.key: tuple[int, str] = (-1, "")  # the generation attached: (epoch, leader)
        self.outsider: str | None = None  # the leader of the older generation refused last
        self.names: list[str] = []  # its members' nodes, by rank
        self.send_errors = 0
        self.refused = self.stale = 0  # messages from peers refused, and dropped as stale
        self.relay_pid: int | None = None  # the relay attached (status shows it)
        self._wakeup = wakeup
        self._secret, self._reader = secret, Reader(secret, node)
        self._seq = 0  # the last sequence number signed (see `_next_seq`)
        self._sock: socket.socket | None = None
        self._out: queue.Queue[tuple[socket.socket, dict, bytes]] = queue.Queue(MAX_QUEUED)
        self._writing = threading.Lock()  # a frame at a time: the writer, and a goodbye
        self._signing = threading.Lock()  # sequence numbers go out in order
        threading.Thread(target=self._write, name="crossover-uplink-out", daemon=True).start()

    @property
    def attached(self) -> bool:
        return self._sock is not None

    # --- sending ------------------------------------------------------------------------
    def send(self, dest: int, obj: Any) -> None:
        """Send to the service of rank `dest` (to this one: queued directly). Never
        blocks and never raises: a message that cannot go is lost."""
        if dest == self.rank:
            self.inbox.put((self.rank, obj, None))
            self._wakeup()
            return
        # Numbered, signed and queued under one lock: the serve loop and the leader's
        # thread both send, and a receiver refuses a number below one it took (a replay)
        with self._signing:
            sock = self._sock
            if sock is None:
                return
            try:
                to = self.names[dest] if 0 <= dest < len(self.names) else f"daemon {dest}"
                data = encode(self._secret, self.key[0], self.node, to, self._next_seq(),
                              obj)
            except BadMessage as exc:  # this daemon's own bug: say so, send nothing
                self.send_errors += 1
                log.error("not sent to daemon %d: %s", dest, exc)
                return
            try:
                self._out.put_nowait((sock, {"k": "to", "dest": dest}, data))
            except queue.Full:
                self.send_errors += 1

    def _next_seq(self) -> int:
        """A sequence number above every one this node sent before, in this process or
        an earlier one of the node's service (the clock's nanoseconds): a receiver
        takes a message of a sender only above the last one it took (replays)."""
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    def take(self) -> tuple[int, Any] | None:
        """The next message in, (source rank, message), or None. One that came in under
        an earlier generation is dropped as stale (counted): read before this node
        switched to the new one, its source rank names another node now."""
        while True:
            try:
                source, msg, epoch = self.inbox.get_nowait()
            except queue.Empty:
                return None
            if epoch is None or epoch == self.key[0]:
                return source, msg
            self.stale += 1

    def send_leader(self, obj: Any) -> None:
        self.send(self.leader, obj)

    def broadcast(self, obj: Any, lost_too: bool = False) -> None:
        """Send to every service not known to be lost (`lost_too`: to those as well: a
        world's stop must reach a node that was only slow), this one included, last: its
        copy wakes the serve loop, which may act on it at once (a shutdown closes this
        uplink), so the others' copies must be queued by then."""
        rank, size, lost = self.rank, self.size, set() if lost_too else set(self.lost)
        for dest in range(size):
            if dest != rank and dest not in lost:
                self.send(dest, obj)
        self.send(rank, obj)

    # --- relays ---------------------------------------------------------------------------
    def accept(self, listener: socket.socket) -> tuple | None:
        """A relay connecting: its hello (epoch, rank, names, leader) if it is taken."""
        self.outsider = None
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return None
        uid, pid = peer_credentials(sock)
        if uid is not None and uid != os.getuid():
            log.warning("refused a relay of user %s (process %s): a world takes only its "
                        "own user's processes", uid, pid)
            sock.close()
            return None
        try:
            sock.settimeout(5.0)  # a relay says hello as soon as it connects
            epoch, rank, names, leader = parse_hello(read_frame(sock)[0])
        except (OSError, ConnectionError, FrameError) as exc:
            log.warning("a relay connection (process %s) said no valid hello (%s): closed",
                        pid, exc)
            sock.close()
            return None
        key = (epoch, names[leader])
        if key <= self.key:
            log.info("a relay of generation %d (leader %s) is older than this node's "
                     "(%d, leader %s): refused", epoch, names[leader], *self.key)
            sock.close()
            # its leader forms generations of its own: a node this world may lack (a
            # service of a cluster's world that started again, or one split off)
            self.outsider = names[leader]
            return None
        sock.settimeout(None)
        # a relay that stops reading (stopped, wedged) fails the writer's send after
        # SEND_TIMEOUT_S instead of holding it, and the lock a newer relay needs, for ever
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        # the generation first, then the relay, at once for a sender (which signs with
        # both): no message goes out through the new relay numbered by the old one
        with self._signing:
            self.key, self.relay_pid, self.names = key, pid, list(names)
            self.rank, self.size, self.leader, self.lost = rank, len(names), leader, set()
            old, self._sock = self._sock, sock
        if old is not None:
            with self._writing:
                _close(old, "replaced")  # that relay ends
        threading.Thread(target=self._read, args=(sock, epoch, list(names)), daemon=True,
                         name=f"crossover-uplink-in-{epoch}").start()
        return epoch, rank, list(names), leader

    def close(self) -> None:
        """This service stops: what it has queued goes out first (a world's shutdown,
        say, for the other nodes; FLUSH_S, and a write to a relay that reads nothing may
        hold the writer's lock up to 2 x SEND_TIMEOUT_S), then its relay ends too."""
        deadline = time.monotonic() + FLUSH_S
        # unfinished, not empty: the writer may have taken the last frame off the queue
        # and not yet written it (closing first would drop it: a node never told to stop)
        while self._sock is not None and self._out.unfinished_tasks and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        sock, self._sock = self._sock, None
        if sock is not None:
            with self._writing:
                _close(sock, "stop")

    def _read(self, sock: socket.socket, epoch: int, names: list[str]) -> None:
        while True:
            try:
                header, payload = read_frame(sock)
            except (OSError, ConnectionError, FrameError):
                break
            source = header.get("source")
            if header["k"] != "from" or not isinstance(source, int):
                continue
            try:
                msg = self._reader.read(payload, epoch, names, source)
            except BadMessage as exc:
                self.refused += 1
                if self.refused <= 10 or self.refused % REFUSALS_LOGGED == 0:
                    log.warning("refused a message from daemon %d (node %s) of generation "
                                "%d: %s (%d refused so far)", source,
                                names[source] if 0 <= source < len(names) else "?", epoch,
                                exc, self.refused)
                continue
            if msg is None:  # another generation's, or a sender not at that rank now
                self.stale += 1
                continue
            self.inbox.put((source, msg, epoch))
            self._wakeup()
        if self._sock is sock:  # not replaced by a newer relay: this node is cut off
            self._sock = None
            self.inbox.put((self.rank, ("detached", epoch), None))
            self._wakeup()

    def _write(self) -> None:
        while True:
            sock, header, payload = self._out.get()
            try:
                self._write_one(sock, header, payload)
            finally:
                self._out.task_done()  # written or dropped: `close` waits for this

    def _write_one(self, sock: socket.socket, header: dict, payload: bytes) -> None:
        with self._writing:
            if sock is not self._sock:
                return  # for a relay since replaced
            try:
                write_frame(sock, header, payload)
            except OSError:  # a frame may be cut short: that relay is done
                self.send_errors += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # its reader finds the end
                except OSError:
                    pass


def _close(sock: socket.socket, why: str) -> None:
    """End a relay's connection, saying why ("stop": this service stops; "replaced":
    by a newer generation's relay); a relay whose connection ends without a word takes
    its service for dead, and starts another."""
    try:
        sock.settimeout(1.0)
        write_frame(sock, {"k": "bye", "why": why})
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
    except OSError:
        pass
    sock.close()
