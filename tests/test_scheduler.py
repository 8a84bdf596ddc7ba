"""The slot state machine, tested with tables of events -> expected grants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossover.protocol import Phase
from crossover.scheduler import SchedulerError, SlotGrant, SlotScheduler, make_policy

M, IDLE = Phase.COMMUNICATE, Phase.IDLE


class FakeClock:
    """Injected time for a pure unit test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(policy: str, jobs: dict[str, list[str]], weights=None, lease_s=10.0, patience_s=1.0):
    """A scheduler with `jobs` = {name: [device of rank 0, device of rank 1, ...]}."""
    clock = FakeClock()
    sched = SlotScheduler(make_policy(policy), clock, lease_s=lease_s, patience_s=patience_s)
    for order, (job, devices) in enumerate(jobs.items()):
        for rank, dev in enumerate(devices):
            sched.register(job, rank, dev, order, (weights or {}).get(job, 1.0))
    return sched, clock


def run(sched, clock, events):
    """Apply events; return the grants each produced, as 'job:rank' strings."""
    out = []
    for ev in events:
        op, job, rank, *rest = ev
        if op == "req":
            grants = sched.request(job, rank)
        elif op == "rel":
            grants = sched.release(job, rank, rest[0])
        elif op == "bye":
            grants = sched.unregister(job, rank)
        elif op == "tick":
            clock.now += rest[0]
            grants = sched.expire()[1]
        else:
            raise AssertionError(op)
        out.append(sorted(f"{g.job}:{g.rank}" for g in grants))
    return out


TWO_JOBS = {"A": ["d0", "d1"], "B": ["d0", "d1"]}
THREE_ON_ONE = {"A": ["d0"], "B": ["d0"], "C": ["d0"]}
COMPUTE = Phase.COMPUTE

TABLE = [
    # (name, policy, jobs, events, expected grants per event)
    ("the first job in the global order is granted", "crossover", TWO_JOBS,
     [("req", "A", 0)], [["A:0"]]),
    ("a later job waits for the first job's turn", "crossover", TWO_JOBS,
     [("req", "B", 0), ("req", "A", 0), ("rel", "A", 0, M)], [[], ["A:0"], ["B:0"]]),
    ("busy device queues", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0)], [["A:0"], []]),
    ("communicate hands over", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("rel", "A", 0, M)], [["A:0"], [], ["B:0"]]),
    ("the device waits for the job whose turn it is", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("rel", "A", 0, M), ("rel", "B", 0, M),
      ("req", "B", 0), ("req", "A", 0)],
     [["A:0"], [], ["B:0"], [], [], ["A:0"]]),
    ("patience passes over a rank that keeps the device waiting", "crossover", TWO_JOBS,
     [("req", "A", 0), ("rel", "A", 0, M), ("req", "B", 0), ("rel", "B", 0, M),
      ("req", "B", 0), ("tick", "-", 0, 0.5), ("tick", "-", 0, 0.5)],
     [["A:0"], [], ["B:0"], [], [], [], ["B:0"]]),
    ("a passed-over rank rejoins at the present turn", "crossover", TWO_JOBS,
     [("req", "A", 0), ("rel", "A", 0, M), ("req", "B", 0), ("rel", "B", 0, M),
      ("req", "B", 0), ("tick", "-", 0, 1.0), ("req", "A", 0), ("rel", "B", 0, M)],
     [["A:0"], [], ["B:0"], [], [], ["B:0"], [], ["A:0"]]),
    ("an idle job does not hold the others up", "crossover", TWO_JOBS,
     [("req", "A", 0), ("rel", "A", 0, IDLE), ("req", "B", 0), ("rel", "B", 0, M),
      ("req", "B", 0)],
     [["A:0"], [], ["B:0"], [], ["B:0"]]),
    ("crossover keeps the device at a step boundary", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("rel", "A", 0, COMPUTE), ("req", "A", 0)],
     [["A:0"], [], [], ["A:0"]]),
    ("round-robin keeps through communicate, hands over at the step", "round-robin",
     TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("rel", "A", 0, M), ("req", "A", 0),
      ("rel", "A", 0, COMPUTE)],
     [["A:0"], [], [], ["A:0"], ["B:0"]]),
    ("re-request while holding is idempotent", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "A", 0)], [["A:0"], ["A:0"]]),
    ("the global order wraps around", "crossover", THREE_ON_ONE,
     [("req", "A", 0), ("req", "B", 0), ("req", "C", 0), ("rel", "A", 0, M),
      ("req", "A", 0), ("rel", "B", 0, M), ("rel", "C", 0, M)],
     [["A:0"], [], [], ["B:0"], [], ["C:0"], ["A:0"]]),
    ("gang: peers on one device hold together", "crossover",
     {"A": ["d0", "d0"], "B": ["d0"]},
     [("req", "A", 0), ("req", "B", 0), ("req", "A", 1), ("rel", "A", 0, M), ("rel", "A", 1, M)],
     [["A:0"], [], ["A:1"], [], ["B:0"]]),
    ("gang: a served rank may not rejoin while others wait", "crossover",
     {"A": ["d0", "d0"], "B": ["d0"]},
     [("req", "A", 0), ("req", "A", 1), ("req", "B", 0), ("rel", "A", 0, M), ("req", "A", 0),
      ("rel", "A", 1, M)],
     [["A:0"], ["A:1"], [], [], [], ["B:0"]]),
    ("gang: the whole waiting gang is granted at once", "crossover",
     {"A": ["d0"], "B": ["d0", "d0"]},
     [("req", "A", 0), ("req", "B", 0), ("req", "B", 1), ("rel", "A", 0, M)],
     [["A:0"], [], [], ["B:0", "B:1"]]),
    ("crash frees the slot", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("bye", "A", 0)], [["A:0"], [], ["B:0"]]),
    ("lease expiry frees the slot", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("tick", "-", 0, 5.0), ("tick", "-", 0, 5.0)],
     [["A:0"], [], [], ["B:0"]]),
    ("release after expiry is ignored", "crossover", TWO_JOBS,
     [("req", "A", 0), ("req", "B", 0), ("tick", "-", 0, 10.0), ("rel", "A", 0, M)],
     [["A:0"], [], ["B:0"], []]),
    ("off grants everything", "off", TWO_JOBS,
     [("req", "B", 0), ("req", "A", 0)], [["B:0"], ["A:0"]]),
]


