"""The node service's Prometheus endpoint: what the scheduler counts for it (tables on a
fake clock), the text it renders (parsed back by prometheus-client's own parser), its
HTTP server's answers, and a real daemon scraped while two jobs share its device."""

from __future__ import annotations

import json
import os
import pwd
import re
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

from crossover import protocol as P
from crossover import trace
from crossover.daemon.node import metrics as M
from crossover.daemon.world.leader import Durations
from crossover.protocol import Phase
from tests.conftest import PY, REPO, Cluster, Proc, wait_for
from tests.test_scheduler import build

USER = pwd.getpwuid(os.getuid()).pw_name
COMMUNICATE = Phase.COMMUNICATE  # a release before an allreduce hands the device over


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples}


# --- what the scheduler counts ------------------------------------------------------------
def play(sched, clock, table) -> None:
    """Apply (time, call, job, rank) rows: req, rel (before an allreduce), bye."""
    for t, op, job, rank in table:
        clock.now = t
        if op == "req":
            sched.request(job, rank)
        elif op == "rel":
            sched.release(job, rank, COMMUNICATE)
        else:
            sched.unregister(job, rank)


def spent(sched, device: str = "d0") -> dict[str, tuple[float, float]]:
    return {job: (acc["held_s"], acc["waited_s"])
            for job, acc in sched.accounts()[device]["jobs"].items()}


def test_accounts_count_each_jobs_hold_and_wait_and_the_grants():
    """A holds 0-1, B waits 0-1 and holds 1-3, A waits again 2-3 and holds from 3: at 4,
    A held 2 s and waited 1, B held 2 and waited 1, three grants."""
    sched, clock = build("crossover", {"A": ["d0"], "B": ["d0"]})
    play(sched, clock, [(0.0, "req", "A", 0), (0.0, "req", "B", 0), (1.0, "rel", "A", 0),
                        (2.0, "req", "A", 0), (3.0, "rel", "B", 0)])
    clock.now = 4.0
    assert spent(sched) == {"A": (2.0, 1.0), "B": (2.0, 1.0)}
    assert sched.accounts()["d0"]["grants"] == 3


def test_a_jobs_time_on_a_device_is_wall_clock_and_outlives_a_rank_but_not_the_job():
    """Two ranks of A on d0 hold it together 0-2 (2 s, not 4); rank 1 leaves at 3 and
    its time stays; A's last rank leaves at 5 and A's time on d0 goes; A run again
    starts from 0."""
    sched, clock = build("crossover", {"A": ["d0", "d0"], "B": ["d0"]})
    play(sched, clock, [(0.0, "req", "A", 0), (0.0, "req", "A", 1), (2.0, "rel", "A", 0),
                        (2.0, "rel", "A", 1), (3.0, "bye", "A", 1)])
    clock.now = 4.0
    assert spent(sched)["A"] == (2.0, 0.0)
    play(sched, clock, [(5.0, "bye", "A", 0)])
    assert "A" not in spent(sched)
    sched.register("A", 0, "d0", 0)
    play(sched, clock, [(6.0, "req", "A", 0)])
    clock.now = 7.0
    assert spent(sched)["A"] == (1.0, 0.0)
    assert sched.accounts()["d0"]["jobs"]["A"]["since"] == 5.0


def test_counters_never_go_back_and_start_again_for_a_job_run_again():
    """A hold counted up to one scrape may end earlier than that by the next (a fast-path
    release applied at its own, earlier time): the counter stays where it was. A job
    of the same name that arrives anew (another `since`) starts from its own count."""
    water = M.HighWater()

    def acc(held: float, since: float = 0.0) -> dict:
        return {"d0": {"grants": 1, "jobs": {"A": {"held_s": held, "waited_s": 0.0,
                                                   "since": since}}}}
    seen = [water.never_back(acc(v))["d0"]["jobs"]["A"]["held_s"]
            for v in (1.0, 2.5, 2.4, 3.0)]
    assert seen == [1.0, 2.5, 2.5, 3.0]
    assert water.never_back(acc(0.5, since=9.0))["d0"]["jobs"]["A"]["held_s"] == 0.5


