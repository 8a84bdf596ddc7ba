"""The relays' channel over real MPI: messages are bytes of any length the protocol
allows (mpi4py's pickled receive took at most 32 KiB, and a longer message vanished as
if its peer had died), and the one collective exchanges JSON, not pickles."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import PY, REPO, mpirun

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import hashlib, json, sys, threading
from mpi4py import MPI
from crossover.daemon.relay import mpichannel
from crossover.daemon.relay.mpichannel import MpiChannel, allgather_json

comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank = comm.Get_rank()
names = allgather_json(comm, [f"node{rank}", {"rank": rank}])
assert names == [["node0", {"rank": 0}], ["node1", {"rank": 1}]], names
woken = threading.Event()
channel = MpiChannel(comm, woken.set)
sizes = [0, 1, 32 * 1024 + 1, 2**20, 3 * 2**20 + 7]
if rank == 0:
    for n in sizes:
        channel.send(1, bytes((i * 7) % 251 for i in range(n)))
    left = channel.flush(30.0)
    assert left == 0, left
    comm.Barrier()
else:
    got = [channel.inbox.get(timeout=30) for _ in sizes]
    assert [source for source, _ in got] == [0] * len(sizes)
    assert [len(data) for _, data in got] == sizes, [len(d) for _, d in got]
    for n, (_, data) in zip(sizes, got):
        assert data == bytes((i * 7) % 251 for i in range(n))
    comm.Barrier()
    print(json.dumps({"received": [len(d) for _, d in got],
                      "recv_errors": channel.recv_errors}))
# past the limit: consumed and dropped, never handed on, and the next one comes through
mpichannel.MAX_BYTES = 1000
if rank == 0:
    channel.send(1, b"x" * 5000)
    channel.send(1, b"after")
    assert channel.flush(30.0) == 0
else:
    assert channel.inbox.get(timeout=30) == (0, b"after")
    print(json.dumps({"oversize": channel.oversize}))
comm.Barrier()
channel.close()
MPI.Finalize()
"""


@pytest.mark.timeout(180)
def test_messages_of_a_byte_to_megabytes_arrive_whole_and_one_past_the_limit_never():
    res = subprocess.run(mpirun(2, PY, "-c", SCRIPT), cwd=REPO, capture_output=True,
                         text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert '"received": [0, 1, 32769, 1048576, 3145735], "recv_errors": 0' in res.stdout
    assert '{"oversize": 1}' in res.stdout
