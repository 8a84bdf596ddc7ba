"""Which network the relays' MPI traffic between nodes takes.

A cluster node often has several networks (a management Ethernet, a fast fabric, a
container bridge); Open MPI's TCP transport and runtime would use any of them. The
relays keep to one: CROSSOVER_RELAY_NETWORK (an interface, an IPv4 network, or `any`),
by default the network that carries the address the node's name resolves to, given to
Open MPI as `btl_tcp_if_include` and `oob_tcp_if_include`.

What this does not do: Open MPI 4.1 binds its listening sockets to every address
whatever these settings say (measured with `ss -ltn` beside a relay); they choose which
addresses it advertises and connects to. What reaches a relay's port from elsewhere
cannot pose as a member (every message is signed with the world's key,
`crossover.daemon.world.wire`); keeping it from reaching the port at all is the firewall's job.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from crossover import environment as E

#: the setting that leaves the choice to Open MPI
ANY = "any"


def own_network(name: str) -> str | None:
    """The IPv4 network (CIDR) of this machine's interface that carries the address
    `name` resolves to; None where it resolves to a loopback address (one machine), does
    not resolve, or is no address of this machine."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except (OSError, UnicodeError):
        return None
    wanted = {info[4][0] for info in infos}
    if not wanted or any(ipaddress.ip_address(a).is_loopback for a in wanted):
        return None
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and a.address in wanted and a.netmask:
                return str(ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False))
    return None


def relay_network() -> str | None:
    """The interface or network the relays keep to, None for Open MPI's own choice.

    Raises:
        ValueError: CROSSOVER_RELAY_NETWORK, CROSSOVER_NODE or CROSSOVER_FAKE_NODES is
            bad, naming it.
    """
    setting = E.relay_network()
    if setting:
        return None if setting.lower() == ANY else setting
    if E.fake_nodes():  # fake nodes share one machine and have no addresses
        return None
    return own_network(E.node_name())


def network_mca_flags() -> list[str]:
    """mpirun's flags that keep the relays' traffic to `relay_network()`."""
    network = relay_network()
    if network is None:
        return []
    return ["--mca", "btl_tcp_if_include", network, "--mca", "oob_tcp_if_include", network]


__all__ = ["ANY", "network_mca_flags", "own_network", "relay_network"]
