"""A model as an operator DAG: what the partitioner cuts and what a stage executes.

Two ways in: `Graph.from_fx` traces a PyTorch module with torch.fx (leaf modules such as
nn.Linear or nn.TransformerEncoderLayer stay single operators), and `Graph.from_modules`
takes an explicit DAG of submodules for models that do not trace. Both give the same
object: named ops in a topological order, each with the names of the ops it reads, a way
to run it on an environment of values, and the parameters it owns.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class GraphError(ValueError):
    """The graph is malformed (cycle, dangling input, untraceable model); says the fix."""


@dataclass(eq=False)
class Op:
    """One operator.

    Args:
        name: unique name; other ops refer to it in their `inputs`.
        inputs: names of the ops whose outputs this op reads, in call order.
        run: computes the op's output from a mapping of op name -> value.
        params: the parameters this op owns, by qualified name (for gradients). A
            parameter several ops share (tied weights) has one name in all of them;
            those ops may sit on different stages, each holding a copy whose
            gradients are summed between them (`crossover.pipeline.ties`).
        buffers: the buffers this op's module owns (batch norm's running statistics),
            by qualified name: state that is not trained but must move with the op.
        is_input: True for a model input (fed from the batch, not computed).
    """

    name: str
    inputs: tuple[str, ...]
    run: Callable[[Mapping[str, Any]], Any]
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    is_input: bool = False
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


class Graph:
    """A validated operator DAG with one output.

    Args:
        ops: the operators, in any order.
        output: the name of the op whose value is the model's output.
        root: the module the parameters belong to (kept alive with the graph).

    Raises:
        GraphError: duplicate names, an input that no op produces, a cycle, or a
            missing output; the message names the ops involved and the fix.
    """

    def __init__(self, ops: Iterable[Op], output: str, root: nn.Module | None = None) -> None:
        ops = list(ops)
        self.root = root
        self.output = output
        by_name: dict[str, Op] = {}
        for op in ops:
            if op.name in by_name:
                raise GraphError(f"two ops are named {op.name!r}: op names must be unique")
            by_name[op.name] = op
        for op in ops:
            for src in op.inputs:
                if src not in by_name:
                    raise GraphError(
                        f"op {op.name!r} reads {src!r}, which no op produces (a dangling "
                        f"input): add an op named {src!r} or fix the inputs of {op.name!r}")
        if output not in by_name:
            raise GraphError(f"the output {output!r} is not an op: name one of "
                             f"{sorted(by_name)[:8]}...")
        order = _topological(by_name)
        # Ops that do not feed the output are dead code for a pipeline: dropped.
        live = {output}
        for name in reversed(order):
            if name in live:
                live.update(by_name[name].inputs)
        self.dropped = [n for n in order if n not in live]
        self.ops: dict[str, Op] = {n: by_name[n] for n in order if n in live}
        self.succ: dict[str, list[str]] = {n: [] for n in self.ops}
        for op in self.ops.values():
            for src in dict.fromkeys(op.inputs):
                self.succ[src].append(op.name)
        self.inputs = [n for n, op in self.ops.items() if op.is_input]

    # --- construction ------------------------------------------------------------------
    @classmethod
    def from_modules(cls, inputs: Sequence[str],
                     nodes: Sequence[tuple[str, Callable[..., Any], Sequence[str]]],
                     output: str | None = None, root: nn.Module | None = None) -> Graph:
        """An explicit graph of submodules, for models torch.fx cannot trace.

        Args:
            inputs: names of the model's inputs (fed from the batch in this order).
            nodes: (name, callable, input names): the callable is applied to the input
                values in order; an nn.Module's parameters become the op's parameters.
            output: the op giving the model output (default: the last node).
            root: the module owning all submodules (parameter names are relative to it).

        Returns:
            The validated graph.

        Raises:
            GraphError: see `Graph`.
        """
        names = _param_names(root)
        bnames = _buffer_names(root)
        ops = [Op(n, (), _input_reader(n), is_input=True) for n in inputs]
        for name, fn, srcs in nodes:
            params, buffers = {}, {}
            if isinstance(fn, nn.Module):
                params = {names.get(id(p), f"{name}.{k}"): p
                          for k, p in fn.named_parameters()}
                buffers = {bnames.get(id(b), f"{name}.{k}"): b for k, b in fn.named_buffers()}
            ops.append(Op(name, tuple(srcs), _apply(fn, tuple(srcs)), params,
                          buffers=buffers))
        if output is None:
            if not nodes:
                raise GraphError("an explicit graph needs at least one node")
            output = nodes[-1][0]
        return cls(ops, output, root)

    @classmethod
    def from_fx(cls, model: nn.Module, leaf_modules: Sequence[type] = ()) -> Graph:
        """Trace `model` with torch.fx into an operator graph.

        Args:
            model: the module; its forward takes tensors and returns one tensor.
            leaf_modules: module classes kept as single ops (torch.nn's own already are).

        Returns:
            The validated graph; op names are the fx node names.

        Raises:
            GraphError: the model does not trace, or returns more than one tensor.
        """
        import torch.fx as fx

        leaves = tuple(leaf_modules)

        class _Tracer(fx.Tracer):
            def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
                return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

        try:
            fx_graph = _Tracer().trace(model)
        except Exception as exc:  # fx raises many types: TraceError, TypeError, ...
            raise GraphError(
                f"{type(model).__name__} is not traceable by torch.fx "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                f"pass the offending submodule classes as leaf_modules=..., or describe "
                f"the model with Graph.from_modules(inputs, [(name, module, inputs), ...])"
            ) from exc
        names, bnames = _param_names(model), _buffer_names(model)
        ops: list[Op] = []
        output = None
        for node in fx_graph.nodes:
            srcs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
            if node.op == "placeholder":
                ops.append(Op(node.name, (), _input_reader(node.name), is_input=True))
            elif node.op == "output":
                out = node.args[0]
                if not isinstance(out, fx.Node):
                    raise GraphError(
                        f"{type(model).__name__}.forward returns {type(out).__name__}; a "
                        f"pipeline needs one tensor output: return a tensor (e.g. torch.cat)")
                output = out.name
            else:
                params: dict[str, nn.Parameter] = {}
                buffers: dict[str, torch.Tensor] = {}
                if node.op == "call_module":
                    sub = model.get_submodule(node.target)
                    params = {names[id(p)]: p for p in sub.parameters()}
                    buffers = {bnames[id(b)]: b for b in sub.buffers() if id(b) in bnames}
                elif node.op == "get_attr":
                    attr = _get_attr(model, node.target)
                    if isinstance(attr, nn.Parameter):
                        params = {node.target: attr}
                    elif id(attr) in bnames:
                        buffers = {bnames[id(attr)]: attr}
                ops.append(Op(node.name, srcs, _fx_runner(model, node), params,
                              buffers=buffers))
        if output is None:
            raise GraphError(f"{type(model).__name__} traced to a graph without output")
        return cls(ops, output, model)

    # --- queries -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ops)

    def order(self) -> list[str]:
        """Op names in topological order."""
        return list(self.ops)

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) pairs."""
        return [(s, d) for s, ds in self.succ.items() for d in ds]

    def parameters(self) -> dict[str, nn.Parameter]:
        """All parameters by qualified name (each once)."""
        out: dict[str, nn.Parameter] = {}
        for op in self.ops.values():
            out.update(op.params)
        return out

    def buffers(self) -> dict[str, torch.Tensor]:
        """All ops' buffers by qualified name (each once)."""
        out: dict[str, torch.Tensor] = {}
        for op in self.ops.values():
            out.update(op.buffers)
        return out

    def run(self, feeds: Mapping[str, Any], names: Iterable[str] | None = None,
            env: dict[str, Any] | None = None) -> dict[str, Any]:
        """Execute ops in order.

        Args:
            feeds: values for the model inputs (by input name).
            names: which ops to run (default all), in topological order.
            env: values already known (e.g. received from other stages); updated.

        Returns:
            The environment: op name -> value.
        """
        env = {} if env is None else env
        for name in self.ops if names is None else names:
            op = self.ops[name]
            env[name] = feeds[name] if op.is_input else op.run(env)
        return env

    def without_prefix(self, prefix: Iterable[str]) -> Graph:
        """The graph with the ops of `prefix` cut off: every value that crosses the cut
        (a prefix op's or a model input's, read by a kept op) becomes an input of the
        same name, so kept ops run unchanged on fed values.

        Raises:
            GraphError: `prefix` holds the output, or an op that reads a kept op (it is
                not a front of the graph).
        """
        cut = set(prefix)
        if self.output in cut:
            raise GraphError(f"the prefix to cut off holds the output {self.output!r}: "
                             f"keep at least the op that gives the model's output")
        for name in cut:
            late = [src for src in self.ops[name].inputs if src not in cut
                    and not self.ops[src].is_input]
            if late:
                raise GraphError(f"{name!r} reads {late} outside the prefix: a prefix to "
                                 f"cut off must hold everything its ops read")
        kept = [n for n, op in self.ops.items() if n not in cut and not op.is_input]
        crossing = [n for n in self.ops if n not in kept
                    and any(s in kept for s in self.succ[n])]
        ops = [Op(n, (), _input_reader(n), is_input=True) for n in crossing]
        return Graph(ops + [self.ops[n] for n in kept], self.output, self.root)

    def forward(self, *args: Any) -> Any:
        """The whole model, as a single process would run it."""
        return self.run(dict(zip(self.inputs, args, strict=True)))[self.output]


def stable_order(preds: Mapping[Any, Iterable[Any]], rank: Callable[[Any], int]) -> list:
    """Kahn's order of the nodes of `preds` (node -> the nodes it needs), taking the
    lowest `rank` first among those ready; a node on a cycle is left out."""
    import heapq

    indeg = {n: len(set(ps)) for n, ps in preds.items()}
    succ: dict[Any, list[Any]] = {n: [] for n in preds}
    for n, ps in preds.items():
        for p in set(ps):
            succ[p].append(n)
    heap = [(rank(n), n) for n, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: list[Any] = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(heap, (rank(m), m))
    return order


def _topological(ops: Mapping[str, Op]) -> list[str]:
    """Kahn's order, stable in the order ops were given; on a cycle, raise with it."""
    pos = {n: i for i, n in enumerate(ops)}
    order = stable_order({n: op.inputs for n, op in ops.items()}, pos.__getitem__)
    if len(order) < len(ops):
        done = set(order)
        cycle = _find_cycle(ops, {n for n in ops if n not in done})
        raise GraphError(f"the graph has a cycle: {' -> '.join(cycle)}; a pipeline needs a "
                         f"DAG: break the cycle (a recurrence belongs inside one op)")
    return order


def _find_cycle(ops: Mapping[str, Op], left: set[str]) -> list[str]:
    start = min(left)
    path, seen = [start], {start: 0}
    node = start
    while True:
        node = next(s for s in ops[node].inputs if s in left)
        if node in seen:
            cyc = path[seen[node]:] + [node]
            return list(reversed(cyc))
        seen[node] = len(path)
        path.append(node)


def _param_names(root: nn.Module | None) -> dict[int, str]:
    return {} if root is None else {id(p): n for n, p in root.named_parameters()}


def _buffer_names(root: nn.Module | None) -> dict[int, str]:
    return {} if root is None else {id(b): n for n, b in root.named_buffers()}


def _input_reader(name: str) -> Callable[[Mapping[str, Any]], Any]:
    return operator.itemgetter(name)


def _apply(fn: Callable[..., Any], srcs: tuple[str, ...]) -> Callable[[Mapping[str, Any]], Any]:
    def run(env: Mapping[str, Any]) -> Any:
        return fn(*(env[s] for s in srcs))
    return run


def _get_attr(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _fx_runner(model: nn.Module, node: Any) -> Callable[[Mapping[str, Any]], Any]:
    import torch.fx as fx

    kind, target = node.op, node.target
    if kind == "call_module":
        sub = model.get_submodule(target)
    if kind == "get_attr":
        value = _get_attr(model, target)

    def run(env: Mapping[str, Any]) -> Any:
        args = fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if kind == "call_module":
            return sub(*args, **kwargs)
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "get_attr":
            return value
        raise GraphError(f"unsupported fx node kind {kind!r} at {node.name!r}")

    return run


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor (or of the tensors in a tuple/list); 0 for other values."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0
