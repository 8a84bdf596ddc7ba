"""CROSSOVER_* values: each variable's accepted forms as a table, what a job process does
with a bad one (says it once and trains on), and what the launcher and the daemon's
command do (refuse it before anything starts)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from crossover import environment as E
from crossover.launch import jobspec
from tests.conftest import PY, REPO

CROSSOVERRUN = [PY, "-m", "crossover.launch.cli"]
FLAG = "give 1/0, true/false, yes/no or on/off"


class Bad(str):
    """The exact error line a value gets."""


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No CROSSOVER_* from the caller's shell, and every bad value news again."""
    for name in E.VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(E, "_reported", set())


# (variable, value) -> the parsed setting, or Bad(the exact line); "" is unset.
TABLE = [
    (E.ENABLE, "", True),
    (E.ENABLE, "1", True),
    (E.ENABLE, "0", False),
    (E.ENABLE, "TRUE", True),
    (E.ENABLE, "No", False),
    (E.ENABLE, " on ", True),
    (E.ENABLE, "off", False),
    (E.ENABLE, "nah", Bad(f"CROSSOVER_ENABLE='nah': {FLAG} (default 1)")),
    (E.ENABLE, "2", Bad(f"CROSSOVER_ENABLE='2': {FLAG} (default 1)")),
    (E.JOB, "", None),
    (E.JOB, "resnet-1", "resnet-1"),
    (E.JOB, "my job.v2", "my job.v2"),
    (E.JOB, "a/b", Bad("CROSSOVER_JOB='a/b': give 1-200 printable characters without '/' "
                       "(default <script>-<pid of rank 0>)")),
    (E.JOB, "x" * 201, Bad(f"CROSSOVER_JOB='{'x' * 201}': give 1-200 printable characters "
                           f"without '/' (default <script>-<pid of rank 0>)")),
    (E.JOB, "a\tb", Bad("CROSSOVER_JOB='a\\tb': give 1-200 printable characters without "
                        "'/' (default <script>-<pid of rank 0>)")),
    (E.JOB_START, "", 0),
    (E.JOB_START, "1765000000123456789", 1765000000123456789),
    (E.JOB_START, "-5", Bad("CROSSOVER_JOB_START='-5': give the job's start in ns since the "
                            "epoch, a whole number >= 0 (default 0, or agreed with the name)")),
    (E.JOB_START, str(2**63), Bad(f"CROSSOVER_JOB_START='{2**63}': give the job's start in "
                                  f"ns since the epoch, a whole number >= 0 (default 0, or "
                                  f"agreed with the name)")),
    (E.RUNTIME_DIR, "", None),
    (E.RUNTIME_DIR, "/tmp/cx run", "/tmp/cx run"),
    (E.SYSTEM_DIR, "", "/run/crossover"),
    (E.SYSTEM_DIR, "/srv/cx", "/srv/cx"),
    (E.PRIORITY, "", 1.0),
    (E.PRIORITY, "3", 3.0),
    (E.PRIORITY, " 0.25", 0.25),
    (E.PRIORITY, "1e-3", 0.001),
    (E.PRIORITY, "abc", Bad("CROSSOVER_PRIORITY='abc': give a number > 0 (default 1)")),
    (E.PRIORITY, "-1", Bad("CROSSOVER_PRIORITY='-1': give a number > 0 (default 1)")),
    (E.PRIORITY, "0", Bad("CROSSOVER_PRIORITY='0': give a number > 0 (default 1)")),
    (E.PRIORITY, "nan", Bad("CROSSOVER_PRIORITY='nan': give a number > 0 (default 1)")),
    (E.PRIORITY, "inf", Bad("CROSSOVER_PRIORITY='inf': give a number > 0 (default 1)")),
    (E.TRACE, "", None),
    (E.TRACE, "out/traces", "out/traces"),
    (E.PIN_CPU, "", False),
    (E.PIN_CPU, "yes", True),
    (E.PIN_CPU, "maybe", Bad(f"CROSSOVER_PIN_CPU='maybe': {FLAG} (default 0)")),
    (E.KEEP_WHEN_ALONE, "", True),
    (E.KEEP_WHEN_ALONE, "false", False),
    (E.KEEP_WHEN_ALONE, "o", Bad(f"CROSSOVER_KEEP_WHEN_ALONE='o': {FLAG} (default 1)")),
    (E.INJECT, "", False),
    (E.INJECT, "1", True),
    (E.INJECT, "y", Bad(f"CROSSOVER_INJECT='y': {FLAG} (default 0)")),
    (E.NATIVE, "", True),
    (E.NATIVE, "OFF", False),
    (E.NATIVE, "-1", Bad(f"CROSSOVER_NATIVE='-1': {FLAG} (default 1)")),
    (E.NODE, "", None),
    (E.NODE, "host-B.lan_1", "host-B.lan_1"),
    (E.NODE, "a/b", Bad("CROSSOVER_NODE='a/b': give a node name of letters, digits, '.', "
                        "'-' or '_' (default the hostname)")),
    (E.NODE, "a b", Bad("CROSSOVER_NODE='a b': give a node name of letters, digits, '.', "
                        "'-' or '_' (default the hostname)")),
    (E.FAKE_NODES, "", 0),
    (E.FAKE_NODES, "3", 3),
    (E.FAKE_NODES, "-1", Bad("CROSSOVER_FAKE_NODES='-1': give a whole number of nodes >= 0 "
                             "(default 0)")),
    (E.FAKE_NODES, "1.5", Bad("CROSSOVER_FAKE_NODES='1.5': give a whole number of nodes >= 0 "
                              "(default 0)")),
    (E.FAKE_NODES, "2_0", Bad("CROSSOVER_FAKE_NODES='2_0': give a whole number of nodes >= 0 "
                              "(default 0)")),
    (E.WORLD_KEY, "", None),
    (E.WORLD_KEY, "00ff" * 8, bytes.fromhex("00ff" * 8)),
    (E.WORLD_KEY, "abcd", Bad("CROSSOVER_WORLD_KEY=<4 characters, not shown>: give the "
                              "world's key in hex, at least 32 digits (default the runtime "
                              "directory's world.key)")),
    (E.WORLD_KEY, "0x" + "ab" * 16, Bad("CROSSOVER_WORLD_KEY=<34 characters, not shown>: "
                                        "give the world's key in hex, at least 32 digits "
                                        "(default the runtime directory's world.key)")),
    (E.LOG_BYTES, "", 16 << 20),
    (E.LOG_BYTES, "65536", 65536),
    (E.LOG_BYTES, "100", Bad("CROSSOVER_LOG_BYTES='100': give a size in bytes, a whole "
                             f"number >= 4096 (default {16 << 20})")),
    (E.METRICS_PORT, "", None),
    (E.METRICS_PORT, "9464", 9464),
    (E.METRICS_PORT, "0", Bad("CROSSOVER_METRICS_PORT='0': give a port number from 1 to "
                              "65535 (default no metrics)")),
    (E.METRICS_ADDRESS, "", "127.0.0.1"),
    (E.METRICS_ADDRESS, "0.0.0.0", "0.0.0.0"),
    (E.METRICS_ADDRESS, "a b", Bad("CROSSOVER_METRICS_ADDRESS='a b': give an IPv4 "
                                   "address or host name (default 127.0.0.1)")),
    (E.RELAY_NETWORK, "", None),
    (E.RELAY_NETWORK, "eth0", "eth0"),
    (E.RELAY_NETWORK, "10.1.0.0/16", "10.1.0.0/16"),
    (E.RELAY_NETWORK, "any", "any"),
    (E.RELAY_NETWORK, "eth0 eth1", Bad("CROSSOVER_RELAY_NETWORK='eth0 eth1': give an "
                                       "interface name (eth0), an IPv4 network (10.1.0.0/16) "
                                       "or any (default the network of the node name's "
                                       "address)")),
]


