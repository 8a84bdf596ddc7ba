"""The CROSSOVER_* environment variables in one place: each one's accepted form, default
and what a bad value does, and the one node name that the client, the daemon, the
launcher and the local runner all derive from them.

An empty value is the same as an unset one. Flags take 1/0, true/false, yes/no or on/off
(any case).

Each variable's meaning, accepted form, default and reader are in `VARS` below, and
docs/configuration.md lists them (generated from `VARS` by scripts/configuration_doc.py).

A value that does not parse is named in one line: `VAR='value': <accepted form> (default
D)`. The launcher (`crossoverrun`) and the daemon's command refuse it before anything
starts (`check`). A job never crashes over crossover (docs/design.md), so in a job
process the accessors say that line once on stderr and go on with the default, or, where
guessing is unsafe, with crossover off for the process: a bad CROSSOVER_ENABLE or
CROSSOVER_INJECT means off, and a bad CROSSOVER_NODE or CROSSOVER_FAKE_NODES raises
ValueError, which the client turns into running uncoordinated (a guessed node could be
another emulated host's daemon).
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENABLE = "CROSSOVER_ENABLE"
JOB = "CROSSOVER_JOB"
JOB_START = "CROSSOVER_JOB_START"
RUNTIME_DIR = "CROSSOVER_RUNTIME_DIR"
SYSTEM_DIR = "CROSSOVER_SYSTEM_DIR"
PRIORITY = "CROSSOVER_PRIORITY"
TRACE = "CROSSOVER_TRACE"
PIN_CPU = "CROSSOVER_PIN_CPU"
KEEP_WHEN_ALONE = "CROSSOVER_KEEP_WHEN_ALONE"
INJECT = "CROSSOVER_INJECT"
NATIVE = "CROSSOVER_NATIVE"
NODE = "CROSSOVER_NODE"
FAKE_NODES = "CROSSOVER_FAKE_NODES"
WORLD_KEY = "CROSSOVER_WORLD_KEY"
LOG_BYTES = "CROSSOVER_LOG_BYTES"
METRICS_PORT = "CROSSOVER_METRICS_PORT"
METRICS_ADDRESS = "CROSSOVER_METRICS_ADDRESS"
RELAY_NETWORK = "CROSSOVER_RELAY_NETWORK"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
FLAG_FORM = "give 1/0, true/false, yes/no or on/off"


def parse_flag(value: str) -> bool:
    """A switch as Horovod and torchrun users write one.

    Raises:
        ValueError: not one of 1/0, true/false, yes/no, on/off (any case).
    """
    v = value.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(value)


def _weight(value: str) -> float:
    w = float(value)  # ValueError for 'abc'
    # nan and inf parse as floats, but the daemon refuses them in a Hello
    if not (math.isfinite(w) and w > 0):
        raise ValueError(value)
    return w


def _count(value: str, low: int = 0, high: int = 2**63 - 1) -> int:
    # a regex, not int(): int() also takes '+2', '2_0' and other digit scripts; at most
    # a signed 64-bit count, which is what the daemon takes
    if not re.fullmatch(r"\s*[0-9]+\s*", value) or not low <= int(value) <= high:
        raise ValueError(value)
    return int(value)


def _log_bytes(value: str) -> int:
    return _count(value, low=4096)  # fewer would rotate at every few lines


def _port(value: str) -> int:
    return _count(value, low=1, high=65535)


def _address(value: str) -> str:
    """An IPv4 address or a host name (the metrics server is IPv4)."""
    if not value or not all(c.isalnum() or c in ".-" for c in value):
        raise ValueError(value)
    return value


def _node(value: str) -> str:
    # the name is part of the socket's file name (node-<name>.sock): no '/' or spaces
    if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
        raise ValueError(value)
    return value


def _job(value: str) -> str:
    # the daemon takes 1-200 printable characters; '/' would put the trace files
    # (<job>.rank<r>.json) in another directory
    if not (len(value) <= 200 and value.isprintable() and "/" not in value):
        raise ValueError(value)
    return value


def _path(value: str) -> str:
    return value


def _network(value: str) -> str:
    # an interface name, an IPv4 network in CIDR form, or "any" (Open MPI's own choice)
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}|\d{1,3}(\.\d{1,3}){3}/\d{1,2}", value):
        raise ValueError(value)
    return value


def _key(value: str) -> bytes:
    key = bytes.fromhex(value)  # ValueError: not hex
    if len(key) < 16:
        raise ValueError(value)
    return key


@dataclass(frozen=True)
class Var:
    """One CROSSOVER_* variable.

    Args:
        name: the variable.
        parse: the value (never empty) to the setting; ValueError if it does not parse.
        default: the setting when the variable is unset or empty.
        shown: the default as the error line shows it.
        form: the accepted form, as the fix to a bad value ("give ...").
        sides: who reads it: "job", "daemon" (the launcher reads them all).
        bad: the setting a job process uses for a value that does not parse.
        effect: what that means, appended to the job process's warning.
        strict: a bad value raises ValueError even in a job process (the caller turns
            crossover off for the process).
        about: what the variable does, for the manual.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    shown: str
    form: str
    sides: tuple[str, ...] = ("job",)
    bad: Any = None
    effect: str = ""
    strict: bool = False
    about: str = ""
    secret: bool = False  # its value is never shown (a key in a log is a key given away)

    def line(self, value: str) -> str:
        """The one line naming the variable, its value and the accepted form."""
        shown = f"<{len(value)} characters, not shown>" if self.secret else repr(value)
        return f"{self.name}={shown}: {self.form} (default {self.shown})"


