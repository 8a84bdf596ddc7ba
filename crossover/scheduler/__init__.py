"""The pure slot scheduler: a state machine, policies and the mode decision, with no I/O.

Its vocabulary (`Phase`, `Mode`) travels on the wire, so it lives in `crossover.protocol`.
"""

from crossover.scheduler.core import SchedulerError, SlotScheduler
from crossover.scheduler.mode import ModeController, ModeSwitch
from crossover.scheduler.policies import POLICIES, Policy, make_policy
from crossover.scheduler.state import SlotGrant

__all__ = ["ModeController", "ModeSwitch", "POLICIES", "Policy", "SlotGrant",
           "SchedulerError", "SlotScheduler", "make_policy"]
