"""Who may use a node's daemon, and whose a job is.

A daemon started by a user for their own jobs (`crossoverrun`, `crossover daemon`)
serves that user alone: its socket is 0600 in a 0700 directory. A node service started
by the system (`crossover daemon --system`, run by root or a dedicated user, e.g. from
systemd) serves every user of the node, or the members of one group: its socket is
0666, or 0660 and owned by that group, and each connection's user comes from the kernel
(SO_PEERCRED), never from what the process says.

On a service for several users a job is known by its owner and its name
(`owner/name`): a user's hello can only name a job of their own, so no user can pose as
another's rank, take its place in the order, or free its slot (a rank's release and
renew act on its own connection). Stopping or growing the service's world is for the
service's own user and root.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass, field

from crossover import protocol as P

#: between a job's owner and its name in the job's key on a service for several users:
#: a user name never holds it, so the owner is what precedes the first one
OWNER_SEP = "/"


class UsersError(ValueError):
    """A setting of who may use the service that cannot be applied (no such group)."""


def user_name(uid: int) -> str:
    """The login name of `uid`, else the number as text (a user the node does not
    know by name still has one identity)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_ids(uid: int) -> set[int]:
    """The groups of `uid`: its primary one and those that list it (NSS included)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return set(os.getgrouplist(entry.pw_name, entry.pw_gid))


def owner_of(job: str) -> str | None:
    """The owner in a job key of a service for several users, else None."""
    owner, sep, _ = job.partition(OWNER_SEP)
    return owner if sep else None


@dataclass(frozen=True)
class Users:
    """Who may connect, and how their jobs are named.

    Args:
        shared: a service for several users (False: the daemon's own user only).
        group: with `shared`, only members of this group (and the service's user, and
            root) may connect; None: every user of the node.
        service_uid: the daemon's own user.
        groups_of: the groups of a uid (injectable for tests).
    """

    shared: bool = False
    group: str | None = None
    service_uid: int = field(default_factory=os.geteuid)
    groups_of: Callable[[int], set[int]] = group_ids

    def __post_init__(self) -> None:
        if self.group is not None:
            if not self.shared:
                raise UsersError("--allow-group needs --system: a daemon of one user "
                                 "serves that user alone")
            self.gid  # noqa: B018 - a group that does not exist is refused at start

    @property
    def gid(self) -> int | None:
        """The allowed group's id (None: no group named).

        Raises:
            UsersError: the group does not exist.
        """
        if self.group is None:
            return None
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise UsersError(f"--allow-group {self.group}: no such group on this node; "
                             f"create it (groupadd {self.group}) or name another") from None

    @property
    def socket_mode(self) -> int:
        """The mode of the ranks' socket: the kernel's first check of who connects."""
        if not self.shared:
            return 0o600
        return 0o660 if self.group is not None else 0o666

    @property
    def directory_mode(self) -> int:
        """The runtime directory's mode: others may enter a shared service's."""
        return 0o755 if self.shared else 0o700

    def admits(self, uid: int) -> bool:
        """Whether the user `uid` may use this daemon."""
        if uid == self.service_uid:
            return True
        if not self.shared:
            return False
        return uid == 0 or self.group is None or self.gid in self.groups_of(uid)

    def manages(self, uid: int) -> bool:
        """Whether `uid` may stop or grow this daemon's world: its own user, and on a
        service for several users root too."""
        return uid == self.service_uid or (self.shared and uid == 0)

    def job_key(self, uid: int, job: str) -> str:
        """The job's name in this daemon: its owner's name and its own on a service for
        several users (two users' jobs of one name are two jobs), else as given."""
        return f"{user_name(uid)}{OWNER_SEP}{job}" if self.shared else job

    def refuses(self, uid: int | None, msg: P.Message, node: str) -> str | None:
        """Why `uid` may not send `msg` to this daemon (stop or grow its world), or None."""
        if uid is None or not isinstance(msg, (P.StopWorld, P.Grow)) or self.manages(uid):
            return None
        verb = "stop" if isinstance(msg, P.StopWorld) else "grow"
        return (f"user {user_name(uid)} may not {verb} the crossover service of user "
                f"{user_name(self.service_uid)} on node {node}: its operator does (e.g. "
                f"systemctl stop crossover)")

    def owned(self, uid: int | None, msg: P.Message) -> P.Message:
        """`msg` as this daemon takes it from `uid`: a hello names its owner's job."""
        if isinstance(msg, P.Hello) and self.shared and uid is not None:
            return dataclasses.replace(msg, job=self.job_key(uid, msg.job))
        return msg

    def refusal(self, uid: int) -> str:
        """Why `uid` may not connect, and what to do."""
        who = f"user {user_name(uid)} (uid {uid})"
        if self.shared:
            return (f"{who} is not in group {self.group}, which this node's crossover "
                    f"service admits: ask the operator to add you, or run your own "
                    f"daemon (set CROSSOVER_RUNTIME_DIR to a directory of yours)")
        return (f"{who} may not use the crossover daemon of user "
                f"{user_name(self.service_uid)}: run your own (set CROSSOVER_RUNTIME_DIR "
                f"to a directory of yours)")
