"""The leader's decisions on their own thread (`crossover.daemon.world.leader_thread`): handled in
the order posted, ticked at their deadlines, failures handed to the serve loop, and a
leader stuck on one job's join holds none of its node's grants."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from crossover.client import RankInfo, SlotClient
from crossover.daemon.world.leader import Leader
from crossover.daemon.world.leader_thread import LeaderThread
from crossover.protocol import Phase
from tests.conftest import wait_for
from tests.test_daemon_parts import Channel

SOLO = RankInfo(rank=0, size=1, local_rank=0, local_size=1)


class Recorder:
    """Stands in for a `Leader`: records what it is asked, in order (pure logic)."""

    aligner = None

    def __init__(self, deadline: float | None = None) -> None:
        self.calls: list[tuple] = []
        self.deadline = deadline
        self.ticks = 0

    def handle(self, source: int, msg: tuple) -> bool:
        if msg[0] == "boom":
            raise KeyError(msg[1])
        self.calls.append(("handle", source, msg))
        return True

    def renumber(self, ranks_now: dict[int, int]) -> None:
        self.calls.append(("renumber", ranks_now))

    def member_lost(self, rank: int) -> None:
        self.calls.append(("member_lost", rank))

    def tick(self) -> None:
        self.ticks += 1

    def next_deadline(self) -> float | None:
        return self.deadline

    def check_idle(self, busy_here: bool) -> None:
        self.calls.append(("idle?", busy_here)) if not busy_here else None

    def snapshot(self) -> dict:
        return {"calls": len(self.calls)}


def test_messages_and_membership_calls_are_handled_in_the_order_posted():
    rec = Recorder()
    lead = LeaderThread(rec, time.monotonic, lambda: None)
    lead.busy_here = True
    lead.post(1, ("join", "A"))
    lead.renumber({1: 0})  # after the join from the old rank 1, not before it
    lead.post(0, ("join", "B"))
    lead.member_lost(2)
    wait_for(lambda: lead.handled == 4, 10, "the thread to handle all four")
    lead.close()
    assert rec.calls == [("handle", 1, ("join", "A")), ("renumber", {1: 0}),
                         ("handle", 0, ("join", "B")), ("member_lost", 2)]


def test_a_real_leaders_answers_come_from_its_thread():
    peers = Channel()
    lead = LeaderThread(Leader(peers, None, None, None, time.monotonic), time.monotonic,
                        lambda: None)
    lead.post(0, ("join", "A"))
    lead.post(1, ("stop_world",))
    wait_for(lambda: len(peers.sent) == 2, 10, "the leader's shutdown to both nodes")
    lead.close()
    assert peers.sent == [(0, ("shutdown",)), (1, ("shutdown",))]


def test_the_leader_is_ticked_at_its_deadline_without_a_message():
    rec = Recorder(deadline=time.monotonic() + 0.05)
    lead = LeaderThread(rec, time.monotonic, lambda: None)
    wait_for(lambda: rec.ticks >= 2, 5, "a tick at the deadline")
    lead.close()


def test_the_idle_shutdown_sees_whether_this_node_is_busy():
    rec = Recorder()
    lead = LeaderThread(rec, time.monotonic, lambda: None)
    lead.busy_here = True
    lead.post(0, ("join", "A"))
    wait_for(lambda: lead.handled == 1, 5, "the join")
    assert ("idle?", False) not in rec.calls
    lead.busy_here = False
    wait_for(lambda: ("idle?", False) in rec.calls, 5, "an idle check while idle")
    lead.close()


def test_a_failure_on_the_thread_is_raised_in_the_serve_loop():
    woken = threading.Event()
    lead = LeaderThread(Recorder(), time.monotonic, woken.set)
    lead.raise_error()  # nothing failed yet
    lead.post(0, ("boom", "A"))
    assert woken.wait(5), "the serve loop is woken to see the failure"
    with pytest.raises(RuntimeError, match="leader's thread failed") as info:
        lead.raise_error()
    assert isinstance(info.value.__cause__, KeyError)


def test_a_leader_stuck_on_a_join_holds_none_of_its_nodes_grants(tmp_path, monkeypatch):
    """Jobs a and b take turns on the leader's node (every turn through the serve loop:
    no native table) while the leader is stuck on job c's join: their turns and a
    status go on. With the leader in the serve loop, the turns waited for the leader."""
    from crossover.daemon import Daemon
    from crossover.probe import daemon_status

    monkeypatch.setenv("CROSSOVER_NATIVE", "0")
    runtime = tmp_path / "run"
    daemon = Daemon(runtime_dir=runtime)
    gate, opened = threading.Event(), []
    handle = daemon.leader.leader.handle

    def stuck_on_c(source: int, msg: tuple) -> bool:
        if msg[:2] == ("join", "c"):
            opened.append(gate.wait(20))  # False: nobody opened it while it was stuck
        return handle(source, msg)

    daemon.leader.leader.handle = stuck_on_c
    failures: list[BaseException] = []

    def jobs() -> None:
        try:
            wait_for(daemon.path.exists, 20, "the daemon's socket")
            a, b = (SlotClient(j, SOLO, runtime_dir=runtime, pin_cpu=False) for j in "ab")
            wait_for(lambda: a._keep_alone() is not None and not a._alone, 20,
                     "the daemon to tell job a of its company")
            daemon.peers.send(0, ("join", "c"))  # a join, as a rank of c would send
            wait_for(lambda: daemon.leader.handled >= 2, 10, "the leader to take c's join")
            turns = 0
            for _ in range(10):
                for rank in (a, b):
                    rank.acquire()
                    assert rank.holding
                    rank.release(Phase.COMMUNICATE)
                    turns += 1
            assert daemon_status(runtime), "status answers while the leader is stuck"
            assert not gate.is_set() and turns == 20
            gate.set()
            for rank in (a, b):
                rank.close()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)
        finally:
            gate.set()
            daemon.stop()

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    cores = os.sched_getaffinity(0)  # the daemon may pin itself: this is pytest
    worker = threading.Thread(target=jobs)
    worker.start()
    try:
        daemon.serve()  # signal handlers need the main thread
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
        os.sched_setaffinity(0, cores)
        worker.join(30)
    assert not failures, failures
    assert opened == [True], "the leader was opened by the jobs' thread, after 20 turns"
