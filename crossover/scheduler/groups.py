"""Groups of jobs that share nodes: what one mode decision covers.

Two jobs with ranks on one node share that node's devices (its scheduler serves them
in one mode), so they are in one group; a group is a connected component of jobs
linked by the nodes they share. What happens in one group (a job arriving or leaving,
a probe, a switch) concerns only that group's nodes: the leader keeps one mode decision
per group and tells only its nodes. A node holds the jobs of one group at a time, so a
node's one mode is always its group's.

A group keeps its number while it lives; groups that a newcomer joins together take the
number of the largest (its decision carries on; the others' end). A job's departure may
split its group: the part with the most jobs keeps the number, the others get new ones.

Pure: no I/O; the leader calls it and acts on what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Regroup:
    """What a change did to the groups.

    Attributes:
        group: the group of the job that joined (None on a leave).
        ended: groups merged into `group` (or emptied by a leave): their decisions end.
        split: groups made by a leave, each with its jobs: they start deciding afresh.
    """

    group: int | None = None
    ended: list[int] = field(default_factory=list)
    split: dict[int, set[str]] = field(default_factory=dict)


class Groups:
    """The jobs, the nodes they are on, and their groups."""

    def __init__(self) -> None:
        self._nodes: dict[str, set[int]] = {}  # job -> the nodes with its ranks
        self._jobs_on: dict[int, set[str]] = {}  # node -> its jobs
        self._group: dict[str, int] = {}  # job -> group number
        self._members: dict[int, set[str]] = {}  # group number -> its jobs
        self._next = 0

    def group_of(self, job: str) -> int | None:
        return self._group.get(job)

    def jobs(self, group: int) -> set[str]:
        return set(self._members.get(group, ()))

    def nodes(self, group: int) -> set[int]:
        """The nodes of a group's jobs."""
        return set().union(*(self._nodes[j] for j in self.jobs(group)))

    def groups(self) -> set[int]:
        return set(self._members)

    def _put(self, job: str, group: int) -> None:
        old = self._group.get(job)
        if old is not None and old != group:
            self._members[old].discard(job)
            if not self._members[old]:
                del self._members[old]
        self._group[job] = group
        self._members.setdefault(group, set()).add(job)

    def join(self, job: str, node: int) -> Regroup:
        """A rank of `job` arrived on `node`: the job joins the group of the jobs there
        (merging theirs if it links several)."""
        self._nodes.setdefault(job, set()).add(node)
        self._jobs_on.setdefault(node, set()).add(job)
        linked = {self._group[j] for j in self._jobs_on[node] if j in self._group}
        if job in self._group:
            linked.add(self._group[job])
        if not linked:
            self._put(job, self._next)
            self._next += 1
            return Regroup(self._group[job])
        keep = max(sorted(linked), key=lambda g: len(self._members[g]))
        for g in sorted(linked - {keep}):
            for j in list(self._members[g]):
                self._put(j, keep)
        self._put(job, keep)
        return Regroup(keep, ended=sorted(linked - {keep}))

    def leave(self, job: str, node: int) -> Regroup:
        """`job` has no rank left on `node`; once on no node, it leaves its group, which
        may fall apart."""
        nodes = self._nodes.get(job)
        if nodes is None:
            return Regroup()
        nodes.discard(node)
        on = self._jobs_on.get(node, set())
        on.discard(job)
        if not on:
            self._jobs_on.pop(node, None)
        if nodes:
            return Regroup()  # still on other nodes: the group stays as it is
        del self._nodes[job]
        group = self._group.pop(job)
        self._members[group].discard(job)
        rest = self.jobs(group)
        if not rest:
            del self._members[group]
            return Regroup(ended=[group])
        parts = self._components(rest)
        if len(parts) == 1:
            return Regroup()
        parts.sort(key=lambda p: (-len(p), sorted(p)))
        out = Regroup()
        for part in parts[1:]:
            number = self._next
            self._next += 1
            for j in part:
                self._put(j, number)
            out.split[number] = part
        return out

    def renumber(self, nodes_now: dict[int, int]) -> None:
        """Node `n` is `nodes_now[n]` from now on (one not in it is gone)."""
        self._nodes = {j: {nodes_now[n] for n in ns if n in nodes_now}
                       for j, ns in self._nodes.items()}
        self._jobs_on = {nodes_now[n]: js for n, js in self._jobs_on.items()
                         if n in nodes_now}

    def _components(self, jobs: set[str]) -> list[set[str]]:
        """`jobs` split into the sets linked by shared nodes."""
        left, parts = set(jobs), []
        while left:
            todo, part = [left.pop()], set()
            while todo:
                job = todo.pop()
                part.add(job)
                for node in self._nodes[job]:
                    for other in self._jobs_on.get(node, ()):
                        if other in left:
                            left.discard(other)
                            todo.append(other)
            parts.append(part)
        return parts
