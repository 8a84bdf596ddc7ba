"""The peer: torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on our chain model.

Runs on 2+ ranks (one stage per rank, gloo, CPU). The model is `crossover.pipeline.models`
`chain`, cut exactly where our plan cuts it (`--plan`, the op lists our runner gets), so
our runner and this peer run the same stages, batch, micro-batches, dtype and data. Each
stage is a manual `PipelineStage` around an `nn.Sequential` of the plan's modules (the
chain's ops are modules each consuming the previous one's output; anything else is
refused).

Before timing, the first step of each schedule is checked against one process running the
whole model on the whole batch: loss and every parameter gradient must agree within float
tolerance, else the script exits non-zero and writes no numbers.

Launch with `launch(...)` (mpirun, a free port, a timeout) or by hand:

    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 \\
        python -m bench.pipeline.torch_peer --plan '[["x","body_0"],["body_1",...]]' \\
        --out peer.json

torchrun also works (it sets RANK/WORLD_SIZE/MASTER_*).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness.common import REPO, module_argv

SCHEDULES = ("gpipe", "1f1b")
TOLERANCE = {"float32": 1e-4, "float64": 1e-9}  # max |diff| / max |reference| per tensor


class PeerError(RuntimeError):
    """The peer failed, timed out or its correctness check did not pass."""


def stage_module(model: nn.Module, ops: list[str]) -> tuple[nn.Sequential, list[str]]:
    """The plan's ops of one stage as an `nn.Sequential`, with each module's qualified name.

    Raises:
        PeerError: an op is not a module call fed by the op before it (not a chain).
    """
    traced = torch.fx.symbolic_trace(model)
    nodes = {n.name: n for n in traced.graph.nodes}
    mods, names, prev = [], [], None
    for name in ops:
        node = nodes[name]
        if node.op == "placeholder":
            prev = node
            continue
        if node.op != "call_module" or len(node.args) != 1 or (
                prev is not None and node.args[0] is not prev):
            raise PeerError(f"op {name} is not a module on a chain: the peer splits chains only")
        mods.append(model.get_submodule(node.target))
        names.append(str(node.target))
        prev = node
    return nn.Sequential(*mods), names


def main(argv: list[str] | None = None) -> int:
    """Run on one rank: check, then time both schedules; rank 0 writes the JSON."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from crossover.pipeline.models import build

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="chain")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--plan", required=True, help="[[op, ...], ...] per stage (our plan)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (the first checks)")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per schedule")
    ap.add_argument("--timeout", type=float, default=120.0, help="gloo collective timeout")
    ap.add_argument("--fault", action="store_true",
                    help="test only: scale the last stage's gradients by 1.01 before the "
                         "check, which must then fail")
    ap.add_argument("--out", help="rank 0 writes results (JSON) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as our runner: one thread per rank

    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    plan = json.loads(args.plan)
    if len(plan) != world:
        raise PeerError(f"the plan has {len(plan)} stages but {world} ranks were launched")
    dtype = getattr(torch, args.dtype)
    spec = build(args.model, dtype, small=args.small)
    feeds, target = spec.make_batch(args.batch, 1)  # data seed 1, as our runner
    (x,) = feeds.values()
    module, names = stage_module(spec.module, plan[rank])
    first, last = rank == 0, rank == world - 1
    mb = args.batch // args.micro

    def params() -> dict[str, torch.Tensor]:
        return {f"{n}.{k}": p for n, m in zip(names, module, strict=True)
                for k, p in m.named_parameters()}

    def step(sched: Any) -> float:
        losses: list[torch.Tensor] = []
        if first:
            sched.step(x, return_outputs=False)
        elif last:
            sched.step(target=target, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        # the schedule averages micro-batch gradients (scale_grads); the loss likewise
        return float(sum(loss.detach() for loss in losses) / args.micro) if last else 0.0

    result: dict[str, Any] = {"settings": {
        "model": args.model, "small": args.small, "dtype": args.dtype, "batch": args.batch,
        "micro_batches": args.micro, "micro_batch": mb, "stages": plan, "ranks": world,
        "backend": "gloo", "warmup": args.warmup, "iters": args.iters, "threads": 1,
        "torch": torch.__version__, "stat": "median samples/s over the timed steps"},
        "check": {}}
    ref_grads, ref_loss = None, 0.0
    if first:  # one process, whole model, whole batch: what the pipeline must reproduce
        ref = build(args.model, dtype, small=args.small)
        loss = ref.loss(ref.module(**feeds), target)
        loss.backward()
        ref_grads = {k: p.grad for k, p in ref.module.named_parameters()}
        ref_loss = float(loss.detach())
    for kind in SCHEDULES:
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        sched = cls(stage, args.micro, loss_fn=spec.loss)
        times: list[float] = []
        for i in range(args.warmup + args.iters):
            for p in module.parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(sched)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            if i == 0:  # the check: one step's gradients and loss against one process
                mine = {k: p.grad.detach().clone() for k, p in params().items()}
                if args.fault and last:
                    mine = {k: v * 1.01 for k, v in mine.items()}
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, (mine, loss))
                if first:
                    result["check"][kind] = compare(parts, ref_grads, ref_loss, args.dtype)
                ok = [result["check"].get(kind, {}).get("passed", False)]
                dist.broadcast_object_list(ok, src=0)
                if not ok[0]:
                    if first:
                        print(f"peer check FAILED ({kind}): {result['check'][kind]}",
                              file=sys.stderr, flush=True)
                    dist.destroy_process_group()
                    return 2
        timed = times[args.warmup:]
        result[kind] = {"samples_per_s": args.batch / statistics.median(timed),
                        "median_s": statistics.median(timed), "times": timed}
    if first and args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


def compare(parts: list[Any], ref_grads: dict[str, torch.Tensor] | None, ref_loss: float,
            dtype: str) -> dict[str, Any]:
    """Every rank's (gradients, loss) against the single-process reference."""
    assert ref_grads is not None
    got: dict[str, torch.Tensor] = {}
    loss = 0.0
    for grads, part_loss in parts:
        got.update(grads)
        loss += part_loss
    tol = TOLERANCE[dtype]
    missing = sorted(set(ref_grads) ^ set(got))
    errs = {k: float((got[k] - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for k, r in ref_grads.items() if k in got}
    worst = max(errs.values(), default=float("inf"))
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    return {"passed": not missing and worst < tol and loss_err < tol,
            "max_grad_rel_err": worst, "loss_rel_err": loss_err, "tolerance": tol,
            "params_checked": len(errs), "missing": missing}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan: list[list[str]], *extra: str, timeout: float = 300.0) -> dict[str, Any]:
    """Run the peer under mpirun (one rank per stage) and return rank 0's results.

    Args:
        plan: the stages' op lists (our plan).
        extra: more command-line arguments (see `main`).
        timeout: seconds for the whole run; the process tree is killed after it.

    Raises:
        PeerError: non-zero exit (a failed check included) or timeout, with the log's tail.
    """
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(len(plan)),
               "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONWARNINGS",
               *module_argv(__spec__.name, "--plan", json.dumps(plan)),
               "--timeout", str(min(timeout, 120.0)), "--out", str(out), *extra]
        # own session: on timeout the whole tree (mpirun and its ranks) is killed
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise PeerError(f"torch pipelining peer timed out after {timeout} s:\n"
                            f"{log[-3000:]}") from None
        if proc.returncode != 0 or not out.exists():
            raise PeerError(f"torch pipelining peer exited {proc.returncode}:\n{log[-3000:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
