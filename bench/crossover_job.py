"""The benchmark's training job: an MLP, a small CNN or a transformer block, synthetic data.

    mpirun -np 2 python bench/crossover_job.py --model cnn --steps 30

A Horovod PyTorch job under crossover (plain with CROSSOVER_ENABLE=0), seeded. Rank 0
prints one JSON line: wall-clock start and end of the training loop (epoch seconds, so
runs of several jobs can be laid on one time axis), samples/s, and the step's split into
compute (forward, backward, update) and exposed communication (waiting for the gradient
allreduces after backward), summed over the steps.
"""

from __future__ import annotations

import argparse
import json
import time

import horovod.torch as hvd
import torch
from torch import nn

import crossover.hooks.torch as crossover_torch

MODELS = ("mlp", "cnn", "transformer")


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


def main() -> None:
    """Train and print the JSON line (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # one core is one device
    torch.manual_seed(args.seed)
    model, data = build(args.model, args.width, args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    crossover_torch.wrap(optimizer)
    gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    loss_fn = nn.CrossEntropyLoss()
    batches = [data(args.batch, gen) for _ in range(4)]  # data loading is not measured

    compute = comm = 0.0
    start_wall, start = time.time(), time.perf_counter()
    cpu0, main0 = time.process_time(), time.thread_time()
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        optimizer.synchronize()  # the allreduces, without the slot
        t2 = time.perf_counter()
        with optimizer.skip_synchronize():
            optimizer.step()
        t3 = time.perf_counter()
        compute += (t1 - t0) + (t3 - t2)
        comm += t2 - t1
    elapsed = time.perf_counter() - start
    cpu, main_cpu = time.process_time() - cpu0, time.thread_time() - main0
    end_wall = start_wall + elapsed

    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({
            "model": args.model, "params": params, "steps": args.steps,
            "samples_per_s": args.steps * args.batch * hvd.size() / elapsed,
            "seconds": elapsed, "start": start_wall, "end": end_wall,
            "compute_s": compute, "comm_s": comm, "cpu_s": cpu,
            "main_thread_cpu_s": main_cpu, "loss": float(loss.detach()),
        }), flush=True)


if __name__ == "__main__":
    main()
