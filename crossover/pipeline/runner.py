"""The stage runner: each MPI rank executes its stage's row of a lowered schedule.

Activations and gradients travel by MPI point-to-point (mpi4py Isend/Irecv on the
tensors' own memory: a contiguous CPU tensor is sent without a copy and received into
the tensor that is then used). Every receive polls with a deadline (`waits`), so a dead
or diverging peer gives a TimeoutError naming the stage, micro-batch and tensor, never a
hang; an iteration that fails cancels its requests still in flight before it raises, so
the caller may free the communicators and no late message lands in freed memory.

Each compute action holds the device slot from the crossover daemon (ACQ/REL in the
schedule), so pipeline stages share devices with Horovod jobs under one scheduler; an
iteration ends holding the device, like a Horovod step (`PipelineTrainer.release_device`
gives it up before a pause).

A stage with r replicas runs on r consecutive ranks (`Plan.devices_of`). Every replica
runs the stage's one schedule row on its contiguous 1/r share of each micro-batch (rows
along the batch dimension). A tensor crossing a stage edge goes, piece by piece, from
each sender replica to each receiver replica whose rows overlap its own, so a
non-replicated neighbour scatters and gathers shards and replicated neighbours exchange
matching ranges. Each replica weights its loss by its share of the micro-batch, so its
parameter gradients are its part of the single-process sum; at the end of the step the
replicas sum them with an MPI allreduce over one communicator per replicated stage.
A parameter tied across stages (a copy on each) is summed over every rank holding a
copy instead (`ties`), so the copies stay equal.

Where stages run and how replicas split a micro-batch is `placement`, the messages'
tags are `tags`, and the command line is `python -m crossover.pipeline` (`__main__`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from crossover.pipeline.graph import Graph
from crossover.pipeline.placement import check_ranks, links, shard_rows
from crossover.pipeline.placement import replica_comms as make_replica_comms
from crossover.pipeline.plan import Plan
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
from crossover.pipeline.tags import check_tags, edge_tensor_ids, message_tag, tag_upper_bound
from crossover.pipeline.ties import gradient_groups, group_comms, sum_gradients
from crossover.pipeline.waits import InFlight, host_spin_budget, wait_requests
from crossover.protocol import Phase

Feeds = Callable[[int], Mapping[str, torch.Tensor]]


class StageRunner:
    """Runs one stage replica's row of a lowered schedule.

    Args:
        graph: the whole model graph (every rank holds it; a stage runs its own ops).
        plan: the partition; `stage` indexes its stages. A stage with r replicas runs
            on ranks `plan.devices_of(stage)`, each on 1/r of every micro-batch.
        schedule: the lowered schedule (one row per stage, replicas share it).
        stage: this process's stage; this rank must be one of its devices.
        comm: an mpi4py communicator with exactly `plan.devices` ranks (more with
            `spare`: the ranks past them run no stage, as after a trainer's re-plan).
        shapes: op name -> (shape, dtype) of its output for one whole micro-batch.
        client: a crossover SlotClient, or None to run without slots.
        timeout: seconds any single receive, send or gradient allreduce may take.
        replica_comms: {stage: communicator of its replicas} for this rank's stage if
            it is replicated; None: made by `replica_comms` here, which is collective
            (every rank constructs its runner, as when every rank runs a stage).
        spare: the communicator may hold ranks the plan leaves out.

    Raises:
        ValueError: the communicator has the wrong number of ranks (the message names
            the number needed), this rank is not a device of `stage`, a replicated
            stage's micro-batch does not split evenly, or a tensor crossing a replicated
            stage's edge is not batch-major.
    """

    def __init__(self, graph: Graph, plan: Plan, schedule: Schedule, stage: int, comm: Any,
                 shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 client: Any = None, timeout: float = 60.0,
                 replica_comms: Mapping[int, Any] | None = None, spare: bool = False) -> None:
        check_ranks(plan, comm.Get_size(), spare)
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
        self.tensor_ids = edge_tensor_ids(plan)
        check_tags(len(self.tensor_ids), schedule.num_micro, tag_upper_bound(comm))
        self.params = {k: p for o in self.ops for k, p in graph.ops[o].params.items()}
        self.inflight = InFlight()  # this rank's sends and receives not yet complete
        # how its waits poll: back to back only on cores no other job wants (a job that
        # shares the devices through slots has neighbours whose ranks need the CPU)
        self.spin_s = 0.0 if client is not None else host_spin_budget(comm.Get_size())
        # seconds spent in each action kind (and "drain", "allreduce"), over all runs:
        # what the simulator's per-kind figures are checked against
        self.spent: dict[str, float] = {}
        # most micro-batches whose activations this stage held at once (1F1B bounds it
        # by the stage's depth to the sink; the partitioner prices memory by that)
        self.peak_live = 0
        self._check_split()
        if replica_comms is None:
            replica_comms = make_replica_comms(plan, comm)
        self.replica_comm = replica_comms.get(stage) if self.replicas > 1 else None
        if self.replicas > 1 and self.replica_comm is None:
            raise ValueError(f"stage {stage} has {self.replicas} replicas but no "
                             f"communicator was given for them")
        # the sums at the end of a step: the replicas' and the tied copies' (`ties`)
        self.grad_groups = gradient_groups(graph, plan, stage, list(self.params))
        given = {tuple(plan.devices_of(stage)): self.replica_comm} if self.replica_comm \
            else {}
        self.grad_comms = group_comms(self.grad_groups, comm, given)
        self._made = [c for r, c in self.grad_comms.items() if r not in given]

    def close(self) -> None:
        """Free the communicators this runner made for tied copies' gradient sums (a
        re-plan builds a new runner; the replicas' communicator is its maker's)."""
        for c in self._made:
            c.Free()
        self._made = []

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
        return message_tag(self.tensor_ids[name], backward, micro, self.sched.num_micro)

    def _what(self, name: str, micro: int, backward: bool, peer: int, j: int, rank: int,
              sending: bool) -> str:
        other = f"stage {peer}" if self.plan.stages[peer].replicas == 1 else \
            f"stage {peer} replica {j} (rank {rank})"
        kind = "gradient" if backward else "activation"
        way = "sending" if sending else "receiving"
        return (f"{self._who()} {way} the {kind} {name!r} of micro-batch {micro} "
                f"{'to' if sending else 'from'} {other}")

    def _send(self, tensor: torch.Tensor, peer: int, name: str, micro: int,
              backward: bool) -> None:
        for rank, j, rows in links(self.plan, self.s, self.replica, peer):
            buf = tensor.detach()[rows].contiguous()
            req = self.comm.Isend(buf.numpy(), dest=rank, tag=self._tag(name, micro, backward))
            self.inflight.add(req, buf, self._what(name, micro, backward, peer, j, rank, True))
        # drop finished sends' buffers as we go: held to the end, every micro-batch's
        # activations would stay alive until run() returns
        self.inflight.prune()

    def _recv(self, name: str, peer: int, micro: int, backward: bool) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        if self.replicas > 1 or self.plan.stages[peer].replicas > 1:
            shape = (self.rows[1] - self.rows[0], *shape[1:])
        buf = torch.empty(shape, dtype=dtype)
        reqs = []
        for rank, j, rows in links(self.plan, self.s, self.replica, peer):
            piece = buf[rows]  # rows of a contiguous tensor: a contiguous view, no copy
            req = self.comm.Irecv(piece.numpy(), source=rank,
                                  tag=self._tag(name, micro, backward))
            what = self._what(name, micro, backward, peer, j, rank, False)
            self.inflight.add(req, piece, what)  # a failed wait cancels it (see `run`)
            reqs.append((req, what))
        for req, what in reqs:
            wait_requests([req], self.timeout, what, self.spin_s)
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
                finish in time. Either way the iteration's sends and receives still in
                flight are cancelled first.
        """
        try:
            return self._iterate(feeds, targets, loss_fn)
        except BaseException:
            # requests left in flight would outlive their buffers, and the caller may
            # free the communicator next (a re-plan, a shutdown): take them back first
            self.inflight.cancel()
            raise

    def _iterate(self, feeds: Feeds, targets: Callable[[int], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """`run`'s work, which may leave requests in flight when it raises."""
        m_count = self.sched.num_micro
        weight = (self.rows[1] - self.rows[0]) / self.plan.micro_batch / m_count
        envs: dict[int, dict[str, Any]] = {}
        losses: dict[int, torch.Tensor] = {}
        grads: dict[int, dict[str, torch.Tensor]] = {}
        total = 0.0
        frozen = self.frozen_stages()
        live_preds = [p for p in self.sched.preds[self.s] if p not in frozen]
        last_succ = self.sched.succs[self.s][-1] if self.sched.succs[self.s] else None
        actions = self._actions(frozen)
        if self.client is not None and actions and actions[0].kind != ACQ:
            # the last iteration ended holding; this one starts by waiting on a peer
            self.client.release(Phase.COMMUNICATE)
        clock = time.perf_counter()
        for a in actions:
            m = a.micro
            if a.kind == RECV_F:
                env = envs.setdefault(m, {})
                for name in self.plan.edges[(a.peer, self.s)]:
                    t = self._recv(name, a.peer, m, False)
                    # no gradient is owed to a frozen stage: do not compute one
                    needs_grad = t.is_floating_point() and a.peer not in frozen
                    env[name] = t.requires_grad_() if needs_grad else t
            elif a.kind == F:
                env = envs.setdefault(m, {})
                inputs = feeds(m)
                self.g.run({k: self._share(inputs[k]) for k in self.g.inputs if k in self.ops},
                           self.ops, env)
                if self.g.output in self.ops:
                    # a mean over 1/r of the samples, weighted by 1/r: the replicas' sum
                    # is the micro-batch mean, and gradients sent upstream are unscaled
                    losses[m] = loss_fn(env[self.g.output], self._share(targets(m))) * weight
                    total += float(losses[m].detach())
                self.peak_live = max(self.peak_live, len(envs))
            elif a.kind == SEND_F:
                for name in self.plan.edges[(self.s, a.peer)]:
                    self._send(envs[m][name], a.peer, name, m, False)
                if self.s in frozen and a.peer == last_succ:  # no backward will need m
                    envs.pop(m)
            elif a.kind == RECV_B:
                acc = grads.setdefault(m, {})
                for name in self.plan.edges[(self.s, a.peer)]:
                    if envs[m][name].is_floating_point():
                        gr = self._recv(name, a.peer, m, True)
                        acc[name] = acc[name] + gr if name in acc else gr
            elif a.kind == B:
                self._backward(envs[m], grads.pop(m, {}), losses.pop(m, None))
                if not live_preds:  # no gradient to send back: done with m
                    envs.pop(m)
            elif a.kind == SEND_B:
                for name in self.plan.edges[(a.peer, self.s)]:
                    t = envs[m][name]
                    if t.is_floating_point():
                        gr = t.grad if t.grad is not None else torch.zeros_like(t)
                        self._send(gr, a.peer, name, m, True)
                if a.peer == live_preds[-1]:
                    envs.pop(m)
            elif a.kind == ACQ:
                if self.client is not None:
                    self.client.acquire()
            elif a.kind == REL:
                if self.client is not None:
                    self.client.release(Phase.COMMUNICATE)
            else:
                raise ScheduleError(f"unknown action {a} in stage {self.s}'s schedule")
            clock = self._spend(a.kind.value, clock)
        self.inflight.wait(self.timeout, self.spin_s)  # every send received
        clock = self._spend("drain", clock)
        # frozen parameters are left out of the sums (alike on every rank)
        groups = [(r, live) for r, names in self.grad_groups
                  if (live := tuple(n for n in names if self.params[n].requires_grad))]
        if groups:
            sum_gradients(self.params, groups, self.grad_comms, self.timeout, self._who(),
                          self.spin_s)
            self._spend("allreduce", clock)
        if self.client is not None:
            # a step boundary, as a Horovod step's end: counted, and the device kept for
            # what the caller does between iterations (the optimizer step) unless the
            # policy hands it over here. Releasing IDLE instead would make every
            # iteration ask the daemon again, even with nobody to share the device with.
            self.client.yield_slot()
        return total

    def _spend(self, kind: str, since: float) -> float:
        now = time.perf_counter()
        self.spent[kind] = self.spent.get(kind, 0.0) + now - since
        return now

    def frozen_stages(self) -> set[int]:
        """Stages whose backward would do nothing: every parameter frozen and every
        predecessor such a stage too (no gradient is owed upstream); never the stage
        with the loss. Every rank computes the same set (freezing is decided alike)."""
        out: set[int] = set()
        for s, st in enumerate(self.plan.stages):  # stages are in topological order
            if self.g.output in st.ops:
                continue
            params = [p for o in st.ops for p in self.g.ops[o].params.values()]
            if all(not p.requires_grad for p in params) and \
                    all(p in out for p in self.sched.preds[s]):
                out.add(s)
        return out

    def _actions(self, frozen: set[int]) -> list:
        """This stage's row without the backward work freezing made useless: a frozen
        stage's backward and gradient messages, and gradients sent to a frozen stage
        (with the slot acquire/release that wrapped a dropped backward)."""
        row = self.sched.actions[self.s]
        mine = self.s in frozen

        def dropped(a) -> bool:
            return (mine and a.kind in (B, RECV_B, SEND_B)) or \
                (a.kind == SEND_B and a.peer in frozen)

        out = []
        for i, a in enumerate(row):
            if dropped(a) or (a.kind == ACQ and i + 1 < len(row) and dropped(row[i + 1])) \
                    or (a.kind == REL and i > 0 and dropped(row[i - 1])):
                continue
            out.append(a)
        return out

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


def output_shapes(graph: Graph, feeds: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of every op's output for one micro-batch (a no-grad forward
    that leaves no trace: buffers such as batch norm's running statistics are put back,
    or the rank that sized the messages would train from other statistics)."""
    with torch.no_grad():
        kept = {k: b.clone() for k, b in graph.buffers().items()}
        env = graph.run(feeds)
        for k, b in graph.buffers().items():
            b.copy_(kept[k])
    return {n: (tuple(v.shape), v.dtype) for n, v in env.items() if isinstance(v, torch.Tensor)}