# --- the text -------------------------------------------------------------------------------
FIGURES = M.NodeFigures(
    node="n1", user="alice", leads=True,
    world={"leader_node": "n1", "epoch": 2, "generation": 3, "members": 4,
           "lost": ["n3"]},
    mode="antiphase",
    accounts={"cpu0": {"grants": 7, "jobs": {"A": {"held_s": 1.5, "waited_s": 0.25},
                                             "B": {"held_s": 2.0, "waited_s": 0.5}}},
              "cpu1": {"grants": 0, "jobs": {}}},
    memory={("A", "cpu0"): 1000, ("B", "cpu0"): 2000},
    groups={"0": {"mode": "concurrent"}},
    decisions=Durations(sum_s=15.0, count=2, at_most=[0, 0, 1, 1, 2, 2, 2, 2, 2]),
    batch_jobs={"A": "4242"},
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
        **{("crossover_mode_decision_seconds_bucket", (("le", le), ("node", "n1"))): n
           for le, n in [("1.0", 0), ("2.5", 0), ("5.0", 1), ("10.0", 1), ("20.0", 2),
                         ("30.0", 2), ("60.0", 2), ("120.0", 2), ("300.0", 2),
                         ("+Inf", 2)]},
        ("crossover_mode_decision_seconds_sum", (("node", "n1"),)): 15.0,
        ("crossover_mode_decision_seconds_count", (("node", "n1"),)): 2.0,
    }
    assert got == expected


def test_a_decisions_histogram_counts_each_duration_under_every_bound_above_it():
    d = Durations()
    for seconds in (3.0, 12.0, 400.0):
        d.observe(seconds)
    assert (d.at_most, d.sum_s, d.count) == ([0, 0, 1, 1, 2, 2, 2, 2, 2], 415.0, 3)
    copy = d.copy()
    d.observe(0.5)
    assert copy.count == 3 and copy.at_most[0] == 0  # a snapshot, not a view


def test_a_job_of_a_service_for_several_users_names_its_owner():
    shared = M.NodeFigures(node="n1", user="crossover", leads=False, world={},
                           mode="antiphase",
                           accounts={"cpu0": {"grants": 1, "jobs": {
                               "bob/train": {"held_s": 1.0, "waited_s": 0.0}}}})
    info = [labels for (name, labels), _ in samples(M.render(shared)).items()
            if name == "crossover_job_info"]
    assert info == [(("device", "cpu0"), ("hpc_job", ""), ("job_name", "bob/train"),
                     ("user", "bob"))]


def test_a_member_without_jobs_shows_the_world_only():
    quiet = M.NodeFigures(node="n2", user="alice", leads=False,
                          world={"leader_node": "n1"}, mode="concurrent", accounts={})
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


def test_idle_connections_are_closed_and_scrapes_still_answered(monkeypatch):
    """Connections that send nothing hold no thread past REQUEST_S (a port others reach
    must not tie up the service's threads and descriptors)."""
    monkeypatch.setattr(M, "REQUEST_S", 0.5)
    woken = threading.Event()
    endpoint = M.MetricsEndpoint("127.0.0.1", 0, woken.set)
    before = threading.active_count()
    idle = [socket.create_connection(endpoint.address) for _ in range(20)]
    try:
        wait_for(lambda: threading.active_count() <= before, 10, "idle handlers to end",
                 interval=0.1)
        answering = threading.Thread(
            target=lambda: woken.wait(5) and endpoint.answer(lambda: FIGURES), daemon=True)
        answering.start()
        host, port = endpoint.address
        assert get(f"http://{host}:{port}/metrics")[0] == 200
    finally:
        for sock in idle:
            sock.close()
        endpoint.close()


