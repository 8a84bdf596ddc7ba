"""A node's membership in the daemons' MPI world: the relay.

Each node runs two processes. The node's service (`node.service`) holds everything that must
outlive a fault (its ranks' connections, the slot scheduler, the jobs' order and mode,
and, on the leader's node, the leader's decisions) and does no MPI at all. The relay is
the node's MPI process: it forwards the service's messages to the other nodes' relays
and theirs back, and holds nothing else.

Why two: Open MPI 4.1 has no way to cancel a collective call that lost a member (no
ULFM), and a process stuck in one stays stuck, so a world that re-formed itself with
MPI's own calls (spawn, merge) wedged for good the first time a member died in the
middle. A relay may die, wedge or be cut off at any time: the service serves on with
the last order and mode meanwhile, and the leader forms a new world (a *generation*)
by starting a fresh `mpirun` of relays over the live nodes (`generation`). A generation
that does not form in time is killed whole and tried again; nothing collective is ever
waited on by a process that must survive.

A relay finds its node's service on the socket `node-<name>.relay` of the runtime
directory (0700; the service checks the relay's user, see `uplink`) and starts the
service there if there is none (a new or lost node); a node service for every user
(`--system`) is the system's to start and restart, and its relay waits for it. It
says hello with its generation's epoch, its rank and every member's node name
(`frames`), then forwards the services' signed messages, unread (`wire`), until the
service closes the connection (a newer generation took over, or it stops) or its mpirun
ends it. A signal ends a relay, never its service: an mpirun that aborts (a host of its
world went down) takes its relays with it, and the services serve on and form a new
generation.
A world is stopped by `crossover stop` on any of its nodes, or by its idle shutdown.
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from crossover import environment as E
from crossover.backoff import Backoff, wait_until
from crossover.daemon.credentials import peer_credentials
from crossover.daemon.logfile import LOG_FILE, log_to
from crossover.daemon.node.sockets import RUNNING_EXIT
from crossover.daemon.relay.frames import FrameError, hello, read_frame, write_frame
from crossover.daemon.relay.launch import (
    missing_relay_mca,
    relay_path,
    service_argv,
    service_env,
)
from crossover.daemon.relay.mpichannel import MpiChannel, allgather_json
from crossover.daemon.world.wire import KEY_ENV, fingerprint, world_key
from crossover.procstats import process_state
from crossover.transport import connect, runtime_dir

log = logging.getLogger("crossover.relay")

#: a relay whose world has not formed (every member started) by then gives up
FORM_TIMEOUT_S = 30.0
#: how long a relay waits for the service it started to listen
SERVICE_START_S = 30.0
#: how long a relay waits for a node service the system starts (it says so before the
#: leader kills a generation that did not form, `generation.GENERATION_TIMEOUT_S`)
SYSTEM_SERVICE_S = 10.0
#: a relay starts its node's service again when it dies, up to RESTARTS times in
#: RESTART_WINDOW_S (past that, the node is left to the leader's next generation)
RESTARTS, RESTART_WINDOW_S = 5, 60.0
#: how long a relay waits for its dead service's process to be gone before it starts
#: another (a SIGKILLed process closes its sockets one by one as it ends)
SERVICE_GONE_S = 5.0
#: how long a relay of a stopping world waits in MPI_Finalize (it waits for every
#: member; a member that died makes it wait for ever)
FINALIZE_S = 10.0
#: how long a relay of a stopping world waits for its last messages to other nodes to go
FLUSH_S = 2.0
_FAKE = re.compile(r"fake\d+")
class Relay:
    """One node's relay in one generation.

    Args:
        epoch: the generation's epoch (0: the first, started by a user).
        leader_node: the node whose service leads this generation.
        nodes: the members' node names by rank (a generation a leader started), or None
            (the first generation: each relay names its own node).
        args: the daemon's arguments after `-m crossover`, for a service it starts.
        directory: the runtime directory (None: the default).
    """

    def __init__(self, epoch: int, leader_node: str | None, nodes: list[str] | None,
                 args: list[str], directory: str | None) -> None:
        self.epoch, self.leader_node, self.nodes = epoch, leader_node, nodes
        self.args, self.directory = args, directory
        # a world of node services for every user (`--system`): the system starts them
        self.system = "--system" in args
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._formed = threading.Event()
        self._service: socket.socket | None = None
        self._service_pid: int | None = None  # the process at the other end

    def run(self) -> int:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        rank = comm.Get_rank()
        missing = missing_relay_mca()
        if comm.Get_size() > 1 and missing:
            flags = " ".join(f"--mca {name} 1" for name in missing)
            log.warning("this world was started without %s: Open MPI ends every relay of "
                        "it when one ends, or fails it when one ends without finalizing; "
                        "start it with `mpirun %s ...` (crossoverrun does)", flags, flags)
        # a fake node is the one the leader named; a host is what it calls itself
        fake = self.nodes is not None and E.fake_nodes() and _FAKE.fullmatch(self.nodes[rank])
        name = self.nodes[rank] if fake else E.node_name(rank)
        threading.Thread(target=self._watchdog, daemon=True, name="relay-watchdog").start()
        try:
            key = world_key(runtime_dir(self.directory, create=True))
        except (OSError, ValueError) as exc:
            log.error("relay of node %s: no key for the world's messages (%s)", name, exc)
            key = b""
        if self.system and not wait_until(
                lambda: _listens(relay_path(name, self.directory).with_suffix(".sock")),
                SYSTEM_SERVICE_S, Backoff(0.02, 0.5)):
            # A node service for every user is the system's to start: until it runs this
            # node is down, and its generation must not form (it would count the node in
            # and lose it 5 s later)
            log.error("relay of node %s (generation %d): no node service runs there (the "
                      "system starts it, e.g. `systemctl start crossover`)", name, self.epoch)
            return 1
        # every member started: the generation is formed
        members = allgather_json(comm, [name, fingerprint(key)])
        names = [n for n, _ in members]
        _check_keys(name, members)
        leader = names.index(self.leader_node) if self.leader_node in names else 0
        said = hello(self.epoch, rank, names, leader)
        if not self._attach(name, said):
            return 1
        self._formed.set()
        peers = MpiChannel(comm, self._wakeup)
        restarts: list[float] = []
        while True:
            why = self._forward(peers)
            if why != "died":
                break
            # The service died (no word from it): start another at once, in this
            # generation, so the node is served again without the world re-forming.
            if not self._ended(name):
                break
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(restarts) > RESTARTS:
                log.error("relay of node %s: its service died %d times in %.0f s; "
                          "leaving the node to the leader", name, len(restarts),
                          RESTART_WINDOW_S)
                break
            log.warning("relay of node %s: its service (process %s) died; starting "
                        "another (%d of at most %d in %.0f s)", name, self._service_pid,
                        len(restarts), RESTARTS, RESTART_WINDOW_S)
            if not self._attach(name, said):
                break  # it said why
        peers.close()
        log.info("relay of node %s (generation %d) ends: %s", name, self.epoch, why)
        if why == "stop":  # the world stops (every relay does this now): end it cleanly
            left = peers.flush(FLUSH_S)  # what this node sent last, the others must get
            if left:
                log.warning("relay of node %s: %d message(s) to other nodes had not left "
                            "when the world stopped", name, left)
            done = threading.Thread(target=MPI.Finalize, daemon=True)
            done.start()
            done.join(FINALIZE_S)
            if done.is_alive():
                log.warning("relay of node %s: MPI_Finalize did not return in %g s (a "
                            "member of the world did not stop); leaving without it",
                            name, FINALIZE_S)
        return 0

    def _attach(self, name: str, said: dict) -> bool:
        """Connect to node `name`'s service (started if none listens) and say hello."""
        try:
            self._service = self._find_service(name, dead=self._service_pid)
            self._service_pid = peer_credentials(self._service)[1]
            write_frame(self._service, said)
            return True
        except (OSError, ConnectionError) as exc:
            log.error("relay of node %s (generation %d): no service to serve (%s)", name,
                      self.epoch, exc)
            return False

    def _ended(self, name: str) -> bool:
        """Whether the service that closed the connection has ended (waiting for it a
        while): until then its listener may still take a connection, which then dies at
        once, a restart spent on nothing. One that runs on was cut off, not dead: the
        node is left to the leader's next generation."""
        pid = self._service_pid
        if pid is None or wait_until(lambda: process_state(pid) in ("gone", "zombie"),
                                     SERVICE_GONE_S, Backoff(0.005, 0.1)):
            return True
        log.error("relay of node %s: its service (process %d) closed the connection but "
                  "still runs after %g s; leaving the node to the leader", name, pid,
                  SERVICE_GONE_S)
        return False

    def _forward(self, peers: MpiChannel) -> str:
        """Forward until the service ends the connection: "stop" (it stops, and so does
        the world), "replaced" (a newer generation's relay took over) or "died"."""
        sel = selectors.DefaultSelector()
        sel.register(self._service, selectors.EVENT_READ, "service")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._service.setblocking(True)
        try:
            while True:
                for key, _ in sel.select(1.0):
                    if key.data == "wake":
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    try:
                        header, payload = read_frame(self._service)
                    except (OSError, ConnectionError, FrameError):
                        return "died"
                    if header["k"] == "to" and isinstance(header.get("dest"), int):
                        peers.send(header["dest"], payload)
                    elif header["k"] == "bye":
                        return str(header.get("why"))
                try:
                    while not peers.inbox.empty():
                        source, data = peers.inbox.get_nowait()
                        write_frame(self._service, {"k": "from", "source": source}, data)
                except OSError:
                    return "died"
        finally:
            sel.close()
            self._service.close()

    def _find_service(self, name: str, dead: int | None = None) -> socket.socket:
        """Connected to node `name`'s service; started first if none listens. The
        listener of process `dead` (a service that died and is still ending) is no
        service."""
        path = relay_path(name, self.directory)
        started: subprocess.Popen | None = None
        sock: socket.socket | None = None

        told = False  # that another daemon holds the node's lock

        def attempt() -> bool:
            nonlocal sock, started, told
            try:
                sock = connect(path, 2.0)
                if dead is None or peer_credentials(sock)[1] != dead:
                    return True
                sock.close()
                sock = None
                return False  # still ending: wait until its listener is gone
            except OSError:
                pass
            if started is None:
                if self.system:  # the system starts it (systemd, a prolog)
                    return False
                started = self._start_service(name)
            # it exited: stop waiting, unless another service was starting there (an
            # older generation's relay started one again): wait for that one to listen
            code = started.poll()
            if code == RUNNING_EXIT and not told:
                told = True
                log.warning("relay of node %s: another daemon holds the node's lock (a "
                            "service that another relay starts); waiting up to %g s for "
                            "it to listen", name, SERVICE_START_S)
            return code not in (None, RUNNING_EXIT)
        wait_until(attempt, SERVICE_START_S, Backoff(0.02, 0.5))
        if sock is None:
            code = None if started is None else started.poll()
            why = f"none listened in {SERVICE_START_S:g} s"
            if self.system:
                why += " (a node service: the system starts it, e.g. `systemctl start crossover`)"
            if code == RUNNING_EXIT:
                why = (f"another daemon holds the node's lock but did not listen for "
                       f"relays in {SERVICE_START_S:g} s (one started without mpirun in "
                       f"this runtime directory? stop it with `crossover stop`)")
            elif code is not None:
                why = f"it exited with {code}"
            raise ConnectionError(f"node {name}'s service at {path}: {why}")
        return sock

    def _start_service(self, name: str) -> subprocess.Popen:
        rdir = runtime_dir(self.directory, create=True)
        argv = service_argv(name, self.args)
        log.info("relay of node %s: no service listens there; starting one", name)
        with open(rdir / LOG_FILE, "a") as out:
            return subprocess.Popen(argv, env=service_env(), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def _watchdog(self) -> None:
        """End a relay whose world never formed (a member died before it was whole: its
        allgather would wait for ever) or whose launcher is gone."""
        parent = os.getppid()
        deadline = time.monotonic() + FORM_TIMEOUT_S
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)  # mpirun (or its orted) is gone: so is this generation
            if not self._formed.is_set() and time.monotonic() > deadline:
                os._exit(3)

    def _wakeup(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass


def _listens(path: Path) -> bool:
    """Whether a service accepts its ranks' connections on `path` (a node service for
    every user publishes that socket from its start); the connection is closed at once,
    which the service drops as any rank's that ends."""
    try:
        connect(path, 2.0).close()
        return True
    except OSError:
        return False


def _check_keys(name: str, members: list) -> None:
    """Say so where the members hold different keys: their services refuse each other's
    messages (a world started by hand, without the key handed to every node)."""
    prints = {fp for _, fp in members}
    if len(prints) > 1:
        log.error("relay of node %s: the members hold %d different keys for the world's "
                  "messages (%s), so their services refuse each other: start the world "
                  "with crossoverrun, or hand every node the same key (%s in the relays' "
                  "environment, `mpirun -x %s`)", name, len(prints),
                  ", ".join(f"{n}: {fp}" for n, fp in members), KEY_ENV, KEY_ENV)


def run_relay(epoch: int, leader_node: str | None, nodes: list[str] | None,
              args: list[str], directory: str | None) -> int:
    """`crossover daemon` under mpirun: this node's relay. Finalizes MPI only when its
    world stops (every member does then); otherwise it exits without: MPI_Finalize is a
    collective call that would wait for members that died."""
    rdir = runtime_dir(directory, create=True)
    if epoch == 0 and os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")) == "0":
        # (said through the mpirun that a user may have started by hand: whoever ends it
        # must know that the world does not end with it)
        print(f"crossover daemon: the node services of this world serve on when this "
              f"mpirun ends (a node's loss is that node's alone): stop them all with "
              f"`crossover stop --runtime-dir {rdir}`; their log is {rdir / LOG_FILE}",
              file=sys.stderr, flush=True)
    # the node's log, beside its service's (not through mpirun, which cannot bound it)
    log_to(rdir / LOG_FILE, E.log_bytes(), "crossover-relay")
    # (named from here on: a node service for every user, found where nothing is
    # named, is not this world's)
    code = Relay(epoch, leader_node, nodes, args, str(rdir)).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
