"""A member's and the leader's bookkeeping across generations, on a stand-in for the
relay's link (pure logic: what is sent is recorded, nothing is delivered)."""

from __future__ import annotations

from crossover.daemon.world import generation
from crossover.daemon.world import member as member_mod
from crossover.daemon.world.leader import Leader
from crossover.daemon.world.member import Member


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def run(self, m: Member, until: float) -> None:
        """`m`'s serve loop runs to `until`, ticking every 0.5 s (a gap over half the
        silence limit would be a stall, which the peers' silence leaves out)."""
        while self.t < until:
            self.t = min(until, self.t + 0.5)
            m.tick()


class Link:
    """The service's side of a relay (`Uplink`'s interface), recording what is sent."""

    relayed, attached, relay_pid, key = True, True, None, (0, "n0")
    refused = stale = 0

    def __init__(self) -> None:
        self.rank, self.size, self.leader, self.lost = 0, 1, 0, set()
        self.sent: list[tuple[int, tuple]] = []

    def send(self, dest: int, obj: tuple) -> None:
        self.sent.append((dest, obj))

    def send_leader(self, obj: tuple) -> None:
        self.send(self.leader, obj)

    def broadcast(self, obj: tuple, lost_too: bool = False) -> None:
        for dest in range(self.size):
            if lost_too or dest not in self.lost:
                self.send(dest, obj)


class RecordedGeneration:
    """A `Generation` that starts no mpirun: it records what it was asked to form."""

    def __init__(self, nodes, epoch, leader, *_) -> None:
        self.nodes, self.epoch, self.leader = nodes, epoch, leader
        self.started_at, self.timeout_s, self.failed, self.killed = 0.0, 1e9, False, False

    def kill(self) -> None:
        self.killed = True


def recorded_generations(monkeypatch, kind: type = RecordedGeneration) -> list:
    """The generations the members form from now on, recorded as `kind` (none
    started)."""
    started: list = []

    def record(*args):
        started.append(kind(*args))
        return started[-1]
    monkeypatch.setattr(member_mod, "Generation", record)
    return started


def member(name: str, clock: Clock, link: Link) -> Member:
    return Member(link, name, clock, lambda peers: Leader(peers, None, None, None, clock),
                  holdings=lambda: [], argv=[])


def test_a_successor_brings_back_the_nodes_its_leader_had_yet_to():
    """n3 was lost and left out of the generation before its node came back; the leader
    said so in its member list. The leader is lost too: the successor (n1) brings back
    the leader's node and n3, which it never knew as a member."""
    clock, link = Clock(), Link()
    link.rank, link.size = 1, 3
    m = member("n1", clock, link)
    m.attached(4, 1, ["n0", "n1", "n2"], 0)
    m.route(0, ("members", [0, 1, 2], ["n3"]))
    assert m.lost_nodes == ["n3"]
    clock.run(m, 8.0)  # the leader silent past 5 s: n1 is next in line, asks, leads
    assert m.leader is not None
    assert sorted(m._respawn) == ["n0", "n3"]
    # and it tells the members, so that its own successor would too
    members = [obj for _, obj in link.sent if obj[0] == "members"]
    assert members and members[-1][2] == ["n0", "n3"]


def test_a_service_started_again_tells_the_leader_what_it_holds():
    clock, link = Clock(), Link()
    link.rank, link.size, link.leader = 2, 3, 0
    m = member("n2", clock, link)
    m.attached(1, 2, ["n0", "n1", "n2"], 0)
    assert (0, ("hold", [])) in link.sent


def test_a_hold_replaces_what_the_leader_knew_of_that_node():
    """Job A has ranks on nodes 1 and 2, B on node 2 only. Node 2's service was started
    again and holds C only: A stays (node 1 has it), B is gone from node 2 and so from
    the world, C is taken in."""
    clock, link = Clock(), Link()
    link.size = 3
    leader = Leader(link, None, None, None, clock)
    for source, job in [(1, "A"), (2, "A"), (2, "B")]:
        leader.handle(source, ("join", job))
    leader.handle(2, ("hold", ["C"]))
    assert leader._members == {"A": {1}, "C": {2}}
    leader.handle(1, ("leave", "A"))
    assert leader._members == {"C": {2}}


