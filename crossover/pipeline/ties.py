"""Tied weights: parameters that several ops share, and the units no partition may cut.

A language model's embedding and output layer often share one weight. A pipeline stage
trains its own copy of the parameters its ops hold, so ops that share a parameter must
run in one stage: split over two, each copy gets only its op's part of the gradient, the
copies drift apart, and a checkpoint keeps whichever copy it reads last. Stages also form
a DAG, so every op on a path between two tied ops must be in that stage too (else the
stage would feed a stage that feeds it back).

So the partitioners cut *units*, not ops: each tied group closed under such paths is one
unit, every other op is a unit of its own, and `units` lists them in an order in which
each unit's ops are contiguous and topological. `make_plan` refuses any plan that splits
a shared parameter's ops (`split_ties`), whoever made it.
"""

from __future__ import annotations

from collections.abc import Mapping

from crossover.pipeline.graph import Graph, stable_order


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


def tied_units(graph: Graph) -> list[tuple[str, ...]]:
    """The op sets that must share one stage: the ops of each shared parameter with
    every op on a path between them, merged where they overlap.

    Args:
        graph: the graph.

    Returns:
        The units of more than one op, each in topological order, ordered by first op.
    """
    shared = shared_parameters(graph)
    if not shared:
        return []
    order = graph.order()
    idx = {n: i for i, n in enumerate(order)}
    # ancestor / descendant bitsets: the ops between two tied ops are desc(a) & anc(b)
    anc = [0] * len(order)
    for v, n in enumerate(order):
        for s in graph.ops[n].inputs:
            anc[v] |= anc[idx[s]] | (1 << idx[s])
    desc = [0] * len(order)
    for v in reversed(range(len(order))):
        for s in graph.succ[order[v]]:
            desc[v] |= desc[idx[s]] | (1 << idx[s])
    groups = [sum(1 << idx[o] for o in ops) for ops in shared.values()]
    while True:  # a hull may reach into another group: merge, close again, until stable
        merged: list[int] = []
        for h in (_hull(g, anc, desc) for g in groups):
            for i, m in enumerate(merged):
                if m & h:
                    merged[i] = m | h
                    break
            else:
                merged.append(h)
        if merged == groups:
            break
        groups = merged
    out = [tuple(order[v] for v in range(len(order)) if g >> v & 1) for g in groups]
    return sorted(out, key=lambda u: idx[u[0]])


def _hull(mask: int, anc: list[int], desc: list[int]) -> int:
    """`mask` with every op that is both below one of its ops and above another."""
    below = above = 0
    v, m = 0, mask
    while m:
        if m & 1:
            below |= desc[v]
            above |= anc[v]
        m >>= 1
        v += 1
    return mask | (below & above)


def units(graph: Graph) -> list[tuple[str, ...]]:
    """Every op in exactly one unit (tied units whole, other ops alone), the units in a
    topological order of the graph with each unit contracted to one node.

    Contracting a unit that is closed under paths leaves a DAG, so the order exists; it
    follows the graph's own order where it can (each unit placed by its first op), so a
    graph without ties gives `[(op,) for op in graph.order()]`.

    Args:
        graph: the graph.

    Returns:
        The units, in order; concatenated they are a topological order of the ops.
    """
    order = graph.order()
    pos = {n: i for i, n in enumerate(order)}
    unit_of = {n: (n,) for n in order}
    for u in tied_units(graph):
        for n in u:
            unit_of[n] = u
    preds: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for n in order:
        u = unit_of[n]
        preds.setdefault(u, set()).update(unit_of[s] for s in graph.ops[n].inputs)
        preds[u].discard(u)
    return stable_order(preds, lambda u: pos[u[0]])


def split_ties(graph: Graph, where: Mapping[str, int]) -> list[str]:
    """Each shared parameter whose ops `where` puts in different stages, described.

    Args:
        graph: the graph.
        where: op name -> stage index (ops missing from it are ignored).

    Returns:
        One line per split parameter naming it, its ops and their stages; empty if none.
    """
    out = []
    for pname, ops in shared_parameters(graph).items():
        stages = {where[o] for o in ops if o in where}
        if len(stages) > 1:
            placed = ", ".join(f"{o!r} (stage {where[o]})" for o in ops if o in where)
            out.append(f"parameter {pname!r} is shared by ops {placed}")
    return out


def describe_ties(graph: Graph) -> str:
    """The tied units in a sentence, for messages that explain a search's limits
    (empty when the graph has none)."""
    shared = shared_parameters(graph)
    if not shared:
        return ""
    parts = [f"{p!r} ({', '.join(ops)})" for p, ops in list(shared.items())[:4]]
    return (f"ops that share a parameter stay in one stage with every op between them "
            f"({'; '.join(parts)}), which leaves {len(units(graph))} units to cut")
