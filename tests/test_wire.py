"""Messages between node services (`crossover.daemon.world.wire`): every kind goes through as
data, and what is forged, unsigned, replayed, malformed, too long or stale is refused or
dropped, with the reason (pure, no processes)."""

from __future__ import annotations

import hmac
import json
import os

import pytest

from crossover.daemon.world import wire
from crossover.daemon.world.wire import MAGIC, BadMessage, Reader, encode, world_key

KEY = bytes(range(32))
NAMES = ["n0", "n1", "n2"]

#: one message of every kind, as the daemons send them
MESSAGES = [
    ("join", "A"), ("leave", "A"),
    ("progress", "A", 120, True, 4, 0.031, 0.012),
    ("mode", "antiphase", "antiphase 1.12x concurrent", {"A": 4, "B": 2}),
    ("waited", "A", 0.004), ("delay", 0.002, 0.01), ("status?", 7),
    ("status!", 7, "n1", {"devices": {"0": {"holder": "A"}}, "world": {"lost": []}}),
    ("shutdown",), ("stop_world",), ("beat", 3, 0), ("members", [0, 2], ["n1"]), ("lead", 5),
    ("hold", ["A", "B"]), ("epoch", 5, 2), ("grow", ["n3", "n4"]),
    ("prevote", 5), ("object", 5, 0),
]


def test_every_kind_has_a_schema_and_one_message_here():
    assert {m[0] for m in MESSAGES} == set(wire.SCHEMAS)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m[0])
def test_every_kind_arrives_as_it_was_sent(msg):
    data = encode(KEY, 4, "n1", "n0", 10, msg)
    assert Reader(KEY, "n0").read(data, 4, NAMES, 1) == msg


def test_a_message_of_a_megabyte_arrives():
    snapshot = {"jobs": {f"job{i}": {"holds": "x" * 1000} for i in range(1100)}}
    data = encode(KEY, 0, "n1", "n0", 1, ("status!", 1, "n1", snapshot))
    assert len(data) > 2**20
    assert Reader(KEY, "n0").read(data, 0, NAMES, 1)[3] == snapshot


def sealed(msg=("join", "A"), key=KEY, gen=0, sender="n1", seq=1, to="n0") -> bytes:
    return encode(key, gen, sender, to, seq, msg)


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


@pytest.mark.parametrize("data, reason", [
    (sealed(key=b"another world's key, 32 bytes.."), "signature"),
    (flipped(sealed(), len(MAGIC) + 40), "signature"),  # the body changed on the way
    (flipped(sealed(), len(MAGIC) + 3), "signature"),  # the tag changed
    (b'{"gen": 0, "from": "n1", "to": "n0", "seq": 1, "kind": "lead", "args": [1]}',
     "not a signed message"),  # unsigned: what any process could send
    (MAGIC + b"\0" * 10, "not a signed message"),  # cut short
    (b"\x80\x04\x95" + b"\0" * 40, "not a signed message"),  # a pickle
], ids=["other-key", "body-changed", "tag-changed", "unsigned", "short", "pickle"])
def test_what_the_worlds_key_did_not_sign_is_refused(data, reason):
    with pytest.raises(BadMessage, match=reason):
        Reader(KEY, "n0").read(data, 0, NAMES, 1)


def test_a_replayed_message_is_refused_and_a_later_one_taken():
    reader = Reader(KEY, "n0")
    first = sealed(seq=5)
    assert reader.read(first, 0, NAMES, 1) == ("join", "A")
    with pytest.raises(BadMessage, match="replayed: sequence 5 from n1 after 5"):
        reader.read(first, 0, NAMES, 1)
    with pytest.raises(BadMessage, match="replayed"):
        reader.read(sealed(seq=4), 0, NAMES, 1)
    assert reader.read(sealed(("leave", "A"), seq=6), 0, NAMES, 1) == ("leave", "A")
    # another sender counts on its own
    assert reader.read(sealed(sender="n2", seq=1), 0, NAMES, 2) == ("join", "A")


@pytest.mark.parametrize("gen, source", [(3, 1), (5, 1), (4, 2), (4, 7)],
                         ids=["older-generation", "newer-generation", "other-rank",
                              "no-such-rank"])
def test_another_generations_message_or_one_from_another_rank_is_stale(gen, source):
    """Ranks name other nodes in every generation: a replaced relay's late message, or
    one whose sender is not at that rank now, would be charged to the wrong node."""
    assert Reader(KEY, "n0").read(sealed(gen=gen), 4, NAMES, source) is None


