"""Train an MLP on scikit-learn's handwritten digits with the graph pipeline.

    mpirun -np 2 python examples/pipeline_digits.py [--epochs 20] [--slots]
    mpirun -np 2 python examples/pipeline_digits.py --finetune --depth 6 [--freeze-every 5]
    mpirun -np 2 python examples/pipeline_digits.py --finetune glyphs --depth 6 --width 1024

The model is cut into as many stages as there are ranks (the partitioner plans it);
each rank trains its stage with SGD, which the trainer builds from a factory (so that,
with --repartition, it can rebuild it when stages move between ranks). The digits
(1797 8x8 images) ship inside scikit-learn: nothing is downloaded. Rank 0 shows a
progress bar, checks test accuracy after every epoch on the gathered model, and writes
a loss/accuracy plot.

`--finetune` trains the way freezing pays: a body pretrained on 1000 classes of drawn
stroke glyphs (made here, seeded, once, and cached in ~/.cache/crossover; about 40 s on
one core) gets a new head and is fine-tuned on the digits 5-9, which it has never seen.
Its front has learnt strokes in general and settles within a few epochs; the back adapts
longer (bench/freeze/oracle.py measures when freezing stops costing accuracy).
`--finetune glyphs` fine-tunes that body instead on 50 glyph classes drawn the same way
from another seed (5000 images to train on, 5000 to test).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import sys
import time
from pathlib import Path

import torch
from torch import nn

from crossover.pipeline.graph import Graph
from crossover.pipeline.profile import profile
from crossover.pipeline.train import PipelineTrainer
from crossover.testing import add_start_barrier_flags, start_barrier


class MLP(nn.Module):
    """64 pixels -> `classes` through `depth` hidden layers of `width` (by default
    three: 128, 128, 64)."""

    def __init__(self, depth: int = 0, width: int = 256, classes: int = 10) -> None:
        super().__init__()
        sizes = [64, 128, 128, 64] if depth == 0 else [64] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:], strict=False):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.layers = nn.Sequential(*layers, nn.Linear(sizes[-1], classes))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.layers(pixels)


def shuffled_digits(classes: tuple[int, ...] = tuple(range(10)), seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits of `classes` (pixels scaled to [0, 1], labels), in a seeded order."""
    from sklearn.datasets import load_digits

    data = load_digits()
    keep = torch.isin(torch.tensor(data.target), torch.tensor(classes))
    x = (torch.tensor(data.data, dtype=torch.float32) / 16.0)[keep]
    y = torch.tensor(data.target, dtype=torch.long)[keep]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x[order], y[order]


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y): 1500 images to train on, 297 to test."""
    x, y = shuffled_digits(seed=seed)
    return x[:1500], y[:1500], x[1500:], y[1500:]


FINETUNE = (5, 6, 7, 8, 9)  # the digit classes the pretrained body is fine-tuned on
PRETRAIN_CLASSES, PRETRAIN_COPIES, PRETRAIN_EPOCHS, PRETRAIN_SEED = 1000, 10, 30, 3
# the glyph task: new glyph classes (another seed), copies of each to train on and to test
GLYPH_CLASSES, GLYPH_TRAIN, GLYPH_TEST, GLYPH_SEED = 50, 100, 100, 11


def glyph_drawings(classes: int, g: torch.Generator) -> torch.Tensor:
    """`classes` drawings (classes x 1 x 8 x 8) of three random straight strokes each,
    blurred, their brightest pixel 1."""
    protos = torch.zeros(classes, 1, 8, 8)
    for c in range(classes):
        for _ in range(3):
            r0, c0, r1, c1 = torch.randint(0, 8, (4,), generator=g).tolist()
            for t in torch.linspace(0, 1, 12).tolist():
                protos[c, 0, round(r0 + (r1 - r0) * t), round(c0 + (c1 - c0) * t)] = 1
    protos = nn.functional.avg_pool2d(nn.functional.pad(protos, (1, 1, 1, 1)), 3, 1)
    return protos / protos.amax(dim=(2, 3), keepdim=True)


def stroke_glyphs(classes: int, copies: int, seed: int = PRETRAIN_SEED
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pretraining set drawn here, not downloaded: `classes` glyphs of three random
    straight strokes on the 8x8 grid, blurred and scaled to [0, 1] like the digits' ink
    counts, and `copies` of each, every one turned (up to 0.25 rad), scaled (up to 15%)
    and moved (up to a pixel) at random, with pixel noise. Many classes make the body
    learn strokes in general rather than a few shapes; no glyph is a digit class."""
    g = torch.Generator().manual_seed(seed)
    protos = glyph_drawings(classes, g).repeat(copies, 1, 1, 1)
    n = len(protos)
    turn = (torch.rand(n, generator=g) - 0.5) * 0.5
    scale = 1 + (torch.rand(n, generator=g) - 0.5) * 0.3
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1] = scale * torch.cos(turn), -scale * torch.sin(turn)
    theta[:, 1, 0], theta[:, 1, 1] = scale * torch.sin(turn), scale * torch.cos(turn)
    theta[:, :, 2] = (torch.rand(n, 2, generator=g) - 0.5) * 0.4  # 0.2 of the half-width
    grid = nn.functional.affine_grid(theta, list(protos.shape), align_corners=False)
    xs = nn.functional.grid_sample(protos, grid, align_corners=False).view(n, 64)
    xs = (xs + 0.1 * torch.randn(xs.shape, generator=g)).clamp(0, 1)
    return xs, torch.arange(classes).repeat(copies)


