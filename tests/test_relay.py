"""The relay's pure parts, and a node service's side of its relay (`Uplink`) with real
sockets: which relay it takes, and what it forwards."""

from __future__ import annotations

import ipaddress
import os
import queue
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from crossover.daemon.node.sockets import NodeSockets
from crossover.daemon.relay.frames import hello, read_frame, write_frame
from crossover.daemon.relay.launch import (
    daemon_flags,
    missing_relay_mca,
    relay_mca_flags,
    service_argv,
    service_env,
)
from crossover.daemon.relay.network import network_mca_flags, own_network, relay_network
from crossover.daemon.relay.uplink import Uplink
from crossover.daemon.world.generation import generation_command, reap_orphans, record
from crossover.daemon.world.wire import encode, unseal

KEY = bytes(range(32))


@pytest.mark.parametrize("argv, flags", [
    (["daemon", "--policy", "auto"], ["--policy", "auto"]),
    (["daemon", "--node", "fake1", "--lease", "3"], ["--lease", "3"]),
    (["daemon", "--node=fake1", "--service", "--generation", "4", "--leader", "fake0",
      "--nodes", "fake0,fake1", "--runtime-dir", "/r"], ["--runtime-dir", "/r"]),
    (["--policy", "off"], ["--policy", "off"]),
])
def test_the_worlds_settings_are_kept_and_a_nodes_own_flags_dropped(argv, flags):
    assert daemon_flags(argv) == flags


def test_a_service_is_started_for_its_node_with_the_worlds_settings():
    argv = service_argv("fake2", ["daemon", "--policy", "crossover", "--node", "fake0"])
    assert argv[1:] == ["-m", "crossover", "daemon", "--policy", "crossover", "--service",
                        "--node", "fake2"]


def test_a_service_inherits_no_variable_of_its_relays_mpi_process():
    env = service_env({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_orte_hnp_uri": "x",
                       "PMIX_RANK": "0", "OMPI_MCA_ess_base_vpid": "1",
                       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_MCA_btl_tcp_if_include": "eth0",
                       "CROSSOVER_FAKE_NODES": "4", "PATH": "/bin"})
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_MCA_btl_tcp_if_include": "eth0",
                   "CROSSOVER_FAKE_NODES": "4", "PATH": "/bin"}


def test_a_generation_of_fake_nodes_runs_here_and_one_of_hosts_one_relay_per_host(
        monkeypatch):
    monkeypatch.setenv("CROSSOVER_FAKE_NODES", "4")
    cmd = generation_command(["fake0", "fake3"], 7, "fake0", ["daemon", "--node", "fake0"])
    assert "-H" not in cmd and cmd[cmd.index("-np") + 1] == "2"
    assert cmd[-6:] == ["--generation", "7", "--leader", "fake0", "--nodes", "fake0,fake3"]
    monkeypatch.delenv("CROSSOVER_FAKE_NODES")
    cmd = generation_command(["a", "b"], 1, "a", ["daemon"])
    assert cmd[cmd.index("-H") + 1] == "a:1,b:1" and "ppr:1:node" in cmd
    assert " ".join(relay_mca_flags()) in " ".join(cmd)


def test_a_relay_names_the_open_mpi_settings_its_world_was_started_without():
    flags = relay_mca_flags()
    assert flags[flags.index("orte_enable_recovery") - 1] == "--mca"
    assert missing_relay_mca({}) == ["orte_enable_recovery", "orte_allowed_exit_without_sync"]
    assert missing_relay_mca({"OMPI_MCA_orte_enable_recovery": "true",
                              "OMPI_MCA_orte_allowed_exit_without_sync": "0"}) == [
        "orte_allowed_exit_without_sync"]


