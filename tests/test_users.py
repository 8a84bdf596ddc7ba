"""Who may use a daemon, whose a job is, where the system's node service lives, and
systemd's notify datagrams: the pure parts (the real service is tests/test_system_service.py)."""

from __future__ import annotations

import grp
import os
import socket
from pathlib import Path

import pytest

from crossover.daemon.node.notify import notify
from crossover.daemon.node.users import Users, UsersError, owner_of, user_name
from crossover.transport import runtime_dir, shared_dir_problem, system_service_dir

SERVICE, ALICE, BOB, ROOT = 990, 1001, 1002, 0
GPU = grp.getgrnam("root").gr_gid  # a group that exists on every node (the check looks it up)


def groups(uid: int) -> set[int]:
    return {ALICE: {GPU, 5000}, BOB: {5000}}.get(uid, set())


@pytest.mark.parametrize("users, uid, admits, manages", [
    # a user's own daemon: that user alone
    (Users(service_uid=SERVICE), SERVICE, True, True),
    (Users(service_uid=SERVICE), ALICE, False, False),
    (Users(service_uid=SERVICE), ROOT, False, False),
    # a service for every user: all connect, only its user and root manage it
    (Users(shared=True, service_uid=SERVICE), ALICE, True, False),
    (Users(shared=True, service_uid=SERVICE), ROOT, True, True),
    (Users(shared=True, service_uid=SERVICE), SERVICE, True, True),
    # a group's: its members, the service's user and root
    (Users(shared=True, group="root", service_uid=SERVICE, groups_of=groups), ALICE, True,
     False),
    (Users(shared=True, group="root", service_uid=SERVICE, groups_of=groups), BOB, False,
     False),
    (Users(shared=True, group="root", service_uid=SERVICE, groups_of=groups), ROOT, True,
     True),
    (Users(shared=True, group="root", service_uid=SERVICE, groups_of=groups), SERVICE, True,
     True),
])
def test_who_may_connect_and_who_may_stop(users, uid, admits, manages):
    assert users.admits(uid) is admits
    assert users.manages(uid) is manages


@pytest.mark.parametrize("users, socket_mode", [
    (Users(), 0o600),
    (Users(shared=True), 0o666),
    (Users(shared=True, group="root"), 0o660),
])
def test_the_socket_says_who_may_connect(users, socket_mode):
    assert users.socket_mode == socket_mode


def test_a_connection_the_kernel_does_not_name_is_a_users_own_daemons_only():
    assert Users(service_uid=SERVICE).admits(None)  # as before: its 0700 directory let it in
    shared = Users(shared=True, service_uid=SERVICE)
    assert not shared.admits(None) and not shared.manages(None)
    assert "did not say which user" in shared.refusal(None)


def test_a_users_groups_are_read_once_a_minute_and_a_failed_lookup_refuses_only_them():
    from crossover.daemon.node.users import GROUPS_TTL_S

    asked, now = [], [0.0]

    def lookup(uid: int) -> set[int]:
        asked.append(uid)
        if uid == BOB:
            raise OSError("LDAP down")
        return groups(uid)
    users = Users(shared=True, group="root", service_uid=SERVICE, groups_of=lookup,
                  clock=lambda: now[0])
    assert users.admits(ALICE) and users.admits(ALICE) and asked == [ALICE]
    assert not users.admits(BOB)  # the lookup failed: refused, and the service goes on
    now[0] += GROUPS_TTL_S + 1
    assert users.admits(ALICE) and asked == [ALICE, BOB, ALICE]


def test_a_job_is_its_owners_on_a_service_for_several_users():
    shared = Users(shared=True)
    me = user_name(os.getuid())
    assert shared.job_key(os.getuid(), "train") == f"{me}/train"
    # a name that looks like another user's job is still the caller's
    assert shared.job_key(os.getuid(), "alice/train") == f"{me}/alice/train"
    assert owner_of(f"{me}/alice/train") == me
    assert Users().job_key(os.getuid(), "train") == "train"
    assert owner_of("train") is None
    assert user_name(2**31 - 7) == str(2**31 - 7)  # a uid with no name keeps its number


def test_a_group_that_does_not_exist_or_needs_system_is_refused():
    with pytest.raises(UsersError, match="no such group on this node; create it"):
        Users(shared=True, group="no-such-group-xo")
    with pytest.raises(UsersError, match="--allow-group needs --system"):
        Users(group="root")


