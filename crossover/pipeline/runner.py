"""The stage runner: each MPI rank executes its stage's row of a lowered schedule.

Activations and gradients travel by MPI point-to-point (mpi4py Isend/Irecv on the
tensors' own memory: a contiguous CPU tensor is sent without a copy and received into
the tensor that is then used). Every receive polls with a deadline, so a dead or
diverging peer gives a TimeoutError naming the stage, micro-batch and tensor, never a
hang. Each compute action holds the device slot from the crossover daemon (ACQ/REL in
the schedule), so pipeline stages share devices with Horovod jobs under one scheduler.

A stage with r replicas runs on r consecutive ranks (`Plan.devices_of`). Every replica
runs the stage's one schedule row on its contiguous 1/r share of each micro-batch (rows
along the batch dimension). A tensor crossing a stage edge goes, piece by piece, from
each sender replica to each receiver replica whose rows overlap its own, so a
non-replicated neighbour scatters and gathers shards and replicated neighbours exchange
matching ranges. Each replica weights its loss by its share of the micro-batch, so its
parameter gradients are its part of the single-process sum; at the end of the step the
replicas sum them with a Horovod allreduce over one process set per replicated stage.

Run as a script under mpirun (one rank per stage replica):

    mpirun -np 3 python -m crossover.pipeline.runner --model uno --small --dtype float64
    mpirun -np 3 python -m crossover.pipeline.runner --model chain --small --replicas 2,1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from crossover.backoff import Backoff, wait_until
from crossover.pipeline.graph import Graph
from crossover.pipeline.partition import Plan, Stage, make_plan
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
)
from crossover.protocol import Phase

Feeds = Callable[[int], Mapping[str, torch.Tensor]]


def check_ranks(plan: Plan, size: int) -> None:
    """Raise ValueError unless `size` ranks are exactly what the plan needs.

    Every rank checks on its own before any message is exchanged, so a wrong launch
    fails at once on all ranks instead of hanging in a receive.
    """
    if size != plan.devices:
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


def replica_process_sets(plan: Plan, comm: Any) -> dict[int, Any]:
    """One Horovod process set per replicated stage, keyed by stage.

    Collective: every rank of `comm` must call it with the same plan, because Horovod
    requires all ranks to agree on the process sets. If Horovod is not initialised it
    is initialised here on `comm` with the sets (static process sets); if it already
    is, it must span `comm` with the same ranks and the sets are added dynamically
    (HOROVOD_DYNAMIC_PROCESS_SETS=1).

    Returns:
        {stage: hvd.ProcessSet} (empty when no stage is replicated; Horovod is then not
        touched).

    Raises:
        ValueError: Horovod already runs on other ranks, or cannot add process sets.
    """
    wanted = {s: plan.devices_of(s) for s, st in enumerate(plan.stages) if st.replicas > 1}
    if not wanted:
        return {}
    import horovod.torch as hvd

    # A stage on every rank (pure data parallelism) uses Horovod's global set: Horovod
    # refuses a second set with the same ranks.
    everyone = list(range(comm.Get_size()))
    sets = {s: hvd.ProcessSet(ranks) for s, ranks in wanted.items() if ranks != everyone}
    whole = {s: None for s, ranks in wanted.items() if ranks == everyone}
    if not hvd.is_initialized():
        hvd.init(comm=comm, process_sets=list(sets.values()))
        return {**sets, **{s: hvd.global_process_set for s in whole}}
    if hvd.size() != comm.Get_size() or hvd.rank() != comm.Get_rank():
        raise ValueError(f"Horovod already runs as rank {hvd.rank()} of {hvd.size()} but "
                         f"this is rank {comm.Get_rank()} of {comm.Get_size()} in the "
                         f"pipeline's communicator: initialise Horovod on the same ranks")
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise ValueError("Horovod is already initialised without the replicated stages' "
                         "process sets: set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or let the "
                         "runner initialise Horovod)")
    return {**{s: hvd.add_process_set(ps) for s, ps in sets.items()},
            **{s: hvd.global_process_set for s in whole}}


class StageRunner:
    """Runs one stage replica's row of a lowered schedule.

    Args:
        graph: the whole model graph (every rank holds it; a stage runs its own ops).
        plan: the partition; `stage` indexes its stages. A stage with r replicas runs
            on ranks `plan.devices_of(stage)`, each on 1/r of every micro-batch.
        schedule: the lowered schedule (one row per stage, replicas share it).
        stage: this process's stage; this rank must be one of its devices.
        comm: an mpi4py communicator with exactly `plan.devices` ranks.
        shapes: op name -> (shape, dtype) of its output for one whole micro-batch.
        client: a crossover SlotClient, or None to run without slots.
        timeout: seconds any single receive, send or gradient allreduce may take.
        process_sets: {stage: hvd.ProcessSet} for the replicated stages; None: made by
            `replica_process_sets` here, which is collective (every rank constructs its
            runner, which is the case when every rank runs a stage).

    Raises:
        ValueError: the communicator has the wrong number of ranks (the message names
            the number needed), this rank is not a device of `stage`, a replicated
            stage's micro-batch does not split evenly, or a tensor crossing a replicated
            stage's edge is not batch-major.
    """

    def __init__(self, graph: Graph, plan: Plan, schedule: Schedule, stage: int, comm: Any,
                 shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 client: Any = None, timeout: float = 60.0,
                 process_sets: Mapping[int, Any] | None = None) -> None:
        check_ranks(plan, comm.Get_size())
        if not schedule.lowered:
            raise ValueError("run a lowered schedule (schedule.lower(...))")
        rank = comm.Get_rank()
        if rank not in plan.devices_of(stage):
            raise ValueError(f"rank {rank} is not a device of stage {stage} (its ranks are "
                             f"{plan.devices_of(stage)}): use stage_of_rank(plan, rank)")
        self.g, self.plan, self.sched, self.s = graph, plan, schedule, stage
        self.comm, self.shapes, self.client, self.timeout = comm, shapes, client, timeout
        self.replicas = plan.stages[stage].replicas
        self.replica = plan.devices_of(stage).index(rank)
        self.rows = shard_rows(plan.micro_batch, self.replicas, self.replica)
        self.ops = plan.stages[stage].ops
        self.index = {n: i for i, n in enumerate(graph.ops)}
        self.params = {k: p for o in self.ops for k, p in graph.ops[o].params.items()}
        self.compute_s = 0.0
        self._check_split()
        if process_sets is None:
            process_sets = replica_process_sets(plan, comm)
        self.process_set = process_sets.get(stage) if self.replicas > 1 else None
        if self.replicas > 1 and self.process_set is None:
            raise ValueError(f"stage {stage} has {self.replicas} replicas but no process set "
                             f"was given for it")

    def _check_split(self) -> None:
        """Shards are rows of the batch dimension: refuse what cannot be split that way
        (a wrong split would give wrong gradients, not an error)."""
        b = self.plan.micro_batch
        for s, st in enumerate(self.plan.stages):
            if b % st.replicas:
                raise ValueError(f"stage {s}'s {st.replicas} replicas cannot share a "
                                 f"micro-batch of {b} samples evenly")
        for (a, z), names in self.plan.edges.items():
            if self.plan.stages[a].replicas == self.plan.stages[z].replicas == 1:
                continue
            for name in names:
                shape = self.shapes.get(name, ((), None))[0]
                if not shape or shape[0] != b:
                    raise ValueError(f"tensor {name!r} on the edge from stage {a} to {z} "
                                     f"has shape {shape}, not batch-major with {b} rows: a "
                                     f"replicated stage's boundary tensors must be split "
                                     f"along the batch; do not replicate these stages")

    def _who(self) -> str:
        if self.replicas == 1:
            return f"stage {self.s}"
        return f"stage {self.s} replica {self.replica} (rank {self.comm.Get_rank()})"

    # --- messages ----------------------------------------------------------------------
    def _tag(self, name: str, micro: int, backward: bool) -> int:
        # unique per (tensor, direction, micro-batch); two ranks exchange at most one
        # piece of a tensor per micro-batch, so the rank pair completes the key
        return (self.index[name] * 2 + int(backward)) * self.sched.num_micro + micro

    def _send(self, tensor: torch.Tensor, peer: int, name: str, micro: int, backward: bool,
              pending: list) -> None:
        for rank, _j, rows in links(self.plan, self.s, self.replica, peer):
            buf = tensor.detach()[rows].contiguous()
            pending.append((self.comm.Isend(buf.numpy(), dest=rank,
                                            tag=self._tag(name, micro, backward)), buf))

    def _recv(self, name: str, peer: int, micro: int, backward: bool) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        if self.replicas > 1 or self.plan.stages[peer].replicas > 1:
            shape = (self.rows[1] - self.rows[0], *shape[1:])
        buf = torch.empty(shape, dtype=dtype)
        reqs = []
        for rank, j, rows in links(self.plan, self.s, self.replica, peer):
            piece = buf[rows]  # rows of a contiguous tensor: a contiguous view, no copy
            reqs.append((self.comm.Irecv(piece.numpy(), source=rank,
                                         tag=self._tag(name, micro, backward)), piece, j, rank))
        for req, _piece, j, rank in reqs:
            src = f"stage {peer}" if self.plan.stages[peer].replicas == 1 else \
                f"stage {peer} replica {j} (rank {rank})"
            what = (f"{self._who()} waited {self.timeout:.0f} s for the "
                    f"{'gradient' if backward else 'activation'} {name!r} of micro-batch "
                    f"{micro} from {src}")
            _wait(req, self.timeout, what)
        return buf

    def _share(self, t: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a whole-micro-batch tensor (feeds and targets)."""
        return t if self.replicas == 1 else t[self.rows[0]:self.rows[1]]

    # --- one iteration -----------------------------------------------------------------
    def run(self, feeds: Feeds, targets: Callable[[int], torch.Tensor],
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """One iteration: forwards and backwards of every micro-batch, per the schedule.

        Parameter gradients accumulate in `.grad` (zero them between iterations); the
        loss is the mean of the micro-batch losses, as one process on the whole batch.
        A replica weights its share's loss by its fraction of the micro-batch, and the
        replicas of a stage sum their parameter gradients at the end, so every replica
        ends with the single-process gradient.

        Args:
            feeds: micro-batch index -> model inputs (the whole micro-batch).
            targets: micro-batch index -> target (the whole micro-batch).
            loss_fn: (output, target) -> mean loss.

        Returns:
            The iteration's loss (this replica's weighted part) on the stage holding the
            model output, else 0.0; summed over the ranks it is the full loss.

        Raises:
            TimeoutError: a peer did not send in time, or the gradient allreduce did not
                finish in time.
        """
        m_count = self.sched.num_micro
        weight = (self.rows[1] - self.rows[0]) / self.plan.micro_batch / m_count
        envs: dict[int, dict[str, Any]] = {}
        losses: dict[int, torch.Tensor] = {}
        grads: dict[int, dict[str, torch.Tensor]] = {}
        pending: list = []
        total = 0.0
        for a in self.sched.actions[self.s]:
            m = a.micro
            if a.kind == RECV_F:
                env = envs.setdefault(m, {})
                for name in self.plan.edges[(a.peer, self.s)]:
                    t = self._recv(name, a.peer, m, False)
                    env[name] = t.requires_grad_() if t.is_floating_point() else t
            elif a.kind == F:
                t0 = time.perf_counter()
                env = envs.setdefault(m, {})
                inputs = feeds(m)
                self.g.run({k: self._share(inputs[k]) for k in self.g.inputs if k in self.ops},
                           self.ops, env)
                if self.g.output in self.ops:
                    # a mean over 1/r of the samples, weighted by 1/r: the replicas' sum
                    # is the micro-batch mean, and gradients sent upstream are unscaled
                    losses[m] = loss_fn(env[self.g.output], self._share(targets(m))) * weight
                    total += float(losses[m].detach())
                self.compute_s += time.perf_counter() - t0
            elif a.kind == SEND_F:
                for name in self.plan.edges[(self.s, a.peer)]:
                    self._send(envs[m][name], a.peer, name, m, False, pending)
            elif a.kind == RECV_B:
                acc = grads.setdefault(m, {})
                for name in self.plan.edges[(self.s, a.peer)]:
                    if envs[m][name].is_floating_point():
                        gr = self._recv(name, a.peer, m, True)
                        acc[name] = acc[name] + gr if name in acc else gr
            elif a.kind == B:
                t0 = time.perf_counter()
                self._backward(envs[m], grads.pop(m, {}), losses.pop(m, None))
                self.compute_s += time.perf_counter() - t0
            elif a.kind == SEND_B:
                for name in self.plan.edges[(a.peer, self.s)]:
                    t = envs[m][name]
                    if t.is_floating_point():
                        gr = t.grad if t.grad is not None else torch.zeros_like(t)
                        self._send(gr, a.peer, name, m, True, pending)
                if self._last_send_b(m, a.peer):
                    envs.pop(m)
            elif a.kind == ACQ:
                if self.client is not None:
                    self.client.acquire()
            elif a.kind == REL:
                if self.client is not None:
                    self.client.release(Phase.COMMUNICATE)
            else:
                raise ScheduleError(f"unknown action {a} in stage {self.s}'s schedule")
        for req, _buf in pending:
            _wait(req, self.timeout, f"{self._who()}: a send was not received in time")
        if self.replicas > 1:
            self._sum_replica_grads()
        return total

    def _sum_replica_grads(self) -> None:
        """Sum this stage's parameter gradients over its replicas (Horovod, in place).

        Each replica holds the gradient of its weighted share of the loss, so the sum
        (not the mean) is the whole batch's. Parameters are taken in name order so all
        replicas submit the same grouped allreduce; a missing gradient is a zero one so
        that no replica skips a tensor the others send.
        """
        import horovod.torch as hvd

        names = sorted(self.params)
        for n in names:
            p = self.params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [self.params[n].grad for n in names]
        if not grads:
            return
        handle = hvd.grouped_allreduce_async_(grads, op=hvd.Sum, process_set=self.process_set,
                                              name=f"crossover.pipeline.stage{self.s}.grads")
        if not wait_until(lambda: hvd.poll(handle), self.timeout, Backoff(1e-4, 1e-3)):
            raise TimeoutError(
                f"{self._who()} waited {self.timeout:.0f} s for the gradient allreduce "
                f"of {len(grads)} parameters with its replicas on ranks "
                f"{self.plan.devices_of(self.s)}: are they alive and running the same "
                f"schedule?")
        hvd.synchronize(handle)

    def _last_send_b(self, m: int, peer: int) -> bool:
        preds = [p for p in self.sched.preds[self.s]]
        return not preds or peer == preds[-1]

    def _backward(self, env: dict[str, Any], grads: dict[str, torch.Tensor],
                  loss: torch.Tensor | None) -> None:
        roots, seeds = [], []
        for name, g in grads.items():
            t = env[name]
            if isinstance(t, torch.Tensor) and t.requires_grad:
                roots.append(t)
                seeds.append(g)
        if loss is not None:
            roots.append(loss)
            seeds.append(torch.ones_like(loss))
        if roots:
            torch.autograd.backward(roots, seeds)


def _wait(req: Any, timeout: float, what: str) -> None:
    """Poll an MPI request with backoff until it completes or `timeout` passes."""
    if not wait_until(req.Test, timeout, Backoff(1e-5, 1e-3)):
        raise TimeoutError(what + ": is that rank alive and running the same schedule?")


def output_shapes(graph: Graph, feeds: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every op's output for one micro-batch (a no-grad forward)."""
    with torch.no_grad():
        env = graph.run(feeds)
    return {n: (tuple(v.shape), v.dtype) for n, v in env.items() if isinstance(v, torch.Tensor)}


def gather_grads(graph: Graph, comm: Any, root: int = 0, plan: Plan | None = None
                 ) -> dict[str, torch.Tensor] | None:
    """Every stage's parameter gradients, summed by name, on `root` (None elsewhere).

    With a plan, only the first replica of each stage contributes: after the step every
    replica holds the whole stage gradient, and adding them all would count it r times.
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
            out[k] = out[k] + v if k in out else v
    return out


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


# --- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run a model's pipeline under mpirun; rank 0 writes gradients and timings."""
    from mpi4py import MPI

    from crossover.pipeline import plan_for, schedule_for
    from crossover.pipeline.models import build

    ap = argparse.ArgumentParser(prog="python -m crossover.pipeline.runner")
    ap.add_argument("--model", default="uno")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per iteration")
    ap.add_argument("--partitioner", default="graph", choices=["graph", "sequential"])
    ap.add_argument("--plan", help="a plan as JSON: [[op, ...], ...] per stage (overrides)")
    ap.add_argument("--replicas", help="data-parallel replicas per stage, e.g. 2,1 (stage "
                    "order of --plan, else of the planned stages; default 1 each): the "
                    "launch needs their sum of ranks")
    ap.add_argument("--replicate", action="store_true", help="let the partitioner choose "
                    "data-parallel replicas of stages over the -np ranks (without --plan)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--slots", action="store_true", help="take the crossover device slot")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", help="rank 0 writes gradients (.pt) or timings (.json) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    spec = build(args.model, getattr(torch, args.dtype), small=args.small)
    graph = Graph.from_fx(spec.module)
    b = args.batch // args.micro
    if args.plan:
        ops = json.loads(args.plan)
        reps = parse_replicas(args.replicas, len(ops)) or [1] * len(ops)
        stages = [Stage(tuple(o), r) for o, r in zip(ops, reps, strict=True)]
        plan = make_plan(graph, stages, b, args.micro, args.partitioner)
    else:
        reps = parse_replicas(args.replicas)
        stages_n = len(reps) if reps else size
        plan = comm.bcast(plan_for(graph, stages_n, args.batch, args.micro, args.partitioner,
                                   replicate=args.replicate and not reps)
                          if rank == 0 else None, root=0)
        if reps:
            plan = with_replicas(plan, reps)
    # every rank checks before the first message, so a wrong -np fails at once, no hang
    try:
        check_ranks(plan, size)
    except ValueError as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    stage, _replica = stage_of_rank(plan, rank)
    sched = schedule_for(plan, args.schedule)
    feeds_all, target_all = spec.make_batch(args.batch, 1)
    micro = {m: {k: v[m * b:(m + 1) * b] for k, v in feeds_all.items()}
             for m in range(args.micro)}
    shapes = output_shapes(graph, micro[0])
    client = None
    if args.slots:
        from crossover.client import RankInfo, SlotClient
        client = SlotClient(f"pipeline-{args.model}", RankInfo(rank, size, rank, size))
    times, loss = [], 0.0
    runner = StageRunner(graph, plan, sched, stage, comm, shapes, client, args.timeout)
    for _ in range(args.iters):
        for p in graph.parameters().values():
            p.grad = None
        comm.Barrier()
        t0 = time.perf_counter()
        try:
            loss = runner.run(micro.__getitem__,
                              lambda m: target_all[m * b:(m + 1) * b], spec.loss)
        except (TimeoutError, ScheduleError) as exc:
            print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
            comm.Abort(3)
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    grads = gather_grads(graph, comm, plan=plan)
    # each rank's own stage gradients, so a test can see the replicas agree
    own = {k: p.grad.detach().numpy().copy() for k, p in runner.params.items()
           if p.grad is not None}
    rank_grads = comm.gather(own, root=0)
    losses = comm.gather(loss, root=0)
    if client is not None:
        client.close()
    if rank == 0 and args.out:
        if args.out.endswith(".json"):
            with open(args.out, "w") as f:
                json.dump({"times": times, "median_s": statistics.median(times),
                           "plan": plan.describe(), "loss": sum(losses)}, f)
        else:
            with open(args.out, "wb") as f:
                pickle.dump({"grads": {k: v.numpy() for k, v in grads.items()},
                             "loss": sum(losses), "plan": [list(s.ops) for s in plan.stages],
                             "replicas": [s.replicas for s in plan.stages],
                             "devices": [plan.devices_of(i) for i in range(len(plan.stages))],
                             "rank_grads": rank_grads, "kind": plan.kind}, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
