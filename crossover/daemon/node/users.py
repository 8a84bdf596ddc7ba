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
import functools
import grp
import logging
import os
import pwd
import time
from collections.abc import Callable

from crossover import protocol as P

log = logging.getLogger("crossover.daemon")

#: how long a user's groups are taken as read (a user added to the group gets in after)
GROUPS_TTL_S = 60.0
#: the longest job name a rank may give (its owner's name comes before it on a service
#: for several users)
MAX_JOB = 200
#: the longest owner's name a job key of a service for several users holds in full
MAX_OWNER = 64
#: between a job's owner and its name in the job's key on a service for several users:
#: a user name never holds it, so the owner is what precedes the first one
OWNER_SEP = "/"


class UsersError(ValueError):
    """A setting of who may use the service that cannot be applied (no such group)."""


@functools.lru_cache(maxsize=4096)
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


class Users:
    """Who may connect, and how their jobs are named.

    Args:
        shared: a service for several users (False: the daemon's own user only).
        group: with `shared`, only members of this group (and the service's user, and
            root) may connect; None: every user of the node.
        service_uid: the daemon's own user (default: this process's).
        groups_of: the groups of a uid (injectable for tests).
        clock: monotonic seconds, for how long a user's groups are taken as read.

    Raises:
        UsersError: --allow-group without --system, a group that does not exist, or one
            a service not run by root is not in (it could not give its socket to it).
    """

    def __init__(self, shared: bool = False, group: str | None = None,
                 service_uid: int | None = None,
                 groups_of: Callable[[int], set[int]] = group_ids,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shared, self.group = shared, group
        self.service_uid = os.geteuid() if service_uid is None else service_uid
        self._groups_of, self._clock = groups_of, clock
        self._members: dict[int, tuple[float, bool]] = {}  # uid -> (read at, in group)
        self.gid: int | None = None
        if group is None:
            return
        if not shared:
            raise UsersError("--allow-group needs --system: a daemon of one user serves "
                             "that user alone")
        try:  # once: the name service is not asked on every connection
            self.gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise UsersError(f"--allow-group {group}: no such group on this node; create "
                             f"it (groupadd {group}) or name another") from None
        if self.service_uid == os.geteuid() != 0 and self.gid not in os.getgroups():
            raise UsersError(f"--allow-group {group}: this service's user is not in group "
                             f"{group}, so it cannot give its socket to it; add it (systemd: "
                             f"SupplementaryGroups={group}) or run the service as root")

    @property
    def socket_mode(self) -> int:
        """The mode of the ranks' socket: the kernel's first check of who connects."""
        if not self.shared:
            return 0o600
        return 0o660 if self.group is not None else 0o666

    def admits(self, uid: int | None) -> bool:
        """Whether the user `uid` may use this daemon (None: the kernel did not say,
        which a daemon of one user lets pass, as its 0700 directory let it in, and a
        service for several users does not)."""
        if uid is None:
            return not self.shared
        if uid == self.service_uid:
            return True
        if not self.shared:
            return False
        return uid == 0 or self.group is None or self._in_group(uid)

    def _in_group(self, uid: int) -> bool:
        """Whether `uid` is in the group, as read at most GROUPS_TTL_S ago; a lookup
        that fails refuses the connection, not the service."""
        now = self._clock()
        read = self._members.get(uid)
        if read is None or now - read[0] > GROUPS_TTL_S:
            try:
                member = self.gid in self._groups_of(uid)
            except Exception as exc:  # noqa: BLE001 - an NSS failure must not end the service
                log.warning("cannot read the groups of uid %d (%s): refusing it", uid, exc)
                return False
            if len(self._members) > 4096:
                self._members.clear()
            read = self._members[uid] = (now, member)
        return read[1]

    def manages(self, uid: int | None) -> bool:
        """Whether `uid` may stop or grow this daemon's world: its own user, and on a
        service for several users root too (None: as `admits`)."""
        if uid is None:
            return not self.shared
        return uid == self.service_uid or (self.shared and uid == 0)

    def job_key(self, uid: int, job: str) -> str:
        """The job's name in this daemon: its owner's name and its own on a service for
        several users (two users' jobs of one name are two jobs), else as given."""
        return f"{user_name(uid)}{OWNER_SEP}{job}" if self.shared else job

    def refuses(self, uid: int | None, msg: P.Message, node: str) -> str | None:
        """Why `uid` may not send `msg` to this daemon (stop or grow its world), or None."""
        if not isinstance(msg, (P.StopWorld, P.Grow)) or self.manages(uid):
            return None
        verb = "stop" if isinstance(msg, P.StopWorld) else "grow"
        return (f"user {user_name(uid) if uid is not None else 'unknown'} may not {verb} "
                f"the crossover service of user {user_name(self.service_uid)} on node "
                f"{node}: its operator does (e.g. systemctl stop crossover)")

    def owned(self, uid: int | None, pid: int | None, msg: P.Message) -> P.Message:
        """`msg` as this daemon takes it from the process `pid` of user `uid`: on a
        service for several users, a hello names its owner's job and the process the
        kernel says connected (status and metrics read that process, not one the hello
        names). A name of no length or over MAX_JOB is left to be refused as it came."""
        if not (isinstance(msg, P.Hello) and self.shared and uid is not None):
            return msg
        if not 0 < len(msg.job) <= MAX_JOB:
            return msg
        return dataclasses.replace(msg, job=self.job_key(uid, msg.job),
                                   pid=msg.pid if pid is None else pid)

    def refusal(self, uid: int | None) -> str:
        """Why `uid` may not connect, and what to do."""
        if uid is None:
            return ("the kernel did not say which user connected (no SO_PEERCRED): a "
                    "service for several users admits only users it knows")
        who = f"user {user_name(uid)} (uid {uid})"
        if self.shared:
            return (f"{who} is not in group {self.group}, which this node's crossover "
                    f"service admits: ask the operator to add you, or run your own "
                    f"daemon (set CROSSOVER_RUNTIME_DIR to a directory of yours)")
        return (f"{who} may not use the crossover daemon of user "
                f"{user_name(self.service_uid)}: run your own (set CROSSOVER_RUNTIME_DIR "
                f"to a directory of yours)")
