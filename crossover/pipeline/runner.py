"""The stage runner: one MPI process per stage executes its row of a lowered schedule.

Activations and gradients travel by MPI point-to-point (mpi4py Isend/Irecv on the
tensors' own memory: a contiguous CPU tensor is sent without a copy and received into
the tensor that is then used). Every receive polls with a deadline, so a dead or
diverging peer gives a TimeoutError naming the stage, micro-batch and tensor, never a
hang. Each compute action holds the device slot from the crossover daemon (ACQ/REL in
the schedule), so pipeline stages share devices with Horovod jobs under one scheduler.

Run as a script under mpirun (one rank per stage):

    mpirun -np 3 python -m crossover.pipeline.runner --model uno --small --dtype float64

Limits: one device per stage (replicated stages are planned and simulated, not run).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

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

Feeds = Callable[[int], Mapping[str, torch.Tensor]]


class StageRunner:
    """Runs one stage's row of a lowered schedule.

    Args:
        graph: the whole model graph (every rank holds it; a stage runs its own ops).
        plan: the partition; `stage` indexes its stages.
        schedule: the lowered schedule.
        stage: this process's stage.
        comm: an mpi4py communicator in which rank i runs stage i.
        shapes: op name -> (shape, dtype) of its output for one micro-batch.
        client: a crossover SlotClient, or None to run without slots.
        timeout: seconds any single receive or send may take.

    Raises:
        ValueError: the plan replicates a stage, or the communicator is too small.
    """

    def __init__(self, graph: Graph, plan: Plan, schedule: Schedule, stage: int, comm: Any,
                 shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 client: Any = None, timeout: float = 60.0) -> None:
        if any(st.replicas > 1 for st in plan.stages):
            raise ValueError("the runner runs one device per stage: plan with "
                             "replicate=False (replicated stages are simulated only)")
        if comm.Get_size() < len(plan.stages):
            raise ValueError(f"the plan has {len(plan.stages)} stages but the communicator "
                             f"{comm.Get_size()} ranks: launch one rank per stage")
        if not schedule.lowered:
            raise ValueError("run a lowered schedule (schedule.lower(...))")
        self.g, self.plan, self.sched, self.s = graph, plan, schedule, stage
        self.comm, self.shapes, self.client, self.timeout = comm, shapes, client, timeout
        self.ops = plan.stages[stage].ops
        self.index = {n: i for i, n in enumerate(graph.ops)}
        self.params = {k: p for o in self.ops for k, p in graph.ops[o].params.items()}
        self.compute_s = 0.0

    # --- messages ----------------------------------------------------------------------
    def _tag(self, name: str, micro: int, backward: bool) -> int:
        return (self.index[name] * 2 + int(backward)) * self.sched.num_micro + micro

    def _send(self, tensor: torch.Tensor, dest: int, tag: int, pending: list) -> None:
        buf = tensor.detach().contiguous()
        pending.append((self.comm.Isend(buf.numpy(), dest=dest, tag=tag), buf))

    def _recv(self, name: str, src: int, micro: int, backward: bool) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        buf = torch.empty(shape, dtype=dtype)
        req = self.comm.Irecv(buf.numpy(), source=src, tag=self._tag(name, micro, backward))
        what = (f"stage {self.s} waited {self.timeout:.0f} s for the "
                f"{'gradient' if backward else 'activation'} {name!r} of micro-batch {micro} "
                f"from stage {src}")
        _wait(req, self.timeout, what)
        return buf

    # --- one iteration -----------------------------------------------------------------
    def run(self, feeds: Feeds, targets: Callable[[int], torch.Tensor],
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """One iteration: forwards and backwards of every micro-batch, per the schedule.

        Parameter gradients accumulate in `.grad` (zero them between iterations); the
        loss is the mean of the micro-batch losses, as one process on the whole batch.

        Args:
            feeds: micro-batch index -> model inputs.
            targets: micro-batch index -> target.
            loss_fn: (output, target) -> mean loss.

        Returns:
            The iteration's loss on the stage holding the model output, else 0.0.

        Raises:
            TimeoutError: a peer did not send in time.
        """
        m_count = self.sched.num_micro
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
                self.g.run({k: inputs[k] for k in self.g.inputs if k in self.ops},
                           self.ops, env)
                if self.g.output in self.ops:
                    losses[m] = loss_fn(env[self.g.output], targets(m)) / m_count
                    total += float(losses[m].detach())
                self.compute_s += time.perf_counter() - t0
            elif a.kind == SEND_F:
                for name in self.plan.edges[(self.s, a.peer)]:
                    self._send(envs[m][name], a.peer, self._tag(name, m, False), pending)
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
                        self._send(gr, a.peer, self._tag(name, m, True), pending)
                if self._last_send_b(m, a.peer):
                    envs.pop(m)
            elif a.kind == ACQ:
                if self.client is not None:
                    self.client.acquire()
            elif a.kind == REL:
                if self.client is not None:
                    from crossover.scheduler import Phase
                    self.client.release(Phase.COMMUNICATE)
            else:
                raise ScheduleError(f"unknown action {a} in stage {self.s}'s schedule")
        for req, _buf in pending:
            _wait(req, self.timeout, f"stage {self.s}: a send was not received in time")
        return total

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
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(what + ": is that rank alive and running the same schedule?")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def output_shapes(graph: Graph, feeds: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every op's output for one micro-batch (a no-grad forward)."""
    with torch.no_grad():
        env = graph.run(feeds)
    return {n: (tuple(v.shape), v.dtype) for n, v in env.items() if isinstance(v, torch.Tensor)}


def gather_grads(graph: Graph, comm: Any, root: int = 0) -> dict[str, torch.Tensor] | None:
    """Every stage's parameter gradients, summed by name, on `root` (None elsewhere)."""
    mine: dict[str, torch.Tensor] = {}
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
        stages = [Stage(tuple(ops)) for ops in json.loads(args.plan)]
        plan = make_plan(graph, stages, b, args.micro, args.partitioner)
    else:
        plan = comm.bcast(plan_for(graph, size, args.batch, args.micro, args.partitioner)
                          if rank == 0 else None, root=0)
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
    if rank < len(plan.stages):
        runner = StageRunner(graph, plan, sched, rank, comm, shapes, client, args.timeout)
    for _ in range(args.iters):
        for p in graph.parameters().values():
            p.grad = None
        comm.Barrier()
        t0 = time.perf_counter()
        if rank < len(plan.stages):
            try:
                loss = runner.run(micro.__getitem__,
                                  lambda m: target_all[m * b:(m + 1) * b], spec.loss)
            except (TimeoutError, ScheduleError) as exc:
                print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
                comm.Abort(3)
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    grads = gather_grads(graph, comm)
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
                             "kind": plan.kind}, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
