"""Messages between a job's ranks and their node's daemon, versioned.

Every message is one JSON object in a length-prefixed frame (see `transport`), with the
protocol version and a `kind`. Requests from a rank and the daemon's replies mirror each
other: Hello -> Welcome (-> Attached), Acquire -> Grant, Status -> StatusReport; Release,
Renew, Progress and Ring are one-way. The daemon sends Company unasked. Any request may
be answered with Error, which carries a machine-readable code and the daemon's message.
"""

from __future__ import annotations

import functools
import json
import math
import types
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

#: Bumped on any incompatible change; a client and daemon that differ refuse each other.
PROTOCOL_VERSION = 11


class ErrorCode(str, Enum):
    """Why the daemon refused something: clients act on the code, people read the text."""

    VERSION = "version_mismatch"  # another protocol version: never silenced
    DUPLICATE = "duplicate_rank"  # the job's rank is connected already
    PROTOCOL = "protocol_error"  # a malformed or unexpected message
    REFUSED = "refused"  # a well-formed request that does not fit the scheduler's state


class Phase(str, Enum):
    """What a rank does next when it releases (or offers) its device."""

    COMPUTE = "compute"  # a step boundary: the rank computes on at once
    COMMUNICATE = "communicate"  # it waits on the network
    IDLE = "idle"  # it does not need the device for a while


#: The phase the daemon's plans for the slot table are made for: the one a holder gives
#: the device up in under crossover (the handoff that happens every step); a release in
#: another phase never runs a plan (an idle rank, say, changes who is in line).
PLANNED_PHASE = Phase.COMMUNICATE


class Mode(str, Enum):
    """How a device serves the jobs that share it (the daemons decide, see
    `crossover.scheduler.mode`)."""

    ANTIPHASE = "antiphase"  # one job computes at a time, in the global sequence
    CONCURRENT = "concurrent"  # every job computes at once (plain co-location)

    @property
    def other(self) -> Mode:
        """The mode this one is compared with."""
        return Mode.CONCURRENT if self == Mode.ANTIPHASE else Mode.ANTIPHASE


class ProtocolError(RuntimeError):
    """A malformed message, or one from an incompatible version."""


class VersionMismatch(ProtocolError):
    """A message from another protocol version."""


@dataclass
class Message:
    kind: ClassVar[str] = ""


@dataclass
class Hello(Message):
    """A rank introduces itself; first message on a connection."""

    kind: ClassVar[str] = "hello"
    job: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    pid: int
    weight: float = 1.0
    gpu: int | None = None  # the CUDA device index the rank computes on, if any
    # When the job started (ns since the epoch), the same on every rank: stamped by the
    # launcher or agreed with the job's name; 0 if unknown. (start_ns, job) is the job's
    # place in the global order on every node (`scheduler.state.JobOrder`).
    start_ns: int = 0
    # The batch system's id of the job this rank runs in (Slurm's SLURM_JOB_ID, say;
    # `environment.batch_job`), "" outside one: metrics name it beside the job.
    batch_job: str = ""


@dataclass
class Welcome(Message):
    kind: ClassVar[str] = "welcome"
    device: str
    cores: list[int]  # CPU cores of the device: where the rank should pin itself
    node: str
    policy: str
    lease_s: float
    release_on_communicate: bool  # the policy frees the device while the rank communicates
    yield_on_step: bool  # the policy may hand the device over at a step boundary
    # The node's slot table (the native fast path), the rank's slot in it and the device's
    # index there; "" when the daemon runs without it. The rank answers with Attached.
    table: str = ""
    slot: int = -1
    table_device: int = -1
    report_waits: bool = False  # the daemons align the nodes' phases: send `Waited`


@dataclass
class Acquire(Message):
    kind: ClassVar[str] = "acquire"
    seq: int  # echoed in the Grant, so a late grant for an abandoned wait is recognised
    release_first: bool = False  # offer the device at a step boundary, then queue: a yield
    # the request's point in the rank's sequence, points passed holding included (see
    # `scheduler.core`); 0: the point after the rank's last request
    pos: int = 0


@dataclass
class Attached(Message):
    """Rank -> daemon, after a Welcome that named a slot table: whether the rank mapped it.
    From then on its requests and releases go through the table, and its grants too."""

    kind: ClassVar[str] = "attached"
    ok: bool


@dataclass
class Ring(Message):
    """Rank -> daemon, one-way: events wait in the slot table (a doorbell; the table's
    ring holds the events and their order)."""

    kind: ClassVar[str] = "ring"


@dataclass
class Grant(Message):
    kind: ClassVar[str] = "grant"
    seq: int


@dataclass
class Company(Message):
    """Daemon -> rank, unasked, when its device's jobs change: how many other jobs share it.

    A rank alone on its device keeps it through communication and step boundaries (no
    messages, no waits); told of company, it goes back to releasing."""

    kind: ClassVar[str] = "company"
    others: int
    mode: str = "antiphase"  # `crossover.scheduler.Mode`: concurrent lets every job keep it
    reason: str = ""  # why the daemons chose `mode` (for traces)
    #: the host's cores this rank's job may run on (`crossover.placement`); empty: where
    #: its launcher put it
    cores: list[int] = field(default_factory=list)


@dataclass
class Progress(Message):
    """Rank -> daemon, one-way: the job has made `steps` training steps and passed
    `points` request points (`Acquire.pos`); its recent steps took `compute_s` on the
    device and `gap_s` waiting for gradients, each per step (both 0: not measured). The
    daemons measure step rates and predict the modes from these, and restart antiphase
    turns from the points on every node alike (only a job's rank 0 sends: often while
    it has company, once a second alone)."""

    kind: ClassVar[str] = "progress"
    steps: int
    points: int = 0
    compute_s: float = 0.0
    gap_s: float = 0.0


