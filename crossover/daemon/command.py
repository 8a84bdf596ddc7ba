"""`crossover daemon`: its settings checked (who may use it, a world's hosts, metrics)
and the node's daemon run, or, under mpirun, the node's relay.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from crossover import environment as E
from crossover.daemon.node.users import Users


def _under_mpirun() -> bool:
    """Whether this process is a rank of an mpirun (Open MPI's or a PMI launcher's)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _users(args: argparse.Namespace) -> Users:
    """Who may use the daemon. ValueError (`UsersError`) names a setting that does not
    fit: a group that does not exist, --allow-group without --system, or --system with
    what it cannot have yet."""
    if args.system and args.runtime_dir is not None:
        raise ValueError("--system listens in $CROSSOVER_SYSTEM_DIR, where every user's "
                         "ranks look for it: set that instead of --runtime-dir")
    if args.system and args.policy == "priority":
        raise ValueError("--system with --policy priority: each job says its own weight, "
                         "so any user could take the devices; run auto, crossover or "
                         "round-robin")
    if (args.hosts is not None or args.hostfile is not None) and not args.system:
        raise ValueError("--hosts and --hostfile form a world of node services (--system); "
                         "a daemon of your own forms its world under mpirun (mpirun -H ...)")
    if args.system and args.generation == 0 and not args.service and _under_mpirun():
        raise ValueError("--system: run it on each node (e.g. from systemd), not under "
                         "mpirun; --hosts makes the nodes' services one world")
    return Users(shared=args.system, group=args.allow_group)


def _world_hosts(args: argparse.Namespace) -> list[str] | None:
    """The hosts of a world of node services (--hosts, --hostfile); None for a node
    alone, or for a relay (which needs none). ValueError names what does not fit."""
    from crossover.daemon.world.hosts import world_hosts

    if (args.hosts is None and args.hostfile is None) or (
            args.generation and not args.service):
        return None
    hosts = world_hosts(args.hosts, args.hostfile, E.node_name())
    if len(hosts) > 1 and not args.service and E.world_key() is None:
        raise ValueError("the services of --hosts sign their messages with one key: give "
                         "each the same CROSSOVER_WORLD_KEY (64 hex digits, e.g. from "
                         "`openssl rand -hex 32`, in its unit's EnvironmentFile)")
    return hosts if len(hosts) > 1 else None


def _metrics_setting(args: argparse.Namespace) -> tuple[str, int] | None:
    """(address, port) of the metrics endpoint, or None: each from its flag, else its
    variable (read only then), else the address's default. ValueError names a bad one;
    MetricsError says prometheus-client is missing."""
    port = args.metrics_port if args.metrics_port is not None else E.get(E.METRICS_PORT)
    address = args.metrics_address if args.metrics_address is not None else \
        E.get(E.METRICS_ADDRESS)
    if port is None:
        if args.metrics_address is not None:
            raise ValueError("--metrics-address needs --metrics-port (or "
                             "CROSSOVER_METRICS_PORT)")
        return None
    from crossover.daemon.node.metrics import prometheus_client

    prometheus_client()  # said here once, not by every node's service its relay starts
    return address, int(port)


def _with_metrics(argv: list[str], metrics: tuple[str, int] | None) -> list[str]:
    """`argv` with the metrics flags it settled on, once."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--metrics-port", "--metrics-address"):
            skip = True
        elif not arg.startswith(("--metrics-port=", "--metrics-address=")):
            kept.append(arg)
    return kept if metrics is None else [*kept, "--metrics-address", metrics[0],
                                         "--metrics-port", str(metrics[1])]


def run_daemon(args: argparse.Namespace) -> int:
    """Run `crossover daemon` with its parsed arguments; the exit status."""
    from crossover.daemon import Daemon
    from crossover.daemon.logfile import LOG_FILE, adopt
    from crossover.daemon.node.metrics import MetricsError
    from crossover.daemon.node.sockets import RUNNING_EXIT, DaemonRunning
    from crossover.transport import runtime_dir, system_dir

    if args.node is not None:
        os.environ[E.NODE] = args.node  # read as CROSSOVER_NODE is, by node_identity
    try:
        users = _users(args)
        hosts = _world_hosts(args)
        metrics = _metrics_setting(args)
    except (ValueError, MetricsError) as exc:
        print(f"crossover daemon: {exc}", file=sys.stderr)
        return 2
    if users.shared:
        args.runtime_dir = str(system_dir())
    # the relays and the generations start every node's service with these arguments
    # (the environment does not reach other hosts)
    argv = _with_metrics(sys.argv[1:], metrics)
    if not args.service and _under_mpirun():
        # under mpirun: this node's relay, which starts the node's service if need be
        from crossover.daemon.relay.process import run_relay

        return run_relay(args.generation, args.leader,
                         args.nodes.split(",") if args.nodes else None, argv,
                         args.runtime_dir)
    try:
        adopted = adopt(runtime_dir(args.runtime_dir, create=True) / LOG_FILE,
                        E.log_bytes(), "crossover-daemon")
    except PermissionError:  # the daemon names what is wrong with the directory
        adopted = False
    if not adopted:
        logging.basicConfig(level=logging.INFO,
                            format="crossover-daemon %(asctime)s %(message)s", stream=sys.stderr)
    try:
        daemon = Daemon(policy=args.policy, lease_s=args.lease, patience_s=args.patience,
                        idle_shutdown_s=args.idle_shutdown, runtime_dir=args.runtime_dir,
                        cpu_devices=args.cpu_devices, mode_probe_s=args.mode_probe,
                        mode_hold_s=args.mode_hold, mode_probe_local=args.mode_probe_local,
                        align_phases=args.align_phases, core_shares=args.core_shares,
                        hello_timeout_s=args.hello_timeout,
                        relayed=args.service, argv=argv, metrics=metrics, users=users,
                        hosts=hosts)
    except (ValueError, PermissionError) as exc:  # a bad setting, or runtime directory
        print(f"crossover daemon: {exc}", file=sys.stderr)
        return 2
    try:
        daemon.serve()
    except DaemonRunning as exc:  # one daemon per node and directory
        print(f"crossover daemon: {exc}", file=sys.stderr)
        return RUNNING_EXIT
    except MetricsError as exc:  # its port taken, say
        print(f"crossover daemon: {exc}", file=sys.stderr)
        return 2
    return 0
