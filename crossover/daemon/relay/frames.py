"""Frames between a node's service and its relay, on the node's 0600 socket.

A frame is a small JSON header and, for a peer message, that message's bytes unread
(`wire` signs and checks them in the services; the relay only carries them):

    !II (header bytes, payload bytes) | header JSON | payload

    {"k": "hello", "epoch": e, "rank": r, "names": [...], "leader": l}   relay -> service
    {"k": "from", "source": rank} + message                              relay -> service
    {"k": "to", "dest": rank} + message                                  service -> relay
    {"k": "bye", "why": "stop" | "replaced"}                             service -> relay

Data only, never code: a frame that is not of this form is refused (`FrameError`).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from crossover.daemon.world.wire import MAX_BYTES
from crossover.transport import recv_exact

_LENS = struct.Struct("!II")
#: the longest header (a hello names every member)
MAX_HEADER = 4 * 2**20


class FrameError(ValueError):
    """A frame not of this form (the peer is no relay or service of this version)."""


def write_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    """One frame to the other end (a relay, or its service)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LENS.pack(len(head), len(payload)) + head + payload)


def read_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """One frame's header and payload; ConnectionError once the other end closed.

    Raises:
        FrameError: a length past the limits, or a header that is not a JSON object
            with a kind.
    """
    n_head, n_payload = _LENS.unpack(recv_exact(sock, _LENS.size))
    if n_head > MAX_HEADER or n_payload > MAX_BYTES:
        raise FrameError(f"a frame of {n_head} + {n_payload} bytes, past the limits "
                         f"({MAX_HEADER} + {MAX_BYTES})")
    try:
        header = json.loads(recv_exact(sock, n_head))
    except ValueError as exc:
        raise FrameError(f"a frame header that is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("k"), str):
        raise FrameError(f"a frame header without a kind: {str(header)[:80]}")
    return header, recv_exact(sock, n_payload) if n_payload else b""


def hello(epoch: int, rank: int, names: list[str], leader: int) -> dict[str, Any]:
    return {"k": "hello", "epoch": epoch, "rank": rank, "names": names, "leader": leader}


def parse_hello(header: dict[str, Any]) -> tuple[int, int, list[str], int]:
    """(epoch, rank, names, leader) of a relay's hello.

    Raises:
        FrameError: not a hello, or one whose fields do not fit together.
    """
    try:
        epoch, rank, names, leader = (header["epoch"], header["rank"], header["names"],
                                      header["leader"])
    except KeyError as exc:
        raise FrameError(f"not a relay's hello (no {exc})") from None
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, rank, leader))
    if header["k"] != "hello" or not ints or not isinstance(names, list) or \
            not all(isinstance(n, str) for n in names) or \
            not 0 <= rank < len(names) or not 0 <= leader < len(names):
        raise FrameError(f"not a relay's hello: {str(header)[:120]}")
    return epoch, rank, names, leader
