"""The job side: a rank's handle on its device slot (`slot`), its link to the node's
daemon (`link`) and its side of the slot table (`fastpath`). Imports neither the
scheduler nor the daemon."""

from crossover.client.info import RankInfo
from crossover.client.link import CrossoverDuplicateError, CrossoverVersionError, DaemonRefused
from crossover.client.slot import SlotClient

__all__ = ["CrossoverDuplicateError", "CrossoverVersionError", "DaemonRefused", "RankInfo",
           "SlotClient"]
