"""The coordinator daemon: on each node a service for its ranks and a relay, its MPI
process, which together form the daemons' world.

- `node`: the node's service (`node.service.Daemon`): its ranks' connections, the ranks
  themselves, the slot table's side, its sockets, who may use it, its metrics.
- `world`: the world's agreement: who leads and who is lost (`membership`, `member`),
  the leader's decisions (`leader`, on a thread of its own: `leader_thread`), the
  generations it forms, and the signed messages between nodes (`wire`).
- `relay`: the node's MPI process (`process`), how relays and services are launched
  (`launch`, `network`), the frames between a relay and its service (`frames`), the MPI
  channel between relays (`mpichannel`) and the service's side of its relay (`uplink`).
"""

from crossover.daemon.node.service import Daemon

__all__ = ["Daemon"]
