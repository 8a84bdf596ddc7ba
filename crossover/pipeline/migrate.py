"""Moving a stage between ranks: parameters and optimizer state, bit for bit, over MPI.

When a re-plan gives a parameter new owner ranks, each new owner that did not hold it
before receives it from one of its old owners, with the optimizer's per-parameter state
(SGD's momentum buffer, Adam's moments and step count: whatever `optimizer.state[p]`
holds). Everything is keyed by the parameter's qualified name in the whole model
(`Graph.parameters()`), never by position, because the sending and receiving
optimizers list different parameters in different orders.

The transfer is two-phase so that no receiver has to guess sizes: an `alltoall` of the
entries' names, shapes and dtypes (and any non-tensor state such as an int step count),
then one message of raw bytes per (sender, receiver) pair, the tensors' own bytes
concatenated. Bytes in, the same bytes out: nothing is cast or recomputed, so a
migration changes no bit (`state_hash` proves it in the tests). Every rank of the
communicator calls `migrate`, owners or not: it is collective. Before the first
exchange the ranks agree that every one of them could prepare its sends, so a rank that
cannot (a sparse tensor) makes every rank raise its error instead of leaving them
waiting; every wait has the deadline `timeout` (`crossover.pipeline.waits`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crossover.pipeline.waits import InFlight, agree, alltoall, wait_requests

State = dict[str, dict[str, Any]]  # parameter name -> optimizer state key -> value


@dataclass(frozen=True)
class Move:
    """Parameter `name` (with its optimizer state) goes from rank `src` to rank `dst`."""

    name: str
    src: int
    dst: int


def plan_moves(old: Mapping[str, Sequence[int]], new: Mapping[str, Sequence[int]]
               ) -> list[Move]:
    """Pure: which parameters must travel so that every new owner holds its parameters.

    A rank that already owned a parameter keeps its copy (replicas of a stage hold the
    same values). Senders are picked round-robin among the old owners so that a stage
    spreading onto several new ranks does not load one sender with every message.

    Args:
        old: parameter name -> ranks that hold its current value.
        new: parameter name -> ranks that must hold it after the move.

    Returns:
        The moves, sorted by (name, dst): the same list on every rank.

    Raises:
        ValueError: a parameter has new owners but no old one (nobody could send it).
    """
    out = []
    for name in sorted(new):
        srcs = sorted(old.get(name, ()))
        wanted = [r for r in sorted(new[name]) if r not in srcs]
        if wanted and not srcs:
            raise ValueError(f"parameter {name!r} has no current owner to send it to ranks "
                             f"{wanted}: give every parameter an owner in the old placement")
        out += [Move(name, srcs[i % len(srcs)], dst) for i, dst in enumerate(wanted)]
    return out


def optimizer_state(optimizer: torch.optim.Optimizer | None,
                    params: Mapping[str, torch.Tensor]) -> State:
    """The optimizer's per-parameter state by qualified name (the tensors themselves,
    not copies; parameters it holds no state for are left out).

    Args:
        optimizer: any torch.optim optimizer, or None (no state).
        params: name -> parameter, covering at least the optimizer's parameters.

    Returns:
        {name: {state key: value}}.

    Raises:
        ValueError: the optimizer trains a parameter that `params` does not name.
    """
    if optimizer is None:
        return {}
    names = {id(p): n for n, p in params.items()}
    out: State = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer trains a parameter that is not in the "
                                 "model's named parameters: build it over those")
            if optimizer.state.get(p):
                out[names[id(p)]] = dict(optimizer.state[p])
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer | None,
                         params: Mapping[str, torch.Tensor], state: Mapping[str, Mapping[str, Any]]
                         ) -> None:
    """Give `optimizer` the per-parameter state by name, exactly as given.

    `Optimizer.load_state_dict` would cast floating state to the parameter's dtype,
    which a bit-exact move must not do, so the state is set directly.

    Args:
        optimizer: the optimizer (None: `state` must be empty).
        params: name -> parameter.
        state: {name: {state key: value}} for parameters the optimizer trains.

    Raises:
        ValueError: state for a parameter the optimizer does not train (the message
            names it: build the optimizer over every parameter that has state).
    """
    by_id = {id(p): p for group in (optimizer.param_groups if optimizer else ())
             for p in group["params"]}
    for name, entry in state.items():
        p = params.get(name)
        if p is None or id(p) not in by_id:
            raise ValueError(f"optimizer state for {name!r}, which this rank's optimizer "
                             f"does not train: build the optimizer over every parameter "
                             f"that has state, or leave that state out")
        optimizer.state[p] = dict(entry)


def migrate(params: Mapping[str, torch.Tensor], state: Mapping[str, Mapping[str, Any]],
            old: Mapping[str, Sequence[int]], new: Mapping[str, Sequence[int]], comm: Any,
            timeout: float = 60.0) -> State:
    """Move parameters and their optimizer state to their new owners (collective).

    Every rank holds a tensor for every parameter (every rank built the same model); a
    receiver copies the bytes into its own tensor in place, so modules and graphs that
    refer to the parameter see the new value. Gradients are not moved: call this
    between steps, after the optimizer used them.

    Args:
        params: name -> this rank's tensor for every parameter in `old`/`new`.
        state: this rank's optimizer state by name (`optimizer_state`).
        old, new: name -> owner ranks before and after (see `plan_moves`).
        comm: the mpi4py communicator the ranks are numbered in.
        timeout: seconds each wait on the other ranks may take.

    Returns:
        The optimizer state of the parameters this rank owns under `new`: its own
        entries for those it kept, received ones for the rest.

    Raises:
        ValueError: on every rank, if any rank could not prepare its sends (a sparse
            tensor, a parameter it does not hold, one with no old owner): "migrating
            stage parameters failed on rank r: ..." with that rank's reason.
        TimeoutError: a peer did not take part, send or receive in time (it names
            the wait and the peer).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    what = "migrating stage parameters"
    failure: Exception | None = None
    try:
        outgoing, payload = _outgoing(plan_moves(old, new), rank, size, params, state)
    except Exception as exc:  # whatever it is, the peers must hear of it, not hang
        failure = exc
    try:
        # every rank learns of any rank's failure before the first exchange: a rank
        # raising alone here would leave the others blocked in it
        agree(comm, None if failure is None else f"{type(failure).__name__}: {failure}",
              timeout, what)
    except ValueError as agreed:
        raise agreed from failure
    # a private communicator: these messages never meet the stages' activation tags
    mcomm, req = comm.Idup()
    wait_requests([req], timeout, f"{what}: a private communicator")
    flight = InFlight()
    try:
        incoming = alltoall(mcomm, outgoing, timeout, f"{what}: the entries' shapes")
        for dst, tensors in enumerate(payload):
            if tensors:
                buf = torch.cat([_bytes(t) for t in tensors])
                flight.add(mcomm.Isend(buf.numpy(), dest=dst, tag=0), buf,
                           f"rank {rank} sending stage parameters to rank {dst}")
        received = {}
        for src, entries in enumerate(incoming):
            total = sum(e[4] for e in entries if e[2] != "value")
            if entries:
                buf = torch.empty(total, dtype=torch.uint8)
                received[src] = buf
                flight.add(mcomm.Irecv(buf.numpy(), source=src, tag=0), buf,
                           f"rank {rank} receiving stage parameters from rank {src}")
        flight.wait(timeout)
    finally:
        flight.cancel()  # none left after a success; after a failure, before the Free
        mcomm.Free()
    kept: State = {n: dict(s) for n, s in state.items() if rank in new.get(n, ())}
    for src, entries in enumerate(incoming):
        offset = 0
        for name, key, kind, *rest in entries:
            if kind == "value":
                kept.setdefault(name, {})[key] = rest[0]
                continue
            shape, nbytes = rest
            # a copy first: a view as a wider dtype needs an aligned offset
            t = received[src][offset:offset + nbytes].clone().view(kind).reshape(shape)
            offset += nbytes
            if key is None:
                with torch.no_grad():
                    params[name].copy_(t)  # same dtype and shape: a byte copy
            else:
                kept.setdefault(name, {})[key] = t
    return kept