def new_glyphs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y) of `GLYPH_CLASSES` glyphs drawn as the
    pretraining ones are but from another seed, so none is a class the body was trained
    to tell apart: 5000 images to train on and 5000 to test (a test image is 0.02
    points, where the digits 5-9 have 180)."""
    xs, ys = stroke_glyphs(GLYPH_CLASSES, GLYPH_TRAIN + GLYPH_TEST, GLYPH_SEED)
    cut = GLYPH_CLASSES * GLYPH_TRAIN  # laid out copy by copy, every class in each
    return xs[:cut], ys[:cut], xs[cut:], ys[cut:]


def digits_of(classes: tuple[int, ...], seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y) of the digits in `classes`: 80% to train on."""
    x, y = shuffled_digits(classes, seed)
    cut = len(x) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor,
                ys: torch.Tensor, seed: int, batch: int = 50) -> None:
    """One epoch in one process: whole batches of `batch` in a seeded order."""
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(seed))
    for s in range(0, len(xs) - batch + 1, batch):
        idx = order[s:s + batch]
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        opt.step()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of `x` that `model` labels as `y`."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def pretrained_body(depth: int, width: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The MLP's body (every layer but the head) trained to tell apart the
    `stroke_glyphs` (`PRETRAIN_EPOCHS` epochs of SGD, one process, seeded), from the
    cache or made and cached now, on `device` ("cuda": seconds where one core takes
    minutes; the body then differs from the CPU's in rounding)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "crossover"
    path = cache / (f"strokes-mlp-{depth}x{width}-pretrained-{PRETRAIN_CLASSES}x"
                    f"{PRETRAIN_COPIES}-e{PRETRAIN_EPOCHS}.pt")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        pass
    except Exception as exc:  # a damaged file (a crash while saving): made again
        print(f"pretrained body {path} unreadable ({exc}); making it again", flush=True)
    print(f"pretraining the body on {PRETRAIN_CLASSES} stroke glyphs (made once, cached "
          f"in {path})", flush=True)
    torch.manual_seed(1)
    model = MLP(depth, width)
    model.layers[-1] = nn.Linear(model.layers[-1].in_features, PRETRAIN_CLASSES)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = (t.to(device) for t in stroke_glyphs(PRETRAIN_CLASSES, PRETRAIN_COPIES))
    for epoch in range(PRETRAIN_EPOCHS):
        train_epoch(model, opt, xs, ys, seed=epoch)
    head = f"layers.{len(model.layers) - 1}."
    body = {k: v.cpu() for k, v in model.state_dict().items() if not k.startswith(head)}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(body, tmp)
        tmp.replace(path)  # whole or not at all, if two runs make it at once
    except OSError as exc:  # a read-only cache: the body is made again next time
        print(f"could not cache the pretrained body in {path}: {exc}", flush=True)
    return body


def with_new_head(model: MLP, body: dict[str, torch.Tensor]) -> None:
    """Load the pretrained body into `model`, keeping `model`'s own (fresh) head."""
    model.load_state_dict({**model.state_dict(), **body})


def progress(epoch: int, epochs: int, step: int, steps: int, loss: float) -> None:
    done = int(30 * step / steps)
    print(f"\repoch {epoch + 1:>3}/{epochs} [{'#' * done}{'.' * (30 - done)}] "
          f"loss {loss:.3f}", end="", flush=True)


def main() -> int:
    # imported here: importing the module for its data and model (as the tests do) must
    # not initialise MPI in that process (an mpirun it starts later would then fail)
    from mpi4py import MPI

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--micro", type=int, default=5, help="micro-batches per batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--slots", action="store_true", help="share devices via the daemon")
    ap.add_argument("--freeze-every", type=int, default=None, metavar="N",
                    help="freeze front layers that stopped learning (--freeze-signal), "
                         "judged every N steps (default: no freezing)")
    ap.add_argument("--freeze-threshold", type=float, default=0.05,
                    help="a layer is stable while its mean gradient moves less than this "
                         "(relative) from one N-step interval to the next, or with "
                         "--freeze-signal weight-drift, its weights move less than this "
                         "share of their norm in an interval")
    ap.add_argument("--freeze-signal", choices=("gradient", "weight-drift"),
                    default="gradient", help="what a layer is judged by (default gradient)")
    ap.add_argument("--freeze-loss-gate", type=float, default=None, metavar="G",
                    help="no layer freezes before an interval's mean training loss is at "
                         "most G times the first interval's (default: no gate)")
    ap.add_argument("--freeze-sample-every", type=int, default=None, metavar="K",
                    help="an interval's mean gradient norms come from every K-th step and "
                         "its last (default: every step of intervals under 32 steps, up "
                         "to every 8th of 128 or more; each read is a pass over the "
                         "gradients)")
    ap.add_argument("--repartition", action="store_true",
                    help="after every freeze decision, re-plan with the frozen layers' "
                         "lower cost and move stages between ranks (needs --freeze-every)")
    ap.add_argument("--cache", action="store_true",
                    help="stop running the frozen front: cache its outputs per sample and "
                         "re-plan the rest over the ranks (needs --repartition)")
    ap.add_argument("--depth", type=int, default=0,
                    help="hidden layers of --width (default: three, 128-128-64)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="plan from measured op times instead of parameter counts, kept "
                         "in PATH: measured on the first run, read on later ones (so that "
                         "runs to compare plan alike)")
    ap.add_argument("--finetune", nargs="?", const="digits", choices=("digits", "glyphs"),
                    help="fine-tune a body pretrained on drawn stroke glyphs (made once, "
                         "cached) with a new head: on the digits 5-9 (the default) or on "
                         f"{GLYPH_CLASSES} new glyph classes (glyphs)")
    ap.add_argument("--plot", default="pipeline_digits.png", help="rank 0 writes it here")
    ap.add_argument("--partitioner", default="graph", choices=["graph", "sequential"])
    ap.add_argument("--history", default=None, help="rank 0 writes per-epoch JSON here "
                    "(seconds of training so far, loss, test accuracy, frozen layers)")
    add_start_barrier_flags(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model on every rank
    model = MLP(args.depth, args.width, GLYPH_CLASSES if args.finetune == "glyphs" else 10)
    xs, ys, xt, yt = digits()
    if args.finetune:
        # rank 0 makes (or reads) the body and hands it to every rank, so that a failure
        # there reaches all of them instead of leaving them waiting
        body, error = None, None
        if MPI.COMM_WORLD.Get_rank() == 0:
            try:
                body = pretrained_body(args.depth, args.width)
            except Exception as exc:
                error = f"rank 0 could not make the pretrained body: {exc!r}"
        body, error = MPI.COMM_WORLD.bcast((body, error), root=0)
        if error:
            sys.exit(error)
        with_new_head(model, body)
        xs, ys, xt, yt = new_glyphs() if args.finetune == "glyphs" else digits_of(FINETUNE)
    reference = copy.deepcopy(model)  # rank 0 evaluates the gathered weights in it
    costs = None
    if args.profile and MPI.COMM_WORLD.Get_rank() == 0:  # only rank 0 plans
        saved = Path(args.profile)
        if saved.exists():
            costs = pickle.loads(saved.read_bytes())
        else:
            micro = args.batch // args.micro
            costs = profile(Graph.from_fx(model), lambda b: {"pixels": xs[:b]},
                            sizes=(max(micro // 2, 1), micro))
            saved.write_bytes(pickle.dumps(costs))
    trainer = PipelineTrainer(model, nn.functional.cross_entropy, batch=args.batch,
                              num_micro=args.micro, example={"pixels": xs[:args.batch]},
                              slots=args.slots, freeze_every=args.freeze_every,
                              freeze_threshold=args.freeze_threshold,
                              freeze_sample_every=args.freeze_sample_every,
                              freeze_signal=args.freeze_signal,
                              freeze_loss_gate=args.freeze_loss_gate,
                              partitioner=args.partitioner, costs=costs,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=args.lr,
                                                                   momentum=0.9),
                              repartition=args.repartition, cache_frozen=args.cache)
    rank = trainer.comm.Get_rank()
    if rank == 0:
        print(trainer.plan.describe(), flush=True)
    steps = len(xs) // args.batch
    start_barrier(args.start_barrier, args.start_jobs, rank, trainer.comm.Get_size())
    history, rows, trained_s, shown = [], [], 0.0, 0
    spare_s = 0.0  # device-seconds of ranks the plan left out (free for other jobs)
    for epoch in range(args.epochs):
        trainer.comm.Barrier()
        started, wall_start = time.perf_counter(), time.time()
        cut_walls = []  # when this epoch's re-partitions took effect (wall clock)
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for s in range(steps):
            idx = order[s * args.batch:(s + 1) * args.batch]
            spare = trainer.comm.Get_size() - trainer.plan.devices
            step_started, parts_before = time.perf_counter(), len(trainer.repartitions)
            # a whole step (the trainer zeroes and steps its optimizer); which data this
            # rank needs can change when the trainer re-partitions
            loss = trainer.step({"pixels": xs[idx]} if trainer.needs_inputs else None,
                                ys[idx] if trainer.needs_target else None, index=idx)
            total += loss
            spare_s += spare * (time.perf_counter() - step_started)
            if len(trainer.repartitions) > parts_before:
                cut_walls.append(time.time())
            if rank == 0:
                progress(epoch, args.epochs, s + 1, steps, total / (s + 1))
        trainer.release_device()  # evaluation follows: the device's other jobs go on
        trainer.comm.Barrier()
        trained_s += time.perf_counter() - started  # evaluation is not training time
        wall_end = time.time()
        state = trainer.state_dict()  # collective
        if rank == 0:
            reference.load_state_dict(state)
            acc = accuracy(reference, xt, yt)
            history.append((total / steps, acc))
            frozen = [n for d in trainer.freeze_log for n in d.layers]
            rows.append({"epoch": epoch + 1, "seconds": trained_s, "loss": total / steps,
                         "accuracy": acc, "frozen": frozen,
                         "repartitions": len(trainer.repartitions),
                         "devices": trainer.plan.devices, "spare_device_s": spare_s,
                         "wall_start": wall_start, "wall_end": wall_end,
                         "repartition_walls": cut_walls})
            print(f"  test accuracy {acc:.3f}" + (f"; frozen: {', '.join(frozen)}"
                                                  if frozen else ""), flush=True)
            for step, plan in trainer.repartitions[shown:]:
                print(f"  re-partitioned after step {step}: {plan}", flush=True)
            shown = len(trainer.repartitions)
    if rank == 0:
        if args.history:
            with open(args.history, "w") as f:
                json.dump(rows, f)
        plot(history, args.plot, {"digits": "MLP fine-tuned on digits 5-9, graph pipeline",
                                  "glyphs": f"MLP fine-tuned on {GLYPH_CLASSES} new glyphs, "
                                            "graph pipeline"}.get(args.finetune,
                                                                  "MLP on digits, graph pipeline"))
        print(f"final test accuracy {history[-1][1]:.3f}; plot: {args.plot}", flush=True)
    return 0


def plot(history: list[tuple[float, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = range(1, len(history) + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(epochs, [h[0] for h in history], color="tab:blue", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss", color="tab:blue")
    acc = ax.twinx()
    acc.plot(epochs, [h[1] for h in history], color="tab:green", label="test accuracy")
    acc.set_ylabel("test accuracy", color="tab:green")
    acc.set_ylim(0, 1)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