@pytest.mark.parametrize("name,policy,jobs,events,expected", TABLE, ids=[t[0] for t in TABLE])
def test_table(name, policy, jobs, events, expected):
    sched, clock = build(policy, jobs)
    assert run(sched, clock, events) == expected


@pytest.mark.parametrize("waiter, held_until", [
    (True, 18.0),    # past max_hold_s (12) with B waiting: the lease renewed at 9 runs out
    (False, None),   # nobody waits: renewed for as long as A asks
])
def test_renewals_keep_a_device_no_longer_than_max_hold_while_another_job_waits(
        waiter, held_until):
    clock = FakeClock()
    sched = SlotScheduler(make_policy("crossover"), clock, lease_s=9.0, max_hold_s=12.0)
    sched.register("A", 0, "d0", (0, "A"))
    sched.register("B", 0, "d0", (1, "B"))
    sched.request("A", 0)
    if waiter:
        sched.request("B", 0)
    revoked_at = None
    for _ in range(10):  # A renews every 3 s and never releases
        clock.now += 3.0
        revoked, grants = sched.expire()
        if revoked:
            revoked_at = clock.now
            assert revoked == [("A", 0, "d0")] and [g.job for g in grants] == ["B"]
            break
        sched.renew("A", 0)
    assert revoked_at == held_until


@pytest.mark.parametrize("policy,share_a", [("priority", 0.5), ("crossover", 1 / 3)])
def test_priority_weight_shares_device_time(policy, share_a):
    # Three jobs always ready; A has weight 2. Under priority (weighted fair queuing)
    # A gets 2 of every 4 turns; under crossover the weight is ignored.
    sched, clock = build(policy, {"A": ["d0"], "B": ["d0"], "C": ["d0"]}, weights={"A": 2.0})
    turns = {"A": 0, "B": 0, "C": 0}
    holder = (sched.request("A", 0) + sched.request("B", 0) + sched.request("C", 0))[0].job
    for _ in range(300):
        turns[holder] += 1
        clock.now += 1.0
        done = holder
        handed = sched.release(done, 0, M)
        again = sched.request(done, 0)  # wants it again right after
        holder = (handed or again)[0].job
    assert turns["A"] / sum(turns.values()) == pytest.approx(share_a, abs=0.01)
    assert turns["B"] == pytest.approx(turns["C"], abs=1)


