"""Tied weights: a parameter several ops share, a copy on each stage that runs one.

A language model's embedding and output layer often share one weight
(`head.weight = embed.weight`). As Megatron places a tied embedding, the ops that share
a parameter may sit on different stages: each of those stages holds its own copy (every
rank built the same model), the copies start equal (the trainer copies the first
holder's to the others, `PipelineTrainer`), and after each step's backward the holders
sum their parts of the gradient over a communicator of exactly their ranks, so every
copy takes the same update and training equals one process.

The sums of a step are the *gradient groups* of a rank (`gradient_groups`): a set of
ranks and the parameters whose gradients they sum. A replicated stage's replicas sum
their stage's untied parameters; a tied parameter is summed once over every rank of
every stage holding it, each replica contributing its own share, so nothing is counted
twice. Groups are taken in one order on every rank (sorted by their ranks), so
overlapping groups cannot wait on each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from crossover.pipeline.graph import Graph
from crossover.pipeline.plan import Plan
from crossover.pipeline.waits import abandon, wait_requests

#: (ranks that sum, parameter names they sum), as `gradient_groups` gives them
Group = tuple[tuple[int, ...], tuple[str, ...]]


def shared_parameters(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Each parameter held by more than one op, by the name its first holder gives it.

    Parameters are matched by identity, not by name, so a weight tied under two module
    paths (`head.weight = embed.weight`) is found whatever each op calls it.

    Args:
        graph: the graph.

    Returns:
        {parameter name: the ops holding it, in topological order}.
    """
    holders: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for name, op in graph.ops.items():
        for pname, p in op.params.items():
            ops = holders.setdefault(id(p), [])
            if name not in ops:
                ops.append(name)
            names.setdefault(id(p), pname)
    return {names[k]: tuple(ops) for k, ops in holders.items() if len(ops) > 1}


def tied_copies(graph: Graph, plan: Plan) -> dict[str, tuple[int, ...]]:
    """Each parameter that `plan` puts on more than one stage, with the ranks holding a
    copy (every replica of every stage that runs one of its ops).

    Args:
        graph: the graph the plan covers.
        plan: the plan.

    Returns:
        {parameter name: sorted ranks}, only for parameters on two stages or more.
    """
    where = {o: s for s, st in enumerate(plan.stages) for o in st.ops}
    out: dict[str, tuple[int, ...]] = {}
    for pname, ops in shared_parameters(graph).items():
        stages = sorted({where[o] for o in ops if o in where})
        if len(stages) > 1:
            out[pname] = tuple(sorted(r for s in stages for r in plan.devices_of(s)))
    return out


def gradient_groups(graph: Graph, plan: Plan, stage: int,
                    trainable: Sequence[str]) -> list[Group]:
    """The gradient sums a rank of `stage` takes part in at the end of a step.

    Args:
        graph: the graph the plan covers.
        plan: the plan.
        stage: the rank's stage.
        trainable: the names of the stage's parameters that train (frozen ones are
            left out on every rank alike: freezing is decided alike).

    Returns:
        [(ranks, parameter names)], sorted by ranks: the stage's replicas with its
        untied parameters (if it is replicated and has any), then one group per set of
        ranks holding tied copies. Every member of a group computes the same group.
    """
    tied = tied_copies(graph, plan)
    mine = set(trainable)
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for pname, ranks in tied.items():
        if pname in mine:
            by_ranks.setdefault(ranks, []).append(pname)
    own = sorted(n for n in mine if n not in tied)
    devices = tuple(plan.devices_of(stage))
    if len(devices) > 1 and own:
        by_ranks.setdefault(devices, []).extend(own)
    return [(ranks, tuple(sorted(names))) for ranks, names in sorted(by_ranks.items())]


def group_comms(groups: Sequence[Group], comm: Any,
                given: Mapping[tuple[int, ...], Any] | None = None) -> dict[tuple[int, ...], Any]:
    """A communicator for each group's ranks (collective over each group's members
    only, in the groups' order, which every member shares).

    Args:
        groups: this rank's groups (`gradient_groups`).
        comm: the communicator the ranks are numbered in.
        given: communicators made elsewhere, by ranks (a replicated stage's).

    Returns:
        {ranks: communicator}; the ones made here are the caller's to `Free`.
    """
    out: dict[tuple[int, ...], Any] = {}
    for ranks, _names in groups:
        if given and ranks in given:
            out[ranks] = given[ranks]
        else:
            out[ranks] = comm.Create_group(comm.Get_group().Incl(list(ranks)))
    return out


def sum_gradients(params: Mapping[str, torch.Tensor], groups: Sequence[Group],
                  comms: Mapping[tuple[int, ...], Any], timeout: float, who: str,
                  spin_s: float = 0.0) -> None:
    """Sum each group's parameter gradients over its ranks (MPI, in place).

    Each member holds the gradient of its part of the loss (its ops, its share of the
    rows), so the sum (not the mean) is the whole batch's. Parameters are packed into
    one buffer per dtype in name order, so every member submits the same allreduces; a
    missing gradient is a zero one, so no member skips a tensor the others send.

    Args:
        params: name -> this rank's tensor for every name in the groups.
        groups: the groups, in the order every member takes them.
        comms: ranks -> communicator, for each group.
        timeout: seconds each allreduce may take.
        who: this rank in words, for a timeout's message.
        spin_s: how long a wait polls back to back (`waits`).

    Raises:
        TimeoutError: a sum did not finish in time (it names the ranks and parameters).
    """
    from mpi4py import MPI

    for ranks, names in groups:
        for n in names:
            if params[n].grad is None:
                params[n].grad = torch.zeros_like(params[n])
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for n in names:
            by_dtype.setdefault(params[n].grad.dtype, []).append(params[n].grad)
        for dtype in sorted(by_dtype, key=str):
            grads = by_dtype[dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            req = comms[ranks].Iallreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            what = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                            else "")
            try:
                wait_requests([req], timeout, f"{who}: the gradient sum of {what} with "
                              f"ranks {list(ranks)}", spin_s)
            except BaseException:  # a timeout, an interrupt, an MPI error while polling
                abandon(req, flat)  # a collective cannot be cancelled: keep its memory
                raise
            at = 0
            for g in grads:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()


def split_ties(graph: Graph, where: Mapping[str, int]) -> list[str]:
    """The tied parameters a placement cannot train: none, since every stage holding a
    tied parameter keeps a copy and the copies' gradients are summed. Kept for the
    callers that check a plan before running it.

    Args:
        graph: the graph; where: op name -> stage index.

    Returns:
        An empty list.
    """
    del graph, where
    return []
