"""Per-op costs: measured forward/backward time, activation and parameter bytes, and a
transfer model. Everything the partitioners and the simulator price is here.

Times are affine in the micro-batch size, `t(b) = fixed + per_sample * b`: the fixed part
is what a framework pays per call (kernel launches, Python, MPI message set-up), which is
why fewer, larger micro-batches run faster per sample and why pipeline depth costs.
`profile` fits both terms from two measured batch sizes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from crossover.pipeline.graph import Graph, tensor_bytes

# The whole model's timing (`_whole`): runs discarded first, then at least this many
# seconds of timed runs (capped in runs, for big models on slow machines).
WHOLE_WARMUP, WHOLE_MIN_S, WHOLE_MAX_RUNS = 3, 0.3, 400


@dataclass(frozen=True)
class OpCost:
    """One op's price. Times in seconds, sizes in bytes.

    Args:
        fwd: forward time independent of batch size.
        fwd_per_sample: forward time per sample.
        bwd: backward time independent of batch size.
        bwd_per_sample: backward time per sample.
        act_per_sample: bytes of output activation per sample (kept for backward, and
            sent when a consumer is on another stage).
        param_bytes: bytes of the parameters this op owns.
    """

    fwd: float = 0.0
    fwd_per_sample: float = 0.0
    bwd: float = 0.0
    bwd_per_sample: float = 0.0
    act_per_sample: float = 0.0
    param_bytes: float = 0.0

    def forward(self, b: float) -> float:
        return self.fwd + self.fwd_per_sample * b

    def backward(self, b: float) -> float:
        return self.bwd + self.bwd_per_sample * b


@dataclass(frozen=True)
class Link:
    """Point-to-point transfer cost: `latency + bytes / bandwidth` seconds.

    Args:
        bandwidth: bytes per second.
        latency: seconds per message.
    """

    bandwidth: float = 10e9
    latency: float = 20e-6

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def allreduce(self, nbytes: float, replicas: int) -> float:
        """Ring allreduce among `replicas` devices."""
        if replicas <= 1:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps * self.latency + steps / replicas * nbytes / self.bandwidth


@dataclass(frozen=True)
class Runtime:
    """What the stage runner pays beyond its ops' own time and the wire, per machine
    (`calibrate.py` measures it; the default is the bare model: nothing).

    Args:
        action_s: seconds each forward or backward action costs beyond its ops (the
            runner's bookkeeping, feeding inputs, the autograd call, the loss).
        message_s: seconds each tensor sent or received costs its own side (posting the
            request and completing it, in Python and MPI).
        cores: cores the ranks of one host share (0: a device each); more ranks than
            cores share them, so their compute and message costs stretch.
        shared_slowdown: how much slower the same work runs on each of two ranks of
            the host computing at once than on one alone (shared caches, memory
            bandwidth, sibling hyperthreads); applies with `cores` set.
        sleep_wake_s: what a receive that had to wait pays beyond its message's arrival
            when the ranks outnumber the cores: its waits then sleep between polls
            (`waits.spin_budget`), and it ends only at the poll after the arrival.
    """

    action_s: float = 0.0
    message_s: float = 0.0
    cores: int = 0
    shared_slowdown: float = 1.0
    sleep_wake_s: float = 0.0

    def wake(self, ranks: int) -> float:
        """What a receive that waited pays after its message arrived, with `ranks` ranks
        on the host: nothing more than the wire while each has a core (its waits poll
        back to back), `sleep_wake_s` beyond."""
        return self.sleep_wake_s if self.cores and ranks > self.cores else 0.0

    def stretch(self, ranks: int) -> float:
        """How much slower CPU work runs when `ranks` ranks share `cores` cores."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks / self.cores) * (self.shared_slowdown if ranks > 1 else 1.0)


@dataclass
class Costs:
    """Costs of every op of a graph plus the machine's limits.

    Args:
        ops: op name -> cost (ops missing here cost nothing).
        link: transfer cost between devices.
        memory: bytes a device may hold (parameters x `param_factor` + activations).
        param_factor: copies of each parameter a device keeps (weights, gradients and
            two optimizer moments: 4).
        runtime: the runner's own costs per action and message (`Runtime`).
    """

    ops: dict[str, OpCost]
    link: Link = field(default_factory=Link)
    memory: float = float("inf")
    param_factor: float = 4.0
    runtime: Runtime = field(default_factory=Runtime)

    def of(self, name: str) -> OpCost:
        return self.ops.get(name, _ZERO)

    def scaled(self, factor: float) -> Costs:
        """The same costs with every time multiplied by `factor`."""
        return replace(self, ops={n: replace(c, fwd=c.fwd * factor,
                                             fwd_per_sample=c.fwd_per_sample * factor,
                                             bwd=c.bwd * factor,
                                             bwd_per_sample=c.bwd_per_sample * factor)
                                  for n, c in self.ops.items()})

    def frozen(self, ops: Iterable[str], factor: float = 1 / 6) -> Costs:
        """The same costs with `ops` frozen: no backward, no gradient, no optimizer state.

        A frozen op's forward-plus-backward time becomes `factor` of it, all of it
        forward (PipeTransformer measures a frozen layer at about 1/6 of an active one:
        besides backward, it skips the gradient's allreduce and the optimizer), and it
        keeps one copy of its parameters instead of `param_factor`.

        Args:
            ops: the frozen ops (the ones whose output needs no gradient).
            factor: a frozen op's time as a fraction of its active time.

        Returns:
            New costs; these are unchanged.

        Raises:
            ValueError: `factor` outside (0, 1].
        """
        if not 0 < factor <= 1:
            raise ValueError(f"frozen cost factor {factor!r}: give a fraction in (0, 1]")
        names = set(ops)
        return replace(self, ops={
            n: replace(c, fwd=(c.fwd + c.bwd) * factor,
                       fwd_per_sample=(c.fwd_per_sample + c.bwd_per_sample) * factor,
                       bwd=0.0, bwd_per_sample=0.0,
                       param_bytes=c.param_bytes / max(self.param_factor, 1.0))
            if n in names else c for n, c in self.ops.items()})

    def fed(self, ops: Iterable[str]) -> Costs:
        """The same costs with `ops` fed as inputs (their values come from elsewhere,
        e.g. a cache): no compute and no parameters; their outputs keep their size."""
        names = set(ops)
        return replace(self, ops={n: OpCost(act_per_sample=c.act_per_sample)
                                  if n in names else c for n, c in self.ops.items()})


_ZERO = OpCost()


def profile(graph: Graph, make_batch: Callable[[int], Mapping[str, Any]],
            sizes: tuple[int, int] = (2, 8), repeats: int = 5, link: Link | None = None,
            memory: float = float("inf"), consistent: bool = True) -> Costs:
    """Measure every op's forward and backward time at two batch sizes and fit them.

    Backward of an op is timed as autograd.grad of its output (with a ones gradient)
    with respect to its tensor inputs and parameters, i.e. the op's own share.

    Args:
        graph: the model's graph.
        make_batch: batch size -> {input name: tensor} for the model inputs.
        sizes: two distinct batch sizes to fit `fixed + per_sample * b`.
        repeats: timings per op and size; the fastest after a warm-up counts.
        link: the transfer model to attach (default `Link()`).
        memory: the device memory limit to attach, bytes.
        consistent: scale the op costs so that they add up to the whole model's
            forward and backward run as one (`_scaled_to_whole`).

    Returns:
        The fitted costs.

    Raises:
        ValueError: `sizes` are not two distinct positive sizes.
    """
    b0, b1 = sizes
    if not 0 < b0 < b1:
        raise ValueError(f"sizes must be two increasing positive batch sizes, got {sizes}")
    feeds = {b: make_batch(b) for b in (b0, b1)}
    meas = {b: _measure(graph, feeds[b], repeats) for b in (b0, b1)}
    ops: dict[str, OpCost] = {}
    for name, op in graph.ops.items():
        (f0, g0, _), (f1, g1, a1) = meas[b0][name], meas[b1][name]
        fs, gs = max(f1 - f0, 0.0) / (b1 - b0), max(g1 - g0, 0.0) / (b1 - b0)
        ops[name] = OpCost(fwd=max(f0 - fs * b0, 0.0), fwd_per_sample=fs,
                           bwd=max(g0 - gs * b0, 0.0), bwd_per_sample=gs,
                           act_per_sample=a1 / b1,
                           param_bytes=float(sum(tensor_bytes(p) for p in op.params.values())))
    if consistent:
        whole = {b: _whole(graph, feeds[b], repeats) for b in (b0, b1)}
        ops = _scaled_to_whole(ops, whole, b0, b1)
    return Costs(ops, link or Link(), memory)


def _whole(graph: Graph, feeds: Mapping[str, Any], repeats: int) -> tuple[float, float]:
    """Median seconds of the whole model's forward and of its backward, run as a stage
    runs them (the ops in order, then one autograd call), after `WHOLE_WARMUP` runs.

    Each backward follows the next forward, as in a pipeline's steady state, where
    another micro-batch's forward runs between a micro-batch's forward and its backward:
    right after its own forward, a backward found its activations in cache and ran
    6-13% faster than a stage runner's. These sums set the level of every op's cost, so
    they are timed for at least `repeats` runs and `WHOLE_MIN_S` seconds: a
    sub-millisecond model timed seven times from cold moved its profile by 30-50%."""
    fwd, bwd = [], []
    spent, runs, previous = 0.0, 0, None
    while runs < WHOLE_WARMUP + repeats or (spent < WHOLE_MIN_S and runs < WHOLE_MAX_RUNS):
        t0 = time.perf_counter()
        y = graph.run(feeds)[graph.output]
        t1 = time.perf_counter()
        if previous is not None:
            torch.autograd.backward(previous, torch.ones_like(previous))
        t2 = time.perf_counter()
        previous = y if isinstance(y, torch.Tensor) and y.requires_grad else None
        runs += 1
        if runs > WHOLE_WARMUP:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            spent += t2 - t0
    for p in graph.parameters().values():
        p.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def _scaled_to_whole(ops: dict[str, OpCost], whole: dict[int, tuple[float, float]],
                     b0: int, b1: int) -> dict[str, OpCost]:
    """Op costs scaled so that their sums equal the whole model's forward and backward
    at both sizes. Timed one by one, each op pays a call of its own (its backward a whole
    autograd call), which the model run as one does not: the fixed and per-sample parts
    get a factor each per direction, solved from the two sizes (kept within 0.05-20)."""
    def factors(fixed: float, per: float, w0: float, w1: float) -> tuple[float, float]:
        if per <= 0 or fixed <= 0:
            ratio = w1 / (fixed + per * b1) if fixed + per * b1 > 0 else 1.0
            return ratio, ratio
        a_per = min(max((w1 - w0) / (per * (b1 - b0)), 0.05), 20.0)
        # the fixed factor is solved with the per-sample factor as kept, so the sums
        # still hold at b0 when only that one was clamped (at both sizes when neither)
        a_fixed = (w0 - a_per * per * b0) / fixed
        return min(max(a_fixed, 0.05), 20.0), a_per

    fa, fp = factors(sum(c.fwd for c in ops.values()),
                     sum(c.fwd_per_sample for c in ops.values()), whole[b0][0], whole[b1][0])
    ba, bp = factors(sum(c.bwd for c in ops.values()),
                     sum(c.bwd_per_sample for c in ops.values()), whole[b0][1], whole[b1][1])
    return {n: replace(c, fwd=c.fwd * fa, fwd_per_sample=c.fwd_per_sample * fp,
                       bwd=c.bwd * ba, bwd_per_sample=c.bwd_per_sample * bp)
            for n, c in ops.items()}


def _measure(graph: Graph, feeds: Mapping[str, Any], repeats: int
             ) -> dict[str, tuple[float, float, float]]:
    """op -> (forward s, backward s, output bytes): the fastest of `repeats` timings
    after one warm-up call, the op's own cost with nothing else in the way (one
    preempted timing on a shared machine would move a median; `_scaled_to_whole` brings
    the sums back to what the model run as one pays)."""
    with torch.no_grad():
        env = graph.run(feeds)
    out: dict[str, tuple[float, float, float]] = {}
    for name, op in graph.ops.items():
        if op.is_input:
            out[name] = (0.0, 0.0, float(tensor_bytes(env[name])))
            continue
        fwd, bwd = [], []
        for _ in range(repeats + 1):
            local = {s: _leaf(env[s]) for s in op.inputs}
            t0 = time.perf_counter()
            y = op.run(local)
            t1 = time.perf_counter()
            fwd.append(t1 - t0)
            wrt = [v for v in local.values() if isinstance(v, torch.Tensor) and v.requires_grad]
            wrt += [p for p in op.params.values() if p.requires_grad]
            if isinstance(y, torch.Tensor) and y.requires_grad and wrt:
                t2 = time.perf_counter()
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
                bwd.append(time.perf_counter() - t2)
            else:
                bwd.append(0.0)
        out[name] = (min(fwd[1:]), min(bwd[1:]), float(tensor_bytes(env[name])))
    return out


def _leaf(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().requires_grad_()
    return v


def synthetic(graph: Graph, per_sample: Mapping[str, float], fixed: float = 0.0,
              act_per_sample: float = 4096.0, param_bytes: Mapping[str, float] | None = None,
              bwd_ratio: float = 2.0, link: Link | None = None,
              memory: float = float("inf")) -> Costs:
    """Costs from given numbers instead of measurements (tests, large synthetic graphs).

    Args:
        graph: the graph.
        per_sample: op name -> forward seconds per sample (missing ops: 0).
        fixed: forward seconds per call for every non-input op.
        act_per_sample: bytes of each op's output per sample.
        param_bytes: op name -> parameter bytes (default 0).
        bwd_ratio: backward time as a multiple of forward time.
        link: transfer model; memory: device memory limit in bytes.

    Returns:
        The costs.
    """
    pb = param_bytes or {}
    ops = {}
    for name, op in graph.ops.items():
        f = 0.0 if op.is_input else fixed
        s = per_sample.get(name, 0.0)
        ops[name] = OpCost(f, s, f * bwd_ratio, s * bwd_ratio, act_per_sample, pb.get(name, 0.0))
    return Costs(ops, link or Link(), memory)