def _var(name: str, parse: Callable[[str], Any], default: Any, shown: str, form: str,
         sides: tuple[str, ...] = ("job",), bad: Any = ..., effect: str = "",
         strict: bool = False, about: str = "", secret: bool = False) -> Var:
    if bad is ...:
        bad, effect = default, effect or f"using {shown}"
    return Var(name, parse, default, shown, form, sides, bad, effect, strict, about, secret)


_OFF = "crossover is off in this process"
#: Every variable, by name: the table the accessors, `check` and the tests read.
VARS: dict[str, Var] = {v.name: v for v in [
    _var(ENABLE, parse_flag, True, "1", FLAG_FORM, bad=False, effect=_OFF,
         about="0 turns every hook into a no-op: the job trains as plain Horovod"),
    _var(JOB, _job, None, "<script>-<pid of rank 0>",
         "give 1-200 printable characters without '/'",
         about="the job's name, the same on all its ranks; unique among running jobs"),
    _var(JOB_START, _count, 0, "0, or agreed with the name",
         "give the job's start in ns since the epoch, a whole number >= 0",
         about="when the job started, the same on all its ranks: with its name, its place "
               "in the order every node serves jobs in (0: by name alone, before the "
               "jobs started at a known time); crossoverrun and crossover-torchrun on one "
               "node set it"),
    _var(RUNTIME_DIR, _path, None, "$XDG_RUNTIME_DIR/crossover, else /tmp/crossover-<uid>",
         "give a directory", sides=("job", "daemon"),
         about="the directory of your own daemons' sockets and slot table (yours, mode "
               "0700); set, it wins over a node service for every user"),
    _var(SYSTEM_DIR, _path, "/run/crossover", "/run/crossover", "give a directory",
         sides=("job", "daemon"),
         about="where the node service for every user (`crossover daemon --system`) "
               "listens; a rank uses it when it serves there and CROSSOVER_RUNTIME_DIR "
               "is unset"),
    _var(PRIORITY, _weight, 1.0, "1", "give a number > 0",
         about="the job's weight under the priority policy"),
    _var(TRACE, _path, None, "no trace", "give a directory",
         about="write a Chrome trace per rank there (<job>.rank<r>.json)"),
    _var(PIN_CPU, parse_flag, False, "0", FLAG_FORM,
         about="1 pins a CPU rank to its device's cores while devices are served in "
               "antiphase"),
    _var(KEEP_WHEN_ALONE, parse_flag, True, "1", FLAG_FORM,
         about="0 releases the device at every phase even where it could be kept (a job "
               "alone, or concurrent mode), so that traces show every phase"),
    _var(INJECT, parse_flag, False, "0", FLAG_FORM, bad=False,
         effect="Horovod is not hooked in this process",
         about="set by crossoverrun: its sitecustomize wraps Horovod's optimizers as the "
               "script makes them"),
    _var(NATIVE, parse_flag, True, "1", FLAG_FORM, sides=("daemon",),
         about="0: no slot table, every rank asks over its socket (for comparison runs)"),
    _var(NODE, _node, None, "the hostname",
         "give a node name of letters, digits, '.', '-' or '_'", sides=("job", "daemon"),
         strict=True, about="this process's node name (emulated hosts share a hostname)"),
    _var(FAKE_NODES, _count, 0, "0", "give a whole number of nodes >= 0",
         sides=("job", "daemon"), strict=True,
         about="fake N nodes on one machine, for tests: daemon rank r is node fake<r>, a "
               "rank of local rank l talks to fake<l % N>"),
    _var(WORLD_KEY, _key, None, "the runtime directory's world.key",
         "give the world's key in hex, at least 32 digits", sides=("daemon",), strict=True,
         about="the key that signs the messages between the nodes' daemons; crossoverrun "
               "and the leader hand it to the daemons they start on other hosts (never "
               "give it on a command line)", secret=True),
    _var(LOG_BYTES, _log_bytes, 16 << 20, str(16 << 20),
         "give a size in bytes, a whole number >= 4096", sides=("daemon",),
         about="the size past which the runtime directory's daemon.log is renamed "
               "daemon.log.1 (the older one goes): the daemons' log stays within about "
               "twice this"),
    _var(METRICS_PORT, _port, None, "no metrics", "give a port number from 1 to 65535",
         sides=("daemon",), strict=True,
         about="the daemons serve Prometheus metrics on this port (as `crossover daemon "
               "--metrics-port`; crossoverrun passes it to the daemons it starts on every "
               "host)"),
    _var(METRICS_ADDRESS, _address, "127.0.0.1", "127.0.0.1",
         "give an IPv4 address or host name", sides=("daemon",), strict=True,
         about="the address the metrics port listens on (0.0.0.0: every interface)"),
    _var(RELAY_NETWORK, _network, None, "the network of the node name's address",
         "give an interface name (eth0), an IPv4 network (10.1.0.0/16) or any",
         sides=("daemon",),
         about="the interface or network the relays' MPI traffic between nodes takes "
               "(Open MPI's btl_tcp_if_include and oob_tcp_if_include); any: Open MPI's "
               "own choice. A node name that resolves to a loopback address means any"),
]}

