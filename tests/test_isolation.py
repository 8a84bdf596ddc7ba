"""Who can reach a daemon: its user's processes only, over a Unix socket only."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.conftest import PY, REPO, Cluster

pytestmark = pytest.mark.mpi  # real processes

# Run as `nobody` with the system's Python (the environment lives under /root, which
# nobody may not enter): only the standard library is needed to try the door.
INTRUDER = """
import os, socket, sys
run = sys.argv[1]
try:
    os.listdir(run)
    print("listed")
except PermissionError:
    print("no listing")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(os.path.join(run, sys.argv[2]))
    print("connected")
except PermissionError:
    print("no connection")
"""


@pytest.fixture
def open_parent():
    """A parent directory anyone may enter, so that only the runtime directory's own
    mode stands between another user and the daemon."""
    parent = Path(tempfile.mkdtemp(prefix="crossover-iso-", dir="/tmp"))
    parent.chmod(0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON),
                    reason="switching to another user needs root and a system Python")
def test_another_user_can_neither_list_nor_connect(open_parent):
    c = Cluster(open_parent)
    try:
        with c.daemon():
            sock = next(c.runtime.glob("node-*.sock")).name
            res = subprocess.run([SYSTEM_PYTHON, "-c", INTRUDER, str(c.runtime),
                                  sock], user="nobody", group="nogroup", capture_output=True,
                                 text=True, timeout=30, cwd="/")
            assert res.returncode == 0, res.stderr
            assert res.stdout.split("\n")[:2] == ["no listing", "no connection"], res.stdout
            # the same commands as the daemon's own user do get in: the test can fail
            res = subprocess.run([PY, "-c", INTRUDER, str(c.runtime), sock],
                                 capture_output=True, text=True, timeout=30)
            assert res.stdout.split("\n")[:2] == ["listed", "connected"], res.stdout
    finally:
        c.cleanup()


def test_the_daemon_opens_no_network_socket(cluster: Cluster):
    with cluster.daemon() as proc:
        daemon = psutil.Process(proc.popen.pid)
        inet = daemon.net_connections(kind="inet")
        unix = daemon.net_connections(kind="unix")
    assert inet == [], inet
    assert any(str(cluster.runtime) in c.laddr for c in unix), unix  # it does listen


@pytest.mark.parametrize("problem, fix", [("mode", 0o755), ("owner", 0o700)])
def test_a_runtime_dir_with_a_wrong_owner_or_mode_is_refused(tmp_path, problem, fix):
    run = tmp_path / "run"
    run.mkdir(mode=fix)
    run.chmod(fix)
    if problem == "owner":
        if os.getuid() != 0:
            pytest.skip("giving a directory away needs root")
        os.chown(run, 65534, 65534)  # nobody
    res = subprocess.run([PY, "-m", "crossover", "daemon", "--runtime-dir", str(run)],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert f"{run} must belong to uid {os.getuid()} with mode 0700" in res.stderr
    assert "remove it, or set CROSSOVER_RUNTIME_DIR" in res.stderr
