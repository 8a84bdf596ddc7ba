"""Chain plans: stages that are intervals of one topological order of the ops.

The sequential partitioner (PipeDream-style) searches only these, with every tensor that
crosses a cut passed along the chain through the stages in between. The graph
partitioner searches them too, priced as graph stages (a tensor goes straight from the
stage that makes it to the stages that read it, each graph input sits just before its
first reader), so that its space holds the plans the sequential one can find (a branch
cut part-way included; not a stage of graph inputs alone), each priced no higher.

Both are one vectorised DP over the candidate cut positions: state (stages h, devices d,
first position a) -> the suffix from a with the least bottleneck (its critical path
kept beside it; so, like PipeDream's, the DP can miss a plan with a larger bottleneck
but a shorter path, which matters only with few micro-batches); a stage
[a, b) on r replicas costs `StagePricer.time` on the interval's sums, and holds at most
min(h, M) micro-batches in flight (the 1F1B count), which the memory limit prices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from crossover.pipeline.graph import Graph
from crossover.pipeline.pricing import replica_counts
from crossover.pipeline.profile import Costs


@dataclass
class Intervals:
    """Sums over every interval [pos[a], pos[b]) of `order` (P x P matrices, a < b).

    Args:
        order: the ops, topologically; pos: the candidate cut positions (0 and n
            included); fixed, per_sample, params: the interval's op sums; act: bytes per
            sample kept per micro-batch in flight (own outputs and what it receives);
            comm: bytes per sample sent and received; messages: tensors sent and received.
        trained: how many of the interval's ops hold parameters.
        exact: every cut position is a candidate (none thinned out).
        valid: which (a, b) may be a stage (None: every a < b); members: the ops
            before each position (None: `order[:pos[a]]`). Set by `ideals.py`, whose
            positions are downsets of the graph rather than prefixes of one order.
    """

    order: list[str]
    pos: np.ndarray
    fixed: np.ndarray
    per_sample: np.ndarray
    params: np.ndarray
    act: np.ndarray
    comm: np.ndarray
    messages: np.ndarray
    trained: np.ndarray
    exact: bool = True
    valid: np.ndarray | None = None
    members: list[frozenset[str]] | None = None

    def ops_between(self, a: int, b: int) -> tuple[str, ...]:
        """The ops of stage [a, b), topologically."""
        if self.members is None:
            return tuple(self.order[self.pos[a]:self.pos[b]])
        inside = self.members[b] - self.members[a]
        return tuple(o for o in self.order if o in inside)


def _order(graph: Graph, direct: bool) -> tuple[list[str], np.ndarray]:
    """The ops' topological order and where a cut may fall (between ops). With
    `direct`, each graph input moves to just before its first reader and no cut falls
    right after it, so no stage holds inputs only (a device and a hop for nothing)."""
    order = graph.order()
    if direct:
        inputs = {n for n, op in graph.ops.items() if op.is_input}
        placed: set[str] = set()
        moved: list[str] = []
        for o in order:
            if o in inputs:
                continue
            for src in graph.ops[o].inputs:
                if src in inputs and src not in placed:
                    placed.add(src)
                    moved.append(src)
            moved.append(o)
        order = moved + [n for n in graph.inputs if n not in placed]  # read by nobody
    cuttable = np.ones(len(order) + 1, dtype=bool)
    if direct:
        for i, o in enumerate(order[:-1]):
            if graph.ops[o].is_input:
                cuttable[i + 1] = False
    return order, cuttable


def _thin(cuttable: np.ndarray, crossing: np.ndarray, weight: np.ndarray,
          max_cuts: int) -> np.ndarray:
    """At most `max_cuts` cut positions: all of them if that few, else the one crossed
    by the fewest bytes in each of `max_cuts` stretches of equal compute."""
    pos = np.flatnonzero(cuttable)
    if len(pos) <= max_cuts:
        return pos
    inner = pos[1:-1]
    total = weight[-1] if weight[-1] > 0 else 1.0
    bucket = np.minimum((weight[inner] / total * (max_cuts - 2)).astype(np.int64),
                        max_cuts - 3)
    keep = [0]
    for k in np.unique(bucket):
        cand = inner[bucket == k]
        keep.append(int(cand[np.argmin(crossing[cand])]))
    keep.append(int(pos[-1]))
    return np.array(sorted(set(keep)), dtype=np.int64)


def intervals(graph: Graph, costs: Costs, direct: bool, max_cuts: int) -> Intervals:
    """The interval sums for a chain search.

    Args:
        graph, costs: the graph and its costs.
        direct: price as graph stages (tensors sent straight to their readers); else as
            a sequential chain (tensors crossing a cut pass through every stage between).
        max_cuts: the most cut positions searched (exact below it; see `_thin`).
    """
    order, cuttable = _order(graph, direct)
    n = len(order)
    at = {o: i for i, o in enumerate(order)}
    c = [costs.of(o) for o in order]
    out_act = np.array([x.act_per_sample for x in c])
    readers = [sorted(at[s] for s in graph.succ[o]) for o in order]
    last = np.array([r[-1] if r else i for i, r in enumerate(readers)])
    read_later = (last > np.arange(n)).astype(float)

    def across(weight: np.ndarray) -> np.ndarray:
        """Per cut position j: the sum of `weight` over tensors made before j and read
        at or after it."""
        diff = np.zeros(n + 2)
        np.add.at(diff, np.arange(n) + 1, weight * read_later)
        np.add.at(diff, last + 1, -weight * read_later)
        out = np.cumsum(diff)[:n + 1]
        out[0] = out[n] = 0.0
        return out

    crossing, crossing_n = across(out_act), across(np.ones(n))  # bytes, tensors

    def prefix(vals) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(np.asarray(vals, dtype=float))])

    fixed = prefix([x.fwd + x.bwd for x in c])
    per = prefix([x.fwd_per_sample + x.bwd_per_sample for x in c])
    pos = _thin(cuttable, crossing, per + fixed, max_cuts)
    own_act = prefix(out_act)
    params = prefix([x.param_bytes for x in c])
    trained = prefix([1.0 if graph.ops[o].params else 0.0 for o in order])
    a, b = pos[:, None], pos[None, :]

    def span(pre: np.ndarray) -> np.ndarray:
        return pre[b] - pre[a]

    if not direct:
        comm = crossing[a] + crossing[b]
        msgs = crossing_n[a] + crossing_n[b]
        act = span(own_act) + crossing[a]
    else:
        sent, sent_n, recv, recv_n = _direct_boundaries(pos, out_act, readers, last)
        comm, msgs, act = sent + recv, sent_n + recv_n, span(own_act) + recv
    return Intervals(order, pos, span(fixed), span(per), span(params), act, comm, msgs,
                     span(trained), exact=len(pos) == int(cuttable.sum()))


def _direct_boundaries(pos: np.ndarray, out_act: np.ndarray, readers: list[list[int]],
                       last: np.ndarray) -> tuple[np.ndarray, ...]:
    """Bytes per sample and tensor counts that interval [pos[a], pos[b]) sends (made
    inside, read at or after its end) and receives (made before it, read inside), from
    rectangles added into 2-D difference arrays over the candidate positions."""
    p = len(pos)
    sent = np.zeros((p + 1, p + 1))
    sent_n = np.zeros_like(sent)
    recv = np.zeros_like(sent)
    recv_n = np.zeros_like(sent)

    def rect(mats, weights, i_lo, i_hi, j_lo, j_hi) -> None:
        """Add to every (a, b) with pos[a] in [i_lo, i_hi] and pos[b] in [j_lo, j_hi]."""
        a0, a1 = np.searchsorted(pos, i_lo), np.searchsorted(pos, i_hi, side="right")
        b0, b1 = np.searchsorted(pos, j_lo), np.searchsorted(pos, j_hi, side="right")
        if a0 >= a1 or b0 >= b1:
            return
        for m, w in zip(mats, weights, strict=True):
            m[a0, b0] += w
            m[a0, b1] -= w
            m[a1, b0] -= w
            m[a1, b1] += w

    n = len(out_act)
    for o in range(n):
        if last[o] <= o:
            continue  # read by nothing after it: never crosses a cut
        # sent by [i, j) when i <= o < j <= last reader
        rect((sent, sent_n), (out_act[o], 1.0), 0, o, o + 1, last[o])
        # received by [i, j) when i > o and its first reader at or after i is before j
        lo = o + 1
        for r in readers[o]:
            rect((recv, recv_n), (out_act[o], 1.0), lo, r, r + 1, n)
            lo = r + 1
    return tuple(np.cumsum(np.cumsum(m, axis=0), axis=1)[:p, :p]
                 for m in (sent, sent_n, recv, recv_n))


def chain_search(iv: Intervals, costs: Costs, devices: int, b: int, m: int,
                 replicate: bool, use_all: bool, require_params: bool = False,
                 slack: float | None = None
                 ) -> list[tuple[float, list[tuple[tuple[str, ...], int]]]]:
    """The best chain plan for each (stages, devices used), by least bottleneck (the
    critical path breaks ties), ordered by `critical path + (m - 1) * bottleneck`.

    Args:
        iv: the interval sums; costs: link, memory limit and parameter copies.
        devices, b, m: devices, micro-batch size, micro-batches; replicate: stages may
            run on data-parallel replicas; use_all: the plan must use every device.
        require_params: every stage must hold an op with parameters.
        slack: leave out plans estimated above (1 + slack) x the least (None: keep
            every state's best); a shortlist of that slack is then the same.

    Returns:
        [(estimate, [(ops, replicas)] per stage)], least estimate first; empty if
        nothing fits.
    """
    link, limit, pf, rt = costs.link, costs.memory, costs.param_factor, costs.runtime
    p = len(iv.pos)
    last, rows = p - 1, np.arange(p)
    upper = rows[:, None] < rows[None, :] if iv.valid is None else iv.valid
    if require_params:
        upper = upper & (iv.trained > 0)
    rs = replica_counts(devices, b, replicate)
    times, fits = {}, {}
    sending = iv.messages * (link.latency + 2 * rt.message_s)  # (the same for every r)
    spare = limit - iv.params * pf
    for r in rs:
        share = b / r
        t = (iv.fixed + iv.per_sample * share + 2 * rt.action_s + sending
             + iv.comm * share / link.bandwidth + link.allreduce(iv.params, r) / m)
        times[r] = np.where(upper, t, math.inf)
        per = iv.act * share
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(per > 0, np.floor(spare / per), math.inf)
        fits[r] = np.where(spare < 0, -1.0, most)
        if fits[r].min() >= m:
            fits[r] = None  # memory never binds
    inf = math.inf
    bn = np.full((devices + 1, devices + 1, p), inf)
    cr = np.full_like(bn, inf)
    arg = np.full((devices + 1, devices + 1, p, 2), -1, dtype=np.int64)
    bn[0, 0, last] = cr[0, 0, last] = 0.0
    best = inf  # the least estimate of a whole plan so far
    priced: dict[int, np.ndarray] = {}
    buffer = np.empty(ROW_BLOCK * p)
    for h in range(1, devices + 1):
        # a stage h stages from the end holds min(h, m) micro-batches in flight: the
        # stages that no longer fit are priced out as h grows, until h reaches m
        if h <= m:
            for r in rs:
                if fits[r] is None:
                    priced[r] = times[r]
                elif h == 1:
                    priced[r] = np.where(fits[r] < 1, inf, times[r])
                else:
                    np.putmask(priced[r], fits[r] == h - 1, inf)
        reach = {r: _reach(iv, b / r, best * (1 + slack) * (1 + 1e-12) / m)
                 for r in priced} if slack is not None and best < inf else {}
        for d in range(h, devices + 1):
            for r, t in priced.items():
                if r > d - (h - 1):
                    break
                prev_bn, prev_cr = bn[h - 1, d - r], cr[h - 1, d - r]
                alive = np.flatnonzero(prev_bn < inf)
                if len(alive):
                    # with every device used, only whole plans (row 0) can be finished
                    _extend(t, prev_bn, prev_cr, alive, bn[h, d], cr[h, d], arg[h, d], r,
                            1 if d == devices else p, buffer, reach.get(r))
        if slack is None:
            continue
        # Branch and bound: a part's `critical path + (m - 1) * bottleneck` only grows
        # as stages are added in front, so a part above the slack over the best whole
        # plan cannot make the shortlist: dropped, its column is not searched again
        ends = [d for d in range(h, devices + 1) if not use_all or d == devices]
        best = min([best] + [float(cr[h, d, 0] + (m - 1) * bn[h, d, 0]) for d in ends])
        if best < inf:
            level_bn, level_cr = bn[h], cr[h]
            dead = level_cr + (m - 1) * level_bn > best * (1 + slack) * (1 + 1e-12)
            level_bn[dead] = inf
            level_cr[dead] = inf
    found = []
    for h in range(1, devices + 1):
        for d in range(h, devices + 1):
            if (use_all and d != devices) or bn[h, d, 0] == inf:
                continue
            est = float(cr[h, d, 0] + (m - 1) * bn[h, d, 0])
            stages, a, hh, dd = [], 0, h, d
            while a < last:
                k, r = arg[hh, dd, a]
                stages.append((iv.ops_between(a, k), int(r)))
                a, hh, dd = int(k), hh - 1, dd - int(r)
            found.append((est, stages))
    return sorted(found, key=lambda f: f[0])


def _reach(iv: Intervals, share: float, most: float) -> np.ndarray | None:
    """Per start position a: the first position whose stage [a, k) computes longer than
    `most` at `share` samples a replica (None where positions are downsets, whose sums
    do not grow along them). A stage's time is at least its compute, and a plan's
    estimate at least m times its bottleneck, so with `most` = the branch-and-bound
    limit / m a longer stage makes a part that the bound drops: not searched."""
    if iv.members is not None:
        return None
    # compute from position 0: sums of non-negative costs, so it never falls
    grows = iv.fixed[0] + iv.per_sample[0] * share
    margin = 1e-9 * (float(grows[-1]) + most)  # the matrix sums round differently
    return np.searchsorted(grows, grows + most + margin, side="right")


#: rows of the interval matrices taken at a time in `_extend` (a row's columns start
#: after it: the matrices are upper triangular)
ROW_BLOCK = 256


def _extend(t: np.ndarray, prev_bn: np.ndarray, prev_cr: np.ndarray, alive: np.ndarray,
            cur_bn: np.ndarray, cur_cr: np.ndarray, cur_arg: np.ndarray, r: int,
            rows_hi: int, buffer: np.ndarray, reach: np.ndarray | None = None) -> None:
    """One step of the chain DP: a stage [a, k) priced `t` on `r` replicas in front of
    the best plans of the suffixes at k (`prev_*`, finite at `alive`), kept in `cur_*`
    where it beats them (least bottleneck, then critical path). Only the columns of live
    suffixes after each row are taken; the least k on a tie, as a full row's argmin.
    Rows from `rows_hi` on are not needed; `buffer` (ROW_BLOCK x P values) holds a
    dense block, contiguous (a fresh megabyte a block costs more than its arithmetic).
    `reach` (see `_reach`): per row, the first column not worth taking."""
    # rows at or past the last live suffix have no stage left
    hi = min(int(alive[-1]) + 1, rows_hi)
    end = int(alive[-1]) + 1  # the columns: up to the last live suffix
    dense = len(alive) * 2 > end - int(alive[0])
    for a0 in range(0, hi, ROW_BLOCK):
        a1 = min(a0 + ROW_BLOCK, hi)
        # the block's last row reaches furthest (its stages are the shortest)
        stop = end if reach is None else min(end, int(reach[a1 - 1]))
        if dense:
            lo = max(int(alive[0]), a0 + 1)
            if lo >= stop:
                continue
            cols = np.arange(lo, stop)
            out = buffer[:(a1 - a0) * (stop - lo)].reshape(a1 - a0, stop - lo)
            v = np.maximum(t[a0:a1, lo:stop], prev_bn[lo:stop], out=out)
        else:
            cols = alive[(alive > a0) & (alive < stop)]
            if not len(cols):
                continue
            v = np.maximum(t[a0:a1][:, cols], prev_bn[cols])
        j = np.argmin(v, axis=1)
        rows = np.arange(a1 - a0)
        val = v[rows, j]
        k = cols[j]
        crit = t[rows + a0, k] + prev_cr[k]
        old_bn, old_cr = cur_bn[a0:a1], cur_cr[a0:a1]
        better = ((val < old_bn) | ((val == old_bn) & (crit < old_cr))) & (val < math.inf)
        old_bn[better], old_cr[better] = val[better], crit[better]
        block = cur_arg[a0:a1]
        block[better, 0] = k[better]
        block[better, 1] = r
