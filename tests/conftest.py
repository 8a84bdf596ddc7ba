"""Shared helpers: a real daemon and real Horovod jobs under mpirun on localhost.

Every wait here has a timeout; processes are started in their own session so that a
failing test can kill the whole tree.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from crossover import trace
from crossover.daemon.relay.launch import relay_mca_flags

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
# Four ranks on two cores: a rank waiting in an allreduce yields its core instead of
# spinning on it (as the demo and README advise for CPUs). Without it, two uncoordinated
# 2-rank jobs (the daemon-death test) ran past their 180 s on a slow day.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test another clone's code: the cached environment is shared by clones,
    and its editable install points at whichever ran `make env` last."""
    where = subprocess.run([PY, "-c", "import crossover; print(crossover.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    installed = Path(where.stdout.strip()).resolve().parents[1] if where.returncode == 0 \
        else "not importable"
    if installed != REPO:
        pytest.exit(f"the environment's crossover is {installed}, not this clone ({REPO}): "
                    "run `make env` (or `make test`) here first", returncode=4)


#: daemon.log lines a failed test's report shows: the world's events, not each rank's
LOG_TAIL_LINES = 60
CHATTER = re.compile(r" job \S+ rank \d+ (on|left) node ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that ran a daemon world shows the tail of that world's daemon.log
    in its report: CI keeps the report, not the test's temporary directory."""
    report = yield
    if report.failed:
        for log in sorted(_daemon_logs(item.funcargs.values())):
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if not CHATTER.search(ln)]
            report.sections.append((f"{log} (last {LOG_TAIL_LINES} lines, no ranks)",
                                    "\n".join(ln[:300] for ln in lines[-LOG_TAIL_LINES:])))
    return report


def _daemon_logs(values) -> set[Path]:
    found = set()
    for value in values:
        if isinstance(value, tuple):
            found |= _daemon_logs(value)
        runtime = getattr(value, "runtime", None)
        if isinstance(runtime, Path) and (runtime / "daemon.log").is_file():
            found.add(runtime / "daemon.log")
    return found


def mpirun(np: int, *cmd: str) -> list[str]:
    return ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np), *cmd]


# what torch prints when a std::thread of its gloo process group is torn down unjoined
# at exit: now and then after the script has finished, crossover or not (seen in plain
# torchrun runs of examples/ddp_mlp.py and a one-rank script without destroy)
TORCH_EXIT_ABORT = "terminate called without an active exception"


class Proc:
    """A started process tree with its output in a file. A `reference` run (the job
    without crossover, read only for its result) may end in torch's exit abort."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path,
                 reference: bool = False) -> None:
        self.log = log
        self.cmd = cmd
        self.reference = reference
        # appended to: a world's node services write the same file (`Cluster.daemon`)
        self._out = open(log, "a")  # noqa: SIM115 - closed in wait/kill
        self.popen = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                      cwd=REPO, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> str:
        """Wait for exit; fail the test (after killing the tree) on timeout or error."""
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.cmd} still running after {timeout} s:\n{self.output()[-3000:]}")
        self._out.close()
        if rc != 0 and self.reference and TORCH_EXIT_ABORT in self.output():
            return self.output()  # the caller reads the result, which must be complete
        assert rc == 0, f"{self.cmd} exited {rc}:\n{self.output()[-3000:]}"
        return self.output()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole tree: the process group, and descendants that left it
        (torchrun starts each rank in a session of its own)."""
        try:
            tree = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self._out.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def held(runtime: Path, job: str):
    """True once the daemon's status shows `job` has held every device (it trains); false
    while no daemon answers yet."""
    from crossover.probe import daemon_status

    def check() -> bool:
        try:
            nodes = daemon_status(runtime)
        except ConnectionError:
            return False
        devices = [d for node in nodes.values() for d in node["devices"].values()]
        return bool(devices) and all(d["usage"].get(job, {}).get("hold_pct", 0) > 0
                                     for d in devices)
    return check


