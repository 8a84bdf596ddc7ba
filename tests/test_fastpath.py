"""The native fast path: the C++ unit test under ctest, the scheduler's plans as tables,
and a differential property: random events through the slot table grant exactly what
the pure scheduler grants for the same sequence."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossover import _native, slot_table
from crossover.client.fastpath import RING_FRAME, RankPath
from crossover.daemon.node.table import TablePlane
from crossover.protocol import Mode, Phase
from crossover.scheduler import SlotScheduler, make_policy
from crossover.scheduler.preview import PlanCache, preview
from tests.test_scheduler import FakeClock, build

REPO = Path(__file__).resolve().parents[1]
M = Phase.COMMUNICATE


def test_the_cpp_unit_test_passes_under_ctest(tmp_path):
    build_dir = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build_dir), "-DCROSSOVER_PYTHON=OFF"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "table_test"],
                   check=True, capture_output=True, timeout=240)
    done = subprocess.run(["ctest", "--output-on-failure"], cwd=build_dir,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "100% tests passed" in done.stdout


def test_the_module_is_built_by_the_install():
    # `make test` builds it (setup.py -> CMake); the socket path covers its absence, but
    # here it must be present, or the rest of this file would test nothing.
    assert slot_table.UNAVAILABLE == ""
    assert _native.MAX_SLOTS == 63  # the 64th bit of a plan's mask asks for the daemon


# --- the scheduler's plans, as tables --------------------------------------------------
def _key(s: str) -> tuple[str, int]:
    job, rank = s.split(":")
    return job, int(rank)


def _plan(sched, device="d0"):
    p = preview(sched, device)
    fmt = lambda d: {f"{j}:{r}": sorted(f"{a}:{b}" for a, b in v) for (j, r), v in d.items()}  # noqa: E731
    return fmt(p.on_request), fmt(p.on_release), p.concurrent


PLANS = [
    # (name, policy, jobs, events before, on_request, on_release, concurrent)
    ("a free device grants whoever asks first in line", "crossover",
     {"A": ["d0"], "B": ["d0"]}, [],
     {"A:0": ["A:0"], "B:0": []}, {}, False),
    ("the holder's release hands the device to the waiting job", "crossover",
     {"A": ["d0"], "B": ["d0"]}, [("req", "A", 0), ("req", "B", 0)],
     {"B:0": []}, {"A:0": ["B:0"]}, False),
    ("nobody waits: a release grants nothing, the next request takes it", "crossover",
     {"A": ["d0"], "B": ["d0"]}, [("req", "A", 0), ("rel", "A", 0, M)],
     {"A:0": [], "B:0": ["B:0"]}, {}, False),
    ("one rank of a gang releasing keeps the turn with its peer", "crossover",
     {"A": ["d0", "d0"], "B": ["d0"]}, [("req", "A", 0), ("req", "A", 1), ("req", "B", 0)],
     {"B:0": []}, {"A:0": [], "A:1": []}, False),
    ("the last of a gang releasing hands over", "crossover",
     {"A": ["d0", "d0"], "B": ["d0"]},
     [("req", "A", 0), ("req", "A", 1), ("req", "B", 0), ("rel", "A", 0, M)],
     {"A:0": [], "B:0": []}, {"A:1": ["B:0"]}, False),
    ("concurrent grants every request at once", "off",
     {"A": ["d0"], "B": ["d0"]}, [("req", "A", 0)],
     {"B:0": ["B:0"]}, {"A:0": []}, True),
    ("round-robin keeps the device through communication", "round-robin",
     {"A": ["d0"], "B": ["d0"]}, [("req", "A", 0), ("req", "B", 0)],
     {"B:0": []}, {"A:0": []}, False),
]


@pytest.mark.parametrize("name,policy,jobs,before,on_request,on_release,concurrent", PLANS,
                         ids=[p[0] for p in PLANS])
def test_plan(name, policy, jobs, before, on_request, on_release, concurrent):
    sched, clock = build(policy, jobs)
    for op, job, rank, *rest in before:
        sched.request(job, rank) if op == "req" else sched.release(job, rank, rest[0])
    state = sched.snapshot()
    assert _plan(sched) == (on_request, on_release, concurrent)
    assert sched.snapshot() == state  # a preview changes nothing


# --- the differential property --------------------------------------------------------
class Harness:
    """The daemon's side (a real `TablePlane` on a real table) and the ranks' side (calls
    on the table), driven in one process, beside a reference scheduler that sees every
    event in the same order."""

    def __init__(self, tmp: Path, policy: str, jobs: dict[str, list[str]]):
        self.clock = FakeClock()
        make = lambda: SlotScheduler(make_policy(policy), self.clock, 5.0, 1.0)  # noqa: E731
        self.ref, self.sched = make(), make()
        self.plane = TablePlane(tmp / "node.slots")
        self.table = _native.Table.attach(str(tmp / "node.slots"))
        self.jobs = jobs
        self.gen: dict[tuple[str, int], int] = {}  # waiting or holding ranks' request
        self.rang = False  # an event rang the daemon since it last caught up
        self.state: dict[tuple[str, int], str] = {}
        for order, (job, devices) in enumerate(jobs.items()):
            for rank, dev in enumerate(devices):
                self.join((job, rank), dev, order)
        self.catch_up()

    def join(self, key, device, order):
        self.daemon_change()
        for s in (self.ref, self.sched):
            s.register(*key, device, order)
        self.plane.reserve(key, device)
        self.plane.attach(key, True)
        self.state[key] = "idle"

    def daemon_change(self):
        for dev in self.plane.devices():
            self.deliver(self.plane.drain(self.sched, dev, invalidate=True)[0])

    def deliver(self, grants):
        for g in grants:
            assert self.plane.grant((g.job, g.rank))

    def catch_up(self):
        """As the daemon's loop: apply the events, realign a job's turns that a rank
        back from a pause moved on one device (a change of every device; the reference
        realigns at the same point of the sequence), publish the plans."""
        self.rang = False
        for dev in self.plane.devices():
            self.deliver(self.plane.drain(self.sched, dev, invalidate=False)[0])
        if self.sched.misaligned():
            self.daemon_change()
            self.deliver(self.sched.realign())
            self.ref.realign()
        self.sched.forget_moves()
        self.ref.forget_moves()
        for dev in self.plane.devices():
            grants, seq = self.plane.drain(self.sched, dev, invalidate=False)
            self.deliver(grants)
            assert self.plane.publish(self.sched, dev, seq)

    def slot(self, key):
        return self.plane._slot[key]

    def dev(self, key):
        return self.plane._devices[self.sched.device_of(*key)]

    def request(self, key):
        flags, gen = self.table.request(self.dev(key), self.slot(key), self.clock.now, 1.0)
        assert flags >= 0
        self.rang |= bool(flags & _native.RING_DAEMON)
        self.gen[key], self.state[key] = gen, "waiting"
        return self.ref.request(*key)

    def release(self, key, phase):
        plannable = phase == slot_table.PLANNED_PHASE
        flags = self.table.release(self.dev(key), self.slot(key),
                                   slot_table.PHASES.index(phase), plannable, self.clock.now,
                                   1.0)
        assert flags >= 0
        self.rang |= bool(flags & _native.RING_DAEMON)
        if not self.ref.policy.keeps_device(phase):  # else the holder holds on
            self.state[key] = "idle"
        return self.ref.release(*key, phase)

    def table_holders(self):
        out = set()
        for key, state in self.state.items():
            if state == "waiting" and self.table.granted(self.slot(key), self.gen[key]):
                self.state[key] = "holding"
            if self.state[key] == "holding":
                out.add(key)
        return out

    def ref_holders(self):
        return {k for dev in {self.ref.device_of(*k) for k in self.state}
                for k in self.ref.holders(dev)}


ACTIONS = st.lists(st.tuples(st.sampled_from(["act", "act", "act", "daemon", "tick", "mode"]),
                             st.integers(0, 5), st.sampled_from([M, M, Phase.IDLE,
                                                                 Phase.COMPUTE])),
                   min_size=1, max_size=60)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["crossover", "auto", "priority", "round-robin", "off"]),
       layout=st.sampled_from([{"A": ["d0"], "B": ["d0"]},
                               {"A": ["d0", "d1"], "B": ["d0", "d1"], "C": ["d1"]},
                               {"A": ["d0", "d0"], "B": ["d0"]}]),
       actions=ACTIONS)
def test_the_table_grants_what_the_scheduler_grants(tmp_path_factory, policy, layout, actions):
    h = Harness(tmp_path_factory.mktemp("t"), policy, layout)
    keys = sorted(h.state)
    for what, pick, phase in actions:
        if what == "daemon":
            h.catch_up()
        elif what == "tick":  # time passes: leases and patience run out
            # As the daemon does: it has long answered any ring before seconds pass;
            # then it looks at its (maybe stale) scheduler's deadlines, and only when one
            # is due does it drain the table and expire.
            if h.rang:
                h.catch_up()
            h.clock.now += 0.7 * (pick + 1)
            h.ref.expire()
            due = h.sched.next_deadline()
            if due is not None and due <= h.clock.now:
                h.daemon_change()
                revoked, grants = h.sched.expire()
                h.deliver(grants)
                for job, rank, _ in revoked:  # the holder is not told: it computes on
                    h.state[(job, rank)] = "revoked"
        elif what == "mode" and h.ref.policy.exclusive:
            mode = Mode.CONCURRENT if h.ref.mode == Mode.ANTIPHASE else Mode.ANTIPHASE
            h.daemon_change()
            h.ref.set_mode(mode)
            h.deliver(h.sched.set_mode(mode))
        else:
            key = keys[pick % len(keys)]
            before = h.table_holders()
            if h.state[key] == "idle":
                h.request(key)
            elif h.state[key] in ("holding", "revoked"):
                h.release(key, phase)
            # No rank runs that the scheduler has not granted at this point in the
            # sequence (the daemon may not have caught up: fewer may run).
            now = h.table_holders()
            assert now - before <= h.ref_holders(), (what, key)
    h.catch_up()
    assert h.plane.mismatches == 0
    assert h.table_holders() == h.ref_holders()
    assert h.sched.snapshot()["devices"].keys() == h.ref.snapshot()["devices"].keys()
    for dev in h.ref.snapshot()["devices"]:
        assert h.sched.holders(dev) == h.ref.holders(dev)
        assert h.sched.waiting(dev) == h.ref.waiting(dev)


def test_a_release_that_hands_over_to_a_rank_asking_by_socket_wakes_the_daemon(tmp_path):
    """A rank whose request came over its socket (one after points passed holding, or
    one the table refused) waits for the daemon's Grant message there, so the table
    event that hands it the device must wake the daemon (regression: the plan granted
    it through the table, which it does not watch, and it waited for a lease to end)."""
    h = Harness(tmp_path, "crossover", {"A": ["d0"], "B": ["d0"]})
    h.request(("A", 0))
    h.catch_up()
    assert h.table_holders() == {("A", 0)}
    h.daemon_change()  # as the daemon does for an Acquire on the socket
    h.plane.asked_by_socket(("B", 0))
    assert h.sched.request("B", 0, 1) == []  # A holds: B waits
    h.catch_up()
    h.rang = False
    h.release(("A", 0), M)
    assert h.rang, "the handover to a socket asker did not wake the daemon"
    grants, _ = h.plane.drain(h.sched, "d0", invalidate=False)
    assert [(g.job, g.rank) for g in grants] == [("B", 0)]  # delivered over the socket


def test_chain():
    sched, _ = build("crossover", {"A": ["d0"], "B": ["d0"], "C": ["d1"]})
    def fmt(chain):  # "wake": the daemon must see this event at once (patience)
        return [(f"{j}:{r}", kind.value, [f"{a}:{b}" for a, b in granted])
                + (("wake",) if wake else ()) for (j, r), kind, granted, wake in chain]

    sched.request("C", 0)  # alone on d1: it gets its device back every time
    assert fmt(preview(sched, "d1", depth=4).chain) == [
        ("C:0", "release", []), ("C:0", "request", ["C:0"]),
        ("C:0", "release", []), ("C:0", "request", ["C:0"])]
    sched.request("A", 0)
    # B has not asked yet: after A's release A's request waits for B, free device and
    # all, until B asks or patience passes B over: only the daemon's clock decides, so
    # that step wakes it
    assert fmt(preview(sched, "d0").chain) == [("A:0", "release", []),
                                              ("A:0", "request", [], "wake")]
    sched.request("B", 0)
    assert fmt(preview(sched, "d0", depth=6).chain) == [
        ("A:0", "release", ["B:0"]), ("A:0", "request", []),
        ("B:0", "release", ["A:0"]), ("B:0", "request", []),
        ("A:0", "release", ["B:0"]), ("A:0", "request", [])]
    sched.set_mode(Mode.CONCURRENT)
    assert preview(sched, "d0").chain == ()


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["crossover", "auto", "priority", "round-robin", "off"]),
       ops=st.lists(st.tuples(st.sampled_from(["req", "rel", "idle", "tick", "mode"]),
                              st.integers(0, 3)), max_size=40))
def test_a_cached_plan_is_the_plan(policy, ops):
    # States that differ only by a shift of every turn share a plan: the cache must give
    # exactly what planning afresh gives, state after state.
    sched, clock = build(policy, {"A": ["d0", "d0"], "B": ["d0"], "C": ["d0"]})
    cache = PlanCache(size=8)
    keys = sorted(k for k in [("A", 0), ("A", 1), ("B", 0), ("C", 0)])
    for op, pick in ops:
        key = keys[pick]
        if op == "req":
            sched.request(*key)
        elif op in ("rel", "idle"):
            sched.release(*key, M if op == "rel" else Phase.IDLE)
        elif op == "tick":
            clock.now += 0.6
            sched.expire()
        elif sched.policy.exclusive:
            sched.set_mode(Mode.CONCURRENT if sched.mode == Mode.ANTIPHASE else Mode.ANTIPHASE)
        assert cache.preview(sched, "d0") == preview(sched, "d0")


def test_handoffs_on_the_chain_need_no_daemon(tmp_path):
    """The antiphase cycle of two jobs on one device: after one plan, every handoff of
    the chain happens through the table with the daemon never running; then the daemon
    catches up, finds what its scheduler would have granted, and plans the next chain."""
    h = Harness(tmp_path, "crossover", {"A": ["d0"], "B": ["d0"]})
    a, b = ("A", 0), ("B", 0)
    h.request(a)
    h.request(b)
    h.catch_up()
    for _ in range(3):
        for _round in range(_native.CHAIN // 4):  # two handoffs each
            h.release(a, M)
            assert h.table_holders() == {b}
            h.request(a)
            h.release(b, M)
            assert h.table_holders() == {a}
            h.request(b)
        h.catch_up()
    assert h.plane.fast_grants()["d0"] == 1 + 3 * _native.CHAIN // 2
    assert h.plane.mismatches == 0
    assert h.sched.holders("d0") == h.ref.holders("d0") == {a}


def test_a_request_drained_before_the_ranks_attached_message_is_granted_in_the_table(
        tmp_path):
    # Another rank's arrival drains the device while this rank's Attached is still unread
    # behind its first request: its grant went over the socket, where nobody listened,
    # and the rank waited 65 s (seen in the handoff benchmark).
    sched, _ = build("crossover", {"A": ["d0"]})
    plane = TablePlane(tmp_path / "node.slots")
    slot, dev = plane.reserve(("A", 0), "d0")
    table = _native.Table.attach(str(plane.path))
    flags, gen = table.request(dev, slot, 0.0, 1.0)
    grants, _ = plane.drain(sched, "d0", invalidate=True)
    assert grants == []  # none for the socket
    assert table.granted(slot, gen)


def test_an_event_that_leaves_a_waiter_on_a_free_device_wakes_the_daemon(tmp_path):
    # Found by the differential test once it modelled the daemon's clock (likely also the
    # chaos soak's 9.5 s wait): after two mode switches A holds d1 and B waits; A's
    # release leaves d1 free but waiting for A itself (first in line again), which only
    # the daemon's patience ends. That release followed the chain and did not ring, so B
    # waited until A's stale lease woke the daemon instead of for patience.
    h = Harness(tmp_path, "crossover", {"A": ["d0", "d1"], "B": ["d0", "d1"], "C": ["d1"]})
    a, b = ("A", 1), ("B", 1)
    h.request(a)
    for mode in (Mode.CONCURRENT, Mode.ANTIPHASE):
        h.daemon_change()
        h.ref.set_mode(mode)
        h.deliver(h.sched.set_mode(mode))
    h.request(b)
    h.catch_up()
    assert h.release(a, M) == []  # B is not granted: the device waits for A
    assert h.rang


def test_a_rank_path_rings_the_daemon_once_per_round(tmp_path):
    plane = TablePlane(tmp_path / "node.slots")
    slot, dev = plane.reserve(("A", 0), "d0")
    ours, theirs = socket.socketpair()
    path = RankPath(str(plane.path), dev, slot, ours)
    assert not path.acquire(0.05, lambda: True)  # no plan, no daemon: the wait ends
    assert path.release(M)
    theirs.setblocking(False)
    assert theirs.recv(100) == RING_FRAME  # one doorbell for both events
    with pytest.raises(BlockingIOError):
        theirs.recv(100)


def test_an_install_without_the_module_says_why(tmp_path):
    # Hide the module: the client must go on over the socket path, said once.
    code = ("import sys; sys.modules['crossover._native'] = None\n"
            "from crossover import slot_table; print(repr(slot_table.UNAVAILABLE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert "crossover._native is not importable" in out


def test_a_dormant_jobs_request_wakes_the_daemon():
    # The daemon has told the jobs beside a dormant one that they are alone (they keep
    # the device through communication); its request must reach the daemon at once so
    # that they are told to hand the device over again.
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d0"]})
    cache = PlanCache()
    sched.request("A", 0)
    sched.release("B", 0, Phase.IDLE)
    fresh = preview(sched, "d0")
    assert fresh.on_request[("B", 0)] == ()  # A holds
    assert (("B", 0), "request") not in fresh.wakes
    assert cache.preview(sched, "d0") == fresh
    clock.now += sched.patience_s
    dormant = preview(sched, "d0")
    assert (("B", 0), "request") in dormant.wakes
    assert cache.preview(sched, "d0") == dormant  # the cache tells the two states apart