def test_the_table_covers_every_variable_and_each_is_described():
    assert {name for name, _, _ in TABLE} == set(E.VARS)
    assert {name for name, _, want in TABLE if isinstance(want, Bad)} == set(E.VARS) - {
        E.RUNTIME_DIR, E.SYSTEM_DIR, E.TRACE}  # any string is a directory name
    # each says what it does: docs/configuration.md is made from these (tests/test_docs.py)
    assert all(var.about for var in E.VARS.values())


@pytest.mark.parametrize(("name", "value", "want"), TABLE,
                         ids=[f"{n}={v[:12]!r}" for n, v, _ in TABLE])
def test_value(name, value, want, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    var = E.VARS[name]
    if not isinstance(want, Bad):
        assert E.problem(name, value) is None and E.check(environ={name: value}) == []
        assert E.get(name) == want
        assert capsys.readouterr().err == ""
        return
    assert E.problem(name, value) == want
    assert E.check(environ={name: value}) == [want]
    if var.strict:  # the caller (the client) turns crossover off for the process
        with pytest.raises(ValueError) as exc:
            E.get(name)
        assert str(exc.value) == want
        return
    assert E.get(name) == var.bad
    assert E.get(name) == var.bad  # asked again (the hooks ask every step): said once
    assert capsys.readouterr().err.splitlines() == [f"crossover: WARNING: {want}; {var.effect}"]


@pytest.mark.parametrize(("accessor", "name", "safe", "effect"), [
    (E.enabled, E.ENABLE, False, "crossover is off in this process"),
    (E.job_name, E.JOB, None, "using <script>-<pid of rank 0>"),
    (E.priority, E.PRIORITY, 1.0, "using 1"),
    (E.pin_cpu, E.PIN_CPU, False, "using 0"),
    (E.keep_when_alone, E.KEEP_WHEN_ALONE, True, "using 1"),
    (E.inject, E.INJECT, False, "Horovod is not hooked in this process"),
    (E.native, E.NATIVE, True, "using 1"),
])
def test_a_job_process_goes_on_with_the_safe_setting(accessor, name, safe, effect,
                                                     monkeypatch, capsys):
    monkeypatch.setenv(name, "a/b")
    assert accessor() == safe
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"crossover: WARNING: {name}='a/b': ")
    assert err[0].endswith(f"; {effect}")