def test_relays_keep_to_the_network_of_the_node_names_address(monkeypatch):
    addrs = [(a.address, a.netmask) for v in psutil.net_if_addrs().values() for a in v
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for addr, mask in addrs:  # a name that resolves to one of this machine's addresses
        assert own_network(addr) == str(ipaddress.ip_network(f"{addr}/{mask}",
                                                             strict=False))
    assert own_network("127.0.0.1") is None  # one machine: Open MPI's own choice
    assert own_network("192.0.2.254" if ("192.0.2.254", "255.255.255.0") not in addrs
                       else "198.51.100.7") is None  # not an address of this machine
    monkeypatch.setenv("CROSSOVER_RELAY_NETWORK", "10.9.0.0/16")
    assert network_mca_flags() == ["--mca", "btl_tcp_if_include", "10.9.0.0/16",
                                   "--mca", "oob_tcp_if_include", "10.9.0.0/16"]
    assert relay_mca_flags()[-6:] == network_mca_flags()
    monkeypatch.setenv("CROSSOVER_RELAY_NETWORK", "ANY")
    assert network_mca_flags() == []
    monkeypatch.delenv("CROSSOVER_RELAY_NETWORK")
    monkeypatch.setenv("CROSSOVER_FAKE_NODES", "3")  # no addresses to look up
    assert relay_network() is None


class Node:
    """A node service's sockets and uplink, served by hand."""

    def __init__(self, tmp) -> None:
        self.inbox_woken = 0
        self.sockets = NodeSockets(tmp / "node-x.sock", tmp / "node-x.relay")
        self.ranks, self.relays = self.sockets.open()
        self.uplink = Uplink(self._woken, relayed=True, node="x", secret=KEY)
        self.seq = 0

    def _woken(self) -> None:
        self.inbox_woken += 1

    def relay(self, epoch: int, rank: int, names: list[str], leader: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.sockets.relay))
        write_frame(sock, hello(epoch, rank, names, leader))
        return sock

    def deliver(self, relay: socket.socket, source: int, sender: str, msg: tuple,
                gen: int = 0, key: bytes = KEY) -> None:
        """`msg` from node `sender` at rank `source`, as its relay would bring it."""
        self.seq += 1
        write_frame(relay, {"k": "from", "source": source},
                    encode(key, gen, sender, "x", self.seq, msg))

    def accept(self) -> tuple | None:
        return self.uplink.accept(self.relays)  # a Unix connect is queued at once

    def next(self, timeout: float = 5.0) -> tuple:
        """The next message the serve loop would take (`Uplink.take`)."""
        deadline = time.monotonic() + timeout
        while (item := self.uplink.take()) is None:
            if time.monotonic() > deadline:
                raise queue.Empty
            time.sleep(0.005)
        return item


def sent(relay: socket.socket) -> tuple:
    """What the service wrote to its relay: ("to", dest, message) or ("bye", why), its
    signature checked and its sender this node."""
    header, payload = read_frame(relay)
    if header["k"] == "bye":
        return ("bye", header["why"])
    _, sender, to, _, kind, args = unseal(KEY, payload)
    assert sender == "x" and to != "x"
    return ("to", header["dest"], (kind, *args))


def test_a_service_publishes_its_socket_only_once_a_relay_said_hello(tmp_path):
    node = Node(tmp_path)
    assert not node.sockets.published
    node.relay(0, 1, ["a", "x"], 0)
    assert node.accept() == (0, 1, ["a", "x"], 0)
    node.sockets.publish()
    assert node.sockets.published and os.stat(node.sockets.path).st_mode & 0o077 == 0


