"""The pure slot scheduler: a state machine plus policies, with no I/O."""

from crossover.scheduler.core import Grant, SchedulerError, SlotScheduler
from crossover.scheduler.policies import POLICIES, Phase, Policy, make_policy

__all__ = ["Grant", "POLICIES", "Phase", "Policy", "SchedulerError", "SlotScheduler", "make_policy"]
