"""What freezing could gain on a fine-tuning workload: accuracy when the front freezes early.

    .venv/bin/python -m bench.freeze.oracle [--workload finetune] [--epochs 15] [--orders 3]

In one process, one thread: the model, data and optimizer of
`examples/pipeline_digits.py --finetune` (an MLP with six hidden layers of 256, or 1024
for `finetune-wide`, pretrained on drawn stroke glyphs, a new head, fine-tuned on the
digits 5-9; `finetune-glyphs`: the wide body fine-tuned on 50 new glyph classes; SGD
0.05 with momentum, batch 50), with the first k hidden layers frozen from
the start of epoch e, for every k and e in the table; each cell is the mean test accuracy
of the last five epochs, averaged over `--orders` data orders. Any freezing criterion on
this workload can do at best what the cell of its choice says: the table bounds the
criterion, not the pipeline. About two minutes for `finetune`, half an hour for
`finetune-wide` (`--layers 6` for the whole body only: a sixth of it; `finetune-glyphs
--layers 6`, about 12 minutes). Writes
bench/results/freeze/freeze_oracle.json (freeze_oracle_<workload>.json for the others).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.harness.common import area_results, write_result
from examples import pipeline_digits as digits

RESULTS = area_results("freeze")

LR, BATCH = 0.05, 50
# workload -> (hidden layers, their width, the task a pretrained body is fine-tuned on, or
# None: trained from random weights), as bench/freeze/time_to_accuracy.py runs them
WORKLOADS = {"finetune": (6, 256, "digits"), "finetune-wide": (6, 1024, "digits"),
             "finetune-glyphs": (6, 1024, "glyphs"), "digits": (4, 256, None)}
FROZEN_LAYERS = (1, 2, 3, 5, 6)  # the first k hidden layers
FROM_EPOCHS = (2, 3, 4, 5, 6, 7)  # frozen from the start of this epoch (1-based)


def start(workload: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.nn.Module],
                                  tuple[torch.Tensor, ...]]:
    """The workload's model (seeded; the pretrained body and a new head when it fine-tunes),
    its optimizer, its hidden layers front to back, and its data (train x, y, test x, y)."""
    depth, width, task = WORKLOADS[workload]
    torch.manual_seed(0)
    model = digits.MLP(depth, width, digits.GLYPH_CLASSES if task == "glyphs" else 10)
    if task:
        digits.with_new_head(model, digits.pretrained_body(depth, width))
        data = digits.new_glyphs() if task == "glyphs" else digits.digits_of(digits.FINETUNE)
    else:
        data = digits.digits()
    hidden = [model.layers[i] for i in range(0, 2 * depth, 2)]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, opt, hidden, data


def result_name(workload: str) -> str:
    """The oracle's result file for `workload` (in bench/results, without .json)."""
    return "freeze_oracle" if workload == "finetune" else \
        f"freeze_oracle_{workload.replace('-', '_')}"


def fine_tune(workload: str, frozen: int, from_epoch: int, order: int, epochs: int
              ) -> list[float]:
    """Test accuracy after every epoch, the first `frozen` hidden layers frozen from
    `from_epoch` on."""
    model, opt, hidden, (xs, ys, xt, yt) = start(workload)
    scores = []
    for epoch in range(1, epochs + 1):
        if epoch == from_epoch:
            for layer in hidden[:frozen]:
                for p in layer.parameters():
                    p.requires_grad_(False)
                    p.grad = None  # and so no momentum step either
        digits.train_epoch(model, opt, xs, ys, seed=epoch + 100 * order, batch=BATCH)
        scores.append(digits.accuracy(model, xt, yt))
    return scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--orders", type=int, default=3, help="data orders to average over")
    ap.add_argument("--workload", default="finetune", choices=sorted(WORKLOADS))
    ap.add_argument("--layers", type=int, nargs="+", default=list(FROZEN_LAYERS),
                    choices=range(1, 7), metavar="K",
                    help="frozen-layer counts to try (default 1 2 3 5 6)")
    ap.add_argument("--from-epochs", type=int, nargs="+", default=list(FROM_EPOCHS),
                    metavar="E", help="epochs to freeze from (default 2-7)")
    args = ap.parse_args()
    depth = WORKLOADS[args.workload][0]
    if max(args.layers) > depth:
        ap.error(f"--layers {max(args.layers)}: {args.workload} has {depth} hidden layers")
    if args.epochs < max(args.from_epochs) + 5 or args.orders < 1 or \
            min(args.from_epochs) < 2:
        ap.error(f"--epochs {args.epochs} --orders {args.orders} --from-epochs "
                 f"{args.from_epochs}: give epochs from 2 on, at least five more epochs "
                 f"than the latest, and 1 order or more")
    torch.set_num_threads(1)

    def score(frozen: int, from_epoch: int) -> float:
        runs = [fine_tune(args.workload, frozen, from_epoch, o, args.epochs)
                for o in range(args.orders)]
        return round(100 * statistics.mean(statistics.mean(r[-5:]) for r in runs), 2)

    baseline = score(0, 1)
    print(f"freeze oracle: no freezing {baseline:.2f} %", flush=True)
    table: dict[str, dict[str, float]] = {}
    for e in args.from_epochs:
        table[str(e)] = {}
        for k in args.layers:
            table[str(e)][str(k)] = score(k, e)
        print(f"freeze oracle: from epoch {e}: " + ", ".join(
            f"{k} layers {v:.2f}" for k, v in table[str(e)].items()), flush=True)
    out = write_result(RESULTS, result_name(args.workload), {
        "workload": args.workload, "epochs": args.epochs, "orders": args.orders,
        "accuracy": "mean test accuracy (%) of the last five epochs, mean over orders",
        "no_freezing": baseline,
        "frozen_from_epoch_by_layers": table,
        "loss_points": {e: {k: round(baseline - v, 2) for k, v in row.items()}
                        for e, row in table.items()},
    })
    print(f"freeze oracle: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
