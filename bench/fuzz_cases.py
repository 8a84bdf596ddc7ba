"""Hypothesis strategies for hostile input to a daemon's socket, shared by
tests/test_fuzz.py (a few cases) and bench/fuzz_bench.py (many, with latency figures).

Each strategy draws (an opening, the rest, bad): the opening (a hello, or nothing) is
sent and answered first, as a real rank waits for its welcome; then the rest is sent.
`bad`: the daemon must refuse the input as malformed, so that its last answer before it
hangs up is an error.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import fields

from hypothesis import strategies as st

from crossover import protocol as P
from crossover.transport import recv_msg


def frame(body: bytes, length: int | None = None) -> bytes:
    """A frame as the transport writes it (`length`: a lying length prefix)."""
    return struct.pack("!I", len(body) if length is None else length) + body


def hello_frame(job: str, rank: int = 0, size: int = 1) -> bytes:
    return frame(P.encode(P.Hello(job, rank, size, 0, 1, 1, 1.0, None)))


def malformed(body: bytes) -> bool:
    """Whether the daemon's decoder refuses this frame body."""
    try:
        P.decode(body)
    except P.ProtocolError:
        return True
    return False


def exchange(path: str, data: bytes, opening: bytes = b"",
             timeout: float = 5.0) -> list[P.Message]:
    """Send `opening` and read its answer, send `data`, half-close, and read replies
    until the daemon disconnects."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    replies = []
    try:
        try:
            if opening:
                sock.sendall(opening)
                replies.append(recv_msg(sock))
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except TimeoutError:  # an OSError too, but silence is not a disconnect
            raise TimeoutError(f"no answer within {timeout} s to {opening[:80]!r}") from None
        except OSError:
            return replies  # dropped mid-send: a disconnect
        while True:
            try:
                replies.append(recv_msg(sock))
            except ConnectionError:
                return replies  # the daemon hung up
            except TimeoutError:
                raise TimeoutError(f"no disconnect within {timeout} s after "
                                   f"{data[:80]!r}") from None
    finally:
        sock.close()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=3),
    max_leaves=8)

#: A message of a real kind whose fields hold values of any JSON type.
_typed_body = st.sampled_from(sorted(P.KINDS.values(), key=lambda c: c.kind)).flatmap(
    lambda cls: st.fixed_dictionaries({f.name: _json for f in fields(cls)}).map(
        lambda values: json.dumps({"v": P.PROTOCOL_VERSION, "kind": cls.kind, **values})
        .encode()))

#: Well-formed requests in any order (release without acquire, acquire twice, ...).
_request = st.one_of(
    st.builds(P.Acquire, st.integers(0, 10), st.booleans()),
    st.builds(P.Release, st.sampled_from([p.value for p in P.Phase] + ["nap", ""])),
    st.just(P.Renew()),
    st.builds(P.Progress, st.integers(-5, 10**12)),
    st.just(P.Status()),
    st.builds(P.Hello, st.just("seq"), st.integers(-1, 3), st.integers(0, 3),
              st.integers(-1, 2), st.integers(0, 2), st.integers(0, 99),
              st.floats(allow_nan=True), st.none() | st.integers(-1, 3)),
)


@st.composite
def raw_bytes(draw):
    return b"", draw(st.binary(max_size=300)), True


@st.composite
def lying_frames(draw):
    body = draw(st.binary(max_size=200))
    length = draw(st.integers(0, 2**32 - 1) | st.integers(0, 250))
    return b"", frame(body, length), True


@st.composite
def wrong_types(draw):
    body = draw(_typed_body)
    opening = hello_frame("typed") if draw(st.booleans()) else b""
    return opening, frame(body), malformed(body)


@st.composite
def out_of_order(draw):
    msgs = draw(st.lists(_request, max_size=12))
    opening = hello_frame("seq") if draw(st.booleans()) else b""
    return opening, b"".join(frame(P.encode(m)) for m in msgs), False


@st.composite
def truncated(draw):
    whole = hello_frame("cut") + frame(P.encode(P.Acquire(1)))
    return b"", whole[: draw(st.integers(0, len(whole) - 1))], False


CASES = {
    "raw_bytes": raw_bytes(),
    "lying_frames": lying_frames(),
    "wrong_types": wrong_types(),
    "out_of_order": out_of_order(),
    "truncated": truncated(),
}
