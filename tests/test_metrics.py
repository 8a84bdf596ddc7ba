"""The node service's Prometheus endpoint: what the scheduler counts for it (tables on a
fake clock), the text it renders (parsed back by prometheus-client's own parser), its
HTTP server's answers, and a real daemon scraped while two jobs share its device."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossover import trace
from crossover.daemon import metrics as M
from crossover.protocol import Phase
from tests.conftest import PY, Cluster, Proc, wait_for
from tests.test_scheduler import build

COMMUNICATE = Phase.COMMUNICATE  # a release before an allreduce hands the device over


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples}


# --- what the scheduler counts ------------------------------------------------------------
def test_accounts_count_each_jobs_hold_and_wait_and_the_grants():
    """A holds 0-1, B waits 0-1 and holds 1-3, A waits again 2-3 and holds from 3: at 4,
    A held 2 s and waited 1, B held 2 and waited 1, three grants."""
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d0"]})
    table = [  # (time, call, job)
        (0.0, "req", "A"), (0.0, "req", "B"), (1.0, "rel", "A"),
        (2.0, "req", "A"), (3.0, "rel", "B"),
    ]
    for t, op, job in table:
        clock.now = t
        if op == "req":
            sched.request(job, 0)
        else:
            sched.release(job, 0, COMMUNICATE)
    clock.now = 4.0
    assert sched.accounts() == {"d0": {"grants": 3, "jobs": {
        "A": {"held_s": 2.0, "waited_s": 1.0}, "B": {"held_s": 2.0, "waited_s": 1.0}}}}
    sched.unregister("B", 0)  # a job that left is no longer counted
    assert set(sched.accounts()["d0"]["jobs"]) == {"A"}


def test_counters_never_go_back_and_forget_a_job_that_left():
    """A hold counted up to one scrape may end earlier than that by the next (a fast-path
    release applied at its own, earlier time): the counter stays where it was."""
    water = M.HighWater()

    def acc(held: float, jobs: tuple[str, ...] = ("A",)) -> dict:
        return {"d0": {"grants": 1, "jobs": {j: {"held_s": held, "waited_s": 0.0}
                                              for j in jobs}}}
    seen = [water.never_back(acc(v))["d0"]["jobs"]["A"]["held_s"]
            for v in (1.0, 2.5, 2.4, 3.0)]
    assert seen == [1.0, 2.5, 2.5, 3.0]
    water.never_back(acc(0.0, jobs=()))  # A left the device
    assert water.never_back(acc(0.5))["d0"]["jobs"]["A"]["held_s"] == 0.5


# --- the text -------------------------------------------------------------------------------
FIGURES = M.NodeFigures(
    node="n1", user="alice",
    world={"leader_node": "n1", "epoch": 2, "generation": 3, "members": 4,
           "lost": ["n3"]},
    mode="antiphase",
    accounts={"cpu0": {"grants": 7, "jobs": {"A": {"held_s": 1.5, "waited_s": 0.25},
                                             "B": {"held_s": 2.0, "waited_s": 0.5}}},
              "cpu1": {"grants": 0, "jobs": {}}},
    memory={("A", "cpu0"): 1000, ("B", "cpu0"): 2000},
    groups={"0": {"mode": "concurrent"}},
    hpc_jobs={"A": "4242"},
)


def test_the_text_names_every_figure_by_prometheus_conventions():
    got = samples(M.render(FIGURES))
    expected = {
        ("crossover_build_info", (("node", "n1"), ("version", M.__version__))): 1.0,
        ("crossover_world_nodes", (("node", "n1"),)): 4.0,
        ("crossover_is_leader", (("node", "n1"),)): 1.0,
        ("crossover_generation", (("node", "n1"),)): 3.0,
        ("crossover_epoch", (("node", "n1"),)): 2.0,
        ("crossover_lost_nodes", (("node", "n1"),)): 1.0,
        ("crossover_mode", (("crossover_mode", "antiphase"), ("node", "n1"))): 1.0,
        ("crossover_mode", (("crossover_mode", "concurrent"), ("node", "n1"))): 0.0,
        ("crossover_group_mode", (("crossover_group_mode", "antiphase"), ("group", "0"))):
            0.0,
        ("crossover_group_mode", (("crossover_group_mode", "concurrent"), ("group", "0"))):
            1.0,
        ("crossover_grants_total", (("device", "cpu0"), ("node", "n1"))): 7.0,
        ("crossover_grants_total", (("device", "cpu1"), ("node", "n1"))): 0.0,
        ("crossover_job_info", (("device", "cpu0"), ("hpc_job", "4242"), ("job_name", "A"),
                                ("user", "alice"))): 1.0,
        ("crossover_job_info", (("device", "cpu0"), ("hpc_job", ""), ("job_name", "B"),
                                ("user", "alice"))): 1.0,
        ("crossover_device_hold_seconds_total", (("device", "cpu0"), ("job_name", "A"))): 1.5,
        ("crossover_device_hold_seconds_total", (("device", "cpu0"), ("job_name", "B"))): 2.0,
        ("crossover_slot_wait_seconds_total", (("device", "cpu0"), ("job_name", "A"))): 0.25,
        ("crossover_slot_wait_seconds_total", (("device", "cpu0"), ("job_name", "B"))): 0.5,
        ("crossover_job_memory_bytes", (("device", "cpu0"), ("job_name", "A"))): 1000.0,
        ("crossover_job_memory_bytes", (("device", "cpu0"), ("job_name", "B"))): 2000.0,
    }
    assert got == expected


def test_a_member_without_jobs_shows_the_world_only():
    quiet = M.NodeFigures(node="n2", user="alice", world={"leader_node": "n1"},
                          mode="concurrent", accounts={})
    got = samples(M.render(quiet))
    assert got[("crossover_is_leader", (("node", "n2"),))] == 0.0
    assert not any(name.startswith(("crossover_device_hold", "crossover_job_info",
                                    "crossover_group_mode")) for name, _ in got)


# --- the HTTP server --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""  # nothing listens (yet)


def test_a_scrape_is_rendered_by_the_loop_and_answered():
    """A stand-in serve loop answers when woken; paths other than /metrics are 404."""
    woken = threading.Event()
    endpoint = M.MetricsEndpoint("127.0.0.1", 0, woken.set)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if woken.wait(0.05):
                woken.clear()
                endpoint.answer(lambda: FIGURES)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        host, port = endpoint.address
        status, body = get(f"http://{host}:{port}/metrics")
        assert status == 200
        assert samples(body)[("crossover_grants_total",
                              (("device", "cpu0"), ("node", "n1")))] == 7.0
        assert get(f"http://{host}:{port}/")[0] == 404
    finally:
        stop.set()
        thread.join(5)
        endpoint.close()


def test_a_scrape_the_loop_does_not_answer_gets_503(monkeypatch):
    monkeypatch.setattr(M, "SCRAPE_WAIT_S", 0.2)
    endpoint = M.MetricsEndpoint("127.0.0.1", 0, lambda: None)
    try:
        host, port = endpoint.address
        assert get(f"http://{host}:{port}/metrics")[0] == 503
    finally:
        endpoint.close()


def test_a_port_in_use_is_named_with_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(M.MetricsError, match=rf"127.0.0.1:{port} .*--metrics-port"):
            M.MetricsEndpoint("127.0.0.1", port, lambda: None)


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_port_is_refused_by_the_command_line(port):
    out = subprocess.run([PY, "-m", "crossover", "daemon", "--metrics-port", port],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give a port number from 1 to 65535" in out.stderr


# --- a real daemon ---------------------------------------------------------------------------
def hold_seconds(port: int) -> dict[str, float]:
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return {dict(labels)["job_name"]: value for (name, labels), value in samples(body).items()
            if name == "crossover_device_hold_seconds_total"}


@pytest.mark.mpi
def test_a_daemon_shows_two_running_jobs_holds_and_forgets_them_when_they_end(
        cluster: Cluster):
    port = free_port()
    with cluster.daemon(extra=("--metrics-port", str(port))):
        jobs = cluster.jobs_together(("A", 1, 400), ("B", 2, 400))
        wait_for(lambda: set(hold_seconds(port)) == {"A", "B"}, 60, "both jobs' series")
        wait_for(lambda: min(hold_seconds(port).values()) > 0, 60, "both jobs to hold")
        first = hold_seconds(port)
        time.sleep(2.0)
        later = hold_seconds(port)
        assert all(later[j] > first[j] > 0 for j in ("A", "B")), (first, later)
        for job in jobs:
            job.wait(300)
        wait_for(lambda: hold_seconds(port) == {}, 30, "the ended jobs' series to go")


# --- a real Prometheus -----------------------------------------------------------------------
PROMETHEUS = shutil.which("prometheus")


def prometheus_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    status, body = get(url)
    assert status == 200, body[-500:]
    return json.loads(body)["data"]["result"]


def traced_holds(holds: list[tuple[float, float, str, int]], job: str,
                 until_s: float) -> tuple[float, int]:
    """Seconds `job`'s ranks held the device up to `until_s` as their traces say, and
    how many holds that was."""
    until_us = until_s * 1e6
    mine = [(start, end) for start, end, j, _ in holds if j == job and start < until_us]
    return sum(min(end, until_us) - start for start, end in mine) / 1e6, len(mine)



@pytest.mark.mpi
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (make test "
                    "installs it as root)")
def test_a_real_prometheus_scrapes_each_jobs_hold_seconds_as_the_traces_count_them(
        cluster: Cluster):
    """Prometheus scrapes the daemon every second while two jobs share its devices in
    turns. Each sample of a job's hold seconds on a device, taken while it ran, covers
    what the job's own traces count up to the sample's time (the service counts a hold
    from its grant to the release it receives, the rank from the grant it receives to
    its release), and the two jobs' samples together never exceed the time since the
    device's first hold (one job holds it at a time)."""
    port, web = free_port(), free_port()
    config = cluster.tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: crossover, static_configs: "
        f"[{{targets: ['127.0.0.1:{port}']}}]}}]\n")
    with cluster.daemon(extra=("--metrics-port", str(port))):
        prom = Proc([PROMETHEUS, f"--config.file={config}",
                     f"--storage.tsdb.path={cluster.tmp / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{web}"], cluster.env,
                    cluster.tmp / "prometheus.log")
        cluster.procs.append(prom)
        wait_for(lambda: get(f"http://127.0.0.1:{web}/-/ready", 2.0)[0] == 200
                 if prom.popen.poll() is None else pytest.fail(prom.output()[-2000:]),
                 60, "prometheus to be ready", interval=0.5)
        jobs = cluster.jobs_together(("A", 1, 600), ("B", 2, 600))
        for job in jobs:
            job.wait(300)
        series = prometheus_query(
            web, 'crossover_device_hold_seconds_total{job_name=~"A|B"}[10m]')
    holds = trace.holds_by_device(trace.merge(sorted(cluster.traces.glob("*.json")),
                                              cluster.tmp / "merged.json"))
    places = sorted((s["metric"]["job_name"], s["metric"]["device"]) for s in series)
    assert places == [(j, d) for j in "AB" for d in ("cpu0", "cpu1")], series
    by_device: dict[str, dict[float, float]] = {}  # the jobs' samples summed per time
    compared = 0
    for s in series:
        job, device = s["metric"]["job_name"], s["metric"]["device"]
        points = [(float(t), float(v)) for t, v in s["values"]]
        values = [v for _, v in points]
        assert len(points) >= 3 and values == sorted(values) and values[-1] > values[0], \
            points
        traced = holds[next(d for d in holds if d.endswith(f"/{device}"))]  # node/device
        for at, value in points:
            counted, _ = traced_holds(traced, job, at)
            if counted >= 1.0:  # a second of holds: past any clock's noise
                compared += 1
                assert value >= 0.99 * counted, (job, device, at, value, counted)
            sums = by_device.setdefault(device, {})
            sums[at] = sums.get(at, 0.0) + value
    assert compared >= 4, series
    for device, sums in by_device.items():
        first = holds[next(d for d in holds if d.endswith(f"/{device}"))][0][0] / 1e6
        for at, total in sums.items():
            if at > first:
                assert total <= 1.01 * (at - first) + 0.01, (device, at, total, at - first)


@pytest.mark.mpi
def test_the_environment_turns_metrics_on_and_a_bad_value_is_refused(cluster: Cluster):
    port = free_port()
    cluster.env["CROSSOVER_METRICS_PORT"] = str(port)
    with cluster.daemon():
        status, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"crossover_build_info" in body
    bad = subprocess.run([PY, "-m", "crossover", "daemon"], capture_output=True, text=True,
                         timeout=60, env={**cluster.env, "CROSSOVER_METRICS_PORT": "http"})
    assert bad.returncode == 2 and "CROSSOVER_METRICS_PORT='http'" in bad.stderr
