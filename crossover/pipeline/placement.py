"""Where a plan's stages run: which ranks, which rows of each micro-batch, who talks to
whom on a stage edge, and the Horovod process sets that sum a replicated stage's
gradients.

A stage with r replicas runs on r consecutive ranks (`Plan.devices_of`). Every replica
runs the stage's one schedule row on its contiguous 1/r share of each micro-batch (rows
along the batch dimension). A tensor crossing a stage edge goes, piece by piece, from
each sender replica to each receiver replica whose rows overlap its own.
"""

from __future__ import annotations

import dataclasses
import os
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


def replica_process_sets(plan: Plan, comm: Any, known: dict[tuple[int, ...], Any] | None = None,
                         dynamic: bool = False) -> dict[int, Any]:
    """One Horovod process set per replicated stage, keyed by stage.

    Collective: every rank of `comm` must call it with the same plan, because Horovod
    requires all ranks to agree on the process sets. If Horovod is not initialised it
    is initialised here on `comm`, with the sets (static process sets) or, with
    `dynamic`, ready to add sets later (a re-plan that changes replica counts needs
    that); if it already is, it must span `comm` with the same ranks and new sets are
    added dynamically (HOROVOD_DYNAMIC_PROCESS_SETS=1).

    Args:
        plan, comm: the plan and the pipeline's communicator.
        known: sets made by earlier calls, by ranks (updated): Horovod refuses a
            second set with the same ranks.
        dynamic: initialise Horovod with dynamic process sets.

    Returns:
        {stage: hvd.ProcessSet} (empty when no stage is replicated; Horovod is then not
        touched).

    Raises:
        ValueError: Horovod already runs on other ranks, or cannot add process sets.
    """
    wanted = {s: tuple(plan.devices_of(s)) for s, st in enumerate(plan.stages)
              if st.replicas > 1}
    if not wanted:
        return {}
    import horovod.torch as hvd

    known = {} if known is None else known
    # A stage on every rank (pure data parallelism) uses Horovod's global set: Horovod
    # refuses a second set with the same ranks.
    everyone = tuple(range(comm.Get_size()))
    new = sorted({r for r in wanted.values() if r != everyone and r not in known})
    if not hvd.is_initialized():
        if dynamic:
            hvd.init(comm=comm, process_sets="dynamic")
        else:
            sets = [hvd.ProcessSet(list(r)) for r in new]
            hvd.init(comm=comm, process_sets=sets)
            known.update(zip(new, sets, strict=True))
            new = []
    elif hvd.size() != comm.Get_size() or hvd.rank() != comm.Get_rank():
        raise ValueError(f"Horovod already runs as rank {hvd.rank()} of {hvd.size()} but "
                         f"this is rank {comm.Get_rank()} of {comm.Get_size()} in the "
                         f"pipeline's communicator: initialise Horovod on the same ranks")
    if new and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise ValueError("Horovod is already initialised without the replicated stages' "
                         "process sets: set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or let the "
                         "runner initialise Horovod)")
    for r in new:
        known[r] = hvd.add_process_set(list(r))
    return {s: hvd.global_process_set if r == everyone else known[r]
            for s, r in wanted.items()}


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
