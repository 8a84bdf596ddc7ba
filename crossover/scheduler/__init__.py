"""The pure slot scheduler: a state machine, policies and the mode decision, with no I/O."""

from crossover.scheduler.core import Grant, SchedulerError, SlotScheduler
from crossover.scheduler.mode import Mode, ModeController, ModeSwitch
from crossover.scheduler.policies import POLICIES, Phase, Policy, make_policy

__all__ = ["Grant", "Mode", "ModeController", "ModeSwitch", "POLICIES", "Phase", "Policy",
           "SchedulerError", "SlotScheduler", "make_policy"]
