"""What freezing could gain on the fine-tuning workload: accuracy when the front freezes early.

    .venv/bin/python bench/freeze_oracle.py [--epochs 15] [--orders 3]   # about two minutes

In one process, one thread: the model, data and optimizer of
`examples/pipeline_digits.py --finetune` (an MLP with six hidden layers of 256,
pretrained on drawn stroke glyphs, a new head, fine-tuned on the digits 5-9; SGD 0.05 with
momentum, batch 50), with the first k hidden layers frozen from the start of epoch e,
for every k and e in the table; each cell is the mean test accuracy of the last five
epochs, averaged over `--orders` data orders. Any freezing criterion on this workload
can do at best what the cell of its choice says: the table bounds the criterion, not
the pipeline. Writes bench/results/freeze_oracle.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_digits as digits  # noqa: E402
from common import write_result  # noqa: E402

DEPTH, WIDTH, LR, BATCH = 6, 256, 0.05, 50
FROZEN_LAYERS = (1, 2, 3, 5, 6)  # the first k hidden layers
FROM_EPOCHS = (2, 3, 4, 5, 6, 7)  # frozen from the start of this epoch (1-based)


def fine_tune(frozen: int, from_epoch: int, order: int, epochs: int) -> list[float]:
    """Test accuracy after every epoch, the first `frozen` hidden layers frozen from
    `from_epoch` on."""
    torch.manual_seed(0)
    model = digits.MLP(DEPTH, WIDTH)
    digits.with_new_head(model, digits.pretrained_body(DEPTH, WIDTH))
    xs, ys, xt, yt = digits.digits_of(digits.FINETUNE)
    hidden = [model.layers[i] for i in range(0, 2 * DEPTH, 2)]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
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
    args = ap.parse_args()
    if args.epochs < max(FROM_EPOCHS) + 5 or args.orders < 1:
        ap.error(f"--epochs {args.epochs} --orders {args.orders}: give at least "
                 f"{max(FROM_EPOCHS) + 5} epochs (five after the latest freeze) and 1 order")
    torch.set_num_threads(1)

    def score(frozen: int, from_epoch: int) -> float:
        runs = [fine_tune(frozen, from_epoch, o, args.epochs) for o in range(args.orders)]
        return round(100 * statistics.mean(statistics.mean(r[-5:]) for r in runs), 2)

    baseline = score(0, 1)
    print(f"freeze oracle: no freezing {baseline:.2f} %", flush=True)
    table: dict[str, dict[str, float]] = {}
    for e in FROM_EPOCHS:
        table[str(e)] = {}
        for k in FROZEN_LAYERS:
            table[str(e)][str(k)] = score(k, e)
        print(f"freeze oracle: from epoch {e}: " + ", ".join(
            f"{k} layers {v:.2f}" for k, v in table[str(e)].items()), flush=True)
    out = write_result("freeze_oracle", {
        "workload": "finetune", "epochs": args.epochs, "orders": args.orders,
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
