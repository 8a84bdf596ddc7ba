"""The CROSSOVER_* environment variables in one place, and the one node name that the
client, the daemon, the launcher and the local runner all derive from them.

Job side (crossoverrun sets them; all optional):
    CROSSOVER_ENABLE           "0" turns every hook into a no-op (the job trains plain).
    CROSSOVER_JOB              the job's name, the same on all its ranks.
    CROSSOVER_RUNTIME_DIR      where the daemons' sockets are (default /tmp/crossover-UID).
    CROSSOVER_PRIORITY         weight for the priority policy (default 1).
    CROSSOVER_TRACE            directory for this job's trace files (one per rank).
    CROSSOVER_PIN_CPU          "1" pins a CPU rank to its device's cores in antiphase
                               (off by default; see `SlotClient`).
    CROSSOVER_KEEP_WHEN_ALONE  "0": release at every phase even when the device could be
                               kept (alone, or concurrent mode), to trace every phase.
Daemon side:
    CROSSOVER_NATIVE           "0": no slot table; every rank uses the socket path (for
                               comparison runs; the native fast path is on by default).
Both sides:
    CROSSOVER_NODE             this process's node name (emulated hosts share a hostname).
    CROSSOVER_FAKE_NODES       fake N nodes on one machine (tests): daemon rank r is node
                               fake<r>; a job rank of local rank l talks to fake<l % N>.
"""

from __future__ import annotations

import os
import socket

ENABLE = "CROSSOVER_ENABLE"
JOB = "CROSSOVER_JOB"
RUNTIME_DIR = "CROSSOVER_RUNTIME_DIR"
PRIORITY = "CROSSOVER_PRIORITY"
TRACE = "CROSSOVER_TRACE"
PIN_CPU = "CROSSOVER_PIN_CPU"
KEEP_WHEN_ALONE = "CROSSOVER_KEEP_WHEN_ALONE"
NATIVE = "CROSSOVER_NATIVE"
NODE = "CROSSOVER_NODE"
FAKE_NODES = "CROSSOVER_FAKE_NODES"


def flag(name: str, default: bool = True) -> bool:
    """A "0"/"1" switch: anything but "0" is on; unset is `default`."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value != "0"


def fake_nodes() -> int:
    """N under CROSSOVER_FAKE_NODES=N, else 0.

    Raises:
        ValueError: the value is not a whole number >= 0, naming the variable.
    """
    value = os.environ.get(FAKE_NODES, "") or "0"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{FAKE_NODES}={value!r}: give a number of nodes (>= 0), or unset it")
    return n


def node_name(index: int = 0) -> str:
    """The node of this process: $CROSSOVER_NODE, else fake<index mod N> under fake
    nodes (`index`: a daemon's rank, a job rank's local rank), else the hostname."""
    if os.environ.get(NODE):
        return os.environ[NODE]
    fake = fake_nodes()
    return f"fake{index % fake}" if fake else socket.gethostname()
