"""Asking a node's daemon from outside a job: does it listen, and the status of every
node. Used by the launchers, the `crossover status` command and the benchmarks."""

from __future__ import annotations

import os
import socket

from crossover import environment as E
from crossover import protocol as P
from crossover.client.link import not_admitted
from crossover.transport import recv_msg, send_msg, socket_path


def daemon_status(runtime_dir: str | os.PathLike | None = None, node: str | None = None,
                  timeout_s: float = 5.0) -> dict:
    """Ask a node's daemon for the status of all nodes: {node: snapshot}.

    Raises:
        ConnectionError: no daemon answers there (the message says how to start one).
    """
    return _ask(P.Status(), runtime_dir, node, timeout_s)


def grow_world(nodes: list[str], runtime_dir: str | os.PathLike | None = None,
               node: str | None = None, timeout_s: float = 5.0) -> list[str]:
    """Ask a node's daemon to bring `nodes` into its world; returns those not in it yet
    (the world's leader starts daemons there: `daemon_status` shows them once joined).

    Raises:
        ConnectionError: no daemon answers there.
    """
    return sorted(_ask(P.Grow(list(nodes)), runtime_dir, node, timeout_s))


def stop_world(runtime_dir: str | os.PathLike | None = None, node: str | None = None,
               timeout_s: float = 5.0) -> list[str]:
    """Ask a node's daemon to stop its whole world; returns the world's nodes.

    Raises:
        ConnectionError: no daemon answers there.
    """
    return sorted(_ask(P.StopWorld(), runtime_dir, node, timeout_s))


def _ask(msg: P.Message, runtime_dir: str | os.PathLike | None, node: str | None,
         timeout_s: float) -> dict:
    path = socket_path(node or E.node_name(), runtime_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        send_msg(sock, msg)
        report = recv_msg(sock)
    except PermissionError as exc:  # a node service that does not admit this user
        raise ConnectionError(not_admitted(path, exc)) from None
    except (OSError, P.ProtocolError) as exc:
        raise ConnectionError(f"no crossover daemon answers on {path} ({exc}); start one "
                              f"with `crossover daemon` or use --crossover-daemon auto") from None
    finally:
        sock.close()
    if isinstance(report, P.Error):  # not this user's to ask
        raise ConnectionError(f"the crossover daemon on {path} refused: {report.message}")
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
