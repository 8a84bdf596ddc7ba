"""MPI message tags for the tensors that cross stage edges.

Every piece a stage sends is one point-to-point message; its tag says which tensor,
which direction (activation or gradient) and which micro-batch it is, so a rank can
post its receives in any order. Tags come from small per-edge tensor numbers, not op
indices, so they stay under the MPI library's bound on large graphs.
"""

from __future__ import annotations

from typing import Any

from crossover.pipeline.plan import Plan


def edge_tensor_ids(plan: Plan) -> dict[str, int]:
    """A small number for every tensor that crosses a stage edge (message tags are built
    from these, not from op indices, so they stay small on large graphs)."""
    crossing = sorted({n for names in plan.edges.values() for n in names})
    return {n: i for i, n in enumerate(crossing)}


def message_tag(tensor: int, backward: bool, micro: int, num_micro: int) -> int:
    """The MPI tag of one piece: unique per (tensor, direction, micro-batch); two ranks
    exchange at most one piece of a tensor per micro-batch, so the rank pair completes
    the key."""
    return (tensor * 2 + int(backward)) * num_micro + micro


def tag_upper_bound(comm: Any) -> int:
    """The largest tag the MPI library allows (at least 32767 by the standard)."""
    try:
        from mpi4py import MPI

        bound = comm.Get_attr(MPI.TAG_UB)
    except (AttributeError, ImportError):
        bound = None
    return int(bound) if bound else 32767


def check_tags(tensors: int, num_micro: int, bound: int) -> None:
    """Raise ValueError if the largest tag would pass the library's bound."""
    top = message_tag(tensors - 1, True, num_micro - 1, num_micro) if tensors else 0
    if top > bound:
        raise ValueError(f"{tensors} tensors crossing stage edges x {num_micro} micro-batches "
                         f"need MPI tags up to {top}, above this MPI's bound {bound}: use "
                         f"fewer micro-batches or fewer stages")
