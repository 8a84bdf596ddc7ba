"""Who is at the other end of a Unix socket, from the kernel: the one check of a
peer's user that the node's service (ranks, launchers) and the relays share."""

from __future__ import annotations

import socket
import struct


def peer_credentials(sock: socket.socket) -> tuple[int | None, int | None]:
    """The user id and process id of a Unix socket's other end (Linux), else Nones."""
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET,
                                                          socket.SO_PEERCRED, 12))
    except (OSError, AttributeError):
        return None, None
    return uid, pid