def test_a_newcomer_starts_at_the_present_turn():
    sched, _ = build("crossover", {"A": ["d0"]})
    for _ in range(5):  # A alone for five turns
        assert sched.request("A", 0) == [SlotGrant("A", 0, "d0")]
        sched.release("A", 0, M)
    sched.request("A", 0)
    sched.register("B", 0, "d0", order=1)
    sched.request("B", 0)
    # B does not get five turns of backlog: it alternates with A from now on.
    seq = []
    holder = "A"
    for _ in range(6):
        grants = sched.release(holder, 0, M) + sched.request(holder, 0)
        holder = next(g.job for g in grants if g.job != holder) if any(
            g.job != holder for g in grants) else holder
        seq.append(holder)
    assert seq == ["B", "A", "B", "A", "B", "A"]


def test_errors_name_the_problem():
    sched, _ = build("crossover", {"A": ["d0"]})
    with pytest.raises(SchedulerError, match="rank 0 is registered already"):
        sched.register("A", 0, "d0", 0)
    with pytest.raises(SchedulerError, match="'Z' rank 0 is not registered"):
        sched.request("Z", 0)
    with pytest.raises(SchedulerError, match="weight must be > 0"):
        sched.register("B", 0, "d0", 1, weight=0)
    with pytest.raises(SchedulerError, match="differ from its other ranks"):
        sched.register("A", 1, "d1", 5)
    with pytest.raises(ValueError, match="choose one of auto, crossover, round-robin"):
        make_policy("fifo")


def test_snapshot_reports_holders_queues_and_usage():
    sched, clock = build("crossover", TWO_JOBS)
    sched.request("A", 0)
    sched.request("B", 0)
    clock.now = 2.5
    snap = sched.snapshot()
    assert snap["devices"]["d0"]["holder"] == "A"
    assert snap["devices"]["d0"]["waiting"] == ["B:0"]
    assert snap["devices"]["d0"]["held_s"] == {"A": 2.5}
    assert list(snap["jobs"]) == ["A", "B"]


# --- properties ---------------------------------------------------------------------
JOBS3 = {"A": ["d0", "d1"], "B": ["d0", "d1"], "C": ["d0", "d0"]}
event = st.tuples(
    st.sampled_from(["req", "rel", "bye", "tick"]),
    st.sampled_from(list(JOBS3)),
    st.integers(0, 1),
    st.sampled_from([M, IDLE, Phase.COMPUTE]),
    st.floats(0.1, 4.0),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["crossover", "round-robin", "priority"]), st.lists(event, max_size=80))
def test_never_two_jobs_hold_one_device(policy, events):
    sched, clock = build(policy, JOBS3)
    gone = set()
    for op, job, rank, phase, dt in events:
        if (job, rank) in gone:
            continue
        if op == "req":
            sched.request(job, rank)
        elif op == "rel":
            sched.release(job, rank, phase)
        elif op == "bye":
            sched.unregister(job, rank)
            gone.add((job, rank))
        else:
            clock.now += dt
            sched.expire()
        for dev in ("d0", "d1"):
            assert len({j for j, _ in sched.holders(dev)}) <= 1


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["crossover", "round-robin"]), st.permutations(["A", "B", "C"]))
def test_every_request_granted_within_one_turn_per_other_job(policy, order_of_turns):
    """Jobs hold d0 for one step each; a waiting job is served before any job runs twice.

    Every job keeps asking; after each turn the holder releases and asks again. Whatever
    order the requests came in, a job waits through at most one turn of every other job.
    """
    jobs = {"A": ["d0"], "B": ["d0"], "C": ["d0"]}
    sched, clock = build(policy, jobs)
    waited = {j: 0 for j in jobs}
    holder = None
    for job in order_of_turns:  # request arrival order varies
        for g in sched.request(job, 0):
            holder = g.job
    for _ in range(30):
        for j in jobs:
            if j != holder:
                waited[j] += 1
                assert waited[j] <= len(jobs) - 1, f"{j} starved under {policy}"
        waited[holder] = 0
        clock.now += 1.0
        grants = sched.release(holder, 0, IDLE)
        sched.request(holder, 0)
        holder = grants[0].job if grants else holder