def test_a_newer_generation_replaces_the_relay_and_an_older_one_is_refused(tmp_path):
    node = Node(tmp_path)
    first = node.relay(1, 0, ["x", "b"], 0)
    node.accept()
    newer = node.relay(2, 1, ["b", "x"], 0)
    assert node.accept() == (2, 1, ["b", "x"], 0)
    assert sent(first) == ("bye", "replaced")  # the old relay ends, not its service
    assert first.recv(1) == b""
    older = node.relay(1, 1, ["c", "x"], 0)
    assert node.accept() is None and older.recv(1) == b""
    # its leader forms generations of its own (a service started again, say): the
    # service asks its leader to take that node in (`Member.grow`)
    assert node.uplink.outsider == "c"
    # same epoch, another leader: the later name wins everywhere, so no tie
    assert node.uplink.key == (2, "b")
    node.uplink.send(0, ("join", "A"))
    assert sent(newer) == ("to", 0, ("join", "A"))
    node.deliver(newer, 0, "b", ("mode", "antiphase", "", {"A": 3}), gen=2)
    assert node.next() == (0, ("mode", "antiphase", "", {"A": 3}))


def test_a_relays_end_detaches_the_service_and_what_it_sends_is_dropped(tmp_path):
    node = Node(tmp_path)
    relay = node.relay(0, 1, ["a", "x"], 0)
    node.accept()
    relay.close()
    assert node.next() == (1, ("detached", 0))
    assert not node.uplink.attached
    node.uplink.send(0, ("join", "A"))  # nowhere to go: dropped, never blocks
    node.uplink.send(1, ("beat", 1, 0))  # to itself: still queued
    assert node.next() == (1, ("beat", 1, 0))
    with pytest.raises(queue.Empty):
        node.next(timeout=0.2)


def test_a_relay_without_a_valid_hello_is_closed(tmp_path):
    node = Node(tmp_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(node.sockets.relay))
    write_frame(sock, hello(0, 5, ["a"], 0))  # rank 5 of a world of one
    assert node.accept() is None and sock.recv(1) == b""
    assert not node.uplink.attached


def test_a_relay_that_reads_nothing_is_dropped_and_never_holds_the_service(tmp_path,
                                                                           monkeypatch):
    """A relay that stops reading (stopped, wedged): once the socket is full, the
    writer's send times out, the node is detached, and a newer relay is taken at once."""
    import crossover.daemon.relay.uplink as uplink

    monkeypatch.setattr(uplink, "SEND_TIMEOUT_S", 1)
    node = Node(tmp_path)
    stuck = node.relay(0, 1, ["a", "x"], 0)  # noqa: F841 - kept open, never read
    node.accept()
    for _ in range(64):  # far more than a socket buffer holds
        node.uplink.send(0, ("status!", 1, "x", {"blob": "x" * 65536}))
    assert node.next(timeout=10) == (1, ("detached", 0))
    node.relay(1, 1, ["a", "x"], 0)
    start = time.monotonic()
    assert node.accept() == (1, 1, ["a", "x"], 0)
    assert time.monotonic() - start < 2.0


def test_a_stopping_service_sends_the_frame_its_writer_holds_before_its_goodbye(tmp_path):
    """A world's idle shutdown: the leader's service queues the stop for the other nodes
    and stops at once. The writer may have taken that frame off the queue and not yet
    written it; closing on an empty queue then dropped it, and the other nodes' relays
    never stopped (their mpirun ended in an error after the finalize timeout)."""
    node = Node(tmp_path)
    relay = node.relay(0, 0, ["x", "b"], 0)
    node.accept()
    with node.uplink._writing:  # the writer takes the frame, then waits here
        node.uplink.send(1, ("shutdown",))
        deadline = time.monotonic() + 5
        while not node.uplink._out.empty() and time.monotonic() < deadline:
            time.sleep(0.001)
        closing = threading.Thread(target=node.uplink.close)
        closing.start()
        time.sleep(0.2)  # long enough to find the queue empty
    closing.join(timeout=5)
    assert not closing.is_alive()
    relay.settimeout(5)
    assert sent(relay) == ("to", 1, ("shutdown",))
    assert sent(relay) == ("bye", "stop")


