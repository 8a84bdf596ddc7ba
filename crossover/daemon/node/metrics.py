"""The node service's Prometheus endpoint: who holds which device, how long, and what
the world looks like from this node.

Off unless `crossover daemon --metrics-port` names a port; then it is the service's one
network socket, bound to `--metrics-address` (127.0.0.1 unless set). Each node's service
serves its own node: Prometheus scrapes every node (`docs/configuration.md`).

The serve loop owns the scheduler and the world, and nothing else may read them while
it runs: a scrape, on the HTTP server's thread, asks the loop (`wakeup`) and waits up
to SCRAPE_WAIT_S for a copy of its figures, taken between two events (a 503 past that);
the scrape's thread then reads the ranks' memory and renders the text. A few scrapes at
a time are served, each connection for at most REQUEST_S: a port reached by others
cannot tie up the service's threads or descriptors.

Names follow Prometheus's conventions: base units, `_total` counters, `_info` metadata,
no rank label. A training job is `job_name`: Prometheus sets `job` itself, to the scrape
job, and would rename ours. A job's series are there while it has a rank on the node and go with it,
so their number stays bounded by the jobs present.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

from crossover import __version__
from crossover.daemon.node.users import owner_of
from crossover.daemon.world.leader import Durations
from crossover.protocol import Mode

log = logging.getLogger("crossover.daemon")

#: how long a scrape waits for the serve loop's figures
SCRAPE_WAIT_S = 2.0
#: scrapes served at once (more get a 503), and how long one connection may take
SCRAPES_AT_ONCE, REQUEST_S = 4, 5.0
#: the classic text format, which `generate_latest` writes and every Prometheus reads
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODES = [m.value for m in Mode]


class MetricsError(RuntimeError):
    """The metrics endpoint cannot be served (its library missing, its port taken)."""


def prometheus_client():
    """The optional `prometheus-client` library, or an error that says how to get it."""
    try:
        import prometheus_client as client
        import prometheus_client.core  # noqa: F401 - the metric families, as `client.core`
    except ImportError as exc:
        raise MetricsError("--metrics-port needs the prometheus-client library: "
                           "pip install 'crossover[metrics]' (or prometheus-client)") from exc
    return client


@dataclass
class NodeFigures:
    """What one node's service knows, as the serve loop read it for one scrape.

    Attributes:
        node: the node's name.
        user: the user the service runs as (the owner of every job on a daemon of one
            user; a service for several users names each job's owner in its key).
        leads: whether this node's service leads the world.
        world: `Member.snapshot()` (epoch, generation, members, lost).
        mode: the mode the node's devices are served in.
        accounts: `SlotScheduler.accounts()`: per device its grants and each job's held
            and waited seconds.
        memory: {(job, device): resident bytes of the job's ranks on that device}
            (`with_memory` fills it from `pids`, off the serve loop).
        pids: {(job, device): the pids of the job's ranks on that device}.
        groups: the leader's mode decisions, {group: {"mode": ...}} (the leader only).
        device_memory: {(job, device): (reserved, peak) bytes} of a GPU's memory, as
            the job's ranks there said (`Ranks.device_memory`).
        capacity: {device: bytes} of each GPU that a rank said.
        host_memory: the node's memory in bytes, which its CPU devices share.
        decisions: how long the leader's mode decisions took (the leader only).
        batch_jobs: {job: the batch system's id of the job (Slurm's, say)}, as its
            ranks said.
    """

    node: str
    user: str
    leads: bool
    world: dict
    mode: str
    accounts: dict[str, dict]
    memory: dict[tuple[str, str], int] = field(default_factory=dict)
    pids: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    groups: dict[str, dict] | None = None
    device_memory: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    host_memory: int = 0
    decisions: Durations | None = None
    batch_jobs: dict[str, str] = field(default_factory=dict)

    def with_memory(self) -> NodeFigures:
        """These figures with the memory of the ranks in `pids` read now."""
        if not self.pids:
            return self
        return dataclasses.replace(self, memory={place: resident_bytes(pids)
                                                 for place, pids in self.pids.items()})


def families(f: NodeFigures) -> list:
    """The metric families of one scrape (pure: the text is `render`'s)."""
    core = prometheus_client().core
    node = ["node"]
    out = []

    def gauge(name: str, doc: str, value: float) -> None:
        g = core.GaugeMetricFamily(name, doc, labels=node)
        g.add_metric([f.node], value)
        out.append(g)

    build = core.InfoMetricFamily("crossover_build", "The service's version and node.",
                                  labels=node)
    build.add_metric([f.node], {"version": __version__})
    out.append(build)
    world = f.world
    gauge("crossover_world_nodes", "Nodes in the world as this node sees it (alive).",
          world.get("members", 1))
    gauge("crossover_is_leader", "1 where this node's service leads the world.",
          1.0 if f.leads else 0.0)
    gauge("crossover_generation", "The world's generation this node's relay is of.",
          world.get("generation", 0))
    gauge("crossover_epoch", "The leader's epoch as this node follows it.",
          world.get("epoch", 0))
    gauge("crossover_lost_nodes", "Nodes this node's leader counts as lost.",
          len(world.get("lost", [])))
    mode = core.StateSetMetricFamily("crossover_mode", "The mode this node's devices "
                                     "are served in.", labels=node)
    mode.add_metric([f.node], {m: m == f.mode for m in MODES})
    out.append(mode)
    if f.decisions is not None:
        decisions = core.HistogramMetricFamily(
            "crossover_mode_decision_seconds", "How long the leader's mode decisions took, "
            "from the moment one was due (a group's jobs changed, a held mode drifted or "
            "its hold ended) to the decision.",
            labels=node)
        d = f.decisions
        le = prometheus_client().utils.floatToGoString  # "1.0", as its own histograms
        buckets = [(le(b), n) for b, n in zip(d.bounds, d.at_most, strict=True)]
        decisions.add_metric([f.node], [*buckets, ("+Inf", d.count)], sum_value=d.sum_s)
        out.append(decisions)
    if f.groups is not None:
        groups = core.StateSetMetricFamily(
            "crossover_group_mode", "Each group of jobs' mode, as the leader decided it.",
            labels=["group"])
        for group, decision in sorted(f.groups.items()):
            groups.add_metric([str(group)], {m: m == decision.get("mode") for m in MODES})
        out.append(groups)
    grants = core.CounterMetricFamily("crossover_grants", "Ranks granted a device (a "
                                      "job's ranks on it count one each).",
                                      labels=["node", "device"])
    info = core.InfoMetricFamily("crossover_job", "A job with a rank on a device.",
                                 labels=["job_name", "user", "device", "hpc_job"])
    held = core.CounterMetricFamily(
        "crossover_device_hold_seconds", "Seconds a job held a device (while any of its "
        "ranks on it did).", labels=["job_name", "device"])
    waited = core.CounterMetricFamily(
        "crossover_slot_wait_seconds", "Seconds a job waited for a device (while any of "
        "its ranks on it did).",
        labels=["job_name", "device"])
    memory = core.GaugeMetricFamily(
        "crossover_job_memory_bytes", "Resident memory of a job's ranks on a device.",
        labels=["job_name", "device"])
    on_device = core.GaugeMetricFamily(
        "crossover_job_device_memory_bytes", "A GPU's memory that a job's ranks on it "
        "hold (their allocator's reserved bytes, as they said).", labels=["job_name", "device"])
    peak = core.GaugeMetricFamily(
        "crossover_job_device_memory_peak_bytes", "The most of a GPU's memory that a job's "
        "ranks on it held (their allocators' peaks, summed).", labels=["job_name", "device"])
    capacity = core.GaugeMetricFamily(
        "crossover_device_memory_bytes", "A GPU's memory (as its ranks said); device "
        '"host": the node\'s memory, which its CPU devices share.', labels=["node", "device"])
    if f.host_memory:
        capacity.add_metric([f.node, "host"], f.host_memory)
    for device, total in sorted(f.capacity.items()):
        capacity.add_metric([f.node, device], total)
    for device, acc in sorted(f.accounts.items()):
        grants.add_metric([f.node, device], acc["grants"])
        for job, spent in sorted(acc["jobs"].items()):
            # on a service for several users the job's key names its owner
            info.add_metric([job, owner_of(job) or f.user, device,
                             f.batch_jobs.get(job, "")], {})
            held.add_metric([job, device], spent["held_s"])
            waited.add_metric([job, device], spent["waited_s"])
            if (job, device) in f.memory:
                memory.add_metric([job, device], f.memory[(job, device)])
            if (job, device) in f.device_memory:
                reserved, most = f.device_memory[(job, device)]
                on_device.add_metric([job, device], reserved)
                peak.add_metric([job, device], most)
    return [*out, grants, info, held, waited, memory, on_device, peak, capacity]


def render(f: NodeFigures) -> bytes:
    """The text exposition of one scrape."""
    client = prometheus_client()

    class Once:
        def collect(self) -> Iterable:
            return families(f)

    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return client.generate_latest(registry)


def resident_bytes(pids: Iterable[int]) -> int:
    """The resident set of the processes still there."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


class HighWater:
    """Counters that never go back between scrapes. A hold in progress counts up to the
    scrape, but a release the native fast path made is applied later, at its own time
    (`table`): the hold then ends before the moment an earlier scrape counted to."""

    def __init__(self) -> None:
        self._shown: dict[tuple, float] = {}

    def never_back(self, accounts: dict[str, dict]) -> dict[str, dict]:
        shown = {}
        for device, acc in accounts.items():
            for job, spent in acc["jobs"].items():
                for what in ("held_s", "waited_s"):
                    # the job's arrival on the device tells a run of it from the next
                    key = (device, job, spent.get("since"), what)
                    spent[what] = shown[key] = max(spent[what], self._shown.get(key, 0.0))
        self._shown = shown  # a job gone from a device is forgotten with its series
        return accounts


class _Scrape:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.figures: NodeFigures | None = None


class MetricsEndpoint:
    """The HTTP server on its thread, and the scrapes that wait for the serve loop.

    Args:
        address, port: where to listen.
        wakeup: wakes the serve loop (safe from another thread).
    """

    def __init__(self, address: str, port: int, wakeup: Callable[[], None]) -> None:
        prometheus_client()  # fail now, with the fix, not at the first scrape
        if not 0 <= port <= 65535:
            raise MetricsError(f"cannot serve metrics on port {port}: give --metrics-port "
                               "from 1 to 65535 (fake node N adds N to it)")
        self._wakeup = wakeup
        self._slots = threading.BoundedSemaphore(SCRAPES_AT_ONCE)
        self._counters = HighWater()
        self._lock = threading.Lock()
        self._pending: list[_Scrape] = []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = REQUEST_S  # a connection that says nothing is closed

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                if not endpoint._slots.acquire(blocking=False):
                    self.send_error(503, f"{SCRAPES_AT_ONCE} scrapes are being served")
                    return
                try:
                    text = endpoint.scrape()
                finally:
                    endpoint._slots.release()
                if text is None:
                    self.send_error(503, "the service did not answer in time")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *_) -> None:
                pass  # a scrape every few seconds is no news

        try:
            self._server = http.server.ThreadingHTTPServer((address, port), Handler)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {address}:{port} ({exc.strerror}):"
                               " choose another --metrics-port or --metrics-address") \
                from exc
        self._server.daemon_threads = True
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="crossover-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address)

    def scrape(self) -> bytes | None:
        """The text for one scrape (HTTP thread); None if the loop did not answer."""
        scrape = _Scrape()
        with self._lock:
            self._pending.append(scrape)
        self._wakeup()
        if not scrape.done.wait(SCRAPE_WAIT_S):
            with self._lock:
                if scrape in self._pending:
                    self._pending.remove(scrape)
            return None
        if scrape.figures is None:
            return None
        try:
            return render(scrape.figures.with_memory())
        except Exception:  # noqa: BLE001 - a scrape must never end the service
            log.exception("rendering the metrics failed")
            return None

    def answer(self, figures: Callable[[], NodeFigures]) -> None:
        """Copy the figures for the scrapes waiting (serve loop): one copy serves all."""
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            try:
                f: NodeFigures | None = figures()
                f.accounts = self._counters.never_back(f.accounts)
            except Exception:  # noqa: BLE001 - a scrape must never end the service
                log.exception("reading the metrics failed")
                f = None
        for scrape in pending:
            scrape.figures = f
            scrape.done.set()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
