"""Messages between the node services as data: typed, versioned and signed.

A service's message to another node's service (`leader` lists the kinds) crosses its
relay, MPI and the other node's relay, none of which reads it. On the wire it is

    b"XO1" | HMAC-SHA256 tag (32 bytes) | JSON {"gen", "from", "to", "seq", "kind", "args"}

signed with the world's key, a secret every member holds (`world_key`) and nobody else
does: a process that reaches a relay's port can neither run code in a daemon (nothing
is unpickled) nor be heard (it cannot sign). The receiver (`Reader.read`) refuses, with
a reason, a message that is too long, not of this format, signed with another key or
not at all, addressed to another node, replayed (a sequence number not above the last
one of that sender in that generation), of an unknown kind or with arguments off the
kind's schema; and drops, as stale, one of another generation (a replaced relay's late
message: ranks mean other nodes in each generation) or whose sender is not the node at
that rank now.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin

from crossover import environment as E
from crossover.protocol import fits

MAGIC = b"XO1"
TAG_BYTES = 32
#: The longest message a service sends or takes (a status snapshot of a large node is
#: the longest kind; 1 MB ones are tested): longer ones are refused and logged.
MAX_BYTES = 16 * 2**20
#: Where the launch hands the world's key to the relays and services it starts (hex);
#: an environment variable, never a command line, which any user's `ps` shows.
KEY_ENV = E.WORLD_KEY
#: The key's file in the runtime directory (0600 in the 0700 directory).
KEY_FILE = "world.key"

#: Each kind's arguments, in order, as the types `protocol.fits` checks.
SCHEMAS: dict[str, tuple[Any, ...]] = {
    "join": (str,), "leave": (str,),
    "progress": (str, int, bool, int, float, float),
    "mode": (str, str, dict[str, int]), "waited": (str, float), "delay": (float, float),
    "status?": (int,), "status!": (int, str, dict[str, Any]),
    "shutdown": (), "stop_world": (), "beat": (int, int),
    "members": (list[int], list[str]), "lead": (int,),
    "hold": (list[str],), "epoch": (int, int),
    "grow": (list[str],), "prevote": (int,), "object": (int, int),
}


class BadMessage(ValueError):
    """A message refused: the reason says which check it failed."""


def check_args(kind: str, args: list) -> None:
    """Raises BadMessage unless `args` are of `kind`'s schema."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise BadMessage(f"unknown kind {kind!r}")
    if len(args) != len(schema):
        raise BadMessage(f"{kind}: {len(args)} arguments, not {len(schema)}")
    for i, (hint, value) in enumerate(zip(schema, args, strict=True)):
        if not fits(value, hint):
            name = getattr(hint, "__name__", None) if get_origin(hint) is None else None
            raise BadMessage(f"{kind}: argument {i} is {type(value).__name__}, not "
                             f"{name or hint}")


def world_key(directory: Path) -> bytes:
    """The world's key: the one the launch handed over (`KEY_ENV`), else the runtime
    directory's (`KEY_FILE`), made there now if there is none. Every node's service and
    relay of one world must hold the same (`fingerprint` tells them apart)."""
    given = E.world_key()  # ValueError, naming the variable and the form, if not a key
    if given is not None:
        return given
    path = Path(directory) / KEY_FILE
    if not path.exists():
        make_key(path, replace=False)
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} can be read by other users: the world's key must be "
                         f"its user's alone (chmod 600 {path})")
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"{path} holds no key (at least 16 bytes in hex): remove it, and "
                         f"a new one is made when the world starts")
    return key


def make_key(path: Path, replace: bool = True) -> None:
    """A new key at `path` (0600), made whole in a file of its own and then moved or
    linked into place: a reader never sees half a key. `replace`: over the one there
    (a new world: what was recorded in the last one means nothing in it); else only if
    there is none (another process of the world made it first: that one stays)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_bytes(32).hex() + "\n")
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def fingerprint(key: bytes) -> str:
    """A short name of `key` that gives nothing of it away (for logs and checks)."""
    return hashlib.sha256(b"crossover world key " + key).hexdigest()[:12]


def encode(key: bytes, gen: int, sender: str, to: str, seq: int, msg: tuple) -> bytes:
    """`msg` (kind, *args) as signed bytes from node `sender` to node `to` in
    generation `gen`.

    Raises:
        BadMessage: `msg` is not of its kind's schema, not JSON, or longer than
            MAX_BYTES (the sender's own fault: it is logged there, nothing is sent).
    """
    kind, args = msg[0], list(msg[1:])
    check_args(kind, args)
    try:
        body = json.dumps({"gen": gen, "from": sender, "to": to, "seq": seq, "kind": kind,
                           "args": args}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise BadMessage(f"{kind}: not JSON data ({exc})") from None
    if len(body) + len(MAGIC) + TAG_BYTES > MAX_BYTES:
        raise BadMessage(f"{kind}: {len(body)} bytes, more than the {MAX_BYTES} allowed")
    return MAGIC + hmac.digest(key, body, "sha256") + body


@dataclass
class Reader:
    """A service's check of what arrives from other nodes: one per key; `last_seq`
    holds the highest sequence number heard from each (generation, sender)."""

    key: bytes
    me: str  # this node: a message to another is a copy replayed here

    def __post_init__(self) -> None:
        self.last_seq: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()  # an old relay's reader may overlap the new one's

    def read(self, data: bytes, gen: int, names: list[str], source: int) -> tuple | None:
        """The message (kind, *args) in `data`, from relay rank `source` of generation
        `gen` whose members are `names`; None for a stale one (another generation, or a
        sender that is not at `source` now).

        Raises:
            BadMessage: refused (the reason names the check).
        """
        msg_gen, sender, to, seq, kind, args = unseal(self.key, data)
        if to != self.me:
            raise BadMessage(f"addressed to node {to}, not this one ({self.me})")
        if msg_gen != gen or not 0 <= source < len(names) or names[source] != sender:
            return None
        with self._lock:
            last = self.last_seq.get((gen, sender), -1)
            if seq <= last:
                raise BadMessage(f"replayed: sequence {seq} from {sender} after {last}")
            self.last_seq[(gen, sender)] = seq
            if len(self.last_seq) > 4096:  # generations long gone
                for old in sorted(self.last_seq)[:2048]:
                    del self.last_seq[old]
        return (kind, *args)


def unseal(key: bytes, data: bytes) -> tuple[int, str, str, int, str, list]:
    """(generation, sender, addressee, sequence, kind, args) of a message signed with
    `key`.

    Raises:
        BadMessage: too long, not of this format, not signed with `key`, or not a
            message of its kind's schema.
    """
    if len(data) > MAX_BYTES:
        raise BadMessage(f"{len(data)} bytes, more than the {MAX_BYTES} allowed")
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + TAG_BYTES:
        raise BadMessage("not a signed message of this version")
    tag, body = data[len(MAGIC):len(MAGIC) + TAG_BYTES], data[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.digest(key, body, "sha256")):
        raise BadMessage("its signature is not the world's key's (forged, corrupted, or "
                         "from a world with another key)")
    try:
        doc = json.loads(body)
        gen, sender, to, seq, kind, args = (doc["gen"], doc["from"], doc["to"], doc["seq"],
                                            doc["kind"], doc["args"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadMessage(f"a signed body that is not a message ({exc})") from None
    if not all(fits(v, hint) for v, hint in ((gen, int), (sender, str), (to, str),
                                             (seq, int), (kind, str), (args, list[Any]))):
        raise BadMessage("a signed body with fields of the wrong types")
    check_args(kind, args)
    return gen, sender, to, seq, kind, args
