"""The daemon's parts alone: the leader's decisions and the slot table's order keeper,
with an injected clock and a recording channel (pure logic: no process, no socket)."""

from __future__ import annotations

import pytest

from crossover.daemon.table import FENCE_S, TableSync
from crossover.daemon.world import Leader
from crossover.scheduler.phase import PhaseAligner
from tests.test_scheduler import FakeClock, build


class Channel:
    """Records what the leader sends; daemon ranks 0 and 1."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.sent: list[tuple[int, tuple]] = []

    def send(self, dest: int, obj: tuple) -> None:
        self.sent.append((dest, obj))

    def broadcast(self, obj: tuple) -> None:
        for dest in range(self.size):
            self.send(dest, obj)


def leader(idle_shutdown_s=None, aligner=None) -> tuple[Leader, Channel, FakeClock]:
    clock, peers = FakeClock(), Channel()
    return Leader(peers, None, aligner, idle_shutdown_s, clock), peers, clock


def test_the_leader_orders_jobs_once_and_answers_a_second_node():
    lead, peers, _ = leader()
    for source, job in [(0, "A"), (1, "A"), (1, "B")]:
        assert lead.handle(source, ("join", job))
    assert peers.sent == [(0, ("order", "A", 0)), (1, ("order", "A", 0)),
                          (1, ("order", "A", 0)),  # the second node, answered alone
                          (0, ("order", "B", 1)), (1, ("order", "B", 1))]


def test_the_leader_forgets_a_job_when_its_last_node_leaves():
    lead, peers, _ = leader()
    lead.handle(0, ("join", "A"))
    lead.handle(1, ("join", "A"))
    peers.sent.clear()
    lead.handle(0, ("leave", "A"))
    assert peers.sent == []  # node 1 still has a rank of it
    lead.handle(1, ("leave", "A"))
    assert peers.sent == [(0, ("forget", "A")), (1, ("forget", "A"))]
    lead.handle(1, ("leave", "A"))  # a leave of a forgotten job: nothing
    assert len(peers.sent) == 2


def test_the_leader_shuts_the_daemons_down_once_after_idling():
    lead, peers, clock = leader(idle_shutdown_s=5.0)
    lead.check_idle(busy_here=False)
    clock.now = 4.0
    lead.check_idle(busy_here=True)  # a rank here: the idle time starts again
    clock.now = 8.0
    lead.check_idle(busy_here=False)
    clock.now = 12.0
    lead.check_idle(busy_here=False)
    assert peers.sent == []
    lead.handle(1, ("join", "A"))  # a job elsewhere keeps every daemon up
    clock.now = 30.0
    lead.check_idle(busy_here=False)
    assert ("shutdown",) not in [o for _, o in peers.sent]
    lead.handle(1, ("leave", "A"))
    peers.sent.clear()
    lead.check_idle(busy_here=False)
    clock.now = 36.0
    lead.check_idle(busy_here=False)
    lead.check_idle(busy_here=False)
    assert peers.sent == [(0, ("shutdown",)), (1, ("shutdown",))]


def test_the_leader_passes_on_what_is_not_its_own():
    lead, _, _ = leader()
    for msg in [("order", "A", 0), ("mode", "concurrent", "", {}), ("status?", 1)]:
        assert not lead.handle(1, msg)


def test_without_an_aligner_waits_send_nothing():
    lead, peers, clock = leader(aligner=None)
    lead.handle(0, ("join", "A"))
    lead.handle(1, ("join", "A"))
    peers.sent.clear()
    assert lead.handle(0, ("waited", "A", 0.5))
    assert peers.sent == []
    lead, peers, clock = leader(aligner=PhaseAligner(FakeClock(), 0.015, 0.25))
    assert lead.handle(0, ("waited", "A", 0.5))  # one node only: nothing to align


class Plane:
    """A slot table whose mutexes a test holds (`busy`), for the order keeper's logic."""

    def __init__(self, devices: list[str]) -> None:
        self.busy: set[str] = set()
        self.fenced: list[str] = []
        self._devices = devices
        self.drained: list[str] = []

    def has(self, device: str) -> bool:
        return device in self._devices and device not in self.fenced

    def devices(self) -> list[str]:
        return [d for d in self._devices if d not in self.fenced]

    def drain(self, sched, device, invalidate):
        if device in self.busy:
            return None
        self.drained.append(device)
        return [], 0

    def fence(self, sched, device: str) -> list:
        self.fenced.append(device)
        return []

    def publish(self, sched, device, seq) -> bool:
        return True


def sync(devices: list[str] | None) -> tuple[TableSync, list, FakeClock]:
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d1"]})
    done: list = []
    table = TableSync(sched, deliver=done.extend, pids_on=lambda device: [7])
    table.plane = Plane(devices) if devices is not None else None
    return table, done, clock


def test_without_a_table_a_change_runs_at_once():
    table, _, _ = sync(None)
    ran = []
    table.change("d0", lambda: ran.append(1))
    table.change(None, lambda: ran.append(2))
    assert ran == [1, 2] and not table.waiting and table.settle()
    table.rang("d0")
    table.publish_plans()
    assert table.replan == set()


def test_a_busy_mutex_defers_the_changes_in_their_order_then_fences():
    table, _, clock = sync(["d0", "d1"])
    ran = []
    table.plane.busy.add("d0")
    table.change("d1", lambda: ran.append("d1 first"))  # d1 is free: at once
    table.change("d0", lambda: ran.append("d0"))
    table.change("d1", lambda: ran.append("d1 after"))  # behind d0's: order is kept
    assert ran == ["d1 first"] and table.waiting
    table.run_backlog()
    assert ran == ["d1 first"]
    clock.now = FENCE_S - 0.1
    table.run_backlog()
    assert ran == ["d1 first"] and table.plane.fenced == []
    clock.now = FENCE_S + 0.1
    table.run_backlog()  # fenced: its ranks use their sockets, the changes go on
    assert table.plane.fenced == ["d0"]
    assert ran == ["d1 first", "d0", "d1 after"] and not table.waiting and not table.stuck


def test_a_busy_mutex_with_no_change_queued_is_fenced_too():
    """Leases expire through `settle` alone, with nothing queued: a mutex stuck there
    must not hold every lease of the node for ever."""
    table, _, clock = sync(["d0", "d1"])
    table.plane.busy.add("d1")
    assert not table.settle() and table.stuck
    clock.now = FENCE_S / 2
    table.plane.busy.discard("d1")
    table.plane.busy.add("d0")  # d1 came free: only d0 counts from now
    assert not table.settle()
    clock.now = FENCE_S + 0.1
    assert not table.settle()  # d0 busy for FENCE_S / 2 + 0.1 only
    clock.now = FENCE_S * 1.5 + 0.1
    assert table.settle() and table.plane.fenced == ["d0"] and not table.stuck


def test_a_mutex_freed_in_time_runs_the_changes_without_a_fence():
    table, _, clock = sync(["d0"])
    ran = []
    table.plane.busy.add("d0")
    table.change(None, lambda: ran.append("all"))  # every device: waits for d0
    clock.now = 1.0
    table.run_backlog()
    table.plane.busy.clear()
    table.run_backlog()
    assert ran == ["all"] and table.plane.fenced == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("x")])
def test_a_change_that_raises_stays_out_of_the_serve_loop(error):
    table, _, _ = sync(None)

    def bad() -> None:
        raise error

    table.change("d0", bad)  # logged, not raised
