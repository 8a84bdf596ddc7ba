"""Schedules as data: per stage, the list of actions it performs in one iteration.

`1F0` is stage 1's forward of micro-batch 0, `1B0` its backward. Generators are pure:
`gpipe` (all forwards, then all backwards), and `one_f_one_b`, which works for a chain
(classic 1F1B) and for a stage DAG (GraphPipe): a stage first runs as many forwards as
there are stages on its longest path to the sink, then alternates backward and forward.
`lower` adds the communication (send/recv on each stage edge) and the slot acquire and
release around every compute action. `validate` executes a schedule in lockstep and, on
an error, prints the stage x step grid with the offending action marked.

A replicated stage is one row: its replicas run the same list on their share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from crossover.pipeline.plan import Plan


class ActionKind(str, Enum):
    """What a schedule step does; prints as its short code (`1F0` is stage 1's forward
    of micro-batch 0)."""

    F = "F"  # forward of a micro-batch
    B = "B"  # backward of a micro-batch
    SEND_F = "SF"  # send activations to a successor stage
    RECV_F = "RF"  # receive activations from a predecessor stage
    SEND_B = "SB"  # send gradients back to a predecessor stage
    RECV_B = "RB"  # receive gradients from a successor stage
    ACQ = "ACQ"  # take the device slot
    REL = "REL"  # give the device slot back

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" is the code too, on every Python


F, B = ActionKind.F, ActionKind.B
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B
ACQ, REL = ActionKind.ACQ, ActionKind.REL
COMPUTE = (F, B)


class ScheduleError(ValueError):
    """A schedule is invalid or deadlocks; the message holds the grid with the error."""


@dataclass(frozen=True)
class Action:
    """One step of one stage.

    Args:
        kind: F, B, SF/RF (send/recv activations), SB/RB (send/recv gradients),
            ACQ/REL (take/give back the device slot).
        stage: the stage doing it.
        micro: the micro-batch.
        peer: the other stage of a send/recv.
    """

    kind: ActionKind
    stage: int
    micro: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind in COMPUTE:
            return f"{self.stage}{self.kind}{self.micro}"
        if self.kind in (ACQ, REL):
            return f"{self.stage}{self.kind}"
        arrow = ">" if self.kind in (SEND_F, SEND_B) else "<"
        return f"{self.stage}{self.kind}{self.micro}{arrow}{self.peer}"


@dataclass
class Schedule:
    """Per-stage action lists plus the stage graph they run on.

    Args:
        actions: actions[s] is stage s's list.
        succs: succs[s] = stages reading stage s's outputs.
        num_micro: micro-batches per iteration.
        name: what generated it.
    """

    actions: list[list[Action]]
    succs: list[list[int]]
    num_micro: int
    name: str = ""

    @property
    def preds(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.actions]
        for s, ts in enumerate(self.succs):
            for t in ts:
                out[t].append(s)
        return out

    @property
    def lowered(self) -> bool:
        return any(a.kind not in COMPUTE for row in self.actions for a in row)

    def grid(self, marks: dict[tuple[int, int], str] | None = None,
             steps: list[list[Action | None]] | None = None) -> str:
        """The stage x step grid; `marks` maps (stage, step) -> note for error cells."""
        rows = steps if steps is not None else [list(r) for r in self.actions]
        marks = marks or {}
        width = max([len(str(a)) for r in rows for a in r if a is not None] + [1]) + 2
        n = max((len(r) for r in rows), default=0)
        lines = ["stage | " + " ".join(str(i).rjust(width) for i in range(n))]
        for s, r in enumerate(rows):
            cells = []
            for i in range(n):
                a = r[i] if i < len(r) else None
                text = "." if a is None else str(a)
                if (s, i) in marks:
                    text = f"!{text}!"
                cells.append(text.rjust(width))
            lines.append(f"{s:5d} | " + " ".join(cells))
        notes = [f"  ! stage {s} step {i}: {m}" for (s, i), m in sorted(marks.items())]
        return "\n".join(lines + notes)


def depths(succs: Sequence[Sequence[int]]) -> list[int]:
    """Stages on the longest path from each stage to a sink (itself included)."""
    memo: dict[int, int] = {}

    def d(s: int) -> int:
        if s not in memo:
            memo[s] = 1 + max((d(t) for t in succs[s]), default=0)
        return memo[s]

    return [d(s) for s in range(len(succs))]


def chain(n: int) -> list[list[int]]:
    """The successor lists of a chain of `n` stages."""
    return [[s + 1] if s + 1 < n else [] for s in range(n)]


def gpipe(succs: Sequence[Sequence[int]], num_micro: int) -> Schedule:
    """GPipe: every forward, then every backward (in micro-batch order)."""
    acts = [[Action(F, s, m) for m in range(num_micro)] + [Action(B, s, m) for m in
                                                           range(num_micro)]
            for s in range(len(succs))]
    return Schedule(acts, [list(t) for t in succs], num_micro, "gpipe")


def one_f_one_b(succs: Sequence[Sequence[int]], num_micro: int) -> Schedule:
    """One-forward-one-backward; warm-up depth = the stage's longest path to the sink.

    On a chain of n stages this is the classic 1F1B (stage s warms up with n - s - 1
    forwards); on a stage DAG it is GraphPipe's schedule: parallel branches share a depth,
    so fewer micro-batches are in flight than on a chain of as many stages.

    Args:
        succs: successor lists of the stage DAG (stages in topological order).
        num_micro: micro-batches per iteration.

    Returns:
        The (unlowered) schedule.
    """
    acts = []
    for s, depth in enumerate(depths(succs)):
        warm = min(depth - 1, num_micro)
        row = [Action(F, s, m) for m in range(warm)]
        for m in range(num_micro - warm):
            row += [Action(F, s, warm + m), Action(B, s, m)]
        row += [Action(B, s, m) for m in range(num_micro - warm, num_micro)]
        acts.append(row)
    return Schedule(acts, [list(t) for t in succs], num_micro, "1f1b")


def lower(schedule: Schedule, slots: bool = True) -> Schedule:
    """Add receives before and sends after each compute action, and slot acquire/release.

    Args:
        schedule: an unlowered schedule.
        slots: wrap each compute action in ACQ/REL (the runner takes the device slot).

    Returns:
        The lowered schedule (sends never block; receives do).
    """
    preds = schedule.preds
    out = []
    for s, row in enumerate(schedule.actions):
        low: list[Action] = []
        for a in row:
            if a.kind == F:
                low += [Action(RECV_F, s, a.micro, p) for p in preds[s]]
            elif a.kind == B:
                low += [Action(RECV_B, s, a.micro, t) for t in schedule.succs[s]]
            low += [Action(ACQ, s, a.micro)] if slots and a.kind in COMPUTE else []
            low.append(a)
            low += [Action(REL, s, a.micro)] if slots and a.kind in COMPUTE else []
            if a.kind == F:
                low += [Action(SEND_F, s, a.micro, t) for t in schedule.succs[s]]
            elif a.kind == B:
                low += [Action(SEND_B, s, a.micro, p) for p in preds[s]]
        out.append(low)
    return Schedule(out, schedule.succs, schedule.num_micro, schedule.name + "+lowered")


def validate(schedule: Schedule) -> list[list[Action | None]]:
    """Check a schedule and run it in lockstep (one action per stage per step).

    Checks: every stage has exactly one forward and one backward per micro-batch;
    sends and receives pair up; and the lockstep run finishes (no deadlock: a forward
    needs its predecessors' forwards, a backward its own forward and its successors'
    backwards; a receive needs the matching send in an earlier step).

    Args:
        schedule: lowered or not.

    Returns:
        The executed grid: per stage, the action run at each step (None: waiting).

    Raises:
        ScheduleError: with the grid and the offending actions marked.
    """
    n, mcount = len(schedule.actions), schedule.num_micro
    preds = schedule.preds
    for s, row in enumerate(schedule.actions):
        for kind in COMPUTE:
            seen: dict[int, int] = {}
            for i, a in enumerate(row):
                if a.stage != s:
                    raise ScheduleError(_err(schedule, {(s, i): f"action of stage {a.stage} "
                                                        f"in stage {s}'s list"}))
                if a.kind == kind:
                    if a.micro in seen or not 0 <= a.micro < mcount:
                        raise ScheduleError(_err(schedule, {(s, i): f"{kind} of micro-batch "
                                                            f"{a.micro} repeated or out of "
                                                            f"range 0..{mcount - 1}"}))
                    seen[a.micro] = i
            if len(seen) != mcount:
                missing = sorted(set(range(mcount)) - set(seen))
                raise ScheduleError(_err(schedule, {(s, len(row) - 1): f"stage {s} never "
                                                    f"runs {kind} of micro-batches {missing}"}))
    lowered = schedule.lowered
    if lowered:
        sends = {(a.kind, a.stage, a.peer, a.micro) for r in schedule.actions for a in r
                 if a.kind in (SEND_F, SEND_B)}
        for s, row in enumerate(schedule.actions):
            for i, a in enumerate(row):
                if a.kind in (RECV_F, RECV_B):
                    want = (SEND_F if a.kind == RECV_F else SEND_B, a.peer, s, a.micro)
                    if want not in sends:
                        raise ScheduleError(_err(schedule, {(s, i): "receive without a "
                                                            "matching send"}))
    done: set[tuple[str, int, int]] = set()   # (F/B, stage, micro) computed
    sent: set[tuple[str, int, int, int]] = set()  # (SF/SB, from, to, micro)
    pc = [0] * n
    grid: list[list[Action | None]] = [[] for _ in range(n)]

    def ready(a: Action) -> bool:
        if a.kind == RECV_F:
            return (SEND_F, a.peer, a.stage, a.micro) in sent
        if a.kind == RECV_B:
            return (SEND_B, a.peer, a.stage, a.micro) in sent
        if a.kind == F:
            return lowered or all((F, p, a.micro) in done for p in preds[a.stage])
        if a.kind == B:
            if (F, a.stage, a.micro) not in done:
                return False
            return lowered or all((B, t, a.micro) in done for t in schedule.succs[a.stage])
        return True

    while any(pc[s] < len(schedule.actions[s]) for s in range(n)):
        runnable = [s for s in range(n) if pc[s] < len(schedule.actions[s])
                    and ready(schedule.actions[s][pc[s]])]
        if not runnable:
            marks = {}
            for s in range(n):
                if pc[s] < len(schedule.actions[s]):
                    grid[s].append(schedule.actions[s][pc[s]])
                    marks[(s, len(grid[s]) - 1)] = f"blocked on {schedule.actions[s][pc[s]]}"
            width = max(len(r) for r in grid)
            for r in grid:
                r.extend([None] * (width - len(r)))
            marks = {(s, width - 1): m for (s, _), m in marks.items()}
            raise ScheduleError("deadlock: no stage can make progress\n"
                                + schedule.grid(marks, grid))
        for s in range(n):
            if s in runnable:
                a = schedule.actions[s][pc[s]]
                grid[s].append(a)
                pc[s] += 1
            else:
                grid[s].append(None)
        for s in runnable:  # effects become visible at the next step
            a = grid[s][-1]
            if a.kind in COMPUTE:
                done.add((a.kind, s, a.micro))
            elif a.kind in (SEND_F, SEND_B):
                sent.add((a.kind, s, a.peer, a.micro))
    return grid


def _err(schedule: Schedule, marks: dict[tuple[int, int], str]) -> str:
    return "invalid schedule\n" + schedule.grid(marks)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches forwarded but not yet backwarded."""
    out = []
    for row in schedule.actions:
        cur = peak = 0
        for a in row:
            cur += 1 if a.kind == F else -1 if a.kind == B else 0
            peak = max(peak, cur)
        out.append(peak)
    return out


def schedule_for(plan: Plan, kind: str = "1f1b", slots: bool = True) -> Schedule:
    """The lowered schedule for a plan.

    Args:
        plan: the partition (its edges give the stage graph; a sequential plan's is a chain).
        kind: "1f1b" (GraphPipe's on a DAG, classic on a chain) or "gpipe".
        slots: include slot acquire/release around compute.

    Returns:
        The validated, lowered schedule.

    Raises:
        ValueError: unknown kind.
    """
    succs = [plan.succs(s) for s in range(len(plan.stages))]
    if kind == "1f1b":
        sched = one_f_one_b(succs, plan.num_micro)
    elif kind == "gpipe":
        sched = gpipe(succs, plan.num_micro)
    else:
        raise ValueError(f"schedule kind must be '1f1b' or 'gpipe', not {kind!r}")
    low = lower(sched, slots)
    validate(low)
    return low
