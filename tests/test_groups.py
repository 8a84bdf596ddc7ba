"""Groups of jobs linked by shared nodes (`crossover.scheduler.groups`), as tables:
a sequence of events, then each job's group and each group's nodes."""

from __future__ import annotations

import pytest

from crossover.scheduler.groups import Groups, Regroup


def run(events: list[tuple[str, str, int]]) -> tuple[Groups, list[Regroup]]:
    g = Groups()
    out = [g.join(job, node) if what == "join" else g.leave(job, node)
           for what, job, node in events]
    return g, out


def shape(g: Groups) -> list[tuple[list[str], list[int]]]:
    """Each group's jobs and nodes, sorted."""
    return sorted((sorted(g.jobs(n)), sorted(g.nodes(n))) for n in g.groups())


@pytest.mark.parametrize(("events", "groups"), [
    # two jobs on disjoint nodes: two groups
    ([("join", "A", 0), ("join", "A", 1), ("join", "B", 2), ("join", "B", 3)],
     [(["A"], [0, 1]), (["B"], [2, 3])]),
    # a shared node links them
    ([("join", "A", 0), ("join", "A", 1), ("join", "B", 1), ("join", "B", 2)],
     [(["A", "B"], [0, 1, 2])]),
    # a third job links two groups
    ([("join", "A", 0), ("join", "B", 2), ("join", "C", 0), ("join", "C", 2)],
     [(["A", "B", "C"], [0, 2])]),
    # the linking job leaves: the group falls apart
    ([("join", "A", 0), ("join", "B", 2), ("join", "C", 0), ("join", "C", 2),
      ("leave", "C", 0), ("leave", "C", 2)],
     [(["A"], [0]), (["B"], [2])]),
    # a job leaving one node of two stays in its group
    ([("join", "A", 0), ("join", "A", 1), ("join", "B", 1), ("leave", "A", 1)],
     [(["A", "B"], [0, 1])]),
    # leaving a node it was never on, or a job never seen: nothing
    ([("join", "A", 0), ("leave", "A", 5), ("leave", "Z", 0)], [(["A"], [0])]),
    # the last job leaves: no group
    ([("join", "A", 0), ("leave", "A", 0)], []),
])
def test_groups_after_events(events, groups):
    g, _ = run(events)
    assert shape(g) == groups


def test_a_merge_keeps_the_larger_groups_number_and_ends_the_others():
    g, out = run([("join", "A", 0), ("join", "B", 0), ("join", "C", 5),
                  ("join", "D", 0), ("join", "D", 5)])
    assert [r.group for r in out] == [0, 0, 1, 0, 0]
    assert out[-1].ended == [1] and out[3].ended == []
    assert g.group_of("C") == 0


def test_a_split_keeps_the_larger_part_and_numbers_the_others_afresh():
    g, out = run([("join", "A", 0), ("join", "B", 0), ("join", "C", 1),
                  ("join", "L", 0), ("join", "L", 1), ("leave", "L", 0), ("leave", "L", 1)])
    last = out[-1]
    assert last.group is None and last.ended == []
    assert last.split == {2: {"C"}}
    assert g.group_of("A") == g.group_of("B") == 0 and g.group_of("C") == 2


def test_the_last_job_of_a_group_ends_it():
    _, out = run([("join", "A", 3), ("leave", "A", 3)])
    assert out[-1].ended == [0]