def _outgoing(moves: Sequence[Move], rank: int, size: int, params: Mapping[str, torch.Tensor],
              state: Mapping[str, Mapping[str, Any]]
              ) -> tuple[list[list[tuple]], list[list[torch.Tensor]]]:
    """This rank's sends: per receiving rank, the entries' names and metadata, and the
    tensors whose bytes follow in that order.

    Raises:
        ValueError: a tensor cannot travel as bytes (sparse).
        KeyError: a moved parameter that `params` does not hold.
    """
    outgoing: list[list[tuple]] = [[] for _ in range(size)]
    payload: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for mv in moves:
        if mv.src != rank:
            continue
        entries = [(mv.name, None, *_meta(params[mv.name]))]
        payload[mv.dst].append(params[mv.name])
        for key, value in sorted(state.get(mv.name, {}).items()):
            if isinstance(value, torch.Tensor):
                entries.append((mv.name, key, *_meta(value)))
                payload[mv.dst].append(value)
            else:  # a plain Python value (an int step count, a flag): pickled exactly
                entries.append((mv.name, key, "value", value))
        outgoing[mv.dst] += entries
    return outgoing, payload


def state_hash(params: Mapping[str, torch.Tensor],
               state: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """SHA-256 over name-sorted tensors' dtypes, shapes and bytes (and optimizer state's
    keys and values): equal hashes mean bit-identical training state, wherever it lived.

    Args:
        params: name -> tensor (a state_dict).
        state: optional optimizer state by name (`optimizer_state`).

    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(f"p {name}".encode())
        _hash_value(h, params[name])
    for name in sorted(state or {}):
        for key in sorted(state[name]):
            h.update(f"s {name} {key}".encode())
            _hash_value(h, state[name][key])
    return h.hexdigest()


def _hash_value(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype} {tuple(value.shape)}".encode())
        h.update(_bytes(value).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def _meta(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], int]:
    if t.is_sparse:
        raise ValueError("a sparse tensor cannot be migrated byte for byte: densify the "
                         "parameter or its optimizer state")
    return t.dtype, tuple(t.shape), t.numel() * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