def test_a_broadcast_reaches_the_other_nodes_before_this_one_acts_on_it(tmp_path):
    """The leader's idle shutdown is broadcast from its thread. This node's own copy
    wakes the serve loop, which stops and closes the uplink at once: the copies for the
    other nodes must be queued by then (they were dropped when this node's came first,
    and the other nodes served on until they took the leader for lost)."""
    node = Node(tmp_path)
    relay = node.relay(0, 0, ["x", "b", "c"], 0)
    node.accept()
    node.uplink._wakeup = node.uplink.close  # the serve loop at its quickest
    node.uplink.broadcast(("shutdown",))
    relay.settimeout(5)
    assert [sent(relay) for _ in range(3)] == [
        ("to", 1, ("shutdown",)), ("to", 2, ("shutdown",)), ("bye", "stop")]
    assert node.next() == (0, ("shutdown",))


def test_a_worlds_stop_reaches_a_node_taken_for_lost_and_other_broadcasts_do_not(tmp_path):
    """A node silent past the leader's patience may only be slow: told nothing, it would
    serve on after the world stopped and form a world of its own."""
    node = Node(tmp_path)
    relay = node.relay(0, 0, ["x", "b", "c"], 0)
    node.accept()
    node.uplink.lost = {1}
    node.uplink.broadcast(("members", [0, 2], ["b"]))
    node.uplink.broadcast(("shutdown",), lost_too=True)
    relay.settimeout(5)
    assert [sent(relay) for _ in range(3)] == [
        ("to", 2, ("members", [0, 2], ["b"])), ("to", 1, ("shutdown",)),
        ("to", 2, ("shutdown",))]


def test_a_forged_or_replayed_message_is_refused_and_logged_and_a_signed_one_taken(
        tmp_path, caplog):
    """What reaches a service through its relay but was not signed with the world's key
    (a process that reached the relays' MPI port) never acts: ("lead", 2**62) would
    have won the leadership for ever."""
    node = Node(tmp_path)
    relay = node.relay(3, 0, ["x", "b"], 1)
    node.accept()
    with caplog.at_level("WARNING", logger="crossover.daemon"):
        node.deliver(relay, 1, "b", ("lead", 2**62), gen=3, key=b"guessed" * 5)
        write_frame(relay, {"k": "from", "source": 1},
                    encode(KEY, 3, "b", "x", 7, ("lead", 4)))
        write_frame(relay, {"k": "from", "source": 1},
                    encode(KEY, 3, "b", "x", 7, ("lead", 4)))  # the same bytes again
        assert node.next() == (1, ("lead", 4))
        with pytest.raises(queue.Empty):
            node.next(timeout=0.3)
    assert node.uplink.refused == 2
    refusals = [r.getMessage() for r in caplog.records if "refused a message" in r.message]
    assert "daemon 1 (node b) of generation 3: its signature is not the world's key" in \
        refusals[0]
    assert "replayed: sequence 7 from b after 7" in refusals[1]


def test_a_message_of_an_earlier_generation_is_dropped_not_charged_to_a_node(tmp_path):
    """Generation 2 renumbered the nodes: what node b said as rank 1 of generation 1
    must not be taken as rank 1 (node c) of generation 2."""
    node = Node(tmp_path)
    relay = node.relay(2, 0, ["x", "c", "b"], 0)
    node.accept()
    node.deliver(relay, 1, "b", ("leave", "A"), gen=1)
    node.deliver(relay, 1, "b", ("leave", "A"), gen=2)  # b is not rank 1 now
    node.deliver(relay, 2, "b", ("join", "B"), gen=2)
    assert node.next() == (2, ("join", "B"))
    assert node.uplink.stale == 2 and node.uplink.refused == 0


def test_a_daemon_never_sends_a_message_off_its_schema(tmp_path, caplog):
    node = Node(tmp_path)
    relay = node.relay(0, 0, ["x", "b"], 0)
    node.accept()
    with caplog.at_level("ERROR", logger="crossover.daemon"):
        node.uplink.send(1, ("epoch", 3, "two"))
    node.uplink.send(1, ("epoch", 3, 2))
    relay.settimeout(5)
    assert sent(relay) == ("to", 1, ("epoch", 3, 2))
    assert "not sent to daemon 1: epoch: argument 1 is str, not int" in caplog.text


