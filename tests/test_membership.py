"""The daemons' membership rules (`crossover.daemon.membership`), pure, on a fake clock:
beats, a lost member, a leader's succession, epochs, a member's return."""

from __future__ import annotations

import pytest

from crossover.daemon.membership import Membership


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def world(rank: int, size: int = 4) -> tuple[Membership, Clock]:
    clock = Clock()
    return Membership(rank, size, clock, beat_s=1.0, dead_after_s=4.0), clock


def test_beats_go_to_the_leader_and_from_it_to_every_member():
    leader, _ = world(0)
    member, _ = world(2)
    assert leader.tick().beat_to == [1, 2, 3]
    assert member.tick().beat_to == [0]
    assert member.tick().beat_to == []  # not due again before beat_s


@pytest.mark.parametrize(("silent", "after", "lost"), [
    ({3}, 4.0, []),          # at dead_after_s exactly: not yet
    ({3}, 4.5, [3]),
    ({1, 3}, 4.5, [1, 3]),
    (set(), 10.0, []),       # everyone beat
])
def test_the_leader_loses_members_silent_past_the_limit(silent, after, lost):
    leader, clock = world(0)
    t = 0.0
    while t < after:
        t = min(after, t + 0.5)
        clock.t = t
        for r in {1, 2, 3} - silent:
            leader.heard(r)
        found = leader.tick().lost
        if found:
            break
    assert found == lost
    assert leader.alive == {0, 1, 2, 3} - set(lost) and leader.lost == lost


def test_a_lost_leader_is_succeeded_by_the_lowest_live_member():
    table = []
    for rank in (1, 2, 3):
        m, clock = world(rank)
        clock.t = 4.5
        changes = m.tick()
        table.append((rank, m.leader, m.epoch, changes.took_over))
    assert table == [(1, 1, 1, True), (2, 1, 0, False), (3, 1, 0, False)]


def test_a_successor_that_is_silent_too_is_passed_over():
    m, clock = world(3)
    clock.t = 4.5
    m.tick()
    assert m.leader == 1 and not m.leads
    clock.t = 8.0
    assert not m.tick().took_over  # the successor's allowance runs from 4.5
    clock.t = 9.0
    m.tick()
    assert m.leader == 2
    clock.t = 13.5
    changes = m.tick()
    assert changes.took_over and m.leads and m.epoch == 1 and m.alive == {3}


def test_members_follow_the_successor_and_answer_with_what_they_hold():
    m, clock = world(2)
    clock.t = 4.5
    m.tick()
    changes = m.lead(1, 1)
    assert changes.follow == 1 and m.leader == 1 and m.epoch == 1
    # a stale claim changes nothing
    assert m.lead(0, 0).follow is None and m.leader == 1


def test_a_member_that_never_noticed_the_loss_follows_a_newer_leader():
    m, _ = world(3)
    assert m.leader == 0
    assert m.lead(1, 1).follow == 1 and m.leader == 1


def test_a_resumed_old_leader_steps_down_on_hearing_a_newer_epoch():
    old, clock = world(0)
    clock.t = 100.0  # it was stopped; everyone looks silent
    assert old.tick().lost == [1, 2, 3] and old.leads
    old.heard(2)  # the first message after it resumed
    changes = old.newer(1, 1)  # its answer: daemon 2 follows daemon 1 at epoch 1
    assert changes.stepped_down and changes.follow == 1 and not old.leads


def test_a_claim_of_the_same_epoch_naming_a_lost_leader_is_ignored():
    m, clock = world(3)
    clock.t = 4.5
    m.tick()  # daemon 0 lost, 1 is next
    assert m.newer(0, 0).follow is None and m.leader == 1
    assert m.newer(5, 0).follow == 0  # a later epoch: it came back and succeeded since


def test_a_lost_member_heard_again_is_back():
    leader, clock = world(0)
    clock.t = 5.0
    for r in (1, 2):
        leader.heard(r)
    assert leader.tick().lost == [3]
    assert leader.heard(3).back == [3] and 3 in leader.alive
    assert leader.heard(3).back == []


def test_the_member_list_comes_from_the_leader_only():
    m, _ = world(2)
    assert not m.members(1, [0, 2])
    assert m.members(0, [0, 2]) and m.alive == {0, 2} and m.lost == [1, 3]


def test_next_deadline_is_the_next_beat_or_silence():
    leader, clock = world(0)
    leader.tick()
    assert leader.next_deadline() == 1.0
    member, _ = world(1)
    member.tick()
    assert member.next_deadline() == 1.0
    clock.t = 3.9
    assert leader.next_deadline() == 1.0


def test_bad_timings_are_named():
    with pytest.raises(ValueError, match="beat_s=5.*dead_after_s=4"):
        Membership(0, 2, Clock(), beat_s=5, dead_after_s=4)


def test_status_names_the_generation_the_lost_and_detached_nodes_and_each_groups_jobs():
    from crossover.__main__ import status_table

    world = {"size": 4, "leader": 1, "leader_node": "n1", "epoch": 1, "members": 3,
             "lost": ["n0"], "generation": 2, "relay": True}
    nodes = {"n1": {"devices": {}, "world": world, "mode_decision": {
                 "0": {"mode": "antiphase", "state": "hold", "jobs": ["A", "B"]},
                 "2": {"mode": "concurrent", "state": "probe", "jobs": ["C"]}}},
             "n2": {"devices": {}, "world": world},
             "n3": {"devices": {}, "world": {**world, "relay": False}}}
    table = status_table(nodes).splitlines()
    assert "group 0: A, B: antiphase (hold)" in table
    assert "group 2: C: concurrent (probe)" in table
    assert table[-1] == ("world: 3 of 4 nodes answer (generation 2, leader n1); lost: n0 "
                         "(their ranks run uncoordinated until a daemon is back there); no "
                         "relay: n3 (serving their ranks on until the next generation)")
    nodes["n1"]["world"] = {**world, "forming": 3}  # the leader brings n0 back
    assert status_table(nodes).endswith("; forming generation 3")


