"""The benchmark's training job: an MLP, a small CNN or a transformer block, synthetic data.

    mpirun -np 2 python -m bench.harness.training_job --model cnn --steps 30 [--device cuda]
    torchrun --standalone --nproc-per-node 2 -m bench.harness.training_job --framework ddp

A Horovod PyTorch job under crossover (plain with CROSSOVER_ENABLE=0), seeded; with
`--framework ddp` the same model and data as a PyTorch DDP job (gloo) under torchrun.
Rank 0 prints one JSON line: wall-clock start and end of the training loop (epoch
seconds, so runs of several jobs can be laid on one time axis), samples/s, the step's
split into compute (forward, backward, update) and exposed communication (waiting for
the gradient allreduces after backward), summed over the steps, and a digest of the
final weights. On CUDA the timing points synchronise the device, so the split is what
the GPU did. DDP waits for its allreduces inside backward, so there the split is
estimated: forward and backward of the bare model are timed before training, and the
rest of each training step's forward and backward counts as exposed communication.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from crossover.hooks import _lifecycle
from crossover.testing import add_start_barrier_flags, start_barrier

MODELS = ("mlp", "cnn", "transformer")
#: With --stop-file, the ranks agree every this many steps whether to stop (one small
#: allreduce each time: a rank that stopped alone would leave its peers in a collective).
STOP_EVERY = 10
#: Bare forward and backward passes timed before a DDP job trains (after one warm-up).
CALIBRATION_STEPS = 5


class TransformerBlock(nn.Module):
    """Token embedding, encoder layers, a next-token head: a transformer on random tokens."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch * seq, vocab)."""
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.head(h).flatten(0, 1)


def build(model: str, width: int, layers: int) -> tuple[nn.Module, object]:
    """The model and a function (batch, generator) -> (inputs, targets) for its data.

    Args:
        model: one of MODELS.
        width: hidden width (MLP), channels of the first conv (CNN), d_model (transformer).
        layers: hidden layers (MLP), encoder layers (transformer); unused by the CNN.
    """
    if model == "mlp":
        dims = [64] + [width] * layers
        mods: list[nn.Module] = []
        for a, b in zip(dims, dims[1:], strict=False):
            mods += [nn.Linear(a, b), nn.ReLU()]
        net = nn.Sequential(*mods, nn.Linear(dims[-1], 10))
        return net, lambda n, g: (torch.randn(n, 64, generator=g),
                                  torch.randint(0, 10, (n,), generator=g))
    if model == "cnn":
        c = width
        net = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(4 * c * 16, 512), nn.ReLU(), nn.Linear(512, 10))
        return net, lambda n, g: (torch.randn(n, 3, 32, 32, generator=g),
                                  torch.randint(0, 10, (n,), generator=g))
    if model == "transformer":
        vocab, seq = 512, 64
        net = TransformerBlock(vocab, width, layers, seq)
        return net, lambda n, g: (torch.randint(0, vocab, (n, seq), generator=g),
                                  torch.randint(0, vocab, (n * seq,), generator=g))
    raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


