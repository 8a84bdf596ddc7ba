"""The daemons' membership rules (`crossover.daemon.world.membership`), pure, on a fake clock:
beats, a lost member, a leader's succession, epochs, a member's return."""

from __future__ import annotations

import pytest

from crossover.daemon.world.membership import Changes, Membership


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def world(rank: int, size: int = 4) -> tuple[Membership, Clock]:
    clock = Clock()
    return Membership(rank, size, clock, beat_s=1.0, dead_after_s=4.0), clock


def run_until(m: Membership, clock: Clock, until: float, hear: tuple[int, ...] = ()
              ) -> Changes:
    """The daemon runs to `until`, ticking every 0.5 s as the serve loop does, and
    hears from `hear` before each tick; what the ticks found, merged."""
    found = Changes()
    while clock.t < until:
        clock.t = min(until, clock.t + 0.5)
        for r in hear:
            m.heard(r)
        changes = m.tick()
        found.lost += changes.lost
        found.took_over |= changes.took_over
        found.stalled_s = max(found.stalled_s, changes.stalled_s)
    return found


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
        # n0 lost after 4 s; n1 asks the others and, with no objection, leads after
        # ask_s
        changes = run_until(m, clock, 6.5, hear=(1, 2, 3))
        table.append((rank, m.leader, m.epoch, changes.took_over))
    assert table == [(1, 1, 1, True), (2, 1, 0, False), (3, 1, 0, False)]


def test_a_successor_that_is_silent_too_is_passed_over():
    m, clock = world(3)
    run_until(m, clock, 4.5)
    assert m.leader == 1 and not m.leads
    assert not run_until(m, clock, 8.5).took_over  # the successor's allowance runs from 4.5
    run_until(m, clock, 9.0)
    assert m.leader == 2
    changes = run_until(m, clock, 13.5)
    assert changes.took_over and m.leads and m.epoch == 1 and m.alive == {3}


def test_members_follow_the_successor_and_answer_with_what_they_hold():
    m, clock = world(2)
    run_until(m, clock, 4.5)
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
    run_until(old, clock, 1.0, hear=(1, 2, 3))
    clock.t = 100.0  # it was stopped: the silence it slept through costs no member
    changes = old.tick()
    assert changes.stalled_s == 99.0 and changes.lost == [] and old.leads
    old.heard(2)  # the first message after it resumed
    changes = old.newer(1, 1)  # its answer: daemon 2 follows daemon 1 at epoch 1
    assert changes.stepped_down and changes.follow == 1 and not old.leads


def test_a_claim_of_the_same_epoch_naming_a_lost_leader_is_ignored():
    m, clock = world(3)
    run_until(m, clock, 4.5)  # daemon 0 lost, 1 is next
    assert m.newer(0, 0).follow is None and m.leader == 1
    assert m.newer(5, 0).follow == 0  # a later epoch: it came back and succeeded since


def test_a_lost_member_heard_again_is_back():
    leader, clock = world(0)
    assert run_until(leader, clock, 5.0, hear=(1, 2)).lost == [3]
    assert leader.heard(3).back == [3] and 3 in leader.alive
    assert leader.heard(3).back == []


@pytest.mark.parametrize(("stall", "lost"), [
    (2.0, [3]),   # a gap of dead_after_s / 2 is no stall: 3's silence counts from 0
    (3.0, []),    # just past it: the gap is not counted (3 silent for 2.5 s)
    (6.0, []),
])
def test_silence_the_daemon_slept_through_is_not_counted(stall, lost):
    leader, clock = world(0)
    run_until(leader, clock, 2.5, hear=(1, 2))
    clock.t += stall
    changes = leader.tick()
    assert changes.lost == lost and changes.stalled_s == (stall if stall > 2.0 else 0.0)


def test_silence_before_and_after_a_stall_counts():
    leader, clock = world(0)
    run_until(leader, clock, 3.0, hear=(1, 2))  # 3 silent from 0
    clock.t = 6.0
    assert leader.tick().lost == []  # 3 s of silence, not 6
    assert run_until(leader, clock, 7.0, hear=(1, 2)).lost == []
    assert run_until(leader, clock, 7.5, hear=(1, 2)).lost == [3]
    member, clock = world(2)
    clock.t = 30.0
    assert member.tick().stalled_s == 30.0
    assert not run_until(member, clock, 34.0).took_over and member.leader == 0
    run_until(member, clock, 34.5)
    assert member.leader == 1


@pytest.mark.parametrize(("rank", "pass_s", "found_at"), [
    (0, 3.0, 9.0),   # the leader: member 3 dead from 0, 1 and 2 heard every pass
    (2, 2.6, 7.8),   # a member: its leader dead from 0, passed over
])
def test_a_loop_that_stays_slow_still_finds_the_dead(rank, pass_s, found_at):
    """Every pass past dead_after_s / 2 looks like a stall; each silence is shortened
    once only, so the dead are found one pass later than without the rule."""
    m, clock = world(rank)
    while clock.t < 60:
        clock.t = round(clock.t + pass_s, 6)
        for r in {1, 2} - {rank}:
            m.heard(r)
        changes = m.tick()
        if changes.lost or m.leader != 0:
            break
    assert clock.t == found_at and (changes.lost == [3] if rank == 0 else m.leader == 1)


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


