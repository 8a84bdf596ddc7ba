"""The pure slot scheduler: a state machine, policies and the mode decision, with no I/O."""

from crossover.scheduler.core import SchedulerError, SlotGrant, SlotScheduler
from crossover.scheduler.mode import Mode, ModeController, ModeSwitch
from crossover.scheduler.policies import POLICIES, Phase, Policy, make_policy

__all__ = ["Mode", "ModeController", "ModeSwitch", "POLICIES", "Phase", "Policy", "SlotGrant",
           "SchedulerError", "SlotScheduler", "make_policy"]