def test_a_member_no_generation_takes_back_leads_and_forms_one(monkeypatch):
    """n1's relay is gone and so is its leader's whole node, before the leader formed a
    new generation: nothing would ever take n1 back. ORPHANED_S after its relay's loss
    n1 leads and forms a generation over every node it knows (before that, it waits)."""
    started = recorded_generations(monkeypatch)
    clock, link = Clock(), Link()
    link.rank, link.size, link.leader = 1, 2, 0
    m = member("n1", clock, link)
    m.attached(3, 1, ["n0", "n1"], 0)
    link.attached = False
    m.route(1, ("detached", 3))
    clock.t = member_mod.ORPHANED_S - 1.0
    m.tick()
    assert m.leader is None and started == []  # the leader may still form one
    clock.t = member_mod.ORPHANED_S + 0.5
    m.tick()
    assert m.leader is not None and m.world.leads
    assert [(g.nodes, g.epoch, g.leader) for g in started] == [(["n0", "n1"], 5, "n1")]


def test_a_member_that_leads_unbidden_brings_back_the_nodes_its_leader_lost(monkeypatch):
    """Found by the storm on three emulated hosts: n0 leads and has lost n2; n1's relay
    dies and no generation takes it back, so n1 leads on its own. It must bring n2 back
    as a successor would: left out, nothing ever took n2 into this world again."""
    recorded_generations(monkeypatch)
    clock, link = Clock(), Link()
    link.rank, link.size, link.leader = 1, 3, 0
    m = member("n1", clock, link)
    m.attached(3, 1, ["n0", "n1", "n2"], 0)
    m.route(0, ("members", [0, 1], ["n2"]))
    link.attached = False
    m.route(1, ("detached", 3))
    clock.t = member_mod.ORPHANED_S + 0.5
    m.tick()
    assert m.leader is not None
    assert sorted(m._respawn) == ["n2"]
    assert [obj for _, obj in link.sent if obj[0] == "members"][-1][2] == ["n2"]


def test_a_successor_that_steps_down_keeps_forming_its_newer_generation(monkeypatch):
    """n0's relay died (its service lives): n1 found n0 silent, succeeded it (epoch 2)
    and started generation 3 to bring n0 back. Then n0's own generation 2 reached n1:
    n1 follows n0, but generation 3 runs on (the newest generation wins at every
    service: had n0 killed its generation 2 for n1's 3, killing 3 too would leave the
    world without either), and once it forms, n1 leads it."""
    started = recorded_generations(monkeypatch)
    clock, link = Clock(), Link()
    link.rank, link.size, link.leader = 1, 3, 0
    m = member("n1", clock, link)
    m.attached(1, 1, ["n0", "n1", "n2"], 0)
    clock.run(m, 8.0)  # n0 silent past 5 s: n1 asks n2, and leads from epoch 2
    assert m.leader is not None and m.world.epoch == 2
    clock.run(m, 8.0 + member_mod.RESPAWN_S + 0.1)
    assert [(g.epoch, g.nodes, g.leader) for g in started] == [(3, ["n1", "n2", "n0"], "n1")]
    m.attached(2, 1, ["n0", "n1", "n2"], 0)  # n0's generation, formed meanwhile
    assert m.leader is None and not started[0].killed
    m.attached(3, 0, ["n1", "n2", "n0"], 0)  # and then its own
    assert m.leader is not None and m.world.leads and m._forming is None
    assert len(started) == 1 and not started[0].killed


class Unformed(RecordedGeneration):
    """A generation over a dead host: its mpirun never forms (it is killed after its
    timeout, as `Generation`'s is)."""

    def __init__(self, nodes, epoch, leader, argv, started_at, *_) -> None:
        super().__init__(nodes, epoch, leader)
        self.started_at = started_at
        self.timeout_s = generation.GENERATION_TIMEOUT_S + generation.PER_NODE_S * len(nodes)


