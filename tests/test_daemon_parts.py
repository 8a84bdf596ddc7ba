"""The daemon's parts alone: the leader's decisions and the slot table's order keeper,
with an injected clock and a recording channel (pure logic: no process, no socket)."""

from __future__ import annotations

import pytest

from crossover.daemon.node.table import FENCE_S, TableSync
from crossover.daemon.world.leader import Leader
from crossover.scheduler.phase import PhaseAligner
from tests.test_scheduler import FakeClock, build


class Channel:
    """Records what the leader sends; daemon ranks 0 to size - 1."""

    rank = 0

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.sent: list[tuple[int, tuple]] = []

    def send(self, dest: int, obj: tuple) -> None:
        self.sent.append((dest, obj))

    def broadcast(self, obj: tuple, lost_too: bool = False) -> None:
        for dest in range(self.size):
            self.send(dest, obj)


def leader(idle_shutdown_s=None, aligner=None) -> tuple[Leader, Channel, FakeClock]:
    clock, peers = FakeClock(), Channel()
    return Leader(peers, None, aligner, idle_shutdown_s, clock), peers, clock


def test_a_join_waits_for_no_answer_the_job_carries_its_order():
    """Every rank carries its job's place (start, name): the leader hands none out, so a
    node whose leader is slow, cut off or two at once still orders jobs alike."""
    lead, peers, _ = leader()
    for source, job in [(0, "A"), (1, "A"), (1, "B")]:
        assert lead.handle(source, ("join", job))
    lead.handle(1, ("leave", "A"))
    lead.handle(1, ("hold", ["A", "B"]))
    assert peers.sent == []


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
    for msg in [("mode", "concurrent", "", {}), ("status?", 1), ("delay", 0.1, 0.2)]:
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


def deciding_leader(nodes: int) -> tuple[Leader, Channel, FakeClock]:
    from crossover.scheduler import ModeController

    clock, peers = FakeClock(), Channel(nodes)
    return Leader(peers, lambda: ModeController(clock, probe_s=1.0), None, None,
                  clock), peers, clock


def join_and_step(lead: Leader, job: str, nodes: list[int], steps: int = 0) -> None:
    for node in nodes:
        lead.handle(node, ("join", job))
    lead.handle(nodes[0], ("progress", job, steps, False, 0))


def test_a_job_arriving_in_one_group_sends_nothing_to_another_groups_nodes():
    """Jobs A, B on nodes 0-1 (one group, probing), C, D on nodes 2-3: C and D's
    arrival and probe go to nodes 2 and 3 only; A and B's group goes on undisturbed."""
    lead, peers, clock = deciding_leader(4)
    join_and_step(lead, "A", [0, 1])
    join_and_step(lead, "B", [0, 1])
    before = lead.snapshot()["0"]
    assert before["state"] == "probe" and before["jobs"] == ["A", "B"]
    peers.sent.clear()
    join_and_step(lead, "C", [2, 3])
    join_and_step(lead, "D", [2, 3])
    assert {dest for dest, _ in peers.sent} == {2, 3}
    assert [o[0] for _, o in peers.sent].count("mode") == 2  # D's probe, to 2 and 3
    after = lead.snapshot()
    assert after["0"] == before and after["1"]["jobs"] == ["C", "D"]
    sent = len(peers.sent)
    for step in range(1, 40):  # A and B's probe runs to a decision, told to 0 and 1 only
        clock.now += 0.2
        for job in ("A", "B"):
            lead.handle(0, ("progress", job, step, False, 0))
    modes = [(dest, o[1]) for dest, o in peers.sent[sent:] if o[0] == "mode"]
    assert modes and {dest for dest, _ in modes} == {0, 1}


def test_a_job_that_links_two_groups_merges_them_and_its_departure_splits_them():
    lead, peers, _ = deciding_leader(4)
    join_and_step(lead, "A", [0])
    join_and_step(lead, "B", [2])
    assert sorted(lead.snapshot()) == ["0", "1"]
    join_and_step(lead, "L", [0, 2])
    assert sorted(lead.snapshot()) == ["0"]
    assert lead.snapshot()["0"]["jobs"] == ["A", "B", "L"]
    lead.handle(0, ("leave", "L"))
    lead.handle(2, ("leave", "L"))
    assert {g: s["jobs"] for g, s in lead.snapshot().items()} == {"0": ["A"], "2": ["B"]}


def test_a_node_new_to_a_decided_group_is_told_its_mode():
    lead, peers, clock = deciding_leader(3)
    join_and_step(lead, "A", [0])
    join_and_step(lead, "B", [0])  # a probe starts: antiphase first (no profiles yet)
    peers.sent.clear()
    lead.handle(2, ("join", "A"))
    assert (2, ("mode", "antiphase", lead.snapshot()["0"]["reason"], {"A": 0, "B": 0})) \
        in peers.sent


def test_a_members_holdings_are_answered_with_its_groups_mode():
    """A mode switch sent while a node changed generation is lost; the holdings it sends
    the leader afterwards are answered with its groups' modes (a node already in that
    mode changes nothing). A node holding no job of a decided group is told nothing."""
    lead, peers, _ = deciding_leader(3)
    join_and_step(lead, "A", [0, 1])
    join_and_step(lead, "B", [0, 1])
    reason = lead.snapshot()["0"]["reason"]
    peers.sent.clear()
    lead.handle(1, ("hold", ["A", "B"]))
    lead.handle(2, ("hold", []))
    assert peers.sent == [(1, ("mode", "antiphase", reason, {"A": 0, "B": 0}))]