def test_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s and patience_s must be > 0"):
        SlotScheduler(make_policy("crossover"), FakeClock(), lease_s=0)


def test_grant_is_for_a_rank_on_its_device():
    sched, _ = build("crossover", TWO_JOBS)
    assert sched.request("A", 1) == [SlotGrant("A", 1, "d1")]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["crossover", "round-robin", "priority"]),
       st.lists(st.integers(0, 3), min_size=50, max_size=300))
def test_all_devices_grant_in_one_sequence(policy, schedule):
    """Two jobs, one rank each on d0 and d1, in the real step life cycle: request, hold,
    release to communicate, and a job's allreduce completes only when both its ranks
    released. Whatever order the four ranks act in, both devices grant the same job
    sequence, and the system never deadlocks."""
    sched, _ = build(policy, TWO_JOBS)
    ranks = [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    state = {r: "ready" for r in ranks}  # ready -> waiting -> holding -> comm -> ready
    released = {("A", t): set() for t in range(400)} | {("B", t): set() for t in range(400)}
    turn = dict.fromkeys(ranks, 0)
    sequence = {"d0": [], "d1": []}

    def granted(grants):
        for g in grants:
            state[(g.job, g.rank)] = "holding"
            sequence[f"d{g.rank}"].append(g.job)

    for pick in schedule:
        enabled = [r for r in ranks if state[r] in ("ready", "holding")
                   or (state[r] == "comm" and len(released[(r[0], turn[r] - 1)]) == 2)]
        assert enabled, f"deadlock: {state}"
        r = enabled[pick % len(enabled)]
        if state[r] in ("ready", "comm"):
            state[r] = "waiting"
            granted(sched.request(*r))
        else:
            phase = Phase.COMPUTE if policy == "round-robin" else M
            state[r] = "comm"
            released[(r[0], turn[r])].add(r[1])
            turn[r] += 1
            granted(sched.release(*r, phase))
            if policy == "round-robin":  # keeps through communicate: offer at step end
                granted(sched.release(*r, M))
    n = min(len(sequence["d0"]), len(sequence["d1"]))
    assert sequence["d0"][:n] == sequence["d1"][:n]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["crossover", "priority"]),
       st.lists(st.integers(0, 4), min_size=60, max_size=300),
       st.integers(0, 40), st.integers(0, 40))