def run_with(m: Member, clock: Clock, until: float, alive: list[int]) -> None:
    """`m`'s loop to `until`, the members `alive` beating every 0.5 s."""
    while clock.t < until:
        clock.t = min(until, clock.t + 0.5)
        for rank in alive:
            m.route(rank, ("beat", 1, 0))
        m.tick()


def test_a_host_that_stays_down_costs_at_most_12_tries_in_its_first_hour(monkeypatch):
    """n1's host died: no generation with it ever forms. Each that did not form counts
    as a try (before, it was refunded: a try every 20 s or so for ever), the tries back
    off to 15 minutes, and after RESPAWN_TRIES the node is down, as status says."""
    started = recorded_generations(monkeypatch, Unformed)
    clock, link = Clock(), Link()
    link.size = 2
    m = member("n0", clock, link)
    m.attached(1, 0, ["n0", "n1"], 0)
    assert m.leader is not None
    run_with(m, clock, 3600.0, alive=[])
    first_hour = [g for g in started if "n1" in g.nodes]
    assert 9 <= len(first_hour) <= 12, [g.started_at for g in first_hour]
    gaps = [b.started_at - a.started_at
            for a, b in zip(first_hour, first_hour[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= member_mod.RESPAWN_MAX_S
    assert m.snapshot()["down"] == []
    run_with(m, clock, 3 * 3600.0, alive=[])
    assert len([g for g in started if "n1" in g.nodes]) == member_mod.RESPAWN_TRIES
    assert m.snapshot()["down"] == ["n1"] and m._respawn == {}
    # a job that asks for the node gives it one more try
    m.route(0, ("grow", ["n1"]))
    run_with(m, clock, 3 * 3600.0 + 1.0, alive=[])
    assert "n1" in started[-1].nodes and m.down == set()


def test_a_generation_trying_a_dead_host_again_gives_way_to_one_for_another_node(
        monkeypatch):
    """n2's host died and its first try failed; while the leader tries it again, n1's
    relay dies too. Waiting out the doomed generation (20 s and more) would keep n1
    uncoordinated; it gives way at once, and a generation without n2 brings n1 back."""
    started = recorded_generations(monkeypatch, Unformed)
    clock, link = Clock(), Link()
    link.size = 3
    m = member("n0", clock, link)
    m.attached(1, 0, ["n0", "n1", "n2"], 0)
    run_with(m, clock, 30.0, alive=[1])  # n2 lost at 5 s; its first try failed at 28.5
    assert [g.nodes for g in started] == [["n0", "n1", "n2"]]
    assert started[0].killed and m._forming is None
    run_with(m, clock, 40.0, alive=[1])  # its second try runs (from 32.5 s)
    assert len(started) == 2 and m._forming is started[1] and m._retrying == ["n2"]
    silent_from = clock.t
    run_with(m, clock, silent_from + 8.0, alive=[])  # n1 falls silent
    assert started[1].killed
    healing = started[-1]
    assert "n2" not in healing.nodes and "n1" in healing.nodes
    assert healing.started_at - silent_from <= 8.0


def test_a_node_left_out_of_a_new_generation_stays_lost_until_brought_back(monkeypatch):
    """The 60-minute storm's loss: n3 was lost and its leader (n0) formed a generation
    without it (one that gave way to another node), then n0's service died. n1 knew n3
    as lost: the new generation does not make it forget n3; leading, it brings n3 back,
    and as a member it keeps n3 for its own succession. A node given up (down) stays
    left out."""
    started = recorded_generations(monkeypatch)
    clock, link = Clock(), Link()
    link.rank, link.size = 1, 3
    m = member("n1", clock, link)
    m.attached(4, 1, ["n0", "n1", "n2", "n3"], 0)
    m.route(0, ("members", [0, 1, 2], ["n3"]))
    m.down.add("n4")
    m.lost_nodes.append("n4")
    m.attached(5, 1, ["n0", "n1", "n2"], 0)  # a member of a generation without n3
    assert m.lost_nodes == ["n3"]
    m.attached(6, 0, ["n1", "n2"], 0)  # n0's service gone: n1 leads the next one
    assert m.leader is not None and sorted(m._respawn) == ["n0", "n3"]
    members = [obj for _, obj in link.sent if obj[0] == "members"]
    assert members[-1][2] == ["n0", "n3"]
    clock.run(m, member_mod.RESPAWN_S + 1.0)
    assert started and set(started[-1].nodes) >= {"n0", "n3"}, [g.nodes for g in started]


def test_the_services_of_a_host_list_form_their_world_the_first_at_once(monkeypatch):
    """Services of a cluster's hosts (`--hosts`), started together and never in a
    generation: the first host's forms one over every host at once; the others wait for
    it, and (should it be down) form one ORPHANED_S after their start, HOSTS_APART_S
    apart by their place, so that not all of them do at once."""
    hosts = ["h0", "h1", "h2"]
    apart = member_mod.ORPHANED_S + member_mod.HOSTS_APART_S
    for name, leads_at in (("h0", 0.0), ("h1", member_mod.ORPHANED_S), ("h2", apart)):
        started = recorded_generations(monkeypatch)
        clock, link = Clock(), Link()
        link.key = (-1, "")  # no relay has said hello yet
        m = Member(link, name, clock, lambda peers, c=clock: Leader(peers, None, None, None, c),
                   holdings=lambda: [], argv=[], hosts=hosts)
        clock.t = leads_at - 0.5
        if leads_at:
            m.tick()
            assert m.leader is None and started == [], name
        clock.t = leads_at + 0.5
        m.tick()
        assert m.leader is not None, name
        assert [(sorted(g.nodes), g.epoch, g.leader) for g in started] == \
            [(hosts, 2, name)], name


def test_hosts_that_did_not_come_back_are_tried_one_at_a_time(monkeypatch):
    """Found in review: h0's first generation over its hosts does not form (h2 has no
    service). Tried together again, h2 would keep the live h1 out for ever; each is
    tried on its own, and a node tried before does not make the one forming give way."""
    started = recorded_generations(monkeypatch, Unformed)
    clock, link = Clock(), Link()
    link.key = (-1, "")
    m = Member(link, "h0", clock, lambda peers: Leader(peers, None, None, None, clock),
               holdings=lambda: [], argv=[], hosts=["h0", "h1", "h2"])
    while clock.t < 200.0:  # a generation of h0 alone forms (its relay says hello)
        clock.t += 0.5
        m.tick()
        if m._forming is not None and m._forming.nodes == ["h0"]:
            link.key = (m._forming.epoch, "h0")
            m.attached(m._forming.epoch, 0, ["h0"], 0)
    tried = [sorted(g.nodes) for g in started]
    assert tried[0] == ["h0", "h1", "h2"]
    again = [nodes for nodes in tried[1:] if nodes != ["h0"]]  # (h0's own relay: alone)
    assert all(len(nodes) == 2 for nodes in again) and len(again) >= 3, tried
    assert {nodes[1] for nodes in again} == {"h1", "h2"}, tried  # each has its turn
    # each that did not form ran to its timeout: none gave way to a node tried before
    unformed = [g for g in started if g.nodes != ["h0"]]
    assert all(b.started_at - a.started_at >= a.timeout_s
               for a, b in zip(unformed, unformed[1:], strict=False)), tried


def test_a_lost_members_service_started_again_is_taken_back_when_asked(monkeypatch):
    """Found in review: n1's service was stopped (lost, its next try far off) and
    started again; its own generation is refused as older, and the node that refused
    it asks the leader to take n1 in. n1 is still a (lost) member of the world: that
    must not read as "already in"."""
    started = recorded_generations(monkeypatch)
    clock, link = Clock(), Link()
    link.size = 2
    m = member("n0", clock, link)
    m.attached(1, 0, ["n0", "n1"], 0)
    run_with(m, clock, 8.0, alive=[])  # n1 silent: lost
    assert 1 in m.world.lost and "n1" in started[-1].nodes
    started[-1].failed = True  # its service is stopped: the try does not form
    m.tick()
    m._respawn["n1"] = clock.t + 900.0  # as after many tries
    before = len(started)
    assert m.grow(["n1"]) == ["n1"]
    m.route(0, link.sent[-1][1])  # the leader (this node) gets the request
    m.tick()
    assert len(started) == before + 1 and "n1" in started[-1].nodes