@pytest.mark.parametrize("msg, reason", [
    (("epoch", 5, "2"), "argument 1 is str, not int"),
    (("epoch", 5, True), "argument 1 is bool, not int"),
    (("lead",), "0 arguments"),
    (("beat",), "0 arguments"),
    (("hold", ["A", 1]), "argument 0"),
    (("members", [0, "1"], []), "argument 0"),
    (("exec", "import os"), "unknown kind 'exec'"),
])
def test_a_message_off_its_kinds_schema_is_refused_by_sender_and_receiver(msg, reason):
    with pytest.raises(BadMessage, match=reason):
        encode(KEY, 0, "n1", "n0", 1, msg)
    # signed by a member with a bug: the receiver checks too
    body = json.dumps({"gen": 0, "from": "n1", "to": "n0", "seq": 1, "kind": msg[0],
                       "args": list(msg[1:])}).encode()
    data = MAGIC + hmac.digest(KEY, body, "sha256") + body
    with pytest.raises(BadMessage, match=reason):
        Reader(KEY, "n0").read(data, 0, NAMES, 1)


def test_a_message_past_the_limit_is_refused_at_both_ends(monkeypatch):
    monkeypatch.setattr(wire, "MAX_BYTES", 4096)
    with pytest.raises(BadMessage, match="more than the 4096 allowed"):
        encode(KEY, 0, "n1", "n0", 1, ("status!", 1, "n1", {"x": "y" * 5000}))
    with pytest.raises(BadMessage, match="more than the 4096 allowed"):
        Reader(KEY, "n0").read(MAGIC + b"\0" * 5000, 0, NAMES, 1)


def test_the_worlds_key_is_made_once_for_its_user_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    key = world_key(tmp_path)
    path = tmp_path / wire.KEY_FILE
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert world_key(tmp_path) == key  # the next process of the world takes the same
    assert wire.fingerprint(key) != key.hex()[:12]
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=f"read by other users.*chmod 600 {path}"):
        world_key(tmp_path)


def test_a_key_handed_over_wins_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(wire.KEY_ENV, KEY.hex())
    assert world_key(tmp_path) == KEY and not (tmp_path / wire.KEY_FILE).exists()
    monkeypatch.setenv(wire.KEY_ENV, "not hex")
    with pytest.raises(ValueError, match=f"{wire.KEY_ENV}=<7 characters, not shown>: give"):
        world_key(tmp_path)
    monkeypatch.delenv(wire.KEY_ENV)
    (tmp_path / wire.KEY_FILE).write_text("abcd\n")
    os.chmod(tmp_path / wire.KEY_FILE, 0o600)
    with pytest.raises(ValueError, match="holds no key.*remove it"):
        world_key(tmp_path)


def test_a_copy_of_a_message_to_another_node_is_refused():
    """The leader's ("delay", ...) to n2, recorded and played to n1, whose last number
    from the leader is lower: addressed to n2, it is refused."""
    data = encode(KEY, 0, "n0", "n2", 500, ("delay", 0.002, 0.01))
    with pytest.raises(BadMessage, match="addressed to node n2, not this one"):
        Reader(KEY, "n1").read(data, 0, NAMES, 0)
    assert Reader(KEY, "n2").read(data, 0, NAMES, 0) == ("delay", 0.002, 0.01)


def test_a_new_world_makes_a_new_key(tmp_path, monkeypatch):
    """What was recorded in one world means nothing in the next one started there."""
    monkeypatch.delenv(wire.KEY_ENV, raising=False)
    first = world_key(tmp_path)
    wire.make_key(tmp_path / wire.KEY_FILE)
    assert world_key(tmp_path) != first
    assert os.stat(tmp_path / wire.KEY_FILE).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [wire.KEY_FILE]  # no leftovers


@pytest.mark.parametrize("msg, reason", [
    (("mode", "antiphase", "", {1: 2}), "argument 2"),  # JSON would make the key a string
    (("status!", 1, "n1", {"jobs": {"A", "B"}}), "not JSON data"),  # a set
    (("waited", "A", float("nan")), "not JSON data"),
])
def test_what_json_would_change_or_cannot_carry_is_never_sent(msg, reason):
    """A BadMessage, which the sender logs; any other error would end its thread."""
    with pytest.raises(BadMessage, match=reason):
        encode(KEY, 0, "n1", "n0", 1, msg)