def test_a_job_whose_ranks_register_at_different_times_keeps_one_sequence(
        policy, schedule, join_0, join_1):
    """Job B's two ranks register late, each at its own point, while job A runs on both
    devices in the step life cycle (its ranks at different points of its sequence).
    Both devices still grant the same job sequence: a late rank starts at its job's
    offset, not at its device's present turn, which differs from its peer's (regression:
    crossed devices stalled two jobs on one host)."""
    sched, _ = build(policy, {"A": ["d0", "d1"]})
    ranks = [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    joined = {("A", 0), ("A", 1)}
    joins = {join_0: ("B", 0), join_1 + 1: ("B", 1)} if join_0 != join_1 + 1 else {
        join_0: ("B", 0), join_1 + 2: ("B", 1)}
    state = dict.fromkeys(ranks, "ready")
    released = {(j, t): set() for j in "AB" for t in range(400)}
    turn = dict.fromkeys(ranks, 0)
    sequence = {"d0": [], "d1": []}

    def granted(grants):
        for g in grants:
            state[(g.job, g.rank)] = "holding"
            sequence[f"d{g.rank}"].append(g.job)

    # The drawn schedule, then a fixed cycle of picks until each device has granted B
    # enough times for the comparison below to mean something (a short draw once left
    # it nothing to compare).
    picks = itertools.chain(schedule, itertools.cycle(range(5)))
    for i, pick in enumerate(picks):
        if i >= len(schedule) and min(sequence["d0"].count("B"),
                                      sequence["d1"].count("B")) >= 12:
            break
        assert i < len(schedule) + 5000, f"B was not served: {sequence}"
        if i in joins:
            job, rank = joins[i]
            sched.register(job, rank, f"d{rank}", order=1)
            joined.add((job, rank))
        enabled = [r for r in sorted(joined) if state[r] in ("ready", "holding")
                   or (state[r] == "comm" and len(released[(r[0], turn[r] - 1)]) == 2)]
        if not enabled:
            # only A waiting for B's late rank in an allreduce may hold everyone up
            assert len(joined) < len(ranks), f"deadlock with every rank joined: {state}"
            continue
        r = enabled[pick % len(enabled)]
        if state[r] in ("ready", "comm"):
            state[r] = "waiting"
            granted(sched.request(*r))
        else:
            state[r] = "comm"
            released[(r[0], turn[r])].add(r[1])
            turn[r] += 1
            granted(sched.release(*r, M))
    # Where B's i-th grant falls among A's grants, per device. A late rank has missed
    # turns (its device served A alone meanwhile) and catches up first; from then on
    # both devices interleave the jobs alike.
    def a_before_b(seq):
        out, a = [], 0
        for job in seq:
            a += job == "A"
            if job == "B":
                out.append(a)
        return out
    b0, b1 = a_before_b(sequence["d0"]), a_before_b(sequence["d1"])
    n = min(len(b0), len(b1))
    assert n >= 12 and b0[n - 4:n] == b1[n - 4:n], (sequence, b0, b1)


def test_a_rank_back_from_a_pause_moves_its_jobs_turns_on_every_device_at_realign():
    sched, clock = build("crossover", TWO_JOBS)
    for rank in (0, 1):
        sched.request("A", rank)
        sched.request("B", rank)
        sched.release("A", rank, M)  # A communicates; B computes
        sched.release("B", rank, M)
    assert sched.request("B", 0) == []  # d0 waits for A's rank 0, whose turn it is
    clock.now += 1.5
    assert sched.expire()[1] == [SlotGrant("B", 0, "d0")]  # A0 passed over on d0 only
    sched.release("B", 0, M)
    assert sched.request("B", 0) == [SlotGrant("B", 0, "d0")]  # again: A0 is away
    sched.request("A", 0)  # back, at d0's present turn: A's turns moved on d0 alone
    assert sched.misaligned()
    sched.realign()
    assert not sched.misaligned()
    assert len(set(sched._offsets("A"))) == 1 and len(set(sched._offsets("B"))) == 1
    # ...and A's rank 1 lines up behind B on d1 as A's rank 0 does on d0.
    sched.release("B", 0, M)
    assert sched.request("B", 1) == [SlotGrant("B", 1, "d1")]


def test_a_job_idle_for_patience_is_dormant_and_no_company_until_it_asks():
    sched, clock = build("crossover", {"A": ["d0", "d0"], "B": ["d0"]}, patience_s=1.0)
    sched.request("B", 0)
    assert sched.company("d0") == {"A", "B"}  # registered, not yet idle: company
    sched.release("A", 0, IDLE)
    clock.now += 5.0
    assert not sched.dormant("A", "d0")  # its rank 1 never went idle
    sched.release("A", 1, IDLE)  # B, waiting behind A's ranks, is granted (lease to 15)
    assert sched.holders("d0") == {("B", 0)}
    assert sched.next_deadline() == 6.0  # when A turns dormant
    clock.now += 0.5
    assert sched.company("d0") == {"A", "B"}  # a short idle spell: still company
    clock.now += 0.5
    assert sched.dormant("A", "d0") and sched.company("d0") == {"B"}
    assert sched.next_deadline() == 15.0  # dormancy has come: only B's lease is left
    assert sched.request("A", 0) == []  # B holds; A waits and is company again
    assert sched.company("d0") == {"A", "B"} and not sched.dormant("A", "d0")


def test_misaligned_is_a_query_and_forget_moves_the_change():
    """Asking changes nothing; the offsets a paused rank moved are dropped by
    `forget_moves` only when no realign is due."""
    sched, clock = build("crossover", {"A": ["d0", "d1"], "B": ["d0", "d1"]},
                         patience_s=1.0)
    for job in ("A", "B"):
        for rank in (0, 1):
            sched.request(job, rank)
    sched.release("A", 0, M)
    sched.release("A", 1, M)
    sched.release("A", 0, Phase.IDLE)
    clock.now += 1.5
    sched.expire()
    sched.request("A", 0)  # back from a pause on d0 alone
    moved = dict(sched._moved)
    assert [sched.misaligned() for _ in range(3)] == [bool(moved)] * 3
    assert sched._moved == moved  # three questions changed nothing
    sched.forget_moves()
    assert sched._moved == (moved if sched.misaligned() else {})
    sched.realign()
    assert not sched.misaligned()
    sched.forget_moves()
    assert sched._moved == {}
