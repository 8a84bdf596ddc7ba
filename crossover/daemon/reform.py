"""Re-forming the daemons' world: new nodes join a running world, lost ones leave it.

An MPI world cannot take in a process started elsewhere (Open MPI 4.1 connects
separately started worlds only through an `ompi-server` every mpirun must be told of),
but its live members can make a new world that holds them and new processes: they form
a communicator of themselves alone (`Create_group`, collective over the members it
names, so the lost ones are not waited for), spawn one daemon per new node from it
(`Spawn_multiple`, with the leader as root), and merge the two sides into one
communicator (`Merge`). Every member, old and new, then knows every other's node name
(`allgather`), and the leader rebuilds the order from what the members hold, as after
a succession (`membership`).

A re-formation is collective, so it runs on a thread of its own: the serve loop goes on
granting with the old world meanwhile, and switches when the thread is done. A member
that dies in the middle leaves the others' threads waiting for ever: MPI cannot cancel
a collective. The leader gives up on that re-formation when it finds the member lost (or
after `REFORM_TIMEOUT_S`) and starts another without it, which the members join at
once (concurrent group creations are told apart by their tags); the stuck threads are
lost (and logged), and the world serves on as it was meanwhile.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crossover import environment as E

log = logging.getLogger("crossover.daemon")

#: a re-formation not done by then is given up
REFORM_TIMEOUT_S = 20.0
_FAKE = re.compile(r"fake\d+")


@dataclass(frozen=True)
class Spawn:
    """A daemon to start on `host`, serving node `node` (`node_arg`: its name given on
    its command line, for a fake node of this machine; None: the host's own name)."""

    host: str
    node: str
    node_arg: str | None


def spawn_for(node: str) -> Spawn:
    """Where the daemon of `node` starts: a fake node (`CROSSOVER_FAKE_NODES`) on this
    machine, named on its command line; any other node on the host of that name."""
    if E.fake_nodes() and _FAKE.fullmatch(node):
        return Spawn("localhost", node, node)
    return Spawn(node, node, None)


def daemon_argv(argv: list[str], spawn: Spawn) -> list[str]:
    """The new daemon's arguments: this daemon's own (`argv`, after `-m crossover`),
    with its node's name where it must be given."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--node":
            skip = True
        elif not arg.startswith("--node="):
            args.append(arg)
    return ["-m", "crossover", *args, *(["--node", spawn.node_arg] if spawn.node_arg else [])]


class Reformation:
    """One re-formation on this member: a thread through the collective calls.

    Args:
        comm: the world now.
        members: the ranks of `comm` in the new world, ascending (this one among them).
        root: the rank of `comm` that spawns (the leader).
        spawns: the daemons to start.
        tag: this re-formation's number, the same on every member.
        name: this daemon's node name.
        argv: this daemon's arguments after `-m crossover` (the new daemons get them).
        done: called on the thread with (new world, every member's node name by new
            rank), or with an exception.
    """

    def __init__(self, comm: Any, members: list[int], root: int, spawns: list[Spawn],
                 tag: int, name: str, argv: list[str],
                 done: Callable[[Any, list[str] | None, BaseException | None], None]) -> None:
        self.comm, self.members, self.root, self.spawns = comm, members, root, spawns
        self.tag, self.name, self.argv, self.done = tag, name, argv, done
        self.thread = threading.Thread(target=self._run, name=f"crossover-reform-{tag}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        from mpi4py import MPI

        try:
            group = self.comm.Get_group().Incl(self.members)
            alive = self.comm.Create_group(group, tag=self.tag)
            group.Free()
            root = self.members.index(self.root)
            if self.spawns:
                infos = []
                for spawn in self.spawns:
                    info = MPI.Info.Create()
                    info.Set("host", spawn.host)
                    infos.append(info)
                inter = alive.Spawn_multiple(
                    [sys.executable] * len(self.spawns),
                    [daemon_argv(self.argv, s) for s in self.spawns],
                    [1] * len(self.spawns), infos, root=root)
                world = inter.Merge(high=False)
                for info in infos:
                    info.Free()
            else:
                world = alive
            world.Set_errhandler(MPI.ERRORS_RETURN)
            names = world.allgather(self.name)
        except BaseException as exc:  # noqa: BLE001 - handed to the serve loop
            self.done(None, None, exc)
            return
        self.done(world, names, None)


def joining_world() -> Any | None:
    """The world a spawned daemon joins (its side of `Merge`), or None if this process
    was not spawned by a world's re-formation."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    world = parent.Merge(high=True)
    world.Set_errhandler(MPI.ERRORS_RETURN)
    return world
