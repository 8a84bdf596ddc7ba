"""The coordinator daemon, one process per node (see `serve`): its parts are the
connections (`conns`), the node's ranks (`ranks`), the slot table's side (`table`) and
the daemons' world with its leader (`world`)."""

from crossover.daemon.serve import Daemon

__all__ = ["Daemon"]