def test_node_and_fake_nodes_raise_naming_the_variable(monkeypatch):
    monkeypatch.setenv(E.FAKE_NODES, "3")
    assert E.node_name(4) == "fake1"
    monkeypatch.setenv(E.NODE, "hostB")
    assert E.node_name(4) == "hostB" and E.node_setting() == "hostB"
    monkeypatch.setenv(E.NODE, "host/B")
    with pytest.raises(ValueError, match=r"^CROSSOVER_NODE='host/B': give a node name"):
        E.node_name()
    monkeypatch.delenv(E.NODE)
    monkeypatch.setenv(E.FAKE_NODES, "two")
    with pytest.raises(ValueError, match=r"^CROSSOVER_FAKE_NODES='two': give a whole"):
        E.node_name()


@pytest.mark.parametrize(("name", "value"), [(E.NODE, "host/B"), (E.FAKE_NODES, "two")])
def test_a_bad_node_turns_crossover_off_for_the_rank(name, value, tmp_path, monkeypatch,
                                                      capsys):
    from crossover.client import RankInfo, SlotClient

    monkeypatch.setenv(name, value)
    c = SlotClient("job", RankInfo(0, 1, 0, 1), runtime_dir=tmp_path / "run")
    c.acquire()  # uncoordinated: returns at once
    c.release()
    c.close()
    assert not c.coordinated
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and E.problem(name, value) in err[0], err


def test_hooks_leave_the_job_alone_under_a_bad_enable(monkeypatch, capsys):
    import crossover

    monkeypatch.setenv(E.ENABLE, "nah")
    assert crossover.enabled() is False and crossover.enabled() is False
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_flag_keeps_its_signature(monkeypatch, capsys):
    assert E.flag("CROSSOVER_SOMETHING_ELSE", default=False) is False
    monkeypatch.setenv("CROSSOVER_SOMETHING_ELSE", "Yes")
    assert E.flag("CROSSOVER_SOMETHING_ELSE", default=False) is True
    monkeypatch.setenv("CROSSOVER_SOMETHING_ELSE", "sure")
    assert E.flag("CROSSOVER_SOMETHING_ELSE", default=False) is False
    monkeypatch.setenv(E.ENABLE, "nah")  # a bad CROSSOVER_ENABLE never means on
    assert E.flag(E.ENABLE) is False
    assert capsys.readouterr().err.splitlines() == [
        f"crossover: WARNING: CROSSOVER_SOMETHING_ELSE='sure': {FLAG} (default 0); using 0",
        f"crossover: WARNING: CROSSOVER_ENABLE='nah': {FLAG} (default 1); "
        f"crossover is off in this process",
    ]
    assert E.runtime_dir_setting() is None


def test_check_picks_a_side():
    env = {E.PRIORITY: "abc", E.NATIVE: "maybe", E.FAKE_NODES: "x", "OTHER": "?"}
    assert [line.split("=")[0] for line in E.check(environ=env)] == [
        E.PRIORITY, E.NATIVE, E.FAKE_NODES]
    assert [line.split("=")[0] for line in E.check("daemon", env)] == [E.NATIVE, E.FAKE_NODES]
    assert [line.split("=")[0] for line in E.check("job", env)] == [E.PRIORITY, E.FAKE_NODES]


def test_a_job_spec_env_is_checked_before_anything_starts():
    doc = {"jobs": [{"name": "a", "command": "python t.py", "np": 1,
                     "env": {"CROSSOVER_PRIORITY": "abc", "CROSSOVER_PIN_CPU": True}}]}
    with pytest.raises(jobspec.JobSpecError) as exc:
        jobspec.parse(doc)
    assert str(exc.value) == ("jobs: job 'a': field 'env': CROSSOVER_PRIORITY='abc': give a "
                              "number > 0 (default 1)")