class Cluster:
    """A runtime directory with a daemon (optionally N fake nodes) and jobs in it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.runtime = tmp / "run"
        self.traces = tmp / "traces"
        self.procs: list[Proc] = []
        self.env = dict(os.environ, CROSSOVER_RUNTIME_DIR=str(self.runtime))

    @contextmanager
    def daemon(self, nodes: int = 1, policy: str = "crossover", lease: float = 30.0,
               fake: bool = False, extra: tuple[str, ...] = (),
               prefix: tuple[str, ...] = ()) -> Iterator[Proc]:
        """Run a daemon (`prefix`: a command it runs under, e.g. prlimit) until the
        block ends."""
        args = ["-m", "crossover", "daemon", "--policy", policy, "--lease", str(lease), *extra]
        env = dict(self.env)
        if nodes > 1 or fake:
            env["CROSSOVER_FAKE_NODES"] = str(nodes)
            self.env["CROSSOVER_FAKE_NODES"] = str(nodes)
            # as crossoverrun starts a world: one daemon's death does not end the others
            cmd = mpirun(nodes, *relay_mca_flags(), PY, *args)
            names = [f"fake{i}" for i in range(nodes)]
            # the nodes' services log to the runtime directory's daemon.log (they outlive
            # the mpirun that started them): one file with mpirun's own output
            self.runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.tmp / "daemon.log").symlink_to(self.runtime / "daemon.log")
        else:
            cmd = [*prefix, PY, *args]
            names = [os.uname().nodename]
        proc = Proc(cmd, env, self.tmp / "daemon.log")
        self.procs.append(proc)
        wait_for(lambda: all((self.runtime / f"node-{n}.sock").exists() for n in names),
                 60, f"daemon sockets {names}")
        try:
            yield proc
        finally:
            proc.kill(signal.SIGTERM)
            self.stop_world()

    def job(self, name: str, seed: int, steps: int, np: int = 2, crossover: bool = True,
            extra: tuple[str, ...] = ()) -> Proc:
        env = dict(self.env, CROSSOVER_JOB=name, CROSSOVER_TRACE=str(self.traces))
        if not crossover:
            env["CROSSOVER_ENABLE"] = "0"
        out = self.tmp / f"{name}.pt"
        cmd = mpirun(np, PY, str(REPO / "examples/torch_mlp.py"), "--seed", str(seed),
                     "--steps", str(steps), "--out", str(out), *extra)
        proc = Proc(cmd, env, self.tmp / f"{name}.log")
        proc.weights = out
        self.procs.append(proc)
        return proc

    def start_args(self, n_jobs: int) -> tuple[str, ...]:
        """Job arguments that start `n_jobs` jobs' training loops together (a fresh
        `crossover.testing.start_barrier` directory for each group)."""
        where = tempfile.mkdtemp(prefix="start-", dir=self.tmp)
        return ("--start-barrier", where, "--start-jobs", str(n_jobs))

    def jobs_together(self, *specs: tuple) -> list[Proc]:
        """Start jobs (name, seed, steps, *extra args) that begin training at the same
        moment (a lone job keeps its device, so a late starter would find it finished);
        returns once every rank of every job has joined the daemon."""
        together = self.start_args(len(specs))
        procs = [self.job(name, seed, steps, extra=(*extra, *together))
                 for name, seed, steps, *extra in specs]
        log = self.tmp / "daemon.log"
        for name, *_ in specs:
            wait_for(lambda n=name: log.exists() and len(re.findall(
                rf"job {n} rank \d+ on node", log.read_text())) >= 2, 120, f"{name} to join")
        return procs

    def cleanup(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.kill()
        self.stop_world()

    def stop_world(self) -> None:
        """End every daemon process of this runtime directory: node services and the
        mpiruns of generations a leader started are no children of the first mpirun,
        and stopping that mpirun stops no service. `crossover stop`'s way first (the
        leader tells every node), then whatever is left."""
        from crossover.probe import stop_world

        for sock in sorted(self.runtime.glob("node-*.sock")) if self.runtime.exists() else []:
            try:
                stop_world(self.runtime, sock.name[len("node-"):-len(".sock")], timeout_s=2.0)
                time.sleep(1.0)
                break
            except ConnectionError:
                continue
        def ours() -> list[psutil.Process]:
            found = []
            for proc in psutil.process_iter(["cmdline"]):
                try:
                    cmd = proc.info["cmdline"] or []
                    if "crossover" in cmd and "daemon" in cmd and proc.environ().get(
                            "CROSSOVER_RUNTIME_DIR") == str(self.runtime):
                        found.append(proc)
                except psutil.Error:
                    pass
            return found
        for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
            procs = ours()
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            psutil.wait_procs(procs, timeout=5)


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An isolated runtime directory for crossoverrun; a daemon it starts there is
    stopped after the test (through `crossover stop`'s checks: a stale pid file never
    signals another process)."""
    from crossover.launch.daemons import UsageError, stop_daemons

    rdir = tmp_path / "run"
    monkeypatch.setenv("CROSSOVER_RUNTIME_DIR", str(rdir))
    yield rdir
    if rdir.exists():
        try:
            stop_daemons(str(rdir), force=True)
        except UsageError as exc:
            print(f"runtime fixture: {exc}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


def assert_ran_together(events: list[dict], min_handovers: int = 2) -> None:
    """Every device in the trace passed between jobs at least `min_handovers` times: the
    jobs ran at the same time (two handovers: one job held it before and after another),
    so a check that their holds never overlapped has tested something."""
    turns = trace.handovers(events)
    assert turns and min(turns.values()) >= min_handovers, (
        f"the jobs did not take turns on every device (handovers per device: {turns}, "
        f"{min_handovers} needed): they did not run at the same time, nothing was tested")


def assert_shared_in_turns(events: list[dict], jobs: set[str], devices: int) -> None:
    """The trace shows `devices` devices, each held by every one of `jobs`; the jobs ran
    together (`assert_ran_together`) and no two ever held a device at once."""
    holds = trace.holds_by_device(events)
    assert len(holds) == devices, holds.keys()
    assert all({job for _, _, job, _ in spans} == jobs for spans in holds.values()), {
        device: {job for _, _, job, _ in spans} for device, spans in holds.items()}
    assert_ran_together(events)
    assert trace.overlaps(events) == []


def same_weights(a: Path, b: Path) -> bool:
    """True when two saved state dicts are bit-identical."""
    import torch

    sa, sb = torch.load(a), torch.load(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