def test_messages_sent_from_two_threads_arrive_in_the_order_of_their_numbers(tmp_path):
    """The serve loop and the leader's thread both send: a message numbered before
    another but queued after it would be refused by the receiver as a replay."""
    node = Node(tmp_path)
    relay = node.relay(0, 0, ["x", "b"], 0)
    node.accept()

    def sends(job: str) -> None:
        for _ in range(300):
            node.uplink.send(1, ("join", job))
    threads = [threading.Thread(target=sends, args=(job,)) for job in "AB"]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    relay.settimeout(5)
    numbers = []
    for _ in range(600):
        header, payload = read_frame(relay)
        numbers.append(unseal(KEY, payload)[3])
    assert numbers == sorted(numbers) and len(set(numbers)) == 600


def test_a_message_read_before_a_new_generation_is_taken_is_dropped(tmp_path):
    """b's hold arrived (rank 1 of generation 1) and waits in the inbox when
    generation 2 is taken, where rank 1 is c: it must not be charged to c."""
    node = Node(tmp_path)
    first = node.relay(1, 0, ["x", "b"], 0)
    node.accept()
    node.deliver(first, 1, "b", ("hold", ["A"]), gen=1)
    deadline = time.monotonic() + 5
    while node.uplink.inbox.empty() and time.monotonic() < deadline:
        time.sleep(0.005)
    second = node.relay(2, 0, ["x", "c", "b"], 0)  # noqa: F841 - open while it serves
    node.accept()
    with pytest.raises(queue.Empty):
        node.next(timeout=0.2)
    assert node.uplink.stale == 1


def test_an_older_generations_mpirun_whose_service_is_gone_is_ended_and_no_other(
        tmp_path, caplog):
    """A service killed while its generation ran leaves the mpirun behind; the next
    service to attach to a newer generation ends it. A generation whose service lives,
    the newer ones, and a record whose pid now names another process are left alone;
    a record that is none is logged and kept, never raised."""
    def session() -> subprocess.Popen:  # an mpirun stands in: its own process group
        return subprocess.Popen(["sleep", "60"], start_new_session=True)

    starter, orphan, kept, newer, reused = (session() for _ in range(5))
    try:
        kept_path = record(tmp_path, 4, kept.pid)  # (this process records: the service)
        newer_path = record(tmp_path, 6, newer.pid)
        record(tmp_path, 2, reused.pid).write_text(f"{reused.pid} 1 {os.getpid()} 1\n")
        # generation 3: its service, another process, is gone
        ticks = open(f"/proc/{starter.pid}/stat").read().rsplit(")", 1)[1].split()[19]
        gone = record(tmp_path, 3, orphan.pid)
        pid, started, _, _ = gone.read_text().split()
        gone.write_text(f"{pid} {started} {starter.pid} {ticks}\n")
        starter.kill()
        starter.wait(5)
        (tmp_path / "generation-1-7.mpirun").write_text("not a record\n")
        with caplog.at_level("WARNING", logger="crossover.daemon"):
            assert reap_orphans(tmp_path, 5) == [orphan.pid]
        assert orphan.wait(5) == -signal.SIGKILL
        assert "generation 3's mpirun" in caplog.text and "replaced it: ended" in caplog.text
        assert "generation-1-7.mpirun left" in caplog.text
        assert all(p.poll() is None for p in (kept, newer, reused))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
            kept_path.name, newer_path.name, "generation-1-7.mpirun"])  # ended, reused: gone
        assert reap_orphans(tmp_path, 7) == []  # their service (this process) lives
    finally:
        for p in (starter, orphan, kept, newer, reused):
            p.kill()
            p.wait(5)