# --- real processes --------------------------------------------------------------------
JOB_SCRIPT = textwrap.dedent("""
    import torch

    from crossover import session

    client = session.init(job="envjob")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        with session.step():
            loss = model(torch.ones(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    print("trained", "coordinated" if client.coordinated else "uncoordinated",
          "weight", client._hello.weight, flush=True)
""")


def run_job(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    return subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


@pytest.mark.parametrize("value", ["abc", "-1"])
def test_a_bad_priority_never_stops_the_job(value, tmp_path):
    # no daemon: the client fails open, and the job trains on with the default weight
    env = dict(os.environ, CROSSOVER_PRIORITY=value, CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    res = run_job(tmp_path, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained uncoordinated weight 1.0" in res.stdout
    named = [line for line in res.stderr.splitlines() if "CROSSOVER_PRIORITY" in line]
    assert named == [f"crossover: WARNING: CROSSOVER_PRIORITY={value!r}: give a number > 0 "
                     f"(default 1); using 1"], res.stderr
    assert "Traceback" not in res.stderr


def test_a_bad_priority_with_a_daemon_joins_it_with_the_default(cluster, tmp_path):
    # the daemon refuses a Hello of weight -1: the job used to die of that refusal
    with cluster.daemon():
        res = run_job(tmp_path, dict(cluster.env, CROSSOVER_PRIORITY="-1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained coordinated weight 1.0" in res.stdout
    assert [line for line in res.stderr.splitlines() if "CROSSOVER_PRIORITY" in line] == [
        "crossover: WARNING: CROSSOVER_PRIORITY='-1': give a number > 0 (default 1); "
        "using 1"], res.stderr


@pytest.fixture
def no_mpirun(tmp_path) -> tuple[dict[str, str], Path]:
    """An environment whose `mpirun` only leaves a mark, to show it never ran."""
    bin_dir, mark = tmp_path / "bin", tmp_path / "mpirun-ran"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text(f"#!/bin/sh\ntouch {mark}\n")
    (bin_dir / "mpirun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"))
    return env, mark


def test_crossoverrun_refuses_a_bad_value_before_starting_anything(no_mpirun, tmp_path):
    env, mark = no_mpirun
    env.update(CROSSOVER_PRIORITY="abc", CROSSOVER_ENABLE="nah")
    res = subprocess.run(CROSSOVERRUN + ["--crossover", "-np", "1", "-H", "localhost:1", PY,
                                         "-c", "print('started')"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"crossoverrun: error: CROSSOVER_ENABLE='nah': {FLAG} (default 1)",
        "crossoverrun: error: CROSSOVER_PRIORITY='abc': give a number > 0 (default 1)",
    ]
    assert "started" not in res.stdout
    assert not mark.exists(), "mpirun ran"
    assert not (tmp_path / "run").exists(), "a daemon was started"


def test_the_daemon_command_refuses_a_bad_value(tmp_path):
    env = dict(os.environ, CROSSOVER_NATIVE="maybe", CROSSOVER_PRIORITY="abc")
    res = subprocess.run([PY, "-m", "crossover", "daemon", "--runtime-dir",
                          str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=env)
    assert res.returncode == 2
    # CROSSOVER_PRIORITY is the jobs' business: the daemon does not read it
    assert res.stderr.splitlines() == [f"crossover daemon: CROSSOVER_NATIVE='maybe': {FLAG} "
                                       f"(default 1)"]
    assert not (tmp_path / "run").exists()


def test_the_local_runner_refuses_a_bad_value_before_starting_the_daemon(tmp_path,
                                                                         monkeypatch):
    from crossover.launch.local import DaemonProcess

    monkeypatch.setenv(E.FAKE_NODES, "x")
    with pytest.raises(ValueError) as exc:
        DaemonProcess(tmp_path / "run")
    assert str(exc.value) == ("CROSSOVER_FAKE_NODES='x': give a whole number of nodes >= 0 "
                              "(default 0)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("environ", "want"), [
    ({}, ""),
    ({"SLURM_JOB_ID": "4242"}, "4242"),
    ({"PBS_JOBID": "17.server", "LSB_JOBID": "9"}, "17.server"),
    ({"SLURM_JOB_ID": "4242", "PBS_JOBID": "17.server"}, "4242"),  # Slurm's first
    ({"SLURM_JOB_ID": "x" * 65}, ""),  # too long to be an id: not said
    ({"SLURM_JOB_ID": "42\n43"}, ""),
])
def test_the_batch_job_is_the_first_batch_systems_id_that_is_set(environ, want,
                                                                  monkeypatch):
    for name in E.BATCH_JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert E.batch_job() == want