class Trainer:
    """One framework's set-up and training step, behind one interface for `main`.

    Attributes:
        rank, size: this process's rank and the job's world size.
        model: the bare model (its state is what the weights digest covers).
        optimizer: the optimizer the step updates.
    """

    rank: int
    size: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    last_loss: float = float("nan")

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> tuple[
            float, float]:
        """One training step; returns (compute seconds, exposed communication seconds)."""
        raise NotImplementedError

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a collective: every rank must call it)."""
        raise NotImplementedError


class HorovodTrainer(Trainer):
    """Horovod's DistributedOptimizer, the crossover optimizer hook on top."""

    def __init__(self, model: nn.Module) -> None:
        import horovod.torch as hvd

        import crossover.hooks.torch as crossover_torch

        self.rank, self.size, self.model = hvd.rank(), hvd.size(), model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.optimizer = hvd.DistributedOptimizer(optimizer,
                                                  named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        crossover_torch.wrap(self.optimizer)
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> tuple[
            float, float]:
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        self.optimizer.synchronize()  # the allreduces, without the slot
        sync()
        t2 = time.perf_counter()
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        sync()
        t3 = time.perf_counter()
        self.last_loss = float(loss.detach())
        return (t1 - t0) + (t3 - t2), t2 - t1

    def any_rank(self, flag: bool) -> bool:
        import horovod.torch as hvd

        return hvd.allreduce(torch.tensor([float(flag)]), op=hvd.Sum,
                             name="crossover_job.stop").item() > 0


class DDPTrainer(Trainer):
    """DistributedDataParallel (gloo), the crossover DDP hook on top.

    The forward and backward of the bare model are timed first (`CALIBRATION_STEPS`, no
    communication, no slot, weights untouched): what a training step's forward and
    backward take beyond that is the allreduce wait DDP hides inside backward.
    """

    def __init__(self, model: nn.Module, device: torch.device,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import crossover.hooks.ddp as crossover_ddp

        self.loss_fn = nn.CrossEntropyLoss()
        self.compute_per_step = self._bare_forward_backward(model, batch)
        self.rank, self.size, self.model = dist.get_rank(), dist.get_world_size(), model
        self.ddp = crossover_ddp.wrap(DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def _bare_forward_backward(self, model: nn.Module,
                               batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Median seconds of the bare model's forward and backward on `batch`."""
        times = []
        for _ in range(CALIBRATION_STEPS + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            self.loss_fn(model(batch[0]), batch[1]).backward()
            if batch[0].is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return statistics.median(times[1:])

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None]) -> tuple[
            float, float]:
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.ddp(x), y)
        loss.backward()  # the allreduces finish inside
        sync()
        t1 = time.perf_counter()
        self.optimizer.step()
        sync()
        t2 = time.perf_counter()
        self.last_loss = float(loss.detach())
        compute = min(self.compute_per_step, t1 - t0)
        return compute + (t2 - t1), (t1 - t0) - compute

    def any_rank(self, flag: bool) -> bool:
        import torch.distributed as dist

        total = torch.tensor([float(flag)])
        dist.all_reduce(total)  # the gloo group takes CPU tensors
        return total.item() > 0


def main() -> None:
    """Train and print the JSON line (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("horovod", "ddp"), default="horovod",
                        help="ddp: DistributedDataParallel over gloo, launched by torchrun")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: local rank i computes on GPU i mod the GPUs present")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms (on CUDA it needs "
                             "CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="record the timed steps' GPU kernels with the torch profiler "
                             "to DIR/<job>.rank<r>.json, phase changes marked "
                             "(bench/harness/release_check.py checks them against the holds)")
    add_start_barrier_flags(parser)
    parser.add_argument("--step-times", action="store_true",
                        help="add each step's end (wall-clock seconds) to the JSON line "
                             "(`step_ends`): the step rate in any window")
    parser.add_argument("--stop-file", type=Path, default=None,
                        help=f"end early once this file exists (looked for every "
                             f"{STOP_EVERY} steps, all ranks at the same step); --steps is "
                             f"then the most")
    parser.add_argument("--skip-device-sync", action="store_true",
                        help="the negative control of that check: release the slot "
                             "without waiting for the GPU to finish")
    args = parser.parse_args()

    if args.framework == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        rank = dist.get_rank()
    else:
        import horovod.torch as hvd

        hvd.init()
        local_rank, rank = hvd.local_rank(), hvd.rank()
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core is one device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        # Not the NaN fill of every new tensor that deterministic mode adds: Horovod's
        # host copy of each CUDA gradient is a new tensor it overwrites whole, and filling
        # it first cost 3-4 ms of CPU per 64 MB gradient (seen in the H100 profile).
        torch.utils.deterministic.fill_uninitialized_memory = False
    if args.skip_device_sync:
        _lifecycle.device_sync = lambda device: None
    profiler = None
    if args.profile_dir is not None:
        from bench.harness.release_check import mark_phases  # bench/, this script's directory

        mark_phases()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
    torch.manual_seed(args.seed)
    model, data = build(args.model, args.width, args.layers)
    model.to(device)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    # data loading is not measured
    batches = [tuple(t.to(device) for t in data(args.batch, gen)) for _ in range(4)]
    trainer: Trainer = (DDPTrainer(model, device, batches[0]) if args.framework == "ddp"
                        else HorovodTrainer(model))

    compute = comm = 0.0
    sync()
    start_barrier(args.start_barrier, args.start_jobs, trainer.rank, trainer.size)
    if profiler is not None:
        profiler.start()
    start_wall, start = time.time(), time.perf_counter()
    cpu0, main0 = time.process_time(), time.thread_time()
    step_ends = []
    done = 0  # steps trained: --steps, or fewer where --stop-file ended the loop
    for step in range(args.steps):
        step_compute, step_comm = trainer.step(*batches[step % len(batches)], sync)
        compute += step_compute
        comm += step_comm
        done = step + 1
        if args.step_times:
            step_ends.append(time.time())
        if (args.stop_file is not None and (step + 1) % STOP_EVERY == 0
                and trainer.any_rank(args.stop_file.exists())):
            break
    elapsed = time.perf_counter() - start
    cpu, main_cpu = time.process_time() - cpu0, time.thread_time() - main0
    end_wall = start_wall + elapsed
    if profiler is not None:
        profiler.stop()
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        job = os.environ.get("CROSSOVER_JOB", "job")  # the name the crossover trace uses
        profiler.export_chrome_trace(str(args.profile_dir / f"{job}.rank{trainer.rank}.json"))
    weights = hashlib.sha256()
    for tensor in model.state_dict().values():
        weights.update(tensor.detach().cpu().contiguous().numpy().tobytes())

    if trainer.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({
            "model": args.model, "framework": args.framework, "params": params,
            "steps": done,
            "samples_per_s": done * args.batch * trainer.size / elapsed,
            "seconds": elapsed, "start": start_wall, "end": end_wall,
            "compute_s": compute, "comm_s": comm, "cpu_s": cpu,
            "main_thread_cpu_s": main_cpu, "loss": trainer.last_loss,
            "device": str(device), "weights_sha256": weights.hexdigest(),
            **({"step_ends": step_ends} if args.step_times else {}),
        }), flush=True)
    if args.framework == "ddp":
        dist.barrier()  # no rank tears its process group down while a peer still uses it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
