"""The `crossover` command: daemon, status, trace merge, trace plot."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from crossover import protocol as P
from crossover.scheduler import POLICIES


def main(argv: list[str] | None = None) -> int:
    """Entry point of `crossover` and `python -m crossover`."""
    parser = argparse.ArgumentParser(prog="crossover", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run this node's coordinator (one per node; under "
                                      "mpirun --map-by ppr:1:node for several nodes)")
    d.add_argument("--policy", choices=list(POLICIES), default="crossover")
    d.add_argument("--lease", type=float, default=30.0, metavar="S",
                   help="seconds a grant lasts without renewal (default 30)")
    d.add_argument("--patience", type=float, default=1.0, metavar="S",
                   help="seconds a free device waits for the job whose turn it is before "
                        "passing it over (default 1)")
    d.add_argument("--idle-shutdown", type=float, default=None, metavar="S",
                   help="exit after S seconds with no job (default: never)")
    d.add_argument("--runtime-dir", default=None, help="socket directory (default "
                   "$CROSSOVER_RUNTIME_DIR or /tmp/crossover-UID)")
    d.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="split this node's cores into N devices (default: one per core)")

    s = sub.add_parser("status", help="devices, holders, queues")
    s.add_argument("--json", action="store_true", help="print the raw report as JSON")
    s.add_argument("--runtime-dir", default=None)
    s.add_argument("--node", default=None, help="the node whose daemon to ask "
                   "(default: this host; fake0 with CROSSOVER_FAKE_NODES)")

    t = sub.add_parser("trace", help="merge or plot Chrome traces")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    m = tsub.add_parser("merge", help="merge trace files into one")
    m.add_argument("inputs", nargs="+")
    m.add_argument("-o", "--output", required=True)
    pl = tsub.add_parser("plot", help="Gantt chart of slot holds per device")
    pl.add_argument("input")
    pl.add_argument("-o", "--output", required=True)

    args = parser.parse_args(argv)
    if args.command == "daemon":
        return _daemon(args)
    if args.command == "status":
        return _status(args)
    from crossover import trace

    if args.trace_command == "merge":
        events = trace.merge(args.inputs, args.output)
        print(f"merged {len(args.inputs)} files, {len(events)} events -> {args.output}")
    else:
        trace.plot_gantt(trace.load(args.input), args.output)
        print(f"wrote {args.output}")
    return 0


def _daemon(args: argparse.Namespace) -> int:
    from crossover.daemon import Daemon

    logging.basicConfig(level=logging.INFO, format="crossover-daemon %(asctime)s %(message)s",
                        stream=sys.stderr)
    Daemon(policy=args.policy, lease_s=args.lease, patience_s=args.patience,
           idle_shutdown_s=args.idle_shutdown,
           runtime_dir=args.runtime_dir, cpu_devices=args.cpu_devices).serve()
    return 0


def _status(args: argparse.Namespace) -> int:
    import os

    from crossover.daemon import FAKE_NODES_ENV
    from crossover.transport import recv_msg, send_msg, socket_path

    node = args.node or ("fake0" if os.environ.get(FAKE_NODES_ENV) else socket.gethostname())
    path = socket_path(node, args.runtime_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(str(path))
        send_msg(sock, P.Status())
        report = recv_msg(sock)
    except OSError as exc:
        print(f"crossover: no daemon answers on {path} ({exc}); start one with "
              f"`crossover daemon`", file=sys.stderr)
        return 2
    finally:
        sock.close()
    if args.json:
        print(json.dumps(report.nodes, indent=2))
        return 0
    print(f"{'node':<12} {'device':<8} {'holder':<20} {'waiting':<30} held s by job")
    for node_name, snap in sorted(report.nodes.items()):
        for dev, st in snap["devices"].items():
            held = ", ".join(f"{j}={t:.1f}" for j, t in st["held_s"].items())
            print(f"{node_name:<12} {dev:<8} {st['holder'] or '-':<20} "
                  f"{','.join(st['waiting']) or '-':<30} {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