def test_refusals_name_the_user_and_the_fix():
    text = Users(shared=True, group="root").refusal(2**31 - 7)
    assert f"uid {2**31 - 7}" in text and "not in group root" in text
    assert "CROSSOVER_RUNTIME_DIR" in text


# --- where the system's service lives --------------------------------------------------
@pytest.fixture
def system(tmp_path, monkeypatch) -> Path:
    """A system directory as root would make it: 0755, in a parent only its owner
    (root, in this suite) may change."""
    if os.getuid() != 0:
        pytest.skip("a directory only root may change needs root")
    parent = tmp_path / "run"
    parent.mkdir(mode=0o755)
    d = parent / "crossover"
    d.mkdir(mode=0o755)
    monkeypatch.setenv("CROSSOVER_SYSTEM_DIR", str(d))
    monkeypatch.delenv("CROSSOVER_RUNTIME_DIR", raising=False)
    return d


def test_a_rank_uses_the_system_service_only_where_one_listens(system):
    assert system_service_dir() is None
    assert runtime_dir(create=False) != system  # the user's own daemon, as before
    (system / "node-h.sock").touch()
    assert system_service_dir() == system
    assert runtime_dir(create=False) == system
    assert runtime_dir(system, create=False) == system  # named: checked as the system's


def test_the_users_own_directory_wins_when_named(system, monkeypatch, tmp_path):
    (system / "node-h.sock").touch()
    mine = tmp_path / "mine"
    monkeypatch.setenv("CROSSOVER_RUNTIME_DIR", str(mine))
    assert runtime_dir(create=True) == mine


@pytest.mark.parametrize("spoil, problem", [
    (lambda d: d.chmod(0o775), "may be changed by users other than its owner"),
    (lambda d: d.parent.chmod(0o777), "which users other than root may change"),
])
def test_a_system_directory_others_could_change_is_not_trusted(system, spoil, problem):
    (system / "node-h.sock").touch()
    spoil(system)
    assert problem in shared_dir_problem(system)
    assert system_service_dir() is None  # ranks fall back to their own daemon
    with pytest.raises(PermissionError, match="let the service make it"):
        runtime_dir(system, create=False)


def test_a_link_is_no_system_directory(system, tmp_path):
    link = tmp_path / "run" / "link"
    link.symlink_to(system)
    assert shared_dir_problem(link) == "is a symbolic link"


# --- systemd's notify protocol ------------------------------------------------------------
def test_notify_sends_one_datagram_to_the_named_socket(tmp_path, monkeypatch):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    assert notify(READY=1, STATUS="serving")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving\n"


def test_notify_reaches_an_abstract_socket(monkeypatch):
    name = f"crossover-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)
    listener.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert notify(STOPPING=1)
    assert listener.recv(4096) == b"STOPPING=1\n"


def test_notify_without_systemd_or_listener_sends_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify(READY=1)
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert not notify(READY=1)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not notify(READY=1)  # logged, not raised: the service serves on


def test_stop_and_grow_are_the_managers_and_a_hello_is_its_owners():
    from crossover import protocol as P

    shared = Users(shared=True, service_uid=SERVICE)
    for msg in (P.StopWorld(), P.Grow(["n2"])):
        assert shared.refuses(SERVICE, msg, "n1") is None
        assert shared.refuses(ROOT, msg, "n1") is None
        assert "its operator does" in shared.refuses(ALICE, msg, "n1")
    assert shared.refuses(ALICE, P.Status(), "n1") is None
    assert "its operator does" in shared.refuses(None, P.StopWorld(), "n1")
    hello = P.Hello("train", 0, 1, 0, 1, 42)
    owned = shared.owned(os.getuid(), 4242, hello)
    # the owner's job, and the process the kernel says connected (not one it names)
    assert (owned.job, owned.pid) == (f"{user_name(os.getuid())}/train", 4242)
    assert Users().owned(os.getuid(), 4242, hello) is hello  # a user's own daemon: as sent
    assert shared.owned(os.getuid(), 4242, P.Status()) == P.Status()
    long = P.Hello("x" * 201, 0, 1, 0, 1, 42)
    assert shared.owned(os.getuid(), 4242, long) is long  # refused as it came