@dataclass
class Waited(Message):
    """Rank -> daemon, one-way: the median time the rank's recent allreduces took to
    finish after it released its device for them, while it was served in antiphase. A
    job's allreduce ends at once on all its ranks, so its ranks' waits differ by how far
    their nodes' turn sequences are apart (`crossover.scheduler.phase`)."""

    kind: ClassVar[str] = "waited"
    wait_s: float


@dataclass
class Memory(Message):
    """Rank -> daemon, one-way: the device memory a GPU rank's allocator holds now
    (`reserved_bytes`), the most it held (`peak_bytes`), and its device's capacity
    (`capacity_bytes`), for status and metrics (now and then, when it changed)."""

    kind: ClassVar[str] = "memory"
    reserved_bytes: int
    peak_bytes: int
    capacity_bytes: int


@dataclass
class Release(Message):
    kind: ClassVar[str] = "release"
    phase: str


@dataclass
class Renew(Message):
    kind: ClassVar[str] = "renew"


@dataclass
class Status(Message):
    kind: ClassVar[str] = "status"


@dataclass
class Grow(Message):
    """A launcher asks for its job's nodes in the daemons' world (answered by a
    StatusReport of the nodes not in it yet: the leader starts their daemons)."""

    kind: ClassVar[str] = "grow"
    nodes: list[str] = field(default_factory=list)


@dataclass
class StopWorld(Message):
    """`crossover stop` asks a node's daemon to stop every daemon of its world (answered
    by a StatusReport of the nodes in it: each stops once the leader's word reaches it)."""

    kind: ClassVar[str] = "stop_world"


@dataclass
class StatusReport(Message):
    kind: ClassVar[str] = "status_report"
    nodes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Error(Message):
    kind: ClassVar[str] = "error"
    message: str
    code: str = ErrorCode.REFUSED.value


#: What a rank may send. Every number in these is a count, an index, a pid, a weight
#: or a duration: finite, >= 0 and within 64 bits, or the decoder refuses it (a NaN
#: wait once reached the leader's phase aligner and stopped a peer daemon).
REQUESTS = frozenset({"hello", "acquire", "attached", "ring", "progress", "waited", "memory",
                      "release", "renew", "status", "grow", "stop_world"})
#: The largest number a request may carry.
MAX_NUMBER = 2**63 - 1

KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (Hello, Welcome, Acquire, Attached, Ring, Grant, Company, Progress, Waited, Memory,
                Release, Renew, Status, Grow, StopWorld, StatusReport, Error)
}


def encode(msg: Message) -> bytes:
    """The message as JSON bytes, with version and kind."""
    return json.dumps({"v": PROTOCOL_VERSION, "kind": msg.kind, **asdict(msg)}).encode()


def decode(data: bytes) -> Message:
    """Parse bytes from `encode`.

    Raises:
        ProtocolError: not JSON, another protocol version, an unknown kind, or fields
            that do not match the kind.
    """
    try:
        obj = json.loads(data)
        version, kind = obj.pop("v"), obj.pop("kind")
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as exc:
        # (RecursionError: JSON nested deeper than the parser's stack, say "[[[[...")
        raise ProtocolError(f"malformed crossover message: {exc}") from None
    if kind == "error" and isinstance(obj.get("message"), str):
        # Readable across versions, since it explains the refusal. An error from another
        # version is a version mismatch whatever it says (version 1 sent no code).
        code = obj.get("code") if version == PROTOCOL_VERSION else ErrorCode.VERSION.value
        return Error(obj["message"], code if isinstance(code, str) else ErrorCode.REFUSED.value)
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"crossover protocol version mismatch: got {version}, this side speaks "
            f"{PROTOCOL_VERSION}; run the client and the daemon from the same crossover "
            f"release (restart the daemon after upgrading)"
        )
    cls = KINDS.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown crossover message kind {kind!r}")
    names = {f.name for f in fields(cls)}
    if set(obj) - names:
        raise ProtocolError(f"{kind}: unexpected fields {sorted(set(obj) - names)}")
    try:
        msg = cls(**obj)
    except TypeError as exc:
        raise ProtocolError(f"{kind}: {exc}") from None
    for name, hint in _field_types(cls).items():
        value = getattr(msg, name)
        if not fits(value, hint):
            raise ProtocolError(f"{kind}: field {name} is {type(value).__name__} "
                                f"{str(value)[:40]!r}, not {hint}")
        if kind in REQUESTS and not _in_range(value):
            raise ProtocolError(f"{kind}: field {name} is {str(value)[:40]}: a request's "
                                f"numbers are finite, >= 0 and at most 2**63 - 1")
    return msg


def _in_range(value: Any) -> bool:
    """Whether a number of a request is finite, >= 0 and within 64 bits (not a number:
    True; lists are checked item by item)."""
    if isinstance(value, list):
        return all(_in_range(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return math.isfinite(value) and 0 <= value <= MAX_NUMBER


@functools.cache
def _field_types(cls: type[Message]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def fits(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value has a declared type (a bool is no number): the
    fields of these messages, and the arguments of the daemons' (`daemon.wire`)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(fits(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(fits(v, get_args(hint)[0]) for v in value)
    if origin is dict:
        key, val = get_args(hint)
        return isinstance(value, dict) and all(fits(k, key) and fits(v, val)
                                               for k, v in value.items())
    if hint is dict:
        return isinstance(value, dict)
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(value, hint)
