"""The `crossover` command: daemon, status, stop, check, trace merge, trace plot."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import crossover
from crossover import environment as E
from crossover.scheduler import POLICIES

#: `crossover status` redraws at most this often.
MIN_INTERVAL_S = 0.1


def _seconds(minimum: float = 0.0, exclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a number of seconds above (or from) `minimum`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (value > minimum if exclusive else value >= minimum) or value != value:
            bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
            raise argparse.ArgumentTypeError(f"give seconds {bound}, got {text}")
        return value
    return parse


def _port(text: str) -> int:
    """An argparse type: a TCP port number (parsed as CROSSOVER_METRICS_PORT is)."""
    try:
        return E.VARS[E.METRICS_PORT].parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a port number from 1 to 65535, got "
                                         f"{text!r}") from None


def _address(text: str) -> str:
    """An argparse type: an IPv4 address or host name."""
    try:
        return E.VARS[E.METRICS_ADDRESS].parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give an IPv4 address or host name, got "
                                         f"{text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag of `crossover` (docs/configuration.md is made from it)."""
    parser = argparse.ArgumentParser(prog="crossover", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"crossover {crossover.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run this node's coordinator (one per node; for "
                                      "several nodes under mpirun --mca "
                                      "orte_enable_recovery 1 --mca "
                                      "orte_allowed_exit_without_sync 1 --map-by "
                                      "ppr:1:node)")
    d.add_argument("--policy", choices=list(POLICIES), default="auto",
                   help="auto (default): antiphase where it measures faster, else the jobs "
                        "run concurrently; crossover: always antiphase; round-robin: hand "
                        "over at step boundaries only; priority: antiphase with weights "
                        "(CROSSOVER_PRIORITY); off: grant everything")
    d.add_argument("--lease", type=_seconds(), default=30.0, metavar="S",
                   help="seconds a grant lasts without renewal (default 30)")
    d.add_argument("--patience", type=_seconds(), default=1.0, metavar="S",
                   help="seconds a free device waits for the job whose turn it is before "
                        "passing it over (default 1)")
    d.add_argument("--idle-shutdown", type=_seconds(), default=None, metavar="S",
                   help="exit after S seconds with no job (default: run until `crossover "
                        "stop`; the daemon crossoverrun starts exits after 300 s)")
    d.add_argument("--runtime-dir", default=None, metavar="DIR", help="socket directory (default "
                   "$CROSSOVER_RUNTIME_DIR, else $XDG_RUNTIME_DIR/crossover, else "
                   "/tmp/crossover-UID)")
    d.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="split this node's cores into N devices (default: one per core)")
    d.add_argument("--mode-probe", type=_seconds(), default=2.0, metavar="S",
                   help="policy auto: shortest window measuring each mode (default 2)")
    d.add_argument("--mode-hold", type=_seconds(), default=30.0, metavar="S",
                   help="policy auto: how long a mode decision holds before it is probed "
                        "again; doubled at each confirmation (default 30)")
    d.add_argument("--mode-probe-local", action="store_true",
                   help="policy auto: probe jobs whose ranks all share this host's CPU too "
                        "(by default they are served concurrently: nothing to fill)")
    d.add_argument("--align-phases", action="store_true",
                   help="keep the nodes' antiphase turns in step: a node whose turns run "
                        "ahead hands its device over later, once (from the ranks' "
                        "allreduce waits; experimental, off by default)")
    d.add_argument("--no-core-shares", dest="core_shares", action="store_false",
                   help="policy auto: leave CPU jobs served concurrently on one host where "
                        "their launchers put them (by default each gets cores of its own)")

    d.add_argument("--node", default=None, metavar="NAME",
                   help="the node this daemon serves (default: $CROSSOVER_NODE, else this "
                        "host; the world's leader gives it to a daemon it starts for a "
                        "fake or emulated node)")
    d.add_argument("--hello-timeout", type=_seconds(), default=10.0, metavar="S",
                   help="drop a connection that sends no hello within S seconds (default 10)")
    d.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://ADDRESS:PORT/metrics (default "
                        "$CROSSOVER_METRICS_PORT, else off; needs prometheus-client: pip "
                        "install 'crossover[metrics]'; fake node N of a test world uses "
                        "PORT+N)")
    d.add_argument("--metrics-address", type=_address, default=None, metavar="ADDRESS",
                   help="the address the metrics port listens on (default "
                        "$CROSSOVER_METRICS_ADDRESS, else 127.0.0.1; 0.0.0.0 for every "
                        "interface)")
    d.add_argument("--system", action="store_true",
                   help="serve every user of this node (a node service run by root or a "
                        "dedicated user, e.g. from systemd): listen in $CROSSOVER_SYSTEM_DIR "
                        "(default /run/crossover), where every user's ranks find it; each "
                        "job is its owner's, and only this user and root may stop it")
    d.add_argument("--allow-group", default=None, metavar="GROUP",
                   help="with --system: serve only the members of GROUP (default: every "
                        "user of the node)")
    d.add_argument("--hosts", default=None, metavar="LIST",
                   help="with --system: form one world with the services of these hosts "
                        "(Slurm's form: gpu[01-04],login1), which decides each job's order "
                        "and mode across its nodes; every host's service gets the same list "
                        "and the same CROSSOVER_WORLD_KEY")
    d.add_argument("--hostfile", default=None, metavar="FILE",
                   help="with --system: the world's hosts from FILE, one a line")
    # how the parts of a world start each other (`crossover.daemon.relay`), not for users
    d.add_argument("--service", action="store_true", help=argparse.SUPPRESS)
    d.add_argument("--generation", type=int, default=0, help=argparse.SUPPRESS)
    d.add_argument("--leader", default=None, help=argparse.SUPPRESS)
    d.add_argument("--nodes", default=None, help=argparse.SUPPRESS)

    s = sub.add_parser("status", help="devices, holders, queues")
    once = s.add_mutually_exclusive_group()
    once.add_argument("--json", action="store_true", help="print the report once, as JSON")
    once.add_argument("--once", action="store_true", help="print the table once")
    s.add_argument("--interval", type=_seconds(MIN_INTERVAL_S, exclusive=False), default=1.0,
                   metavar="S", help=f"refresh period of the live table (default 1, at "
                                     f"least {MIN_INTERVAL_S:g})")
    s.add_argument("--runtime-dir", default=None, metavar="DIR",
                   help="the daemon's socket directory (default as for `crossover daemon`)")
    s.add_argument("--node", default=None, metavar="NODE", help="the node whose daemon to ask "
                   "(default: this host; fake0 with CROSSOVER_FAKE_NODES)")

    st = sub.add_parser("stop", help="stop this node's daemon (and, for one a launcher "
                                     "started over several hosts, every host's)")
    st.add_argument("--runtime-dir", default=None, metavar="DIR",
                    help="the daemon's socket directory (default as for `crossover daemon`)")
    st.add_argument("--force", action="store_true",
                    help="stop it even while jobs use it (their ranks train on "
                         "uncoordinated)")
    sub.add_parser("check", help="is this environment ready for crossover, and what is "
                                 "missing (exit status 1 if something is)")

    t = sub.add_parser("trace", help="merge or plot Chrome traces")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    m = tsub.add_parser("merge", help="merge trace files into one")
    m.add_argument("inputs", nargs="+", metavar="TRACE",
                   help="trace files: ours (per rank or merged) and Horovod timelines")
    m.add_argument("-o", "--output", required=True, help="the merged trace to write")
    pl = tsub.add_parser("plot", help="Gantt chart of slot holds per device")
    pl.add_argument("input", metavar="TRACE", help="a trace file (merged or not)")
    pl.add_argument("-o", "--output", required=True, help="the PNG to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `crossover` and `python -m crossover`."""
    args = build_parser().parse_args(argv)
    if args.command in ("daemon", "status"):
        # the CROSSOVER_* values these read (node, runtime directory, native), refused
        # before anything starts; a job only warns (see crossover.environment)
        bad = E.check("daemon")
        for line in bad:
            print(f"crossover {args.command}: {line}", file=sys.stderr)
        if bad:
            return 2
    if args.command == "daemon":
        from crossover.daemon.command import run_daemon

        return run_daemon(args)
    if args.command == "status":
        return _status(args)
    if args.command == "stop":
        return _stop(args)
    if args.command == "check":
        from crossover import check

        return check.main()
    return _trace(args)


def _trace(args: argparse.Namespace) -> int:
    from crossover import trace

    where = f"crossover trace {args.trace_command}"
    try:
        if args.trace_command == "merge":
            events = trace.merge(args.inputs, args.output)
            print(f"merged {len(args.inputs)} files, {len(events)} events -> {args.output}")
            return 0
        events = trace.load(args.input)
    except (OSError, ValueError) as exc:  # a missing or unwritable file, or not a trace
        problem = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
        print(f"{where}: {problem}; give Chrome trace files that crossover wrote "
              f"(--crossover-trace DIR) and a writable output path", file=sys.stderr)
        return 2
    try:
        trace.plot_gantt(events, args.output)
    except ImportError as exc:
        print(f"{where}: {exc.name or exc} is not installed; pip install matplotlib",
              file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{where}: cannot write {exc.filename} ({exc.strerror})", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from crossover.launch.daemons import UsageError, stop_daemons

    try:
        print(stop_daemons(args.runtime_dir, force=args.force))
    except (UsageError, PermissionError) as exc:
        print(f"crossover stop: {exc}", file=sys.stderr)
        return 2
    return 0


def _status(args: argparse.Namespace) -> int:
    from crossover.probe import daemon_status

    while True:
        try:
            nodes = daemon_status(args.runtime_dir, args.node)
        except ConnectionError as exc:
            print(f"crossover: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(nodes, indent=2))
            return 0
        table = status_table(nodes)
        if args.once:
            print(table)
            return 0
        # Redraw in place: home the cursor, clear the screen.
        print("\x1b[H\x1b[2J" + table + f"\n(every {args.interval:g} s; Ctrl-C to stop)",
              flush=True)
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def status_table(nodes: dict) -> str:
    """Devices, the job holding each, the queue, and per job the share of time spent
    holding and waiting since it joined the device (and whether it is dormant there)."""
    rows = [f"{'node':<10} {'device':<7} {'mode':<10} {'holder':<16} {'queue':<24} "
            f"job: hold% wait%"]
    for node, snap in sorted(nodes.items()):
        mode = snap.get("mode", "-")
        for dev, st in snap["devices"].items():
            usage = "  ".join(f"{job}{' (dormant)' if u.get('dormant') else ''}: "
                              f"{u['hold_pct']:.0f}% {u['wait_pct']:.0f}%"
                              for job, u in st["usage"].items())
            rows.append(f"{node:<10} {dev:<7} {mode:<10} {st['holder'] or '-':<16} "
                        f"{','.join(st['waiting']) or '-':<24} {usage}")
        if not snap["devices"]:
            rows.append(f"{node:<10} (no jobs)")
        if "daemon" in snap:
            d = snap["daemon"]
            jobs = ", ".join(f"{job} {u['ranks']} ranks {u['cpu_pct']:.0f}% CPU "
                             f"{u['rss_mb']:.0f} MiB"
                             for job, u in snap.get("job_usage", {}).items())
            rows.append(f"{node:<10} daemon pid {d['pid']}: {d['fds']} fds, "
                        f"{d['rss_mb']:.0f} MiB, {d['connections']} connections"
                        + (f"; {jobs}" if jobs else ""))
        for dev, mem in snap.get("memory", {}).items():  # a GPU's, as its ranks said
            jobs = ", ".join(f"{job} {_gib(u['reserved'])} (peak {_gib(u['peak'])})"
                             for job, u in mem["jobs"].items())
            rows.append(f"{node:<10} {dev:<7} memory: {jobs} of {_gib(mem['capacity'])}")
        if "fast_path" in snap:
            fast = snap["fast_path"]
            rows.append(f"{node:<10} fast path: " + (
                "off (socket path)" if fast is None else
                ", ".join(f"{dev} {n} grants" for dev, n in fast.items()) or "on"))
    reasons = {snap.get("mode_reason") for snap in nodes.values()} - {None}
    rows += [f"mode: {reason}" for reason in sorted(reasons)]
    for snap in nodes.values():  # the leader's: one mode decision per group of jobs
        for group, d in (snap.get("mode_decision") or {}).items():
            rows.append(f"group {group}: {', '.join(d['jobs']) or '-'}: {d['mode']} "
                        f"({d['state']})")
    worlds = [snap["world"] for snap in nodes.values() if "world" in snap]
    if worlds and worlds[0]["size"] > 1:
        lost = sorted({node for w in worlds for node in w["lost"]})
        newest = max(worlds, key=lambda w: w.get("generation", 0))
        detached = sorted(n for n, snap in nodes.items()
                          if not snap.get("world", {}).get("relay", True))
        forming = [w["forming"] for w in worlds if w.get("forming") is not None]
        rows.append(f"world: {len(nodes)} of {worlds[0]['size']} nodes answer (generation "
                    f"{newest.get('generation', 0)}, leader {newest['leader_node']})"
                    + (f"; lost: {', '.join(lost)} (their ranks run uncoordinated until a "
                       f"daemon is back there)" if lost else "")
                    + (f"; no relay: {', '.join(detached)} (serving their ranks on until "
                       f"the next generation)" if detached else "")
                    + (f"; forming generation {max(forming)}" if forming else ""))
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
