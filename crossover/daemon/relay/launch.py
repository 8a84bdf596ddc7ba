"""How a world's relays and services are launched: Open MPI's settings for every
mpirun of relays, the environment and command line of a service a relay starts, and
where a node's service listens for its relay. The launchers (`crossoverrun`) and the
leader's generations (`crossover.daemon.world.generation`) use these too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from crossover.daemon.relay.network import network_mca_flags
from crossover.transport import runtime_dir

#: the launcher's variables of one MPI process, which a nested mpirun must not inherit
_LAUNCH_PREFIXES = ("PMIX_", "OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess",
                    "OMPI_MCA_pmix", "OMPI_MCA_shmem_", "OMPI_FILE_", "OMPI_FIRST_",
                    "OMPI_APP_", "OMPI_NUM_APP", "OMPI_UNIVERSE", "OMPI_COMMAND",
                    "OMPI_MCA_initial_wdir", "OMPI_MCA_mpi_oversubscribe")
#: Open MPI's settings for every mpirun of relays. Recovery: a relay's end ends that
#: relay only, not its world. Exit without sync: a relay may end without MPI_Finalize
#: (one whose peers died would wait in it for ever), and Open MPI 4 sometimes reports a
#: process that did finalize as "exiting improperly" (its finalize and its exit race in
#: mpirun); either way mpirun must not fail a world whose relays all ended well.
RELAY_MCA = {"orte_enable_recovery": "1", "orte_allowed_exit_without_sync": "1"}
#: the flags that say which node or generation a daemon process is of
_OWN = ("--node", "--generation", "--leader", "--nodes")


def relay_path(node: str, directory: str | os.PathLike | None = None) -> Path:
    """Where node `node`'s service listens for its relay."""
    return runtime_dir(directory, create=False) / f"node-{node}.relay"


def relay_mca_flags() -> list[str]:
    """`RELAY_MCA` as mpirun's command-line flags, with the network the relays keep to
    (`crossover.daemon.relay.network`)."""
    return [*(arg for name, value in RELAY_MCA.items() for arg in ("--mca", name, value)),
            *network_mca_flags()]


def relay_mca_env() -> dict[str, str]:
    """`RELAY_MCA` as the environment variables mpirun reads them from."""
    return {f"OMPI_MCA_{name}": value for name, value in RELAY_MCA.items()}


def missing_relay_mca(environ: dict[str, str] | None = None) -> list[str]:
    """The settings of `RELAY_MCA` that a relay's world (`environ`: a relay's
    environment, which mpirun gives its --mca flags) was started without."""
    env = os.environ if environ is None else environ
    return [name for name in RELAY_MCA
            if env.get(f"OMPI_MCA_{name}", "0").lower() not in ("1", "true", "yes")]


def service_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a service a relay starts: the relay's, less what mpirun set for
    the relay alone (the service does no MPI, and the mpirun a leader's service starts
    would take those for its own)."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCH_PREFIXES)}


def daemon_flags(argv: list[str]) -> list[str]:
    """The world's settings among a daemon's arguments (`argv`, after `-m crossover`):
    without the subcommand and the flags that name a node or a generation."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in _OWN:
            skip = True
        elif not (i == 0 and arg == "daemon") and arg != "--service" and \
                not arg.startswith(tuple(f"{o}=" for o in _OWN)):
            kept.append(arg)
    return kept


def service_argv(name: str, argv: list[str]) -> list[str]:
    """The service's command line for node `name`: `crossover daemon` with the world's
    settings (`argv`: a daemon's arguments after `-m crossover`)."""
    return [sys.executable, "-m", "crossover", "daemon", *daemon_flags(argv), "--service",
            "--node", name]
