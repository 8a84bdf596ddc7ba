"""Where a plan's stages run: which ranks, which rows of each micro-batch, who talks to
whom on a stage edge, and the communicators that sum a replicated stage's gradients.

A stage with r replicas runs on r consecutive ranks (`Plan.devices_of`). Every replica
runs the stage's one schedule row on its contiguous 1/r share of each micro-batch (rows
along the batch dimension). A tensor crossing a stage edge goes, piece by piece, from
each sender replica to each receiver replica whose rows overlap its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from crossover.pipeline.plan import Plan, Stage


def check_ranks(plan: Plan, size: int, spare: bool = False) -> None:
    """Raise ValueError unless `size` ranks are exactly what the plan needs (with
    `spare`, at least that many: the ranks past `plan.devices` run no stage).

    Every rank checks on its own before any message is exchanged, so a wrong launch
    fails at once on all ranks instead of hanging in a receive.
    """
    if size < plan.devices or (size > plan.devices and not spare):
        reps = ", ".join(f"stage {i} x{st.replicas}" for i, st in enumerate(plan.stages)
                         if st.replicas > 1)
        raise ValueError(f"the plan needs {plan.devices} ranks ({len(plan.stages)} stages"
                         f"{'; ' + reps if reps else ''}) but the communicator has {size}: "
                         f"launch mpirun -np {plan.devices}")


def stage_of_rank(plan: Plan, rank: int) -> tuple[int, int]:
    """(stage, replica index) that `rank` runs: stage i's replicas are `plan.devices_of(i)`."""
    for s in range(len(plan.stages)):
        devs = plan.devices_of(s)
        if rank in devs:
            return s, devs.index(rank)
    raise ValueError(f"rank {rank} runs no stage: the plan uses ranks 0..{plan.devices - 1}")


def shard_rows(micro_batch: int, replicas: int, replica: int) -> tuple[int, int]:
    """Rows [lo, hi) of a micro-batch that `replica` of `replicas` computes."""
    share = micro_batch // replicas
    return replica * share, (replica + 1) * share


def links(plan: Plan, stage: int, replica: int, peer: int
          ) -> list[tuple[int, int, slice]]:
    """Who this replica exchanges a boundary tensor with on the edge to stage `peer`.

    Returns:
        (peer rank, peer replica, rows of this replica's local tensor) for each peer
        replica whose share overlaps this one's. The overlap is the same rows seen from
        both sides, so the sender slices and the receiver fills the same piece; when
        neither stage is replicated the whole tensor travels (`slice(None)`), whatever
        its shape.
    """
    mine, theirs = plan.stages[stage].replicas, plan.stages[peer].replicas
    ranks = plan.devices_of(peer)
    if mine == 1 and theirs == 1:
        return [(ranks[0], 0, slice(None))]
    b = plan.micro_batch
    lo, hi = shard_rows(b, mine, replica)
    out = []
    for j in range(theirs):
        plo, phi = shard_rows(b, theirs, j)
        a, z = max(lo, plo), min(hi, phi)
        if a < z:
            out.append((ranks[j], j, slice(a - lo, z - lo)))
    return out


def replica_comms(plan: Plan, comm: Any) -> dict[int, Any]:
    """One MPI communicator per replicated stage, over its replicas, keyed by stage.

    The replicas sum their gradients once per step, all at once after the last
    backward: a plain MPI allreduce does that without Horovod's background thread and
    negotiation, which on a busy host cost more than the sum itself, and a re-plan can
    make new ones at any time. Collective: every rank of `comm` calls it with the same
    plan (one `Split`); a rank gets only its own stage's communicator.

    Returns:
        {stage: communicator} for this rank's stage if it is replicated, else {}.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    mine = next((s for s, st in enumerate(plan.stages)
                 if st.replicas > 1 and rank in plan.devices_of(s)), None)
    sub = comm.Split(MPI.UNDEFINED if mine is None else mine, rank)
    return {} if mine is None else {mine: sub}


def parse_replicas(text: str | None, stages: int | None = None) -> list[int] | None:
    """`--replicas 2,1,1` -> [2, 1, 1] (replicas per stage, in the plan's stage order).

    Raises:
        ValueError: not positive integers, or not one per stage.
    """
    if not text:
        return None
    try:
        reps = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--replicas wants comma-separated counts per stage, not {text!r}"
                         ) from None
    if any(r < 1 for r in reps):
        raise ValueError(f"--replicas counts must be >= 1, not {reps}")
    if stages is not None and len(reps) != stages:
        raise ValueError(f"--replicas gives {len(reps)} counts for a plan of {stages} stages")
    return reps


def with_replicas(plan: Plan, replicas: Sequence[int]) -> Plan:
    """A copy of the plan with stage i on `replicas[i]` devices (edges are unchanged:
    they name stages, and the replicas of a stage share its edges)."""
    if len(replicas) != len(plan.stages):
        raise ValueError(f"{len(replicas)} replica counts for {len(plan.stages)} stages")
    stages = [Stage(st.ops, r) for st, r in zip(plan.stages, replicas, strict=True)]
    return dataclasses.replace(plan, stages=stages, notes=list(plan.notes))
