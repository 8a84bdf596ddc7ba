"""Run a lowered schedule against the cost model: iteration time, throughput, bubble
fraction and peak memory per stage.

Each stage has a clock. Compute actions take the op costs at the stage's share of the
micro-batch plus the runner's own cost per action (`Runtime.action_s`); a send occupies
its sender for `latency + message_s` per tensor plus `bytes / bandwidth`, and the data
arrives when it ends; a receive waits for that arrival and pays `message_s` per tensor.
With more ranks than cores (`Runtime.cores`) all CPU work stretches by ranks / cores.
A replicated stage ends its iteration with a ring allreduce of its parameters. Slot
actions are free (one job).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Plan
from crossover.pipeline.pricing import StagePricer
from crossover.pipeline.profile import Costs
from crossover.pipeline.schedule import (
    ACQ,
    RECV_B,
    RECV_F,
    REL,
    SEND_B,
    SEND_F,
    B,
    F,
    Schedule,
    ScheduleError,
    lower,
)


@dataclass
class SimResult:
    """What a simulated iteration gives.

    Args:
        iteration_s: time from the first action to the last, seconds.
        samples_per_s: samples per second (micro-batch x micro-batches / iteration).
        bubble: fraction of device-time not spent computing.
        peak_memory: per stage, parameter copies + activations held at the peak, bytes.
        peak_in_flight: per stage, the most micro-batches held at once.
        spans: (stage, action, start, end) of every compute, send and receive action
            (a receive's span is its wait for the message and its own message cost).
        kinds: the action kind of each span, in the same order.
    """

    iteration_s: float
    samples_per_s: float
    bubble: float
    peak_memory: list[float]
    peak_in_flight: list[int]
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    def per_kind(self) -> dict[int, dict[str, float]]:
        """{stage: {action kind code: seconds}} over the iteration (the final gradient
        allreduce of replicated stages is not an action and is left out)."""
        out: dict[int, dict[str, float]] = {}
        for (s, _action, start, end), kind in zip(self.spans, self.kinds, strict=True):
            row = out.setdefault(s, {})
            row[kind] = row.get(kind, 0.0) + end - start
        return out


def simulate(graph: Graph, costs: Costs, plan: Plan, schedule: Schedule,
             pricer: StagePricer | None = None) -> SimResult:
    """Simulate one iteration of `plan` run by `schedule`.

    Args:
        graph: the graph; costs: its costs.
        plan: the stages (their replica counts and what each edge carries).
        schedule: lowered or not (it is lowered here if needed).
        pricer: `StagePricer(graph, costs)`, where the caller simulates many plans.

    Returns:
        The simulated iteration.

    Raises:
        ScheduleError: the schedule deadlocks (validate it for the grid).
    """
    if not schedule.lowered:
        schedule = lower(schedule)
    pricer = pricer or StagePricer(graph, costs)
    b, link, rt = plan.micro_batch, costs.link, costs.runtime
    stretch = rt.stretch(plan.devices)  # more ranks than cores: CPU work shares them
    n = len(plan.stages)
    share = [b / st.replicas for st in plan.stages]
    sums = [pricer.stage(tuple(st.ops)) for st in plan.stages]
    fwd = [stretch * (rt.action_s + f0 + f1 * share[s])
           for s, (_, (f0, f1, _b0, _b1)) in enumerate(sums)]
    bwd = [stretch * (rt.action_s + b0 + b1 * share[s])
           for s, (_, (_f0, _f1, b0, b1)) in enumerate(sums)]
    edge_bytes = {e: sum(costs.of(t).act_per_sample for t in ts) for e, ts in plan.edges.items()}
    # one message per tensor: each costs its sender the wire and both sides their own part
    edge_msgs = {e: len(ts) for e, ts in plan.edges.items()}
    message_s = stretch * rt.message_s
    wake = rt.wake(plan.devices)
    act = [info.act_per_sample * share[s] for s, (info, _) in enumerate(sums)]
    params = [info.param_bytes for info, _ in sums]

    clock = [0.0] * n
    pc = [0] * n
    arrivals: dict[tuple[str, int, int, int], float] = {}
    busy = [0.0] * n
    held = [0] * n
    peak = [0] * n
    spans: list[tuple[int, str, float, float]] = []
    kinds: list[str] = []
    rows = schedule.actions
    while True:
        progressed = False
        for s in range(n):
            while pc[s] < len(rows[s]):
                a = rows[s][pc[s]]
                if a.kind in (RECV_F, RECV_B):
                    key = (SEND_F if a.kind == RECV_F else SEND_B, a.peer, s, a.micro)
                    if key not in arrivals:
                        break
                    edge = (a.peer, s) if a.kind == RECV_F else (s, a.peer)
                    start = clock[s]
                    # a receive that waited ends at the poll after the arrival
                    late = wake if arrivals[key] > clock[s] else 0.0
                    clock[s] = (max(clock[s], arrivals[key]) + late
                                + edge_msgs.get(edge, 0) * message_s)
                    spans.append((s, str(a), start, clock[s]))
                    kinds.append(a.kind.value)
                elif a.kind in (F, B):
                    dt = fwd[s] if a.kind == F else bwd[s]
                    spans.append((s, str(a), clock[s], clock[s] + dt))
                    kinds.append(a.kind.value)
                    clock[s] += dt
                    busy[s] += dt
                    held[s] += 1 if a.kind == F else -1
                    peak[s] = max(peak[s], held[s])
                elif a.kind in (SEND_F, SEND_B):
                    edge = (s, a.peer) if a.kind == SEND_F else (a.peer, s)
                    dt = (edge_msgs.get(edge, 0) * (link.latency + message_s)
                          + edge_bytes.get(edge, 0.0) * share[s] / link.bandwidth)
                    spans.append((s, str(a), clock[s], clock[s] + dt))
                    kinds.append(a.kind.value)
                    clock[s] += dt
                    arrivals[(a.kind, s, a.peer, a.micro)] = clock[s]
                elif a.kind not in (ACQ, REL):
                    raise ScheduleError(f"unknown action kind {a.kind!r} in stage {s}")
                pc[s] += 1
                progressed = True
        if all(pc[s] == len(rows[s]) for s in range(n)):
            break
        if not progressed:
            stuck = [str(rows[s][pc[s]]) for s in range(n) if pc[s] < len(rows[s])]
            raise ScheduleError(f"the schedule deadlocks at {stuck}: run "
                                f"schedule.validate() for the grid")
    for s, st in enumerate(plan.stages):
        clock[s] += link.allreduce(params[s], st.replicas)
    makespan = max(clock)
    devices = plan.devices
    compute = sum(busy[s] * st.replicas for s, st in enumerate(plan.stages))
    mem = [params[s] * costs.param_factor + peak[s] * act[s] for s in range(n)]
    return SimResult(makespan, b * schedule.num_micro / makespan if makespan > 0 else 0.0,
                     1.0 - compute / (devices * makespan) if makespan > 0 else 0.0,
                     mem, peak, spans, kinds)
