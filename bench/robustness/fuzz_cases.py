"""Hypothesis strategies for hostile input to a daemon's socket, shared by
tests/test_fuzz.py (a few cases) and bench/robustness/fuzz.py (many, with latency figures).

Each strategy draws (an opening, the rest, bad): the opening (a hello, or nothing) is
sent and answered first, as a real rank waits for its welcome; then the rest is sent.
`bad`: the daemon must refuse the input as malformed, so that its last answer before it
hangs up is an error.

GROUPS draw several hellos sent on as many connections at once (ranks of one new job
with different weights, a job over 1 to 300 devices), each then asking for its device:
`exchange_group` sends them all before it reads, as ranks that start together do.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import fields

from hypothesis import strategies as st

from crossover import protocol as P
from crossover.transport import connect, recv_msg


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
    sock = connect(path, timeout)
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

#: Every kind a client may send, less `stop_world`, which stops the daemon's world by
#: design (as `crossover stop` does; tests/test_world.py covers it).
_KINDS = sorted((c for c in P.KINDS.values() if c is not P.StopWorld), key=lambda c: c.kind)

#: A message of a real kind whose fields hold values of any JSON type.
_typed_body = st.sampled_from(_KINDS).flatmap(
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


#: Every number a JSON field can hold, the edges that once mattered included: 32-bit
#: pids and indexes, 64 bits, and past them.
_edges = st.sampled_from([0, 1, 63, 64, 65, 255, 256, 2**31 - 1, 2**31, 2**32, 2**63 - 1,
                          2**63, 2**64, -1, -2**31, -2**63])
_ints = _edges | st.integers(-2**70, 2**70) | st.integers(0, 300)
_floats = st.floats() | st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1.0, 2.0])
#: Job names at and past the daemon's 200 characters, printable or not.
_names = st.text(min_size=0, max_size=8) | st.sampled_from(["a" * 200, "a" * 201, "",
                                                            "x\n", "\x00", "é" * 200])

#: A hello whose every field is drawn over its whole type's range.
_hello = st.builds(P.Hello, _names, _ints, _ints, _ints, _ints, _ints, _floats,
                   st.none() | _ints)


def _any_of(cls: type[P.Message]) -> st.SearchStrategy:
    """Messages of `cls` with fields of the right types and any values: a client may
    send even the daemon's own kinds (welcome, grant, ...)."""
    draw_for = {str: _names, int: _ints, float: _floats, bool: st.booleans(),
                list[int]: st.lists(_ints, max_size=3), int | None: st.none() | _ints,
                "dict": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)}
    hints = P._field_types(cls)
    return st.builds(cls, **{name: draw_for.get(hint, draw_for["dict"])
                             for name, hint in hints.items()})


_any_message = st.one_of([_any_of(cls) for cls in _KINDS])


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
def deep_nesting(draw):
    """JSON nested past the parser's stack (it once raised RecursionError, which no
    guard caught, and stopped the daemon)."""
    depth = draw(st.integers(900, 13_000))  # within the daemon's 64 KiB frames
    body = draw(st.sampled_from([b"[", b'{"a":'])) * depth
    opening = hello_frame("deep") if draw(st.booleans()) else b""
    return opening, frame(body), True


@st.composite
def hello_ranges(draw):
    body = P.encode(draw(_hello))
    return b"", frame(body), malformed(body)


@st.composite
def every_state(draw):
    """Any kind in any state: before a hello, after one, after the slot table was
    taken up or turned down, after a refusal."""
    state = draw(st.sampled_from(["none", "hello", "attached", "declined", "refused"]))
    job = f"state-{draw(st.integers(0, 3))}"
    opening = {"none": b"", "refused": hello_frame("")}.get(state, hello_frame(job))
    rest = {"attached": [P.Attached(True)], "declined": [P.Attached(False)]}.get(state, [])
    msgs = rest + draw(st.lists(_any_message, min_size=1, max_size=6))
    return opening, b"".join(frame(P.encode(m)) for m in msgs), False


@st.composite
def truncated(draw):
    whole = hello_frame("cut") + frame(P.encode(P.Acquire(1)))
    return b"", whole[: draw(st.integers(0, len(whole) - 1))], False


CASES = {
    "raw_bytes": raw_bytes(),
    "lying_frames": lying_frames(),
    "wrong_types": wrong_types(),
    "hello_ranges": hello_ranges(),
    "deep_nesting": deep_nesting(),
    "every_state": every_state(),
    "out_of_order": out_of_order(),
    "truncated": truncated(),
}

_group = iter(range(1 << 62))  # new job names: each group is a job the daemon never saw


@st.composite
def mixed_weights(draw):
    """Ranks of one new job whose CROSSOVER_PRIORITY differs."""
    size = draw(st.integers(2, 4))
    weights = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=size, max_size=size))
    job = f"weights-{next(_group)}"
    return [P.Hello(job, r, size, r, size, 1, w, None) for r, w in enumerate(weights)]


@st.composite
def many_devices(draw):
    """A job over 1 to 300 GPUs of one node (past the slot table's 64 devices)."""
    size = draw(st.integers(1, 300))
    job = f"devices-{next(_group)}"
    return [P.Hello(job, r, size, r, size, 1, 1.0, r) for r in range(size)]


GROUPS = {"mixed_weights": mixed_weights(), "many_devices": many_devices()}


def exchange_group(path: str, hellos: list[P.Hello], timeout: float = 10.0) -> list[P.Message]:
    """Connect every hello at once, then read each answer; welcomed ranks ask for their
    device once and release it. Returns the first answer of each connection."""
    socks = []
    try:
        for h in hellos:
            sock = connect(path, timeout)
            sock.sendall(frame(P.encode(h)))
            socks.append(sock)
        answers = [recv_msg(sock) for sock in socks]
        asks = frame(P.encode(P.Acquire(1))) + frame(P.encode(P.Release("idle")))
        for sock, answer in zip(socks, answers, strict=True):
            if isinstance(answer, P.Welcome):
                sock.sendall(frame(P.encode(P.Attached(False))) + asks)
        time.sleep(0.01)  # the daemon reads them before the connections close
        return answers
    finally:
        for sock in socks:
            sock.close()