def test_a_port_past_65535_is_refused_with_the_fix():
    with pytest.raises(M.MetricsError, match="from 1 to 65535"):
        M.MetricsEndpoint("127.0.0.1", 65537, lambda: None)


def test_each_setting_comes_from_its_flag_else_its_variable(monkeypatch):
    from crossover.__main__ import build_parser
    from crossover.daemon.command import _metrics_setting, _with_metrics

    def setting(argv: list[str], **env: str):
        for name in ("CROSSOVER_METRICS_PORT", "CROSSOVER_METRICS_ADDRESS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        try:
            return _metrics_setting(build_parser().parse_args(["daemon", *argv]))
        except ValueError as exc:
            return str(exc)
    table = [  # (flags, environment, the setting)
        ([], {}, None),
        ([], {"CROSSOVER_METRICS_PORT": "9000"}, ("127.0.0.1", 9000)),
        (["--metrics-port", "9464"], {"CROSSOVER_METRICS_ADDRESS": "0.0.0.0"},
         ("0.0.0.0", 9464)),
        (["--metrics-port", "9464"], {"CROSSOVER_METRICS_PORT": "http"}, ("127.0.0.1", 9464)),
        (["--metrics-port", "9464", "--metrics-address", "10.0.0.5"],
         {"CROSSOVER_METRICS_ADDRESS": "0.0.0.0"}, ("10.0.0.5", 9464)),
        (["--metrics-address", "10.0.0.5"], {},
         "--metrics-address needs --metrics-port (or CROSSOVER_METRICS_PORT)"),
    ]
    for flags, env, want in table:
        assert setting(flags, **env) == want, (flags, env)
    assert _with_metrics(["daemon", "--metrics-port", "1", "--lease", "3",
                          "--metrics-address=h"], ("0.0.0.0", 5)) == [
        "daemon", "--lease", "3", "--metrics-address", "0.0.0.0", "--metrics-port", "5"]


def test_a_port_in_use_is_named_with_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(M.MetricsError, match=rf"127.0.0.1:{port} .*--metrics-port"):
            M.MetricsEndpoint("127.0.0.1", port, lambda: None)


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--metrics-port", "0", "give a port number from 1 to 65535"),
    ("--metrics-port", "65536", "give a port number from 1 to 65535"),
    ("--metrics-port", "http", "give a port number from 1 to 65535"),
    ("--metrics-address", "a/b", "give an IPv4 address or host name"),
    ("--metrics-address", "", "give an IPv4 address or host name"),
])
def test_a_bad_setting_is_refused_by_the_command_line(flag, value, said):
    out = subprocess.run([PY, "-m", "crossover", "daemon", flag, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and said in out.stderr


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


@pytest.mark.mpi
def test_a_gpu_jobs_memory_is_shown_beside_its_devices_capacity(cluster: Cluster):
    """Two ranks of a job on GPU 0 say what their allocators hold: status and metrics
    show the job's sum on that device beside the device's capacity, and the node's
    memory as the CPU devices' capacity; its batch job's id labels it."""
    from crossover.__main__ import status_table
    from crossover.probe import daemon_status
    from crossover.transport import connect, recv_msg, send_msg

    port = free_port()
    gib = 1 << 30
    with cluster.daemon(extra=("--metrics-port", str(port))):
        sock_path = next(cluster.runtime.glob("node-*.sock"))
        socks = []
        try:
            for rank in (0, 1):
                sock = connect(sock_path, 10)
                socks.append(sock)
                send_msg(sock, P.Hello("G", rank, 2, rank, 2, os.getpid(), 1.0, 0,
                                       batch_job="4242"))
                while not isinstance(reply := recv_msg(sock), P.Welcome):
                    assert not isinstance(reply, P.Error), reply
                send_msg(sock, P.Memory((rank + 1) * gib, 2 * (rank + 1) * gib, 80 * gib))

            def memory() -> dict:
                return next(iter(daemon_status(cluster.runtime).values())).get("memory", {})
            wait_for(lambda: len(memory().get("gpu0", {}).get("jobs", {}).get("G", {})) == 2
                     and memory()["gpu0"]["jobs"]["G"]["reserved"] == 3 * gib, 10,
                     "both ranks' reports")
            assert memory() == {"gpu0": {"capacity": 80 * gib, "jobs": {
                "G": {"reserved": 3 * gib, "peak": 6 * gib}}}}
            table = status_table(daemon_status(cluster.runtime))
            assert "gpu0    memory: G 3.0 GiB (peak 6.0 GiB) of 80.0 GiB" in table, table
            status, body = get(f"http://127.0.0.1:{port}/metrics")
            got = samples(body)
        finally:
            for sock in socks:
                sock.close()
    assert got[("crossover_job_info", (("device", "gpu0"), ("hpc_job", "4242"),
                                       ("job_name", "G"), ("user", USER)))] == 1.0
    assert got[("crossover_job_device_memory_bytes",
                (("device", "gpu0"), ("job_name", "G")))] == 3 * gib
    assert got[("crossover_job_device_memory_peak_bytes",
                (("device", "gpu0"), ("job_name", "G")))] == 6 * gib
    node = next(dict(labels)["node"] for (name, labels) in got if name == "crossover_build_info")
    assert got[("crossover_device_memory_bytes", (("device", "gpu0"), ("node", node)))] == \
        80 * gib
    assert got[("crossover_device_memory_bytes", (("device", "host"), ("node", node)))] > 0


# --- a real Prometheus -----------------------------------------------------------------------
PROMETHEUS = shutil.which("prometheus")


def prometheus_query(port: int, query: str, at: float | None = None) -> list[dict]:
    """The result of an instant query (at `at`, else now); fails on a query error."""
    args = {"query": query, **({"time": f"{at:.3f}"} if at is not None else {})}
    status, body = get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(args))
    assert status == 200, (query, body[-500:])
    return json.loads(body)["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of each query of deploy/grafana/crossover.json, with its
    variables as "All" and Grafana's rate interval as 5 s (the test scrapes every
    second)."""
    board = json.loads((REPO / "deploy/grafana/crossover.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "5s")
            out.append((panel["title"], re.sub(r"\$(instance|job_name)", ".*", expr)))
    return out


def test_the_dashboard_asks_only_for_what_the_services_serve():
    """Every metric a panel of the Grafana dashboard queries is one the service renders
    (the real Prometheus test runs each query)."""
    served = set(re.findall(r"^(crossover_\w+?)(?:\{| )", M.render(FIGURES).decode(), re.M))
    asked = {name for _, expr in dashboard_queries()
             for name in re.findall(r"crossover_\w+", expr)}
    assert asked and asked <= served, asked - served


#: How late the service may count a hold, or answer a scrape, after the moment it
#: stands for (its loop and a loaded machine).
LATE_S = 0.25


def reserved_bounds(holds: list[tuple[float, float, str, int]], job: str,
                    until_s: float) -> tuple[float, float]:
    """What the service may count of `job`'s holds on one device up to `until_s`, from
    the traces of every job on it (one holds it at a time): at least each hold as its
    rank timed it; at most from the previous hold's end (the service grants no sooner
    than it hears of that release) to the next hold's start (it hears of this release
    before it grants the next)."""
    until_us = until_s * 1e6
    low = high = 0.0
    for i, (start, end, j, _) in enumerate(holds):
        if j != job or start >= until_us:
            continue
        before = holds[i - 1][1] if i else start
        after = holds[i + 1][0] if i + 1 < len(holds) else end
        low += min(end, until_us) - start
        high += min(max(after, end), until_us) - min(before, start)
    return low / 1e6, high / 1e6


@pytest.mark.mpi
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (make test "
                    "installs it as root)")
def test_a_real_prometheus_scrapes_two_nodes_hold_seconds_as_the_traces_bound_them(
        cluster: Cluster):
    """Prometheus scrapes the services of two nodes every second while two jobs, with a
    rank on each node, take turns on their devices. Each job's hold seconds on each
    device grow, and every sample taken while the jobs ran lies within what the jobs'
    traces allow up to the sample's time (`reserved_bounds`, with 1 % for the clocks)."""
    port, web = free_port(), free_port()
    config = cluster.tmp / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{port + n}'" for n in range(2))  # fake node n: +n
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs: [{job_name: crossover, static_configs: "
        f"[{{targets: [{targets}]}}]}}]\n")
    with cluster.daemon(nodes=2, extra=("--metrics-port", str(port))):
        prom = Proc([PROMETHEUS, f"--config.file={config}",
                     f"--storage.tsdb.path={cluster.tmp / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{web}"], cluster.env,
                    cluster.tmp / "prometheus.log")
        cluster.procs.append(prom)
        wait_for(lambda: get(f"http://127.0.0.1:{web}/-/ready", 2.0)[0] == 200
                 if prom.popen.poll() is None else pytest.fail(prom.output()[-2000:]),
                 60, "prometheus to be ready", interval=0.5)
        wait_for(lambda: len(prometheus_query(web, "crossover_build_info")) == 2, 30,
                 "both nodes scraped", interval=0.5)
        jobs = cluster.jobs_together(("A", 1, 600), ("B", 2, 600))
        for job in jobs:
            job.wait(300)
        series = prometheus_query(
            web, 'crossover_device_hold_seconds_total{job_name=~"A|B"}[10m]')
        # the Grafana dashboard's queries, at a moment both jobs ran
        while_both = sorted(float(t) for s in series for t, _ in s["values"])
        dashboard = {title: prometheus_query(web, expr, while_both[len(while_both) // 2])
                     for title, expr in dashboard_queries()}
        labels = get(f"http://127.0.0.1:{web}/api/v1/label/job_name/values?" +
                     urllib.parse.urlencode({"match[]": "crossover_job_info"}))[1]
    # each panel has data (the leader's group modes only under an adaptive policy)
    assert {title for title, found in dashboard.items() if not found} <= {
        "Mode of each group of jobs (the leader's decision)"}, dashboard
    assert {"A", "B"} <= set(json.loads(labels)["data"])  # the job variable's choices
    holds = trace.holds_by_device(trace.merge(sorted(cluster.traces.glob("*.json")),
                                              cluster.tmp / "merged.json"))
    node = {f"127.0.0.1:{port + n}": f"fake{n}" for n in range(2)}
    places = {(s["metric"]["job_name"], node[s["metric"]["instance"]]) for s in series}
    assert places == {(j, f"fake{n}") for j in "AB" for n in range(2)}, series
    compared = 0
    for s in series:
        job, device = s["metric"]["job_name"], s["metric"]["device"]
        traced = holds[f"{node[s['metric']['instance']]}/{device}"]
        points = [(float(t), float(v)) for t, v in s["values"]]
        values = [v for _, v in points]
        assert len(points) >= 3 and values == sorted(values) and values[-1] > values[0], \
            points
        for at, value in points:
            # a fast-path hold counts once the service's loop applies the rank's event
            # (backdated to when the rank wrote it), and the service computes the sample
            # after Prometheus stamps the scrape: each up to LATE_S (a loaded 2-core CI
            # saw a sample 16 ms short on 1.05 s of holds: a stall of the
            # service's loop can make more)
            low = reserved_bounds(traced, job, at - LATE_S)[0]
            high = reserved_bounds(traced, job, at + LATE_S)[1]
            if low >= 0.5:  # half a second of holds: past the clocks' noise
                compared += 1
                assert 0.99 * low <= value <= 1.01 * high, (job, device, at, low, value, high)
    assert compared >= 8, series


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
