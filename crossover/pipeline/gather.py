"""Bringing a pipelined model's pieces to one rank: gradients (for tests against one
process) and, for checkpoints, parameters and optimizer state."""

from __future__ import annotations

from typing import Any

import torch

from crossover.pipeline.graph import Graph
from crossover.pipeline.placement import stage_of_rank
from crossover.pipeline.plan import Plan


def gather_grads(graph: Graph, comm: Any, root: int = 0, plan: Plan | None = None
                 ) -> dict[str, torch.Tensor] | None:
    """Every stage's parameter gradients, summed by name, on `root` (None elsewhere).

    With a plan, only the first replica of each stage contributes: after the step every
    replica holds the whole stage gradient, and adding them all would count it r times;
    and a parameter tied across stages is taken once (after the step every copy holds
    the whole gradient).
    """
    mine: dict[str, torch.Tensor] = {}
    if plan is None or stage_of_rank(plan, comm.Get_rank())[1] == 0:
        for name, p in graph.parameters().items():
            if p.grad is not None:
                mine[name] = p.grad.detach().clone()
    parts = comm.gather(mine, root=root)
    if parts is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v
            elif plan is None:
                out[k] = out[k] + v
    return out
