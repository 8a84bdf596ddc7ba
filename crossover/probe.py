"""Asking a node's daemon from outside a job: does it listen, and the status of every
node. Used by the launchers, the `crossover status` command and the benchmarks."""

from __future__ import annotations

import os
import socket

from crossover import environment as E
from crossover import protocol as P
from crossover.transport import recv_msg, send_msg, socket_path


def daemon_status(runtime_dir: str | os.PathLike | None = None, node: str | None = None,
                  timeout_s: float = 5.0) -> dict:
    """Ask a node's daemon for the status of all nodes: {node: snapshot}.

    Raises:
        ConnectionError: no daemon answers there (the message says how to start one).
    """
    path = socket_path(node or E.node_name(), runtime_dir)
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


def daemon_listens(runtime_dir: str | os.PathLike | None = None,
                   node: str | None = None) -> bool:
    """Whether a daemon accepts connections on a node's socket. A socket file alone
    proves nothing (a killed daemon leaves its file); a stopped daemon still accepts
    (the kernel queues the connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(str(socket_path(node or E.node_name(), runtime_dir)))
        return True
    except (OSError, ValueError):
        return False
    finally:
        sock.close()
