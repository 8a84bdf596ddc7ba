"""The job side: one connection per rank to its node's daemon; acquire, release, phases.

The connection itself (registering, the slot table, failing open and healing) is
`crossover.client.link`; a rank never crashes its job over the daemon. What a rank
reports about its steps (progress, profiles, allreduce waits) is
`crossover.client.reporting`: the client decides nothing there, it only sends.
"""

from __future__ import annotations

import os
import time

from crossover import environment as E
from crossover import protocol as P
from crossover.client.info import RankInfo
from crossover.client.link import (
    CrossoverDuplicateError,
    CrossoverVersionError,
    DaemonLink,
    DaemonRefused,
    not_admitted,
)
from crossover.client.pinning import Pinning
from crossover.client.reporting import StepReporter, cuda_memory
from crossover.protocol import Mode, Phase
from crossover.trace import TraceRecorder
from crossover.transport import readable, recv_msg, socket_path


class SlotClient(DaemonLink):
    """A rank's handle on the device slot: through the node's slot table (the native fast
    path) when the daemon has one, else over its socket.

    Args:
        job: the job's name, the same on all its ranks and unique among running jobs.
        info: the rank's place in the job.
        runtime_dir: where the daemons' sockets are (default: see `transport`).
        weight: priority weight for the `priority` policy.
        gpu: the CUDA device index this rank computes on, None on CPU.
        pin_cpu: pin the process to its device's cores in antiphase (CPU devices
            only), as a GPU rank is bound to its GPU. Off by default: a pinned rank
            cannot leave a core where a waiting job's MPI threads spin, and two such
            jobs on one host stalled for 7-25 s (docs/design.md).
        wait_s: longest wait for a grant before going on uncoordinated for that step
            (default: twice the daemon's lease, so a hung holder is revoked first).
        trace: a recorder for slot-wait/hold/communicate events, or None.
        start_ns: when the job started (ns since the epoch), the same on all its ranks;
            with its name, the job's place in the order every node serves jobs in.
    """

    def __init__(
        self,
        job: str,
        info: RankInfo,
        runtime_dir: str | os.PathLike | None = None,
        weight: float = 1.0,
        gpu: int | None = None,
        pin_cpu: bool = False,
        wait_s: float | None = None,
        trace: TraceRecorder | None = None,
        start_ns: int = 0,
    ) -> None:
        super().__init__(job, trace)  # the link: socket, table, healing
        self.info = info
        self.device: str | None = None
        self.policy: str | None = None
        self.label: str | None = None  # node/device, for traces
        self._phase: str | None = None
        self._phase_start = time.time()
        self._seq = 0
        # This rank's place in its job's request sequence (see `scheduler.core`): the
        # request points passed, those passed holding (a release kept) included, and the
        # point of the latest request the daemon has seen.
        self._points = 0
        self._asked = 0
        self._kept = False  # a release was kept since the latest point
        self._last_renew = 0.0
        self._lease_s = 30.0
        self._wait_s = wait_s
        # Uncoordinated (no daemon): give up and take the "slot" as crossover would,
        # so traces of a fail-open run still show the phases.
        self._release_on_communicate = True
        self._yield_on_step = False
        # What the daemon's Company notices say: no other job on the device (keep it),
        # and the mode (concurrent: every job keeps its device).
        self._alone = False
        self._mode = Mode.ANTIPHASE
        # CROSSOVER_KEEP_WHEN_ALONE=0: release at every phase even when the device could
        # be kept (alone, or concurrent mode), to trace every phase
        self._keep_when_alone = E.keep_when_alone()
        self._reporter = StepReporter(info.rank)  # step counts, profiles, waits
        self._pinning = Pinning(pin_cpu, self._warn, trace)
        self._register(runtime_dir, weight, gpu, start_ns)

    def _register(self, runtime_dir: str | os.PathLike | None, weight: float,
                  gpu: int | None, start_ns: int) -> None:
        """Find the node's daemon and register with it; fail open on anything but a
        set-up error (another protocol version, a rank in use), which raises."""
        info = self.info
        try:
            fake = 0 if E.node_setting() else E.fake_nodes()
            # Under fake nodes local rank l is local rank l // N of node fake<l % N>.
            local_rank = info.local_rank // fake if fake else info.local_rank
            self._hello = P.Hello(self.job, info.rank, info.size, local_rank,
                                  info.local_size, os.getpid(), weight, gpu, start_ns,
                                  E.batch_job())
            node = E.node_name(info.local_rank)
        except ValueError as exc:  # a CROSSOVER_NODE / _FAKE_NODES that does not parse
            self._fail_open(f"{exc}; crossover is off in this process", heal=False)
            return
        try:
            self.path = socket_path(node, runtime_dir)
        except OSError as exc:
            # A runtime directory with the wrong owner or mode lands here: its error names
            # the directory, mode, owner and fix. Never crash the job over it; a set-up
            # error does not heal, so the rank does not try again.
            self._fail_open(f"cannot use the crossover runtime directory ({exc})", heal=False)
            return
        try:
            # Another protocol version or a rank in use is a set-up error and raises;
            # nothing else the daemon says or fails to say stops the job.
            self._connect(self._hello, timeout_s=30.0)
        except (CrossoverVersionError, CrossoverDuplicateError):
            raise
        except DaemonRefused as exc:  # it would refuse the same hello again: no healing
            self._fail_open(str(exc), heal=False)
        except PermissionError as exc:  # a node service that does not admit this user
            self._fail_open(not_admitted(self.path, exc), heal=False)
        except Exception as exc:  # noqa: BLE001 - a client never crashes its job
            self._fail_open(f"cannot reach the crossover daemon at {self.path} ({exc})")

    def _rank(self) -> int:
        return self.info.rank

    def _welcomed(self, welcome: P.Welcome) -> None:
        """What a (re)registration tells the slot: device, policy, lease, cores."""
        self.device, self.policy = welcome.device, welcome.policy
        self._lease_s = welcome.lease_s
        self.label = f"{welcome.node}/{welcome.device}"
        self._release_on_communicate = welcome.release_on_communicate
        self._yield_on_step = welcome.yield_on_step
        self._reporter.report_waits = welcome.report_waits
        if self._wait_s is None:
            self._wait_s = 2 * welcome.lease_s + 5.0
        self._alone, self._mode = False, Mode.ANTIPHASE  # until the daemon's notice
        self._reporter.forget_memory()
        self._asked = 0  # this daemon has seen no request of ours yet
        self._pinning.welcomed(welcome.cores)
        self._place()

    # --- the slot ----------------------------------------------------------------------
    def acquire(self) -> None:
        """Block until this rank holds its device (or the wait limit passes)."""
        self._reporter.computing()
        if not self.holding:
            self._request(release_first=False)
        elif self._kept:  # a point passed holding: a peer told of company asked here
            self._pass_point()

    def yield_slot(self) -> None:
        """Step boundary: let a waiting job in, then hold the device again.

        One round trip for a release and an acquire, sent only under policies that hand
        devices over at step boundaries (round-robin, priority); under crossover the
        rank just keeps the device.
        """
        self._count_step()
        if not self.holding:
            self._request(release_first=False)
        elif self._yield_on_step and not self._keep_alone():
            self._request(release_first=True)
        else:
            if self._yield_on_step:  # a handover point passed holding (a kept release
                self._pass_point()   # before it is the same point: a peer asks once)
            self.renew()  # kept across the boundary: a long run must not outlive its lease

    def release(self, phase: Phase = Phase.COMMUNICATE) -> None:
        """Give the device up: the rank now communicates (or idles).

        Under a policy that keeps the device through communication (round-robin) a
        COMMUNICATE release is a no-op: the rank goes on holding.
        """
        if phase == Phase.IDLE:
            self._count_step()  # the end of a `crossover.step()` block
        elif phase == Phase.COMMUNICATE:
            self._reporter.communicating()
        if phase == Phase.COMMUNICATE and not self._release_on_communicate:
            return
        if self.holding and not (phase != Phase.IDLE and self._keep_alone()):
            self._enter(phase.value)
            self._give_up(phase)
            self._kept = False
        elif self.holding:
            self._kept = True

    def renew(self) -> None:
        """Keep a long hold alive; cheap to call often (sends at most every lease/3)."""
        now = time.monotonic()
        if self.holding and now - self._last_renew > self._lease_s / 3:
            self._last_renew = now
            self._send(P.Renew())

    def close(self) -> None:
        """Leave the daemon (the slot is freed) and flush the trace."""
        self._enter(None)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._attempt is not None:
            self._attempt.sock.close()
            self._attempt = None
        self._heal = None
        if self.trace is not None:
            self.trace.flush()

    @property
    def steps(self) -> int:
        """Training steps so far (step boundaries), reported for the mode."""
        return self._reporter.steps

    def note_wait(self, seconds: float) -> None:
        """This step's allreduces finished `seconds` after the rank released its device
        for them (the hooks measure it). While the device is shared in antiphase and the
        daemons align the nodes' phases (`--align-phases`, told in the Welcome), the
        median of a few is reported to them, which keep the nodes' turn sequences in
        step from it (`crossover.scheduler.phase`); one small one-way message every
        `reporting.WAIT_REPORT_S` at most."""
        about_turns = self._sock is not None and not self._alone \
            and self._mode == Mode.ANTIPHASE and self._release_on_communicate
        waited = self._reporter.wait(seconds, about_turns)
        if waited is not None:
            self._send(waited)

    def keeps_device(self) -> bool:
        """True while this rank keeps its device through communication: no other job
        shares it, or the daemons serve it concurrently (plain co-location)."""
        return self._keep_alone()

    # --- internals ---------------------------------------------------------------------
    def _count_step(self) -> None:
        """A step boundary: count it; rank 0 reports the count, its request points and
        the steps' profile when a report is due (`StepReporter.step`)."""
        progress = self._reporter.step(self._points, self._alone, self._sock is not None)
        if progress is not None:
            self._send(progress)
        hello = getattr(self, "_hello", None)  # (none where the node name did not parse)
        gpu = hello.gpu if hello is not None else None
        if gpu is not None and self._sock is not None:
            memory = self._reporter.memory(lambda: cuda_memory(gpu))
            if memory is not None:
                self._send(memory)

    def _pass_point(self) -> None:
        """One more point of this rank's request sequence (asked at, or passed holding)."""
        self._points += 1
        self._kept = False

    def _keep_alone(self) -> bool:
        """Whether to keep the device instead of releasing it: no other job shares it,
        or the mode is concurrent.

        Reads the daemon's pending notices first, so a job that arrived since the last
        step is seen at this release point: a newcomer waits at most one hold of ours.
        """
        self._read_notices()
        keep = self._alone or self._mode == Mode.CONCURRENT
        return keep and self._keep_when_alone and self._sock is not None

    def _read_notices(self) -> None:
        """Take in what the daemon sent unasked. Also at every request: a rank whose
        grants come through the table and which releases only to idle reads its socket
        nowhere else, and a daemon whose notices pile up unread drops the rank."""
        while self._sock is not None:
            try:
                if not readable(self._sock):
                    break
                self._sock.settimeout(5.0)  # a notice is one small frame, sent whole
                self._on_notice(recv_msg(self._sock))
            except (OSError, P.ProtocolError) as exc:
                self._fail_open(f"lost the crossover daemon ({exc})")

    def _on_notice(self, msg: P.Message) -> None:
        """A message the daemon sent unasked (or a grant for an abandoned wait)."""
        if isinstance(msg, P.Company):
            self._alone = msg.others == 0
            try:
                mode = Mode(msg.mode)
            except ValueError:
                self._fail_open(f"crossover daemon sent an unknown mode {msg.mode!r}")
                return
            if mode != self._mode:
                if self.trace is not None:
                    self.trace.instant(f"mode {mode.value}", time.time(), reason=msg.reason,
                                       device=self.label)
                self._mode = mode
            self._pinning.share = msg.cores
            self._place()
        elif isinstance(msg, P.Error):
            self._fail_open(f"crossover daemon error: {msg.message}")

    def _place(self) -> None:
        self._pinning.place(self._sock is not None, self._mode, self.label)

    @property
    def holding(self) -> bool:
        return self._phase == "hold"

    def _enter(self, phase: str | None) -> None:
        """Close the current phase's trace span and start `phase` (None: no span)."""
        now = time.time()
        if self.trace is not None and self._phase is not None:
            self.trace.span(self._phase, self._phase_start, now, device=self.label)
        self._phase, self._phase_start = phase, now

    def _request(self, release_first: bool) -> None:
        self._enter("slot wait")
        if self._sock is None:
            self._try_heal()
            release_first = False  # a new daemon has granted us nothing to give back
        else:
            self._read_notices()
        self._pass_point()
        settled = False
        # The table carries no point: a request after points passed holding goes by socket.
        if self._sock is not None and self._fast is not None and self._points == self._asked + 1:
            if release_first:
                self._give_up(Phase.COMPUTE)
                release_first = False
            settled = self._await_fast_grant()
        if self._sock is not None and not settled:
            self._seq += 1
            self._send(P.Acquire(self._seq, release_first, self._points))
            self._await_grant()
        self._asked = self._points
        self._reporter.waited_for_grant(time.time() - self._phase_start)  # since "slot wait"
        self._enter("hold")
        self._last_renew = time.monotonic()

    def _await_grant(self) -> None:
        deadline = time.monotonic() + self._wait_s
        while self._sock is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._grant_timed_out()
                return
            try:
                self._sock.settimeout(remaining)
                reply = recv_msg(self._sock)
            except TimeoutError:
                continue
            except (OSError, P.ProtocolError) as exc:
                self._fail_open(f"lost the crossover daemon ({exc})")
                return
            if isinstance(reply, P.Grant) and reply.seq == self._seq:
                return
            if isinstance(reply, P.Error):
                self._fail_open(f"crossover daemon error: {reply.message}")
                return
            self._on_notice(reply)  # a Company notice, or a grant for an abandoned wait

    def _give_up(self, phase: Phase) -> None:
        """Tell the daemon the rank gave the device up: through the table when mapped."""
        try:
            if self._fast is not None and self._fast.release(phase):
                return
        except OSError as exc:
            self._fail_open(f"lost the crossover daemon ({exc})")
            return
        self._send(P.Release(phase.value))  # on the socket, the daemon orders it itself

    def _await_fast_grant(self) -> bool:
        """Ask through the table. Returns False if the table refused the request (the
        socket takes it then), True otherwise (granted, timed out, or uncoordinated)."""
        try:
            granted = self._fast.acquire(self._wait_s, self._daemon_alive)
        except OSError as exc:
            self._fail_open(f"lost the crossover daemon ({exc})")
            return True
        if granted is None:
            return False
        if not granted and self._sock is not None:
            self._grant_timed_out()
        return True

    def _grant_timed_out(self) -> None:
        """No grant within the wait limit: past every lease a live daemon would have
        revoked, so the daemon is stopped, swapped out or stuck. Waiting again would
        cost every step as much: go on uncoordinated, and heal when it answers."""
        self._fail_open(f"no grant for {self.device} within {self._wait_s:.0f} s (the "
                        f"crossover daemon is stopped or stuck)")
