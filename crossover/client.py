"""The job side: one connection per rank to its node's daemon; acquire, release, phases.

Fail-open: if the daemon cannot be reached, dies, or does not grant within the wait
limit, the rank warns once and trains on uncoordinated. Scheduling never changes the
math, so a job loses nothing but the sharing.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from dataclasses import dataclass

from crossover import protocol as P
from crossover.daemon import FAKE_NODES_ENV, NODE_ENV
from crossover.scheduler import Phase
from crossover.trace import TraceRecorder
from crossover.transport import recv_msg, send_msg, socket_path


def node_name() -> str:
    """This process's node as the daemons name it ($CROSSOVER_NODE if set, else fake0
    under CROSSOVER_FAKE_NODES, else the hostname)."""
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    return "fake0" if os.environ.get(FAKE_NODES_ENV) else socket.gethostname()


def daemon_status(runtime_dir: str | os.PathLike | None = None, node: str | None = None,
                  timeout_s: float = 5.0) -> dict:
    """Ask a node's daemon for the status of all nodes: {node: snapshot}.

    Raises:
        ConnectionError: no daemon answers there (the message says how to start one).
    """
    path = socket_path(node or node_name(), runtime_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        send_msg(sock, P.Status())
        report = recv_msg(sock)
    except (OSError, P.ProtocolError) as exc:
        raise ConnectionError(f"no crossover daemon answers on {path} ({exc}); start one "
                              f"with `crossover daemon` or use --crossover-daemon auto") from None
    finally:
        sock.close()
    if not isinstance(report, P.StatusReport):
        raise ConnectionError(f"daemon on {path} answered {report.kind}, not a status report")
    return report.nodes


class CrossoverVersionError(RuntimeError):
    """The daemon speaks another protocol version: a set-up error, never silenced."""


@dataclass(frozen=True)
class RankInfo:
    """Where a rank stands in its job."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """From Horovod if initialised, else from the launcher's environment."""
        try:
            import horovod.common.basics  # noqa: F401 - cheap check that horovod exists

            for mod in ("horovod.torch", "horovod.tensorflow"):
                hvd = sys.modules.get(mod)
                if hvd is not None and hvd.is_initialized():
                    return cls(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
        except ImportError:
            pass
        env = os.environ
        for prefix in ("OMPI_COMM_WORLD_", "HOROVOD_"):  # mpirun, horovodrun --gloo
            if prefix + "RANK" in env:
                return cls(int(env[prefix + "RANK"]), int(env[prefix + "SIZE"]),
                           int(env.get(prefix + "LOCAL_RANK", 0)),
                           int(env.get(prefix + "LOCAL_SIZE", 1)))
        return cls(0, 1, 0, 1)


class SlotClient:
    """A rank's handle on the device slot.

    Args:
        job: the job's name, the same on all its ranks and unique among running jobs.
        info: the rank's place in the job.
        runtime_dir: where the daemons' sockets are (default: see `transport`).
        weight: priority weight for the `priority` policy.
        gpu: the CUDA device index this rank computes on, None on CPU.
        pin_cpu: pin the process to its device's cores (CPU devices only), as a GPU
            rank is bound to its GPU.
        wait_s: longest wait for a grant before going on uncoordinated for that step
            (default: twice the daemon's lease, so a hung holder is revoked first).
        trace: a recorder for slot-wait/hold/communicate events, or None.
    """

    def __init__(
        self,
        job: str,
        info: RankInfo,
        runtime_dir: str | os.PathLike | None = None,
        weight: float = 1.0,
        gpu: int | None = None,
        pin_cpu: bool = True,
        wait_s: float | None = None,
        trace: TraceRecorder | None = None,
    ) -> None:
        self.job = job
        self.info = info
        self.trace = trace
        self.device: str | None = None
        self.policy: str | None = None
        self.label: str | None = None  # node/device, for traces
        self._cores: list[int] = []
        self._phase: str | None = None
        self._phase_start = time.time()
        self._seq = 0
        self._sock: socket.socket | None = None
        self._warned = False
        self._last_renew = 0.0
        self._lease_s = 30.0
        # Uncoordinated (no daemon): give up and take the "slot" as crossover would,
        # so traces of a fail-open run still show the phases.
        self._release_on_communicate = True
        self._yield_on_step = False
        self._alone = False  # no other job on the device (the daemon says so): keep it
        # CROSSOVER_KEEP_WHEN_ALONE=0: release at every phase even alone (to trace them)
        self._keep_when_alone = os.environ.get("CROSSOVER_KEEP_WHEN_ALONE", "1") != "0"
        self._wait_s = wait_s
        fake = int(os.environ.get(FAKE_NODES_ENV, "0") or 0)
        node_index, local_rank = (info.local_rank % fake, info.local_rank // fake) if fake \
            else (None, info.local_rank)
        node = f"fake{node_index}" if fake else socket.gethostname()
        if os.environ.get(NODE_ENV):  # an emulated host: one name for all its ranks
            node, local_rank = os.environ[NODE_ENV], info.local_rank
        try:
            self.path = socket_path(node, runtime_dir)
            self._connect(P.Hello(job, info.rank, info.size, local_rank, info.local_size,
                                  os.getpid(), weight, gpu))
        except (OSError, P.ProtocolError) as exc:
            self._fail_open(f"cannot reach the crossover daemon at {self.path} ({exc})")
            return
        if pin_cpu and self._cores:
            os.sched_setaffinity(0, self._cores)

    @property
    def coordinated(self) -> bool:
        """True while a daemon schedules this rank."""
        return self._sock is not None

    def _connect(self, hello: P.Hello) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30.0)  # registration waits for the leader's job order at most this
        try:
            sock.connect(str(self.path))
            send_msg(sock, hello)
            reply = recv_msg(sock)
        except BaseException:
            sock.close()
            raise
        if isinstance(reply, P.Error):
            sock.close()
            if "version" in reply.message:
                raise CrossoverVersionError(reply.message)
            raise RuntimeError(f"crossover daemon refused job {self.job!r}: {reply.message}")
        if not isinstance(reply, P.Welcome):
            sock.close()
            raise P.ProtocolError(f"expected welcome, got {reply.kind}")
        self.device, self.policy, self._lease_s = reply.device, reply.policy, reply.lease_s
        self.label = f"{reply.node}/{reply.device}"
        self._cores = reply.cores
        self._release_on_communicate = reply.release_on_communicate
        self._yield_on_step = reply.yield_on_step
        if self._wait_s is None:
            self._wait_s = 2 * reply.lease_s + 5.0
        self._sock = sock

    # --- the slot ----------------------------------------------------------------------
    def acquire(self) -> None:
        """Block until this rank holds its device (or the wait limit passes)."""
        if not self.holding:
            self._request(release_first=False)

    def yield_slot(self) -> None:
        """Step boundary: let a waiting job in, then hold the device again.

        One round trip for a release and an acquire, sent only under policies that hand
        devices over at step boundaries (round-robin, priority); under crossover the
        rank just keeps the device.
        """
        if not self.holding:
            self._request(release_first=False)
        elif self._yield_on_step and not self._keep_alone():
            self._request(release_first=True)

    def release(self, phase: Phase = Phase.COMMUNICATE) -> None:
        """Give the device up: the rank now communicates (or idles).

        Under a policy that keeps the device through communication (round-robin) a
        COMMUNICATE release is a no-op: the rank goes on holding.
        """
        if phase == Phase.COMMUNICATE and not self._release_on_communicate:
            return
        if self.holding and not (phase != Phase.IDLE and self._keep_alone()):
            self._enter(phase.value)
            self._send(P.Release(phase.value))

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
        if self.trace is not None:
            self.trace.flush()

    def alone(self) -> bool:
        """True while the daemon says no other job shares this rank's device."""
        return self._keep_alone()

    # --- internals ---------------------------------------------------------------------
    def _keep_alone(self) -> bool:
        """Whether to keep the device instead of releasing it: no other job shares it.

        Reads the daemon's pending notices first, so a job that arrived since the last
        step is seen at this release point: a newcomer waits at most one hold of ours.
        """
        while self._sock is not None:
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
                if not readable:
                    break
                self._sock.settimeout(5.0)  # a notice is one small frame, sent whole
                self._on_notice(recv_msg(self._sock))
            except (OSError, P.ProtocolError) as exc:
                self._fail_open(f"lost the crossover daemon ({exc})")
        return self._alone and self._keep_when_alone and self._sock is not None

    def _on_notice(self, msg: P.Message) -> None:
        """A message the daemon sent unasked (or a grant for an abandoned wait)."""
        if isinstance(msg, P.Company):
            self._alone = msg.others == 0
        elif isinstance(msg, P.Error):
            self._fail_open(f"crossover daemon error: {msg.message}")

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
        if self._sock is not None:
            self._seq += 1
            self._send(P.Acquire(self._seq, release_first))
            self._await_grant()
        self._enter("hold")
        self._last_renew = time.monotonic()

    def _await_grant(self) -> None:
        deadline = time.monotonic() + self._wait_s
        while self._sock is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._warn(f"no grant for {self.device} within {self._wait_s:.0f} s; "
                           f"this step runs uncoordinated")
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

    def _send(self, msg: P.Message) -> None:
        if self._sock is None:
            return
        try:
            send_msg(self._sock, msg)
        except OSError as exc:
            self._fail_open(f"lost the crossover daemon ({exc})")

    def _fail_open(self, why: str) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._warn(f"{why}; job {self.job!r} rank {self.info.rank} trains on uncoordinated")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"crossover: WARNING: {message}", file=sys.stderr, flush=True)