_reported: set[str] = set()  # variables whose bad value this process has reported


def problem(name: str, value: str | None) -> str | None:
    """The error line for `value` of variable `name`, None if it parses (or is unset)."""
    if not value:
        return None
    var = VARS[name]
    try:
        var.parse(value)
    except ValueError:
        return var.line(value)
    return None


def check(side: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every bad value in `environ` (default os.environ), one line each: for a command
    that refuses them before it starts anything.

    Args:
        side: only the variables that side reads ("job", "daemon"); None: all of them.
        environ: the environment to check.

    Returns:
        The error lines, in the order of `VARS`; empty if every value parses.
    """
    env = os.environ if environ is None else environ
    found = (problem(v.name, env.get(v.name)) for v in VARS.values()
             if side is None or side in v.sides)
    return [line for line in found if line]


def get(name: str) -> Any:
    """The setting of variable `name` for this process (see the module doc).

    A bad value is said once on stderr and the variable's safe setting used instead.

    Raises:
        ValueError: a bad value of a variable whose safe setting is crossover off
            (CROSSOVER_NODE, CROSSOVER_FAKE_NODES), with the error line.
    """
    var = VARS[name]
    value = os.environ.get(name)
    if not value:
        return var.default
    try:
        return var.parse(value)
    except ValueError:
        if var.strict:
            raise ValueError(var.line(value)) from None
        _report(name, f"{var.line(value)}; {var.effect}")
        return var.bad


def _report(name: str, message: str) -> None:
    # once per variable: the hooks ask on every step, and one line is enough
    if name not in _reported:
        _reported.add(name)
        print(f"crossover: WARNING: {message}", file=sys.stderr, flush=True)


# --- one accessor per variable ---------------------------------------------------------
def enabled() -> bool:
    """CROSSOVER_ENABLE: False turns every hook into a no-op (a bad value too)."""
    return bool(get(ENABLE))


def job_name() -> str | None:
    """CROSSOVER_JOB, or None (unset or bad: the ranks agree on a name)."""
    return get(JOB)


def job_start_ns() -> int:
    """CROSSOVER_JOB_START: the job's start in ns since the epoch, 0 if unset (or bad)."""
    return get(JOB_START)


#: Where batch systems put the id of the job a process runs in, first set wins: Slurm,
#: PBS and Torque, LSF.
BATCH_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
#: The longest batch job id a rank says (longer: not said).
MAX_BATCH_JOB = 64


def batch_job() -> str:
    """The batch system's id of this process's job (`BATCH_JOB_VARS`), "" outside one or
    where it is not 1-64 printable characters."""
    for name in BATCH_JOB_VARS:
        value = os.environ.get(name, "")
        if value:
            return value if len(value) <= MAX_BATCH_JOB and value.isprintable() else ""
    return ""


def runtime_dir_setting() -> str | None:
    """CROSSOVER_RUNTIME_DIR as given, or None (see `crossover.transport.runtime_dir`)."""
    return get(RUNTIME_DIR)


def priority() -> float:
    """CROSSOVER_PRIORITY: the weight for the priority policy, > 0 (default 1)."""
    return float(get(PRIORITY))


def trace_dir() -> str | None:
    """CROSSOVER_TRACE: the directory for this job's trace files, or None."""
    return get(TRACE)


def pin_cpu() -> bool:
    """CROSSOVER_PIN_CPU: pin a CPU rank to its device's cores (default off)."""
    return bool(get(PIN_CPU))


def keep_when_alone() -> bool:
    """CROSSOVER_KEEP_WHEN_ALONE: keep a device no one else wants (default on)."""
    return bool(get(KEEP_WHEN_ALONE))


def inject() -> bool:
    """CROSSOVER_INJECT: hook Horovod's optimizer factories at start-up (default off)."""
    return bool(get(INJECT))


def native() -> bool:
    """CROSSOVER_NATIVE: the daemon makes the node's slot table (default on)."""
    return bool(get(NATIVE))


def node_setting() -> str | None:
    """CROSSOVER_NODE, or None.

    Raises:
        ValueError: the value is not a node name, naming the variable.
    """
    return get(NODE)


def world_key() -> bytes | None:
    """CROSSOVER_WORLD_KEY: the world's key handed over, or None (the runtime
    directory's; `crossover.daemon.world.wire.world_key`). ValueError if it is not a key."""
    return get(WORLD_KEY)


def log_bytes() -> int:
    """CROSSOVER_LOG_BYTES: the daemons' log's rotation size."""
    return int(get(LOG_BYTES))


def metrics_at() -> tuple[str, int] | None:
    """(CROSSOVER_METRICS_ADDRESS, CROSSOVER_METRICS_PORT), or None without a port.
    ValueError if either is malformed."""
    port = get(METRICS_PORT)
    return None if port is None else (get(METRICS_ADDRESS), int(port))


def relay_network() -> str | None:
    """CROSSOVER_RELAY_NETWORK, or None (unset: the node name's network)."""
    return get(RELAY_NETWORK)


def fake_nodes() -> int:
    """N under CROSSOVER_FAKE_NODES=N, else 0.

    Raises:
        ValueError: the value is not a whole number >= 0, naming the variable.
    """
    return int(get(FAKE_NODES))


def flag(name: str, default: bool = True) -> bool:
    """A switch (1/0, true/false, yes/no, on/off); unset or empty is `default`.

    A bad value is said once on stderr; a variable of the table then takes its safe
    setting (off for CROSSOVER_ENABLE), any other name `default`.
    """
    value = os.environ.get(name)
    if not value:
        return default
    if name in VARS:
        return bool(get(name))
    try:
        return parse_flag(value)
    except ValueError:
        _report(name, f"{name}={value!r}: {FLAG_FORM} (default {int(default)}); "
                      f"using {int(default)}")
        return default


def node_name(index: int = 0) -> str:
    """The node of this process: $CROSSOVER_NODE, else fake<index mod N> under fake
    nodes (`index`: a daemon's rank, a job rank's local rank), else the hostname.

    Raises:
        ValueError: CROSSOVER_NODE or CROSSOVER_FAKE_NODES is bad, naming it.
    """
    node = node_setting()
    if node:
        return node
    fake = fake_nodes()
    return f"fake{index % fake}" if fake else socket.gethostname()
