"""When would a freezing criterion freeze? Gradient norms recorded once, criteria replayed.

    .venv/bin/python -m bench.freeze.replay [--workloads finetune digits] [--orders 3]

Each workload of bench/freeze/oracle.py trains in one process with nothing frozen, for
`--epochs` epochs in `--orders` data orders, recording every step's gradient norm of each
layer (the norm `GradientTracker` sums) and every epoch's test accuracy. The shipped
`FreezeCriterion` is then fed the recorded norms exactly as a run would feed it (interval
means over the sampled steps, `reads_gradients`), for every threshold, interval and
patience of the sweep, with and without a loss gate (`LOSS_GATES`), on four signals
(`interval_changes`):

- `norm`: a layer's gradient norm, as the trainer uses it;
- `share`: a layer's gradient norm over the head's, which removes the fall every layer
  shares as the training loss goes to zero;
- `drift`: how far a layer's weights moved over the interval against how far they moved
  since the start (scale-free);
- `drift_weight`: the same move against the weights' norm.

For each setting it reports, per order, the epoch in which the whole body (every hidden
layer) has frozen and what bench/freeze/oracle.py's table for that workload says freezing
the whole body from the start of that epoch costs (run the oracle first, with the whole
body among its `--layers`); then the settings that cost at most 0.3 points on every
workload trained from random weights, earliest on the fine-tuning bodies first. A replay
is exact until the first layer freezes; after that a real run's remaining layers would
see slightly different gradients, which is why only the whole body's freezing epoch is
reported.
Writes bench/results/freeze/freeze_replay.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys

import torch

from bench.freeze import oracle
from bench.freeze.oracle import digits
from bench.harness.common import area_results, write_result
from crossover.freeze.criterion import FreezeCriterion, LayerChange, reads_gradients

RESULTS = area_results("freeze")

# signal -> the thresholds swept (see `interval_changes`)
SIGNALS = {"norm": (0.05, 0.1, 0.15, 0.2, 0.3), "share": (0.05, 0.1, 0.15, 0.2, 0.3),
           "drift": (0.02, 0.05, 0.1, 0.2), "drift_weight": (0.005, 0.01, 0.02, 0.04)}
INTERVALS = (5, 14, 28)  # steps; 14 is one epoch of the fine-tuning digits at batch 50
PATIENCES = (1, 2, 3)
# no gate, or no layer counts as stable until an interval's mean training loss is at
# most this share of the first interval's: a body still learning its features (from
# random weights) should not freeze, and a pretrained one has them when the new head fits
LOSS_GATES = (None, 0.2, 0.1, 0.05)
SAFE_POINTS = 0.3  # what the issue allows freezing to cost in final accuracy


def record(workload: str, order: int, epochs: int) -> dict:
    """Training with nothing frozen: every step's gradient norm per layer (hidden layers
    front to back, then the head), each layer's weight drift at the end of every interval
    of `INTERVALS` (over the interval, since the start, and the weights' norm), and every
    epoch's test accuracy and mean training loss."""
    model, opt, hidden, (xs, ys, xt, yt) = oracle.start(workload)
    layers = [*hidden, model.layers[-1]]

    def weights() -> list[torch.Tensor]:
        return [torch.cat([p.detach().flatten() for p in layer.parameters()])
                for layer in layers]

    first = weights()
    last = {every: first for every in INTERVALS}
    drift: dict[int, list[list[tuple[float, float, float]]]] = {e: [] for e in INTERVALS}
    norms: list[list[float]] = []
    losses, accuracy = [], []
    step = 0
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(
            epoch + 100 * order))
        for s in range(0, len(xs) - oracle.BATCH + 1, oracle.BATCH):
            idx = perm[s:s + oracle.BATCH]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            losses.append(float(loss.detach()))
            norms.append([math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters()))
                          for layer in layers])
            opt.step()
            step += 1
            ends = [every for every in INTERVALS if step % every == 0]
            if ends:
                now = weights()
                for every in ends:
                    drift[every].append([(float((w - v).norm()), float((w - w0).norm()),
                                          float(w.norm()))
                                         for w, v, w0 in zip(now, last[every], first,
                                                             strict=True)])
                    last[every] = now
        accuracy.append(digits.accuracy(model, xt, yt))
    per_epoch = len(norms) // epochs
    return {"norms": norms, "drift": drift, "accuracy": accuracy, "losses": losses,
            "train_loss": [statistics.mean(losses[e * per_epoch:(e + 1) * per_epoch])
                           for e in range(epochs)], "steps_per_epoch": per_epoch}


def interval_changes(run: dict, signal: str, every: int, sample_every: int = 1
                     ) -> list[tuple[int, list[LayerChange | None]]]:
    """(step, each layer's change) at the end of every `every`-step interval, as the
    criterion would see it on `signal` (None: nothing to compare with yet).

    norm: the interval's mean gradient norm against the previous interval's (the
    trainer's); share: the same of each layer's mean norm over the head's; drift: the
    weights' move over the interval against their move since the start; drift_weight:
    against the weights' norm.
    """
    if signal in ("drift", "drift_weight"):
        pick = 1 if signal == "drift" else 2
        return [((k + 1) * every, [LayerChange(row[0], row[pick]) for row in layers])
                for k, layers in enumerate(run["drift"][every])]
    out = []
    sums, reads, prev = None, 0, None
    for step, row in enumerate(run["norms"], start=1):
        if reads_gradients(step, every, sample_every):
            sums = row if sums is None else [a + b for a, b in zip(sums, row, strict=True)]
            reads += 1
        if step % every:
            continue
        means = [total / reads for total in sums]
        if signal == "share":
            means = [m / means[-1] for m in means]
        out.append((step, [None] * len(means) if prev is None else
                    [LayerChange(abs(m - p), p) for m, p in zip(means, prev, strict=True)]))
        sums, reads, prev = None, 0, means
    return out


def gate_step(losses: list[float], every: int, ratio: float | None) -> int:
    """The end of the first `every`-step interval whose mean training loss is at most
    `ratio` times the first interval's (0 without a gate; past the run if never)."""
    if ratio is None:
        return 0
    first = statistics.mean(losses[:every])
    for end in range(every, len(losses) + 1, every):
        if statistics.mean(losses[end - every:end]) <= ratio * first:
            return end
    return len(losses) + 1


def replay(changes: list[tuple[int, list[LayerChange | None]]], threshold: float,
           patience: int, from_step: int = 0) -> list[tuple[int, tuple[str, ...]]]:
    """The (step, layers) decisions `FreezeCriterion` makes on recorded changes (the last
    layer is the head, which never freezes); evaluations before `from_step` find no
    layer stable (a loss gate)."""
    names = [f"L{i}" for i in range(len(changes[0][1]) - 1)] + ["head"]
    crit = FreezeCriterion(names, threshold=threshold, patience=patience, keep_last=1)
    decisions = []
    for step, layers in changes:
        seen = {n: ch for n, ch in zip(names, layers, strict=True)
                if ch is not None and n not in crit.frozen and step >= from_step}
        decision = crit.evaluate(step, seen)
        if decision:
            decisions.append((step, decision.layers))
    return decisions


def body_frozen_epoch(decisions: list[tuple[int, tuple[str, ...]]], hidden: int,
                      steps_per_epoch: int) -> float | None:
    """The epoch (1-based, fractional) by whose end every hidden layer has frozen."""
    frozen = 0
    for step, layers in decisions:
        frozen += len(layers)
        if frozen >= hidden:
            return round(step / steps_per_epoch, 2)
    return None


def oracle_loss(workload: str) -> dict[int, float]:
    """Points lost freezing the whole body from epoch e (the oracle's table), if run."""
    path = RESULTS / f"{oracle.result_name(workload)}.json"
    if not path.exists():
        return {}
    found = json.loads(path.read_text())
    depth = str(oracle.WORKLOADS[workload][0])
    return {int(e): row[depth] for e, row in found["loss_points"].items() if depth in row}


def cost(losses: dict[int, float], frozen_in: float | None) -> float | None:
    """What the oracle says freezing the body at epoch `frozen_in` costs: the cell for
    frozen from the start of the epoch it froze in (an upper bound, give or take the
    noise; frozen at an epoch's end: from the next); 0 when it never froze; past the
    table, the table's last epoch's (None where the table has nothing to say)."""
    if frozen_in is None:
        return 0.0
    if not losses:
        return None
    start = math.floor(frozen_in) + 1
    return losses.get(start, losses[max(losses)] if start > max(losses) else None)


def summary(results: dict) -> list[dict]:
    """Every setting that costs at most `SAFE_POINTS` on every workload trained from
    random weights, by the median epoch in which it froze the fine-tuning bodies (earliest
    first; never counts as the last epoch)."""
    untrained = [w for w in results if not oracle.WORKLOADS[w][2]]
    tuned = [w for w in results if oracle.WORKLOADS[w][2]]
    out = []
    for i, row in enumerate(results[next(iter(results))]["settings"]):
        rows = {w: results[w]["settings"][i] for w in results}
        worst = [c for w in untrained for c in rows[w]["oracle_loss_points"]]
        if any(c is None or c > SAFE_POINTS for c in worst):
            continue
        entry = {k: row[k] for k in ("signal", "threshold", "every", "patience", "loss_gate")}
        for w in tuned:
            frozen = [e if e is not None else results[w]["epochs"]
                      for e in rows[w]["body_frozen_in_epoch"]]
            entry[w] = {"median_frozen_in_epoch": statistics.median(frozen),
                        "oracle_loss_points": rows[w]["oracle_loss_points"]}
        out.append(entry)
    return sorted(out, key=lambda e: [e[w]["median_frozen_in_epoch"] for w in tuned])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+",
                    default=["finetune", "finetune-wide", "finetune-glyphs", "digits"],
                    choices=sorted(oracle.WORKLOADS))
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--orders", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for workload in args.workloads:
        hidden = oracle.WORKLOADS[workload][0]
        runs = []
        for order in range(args.orders):
            runs.append(record(workload, order, args.epochs))
            print(f"freeze replay: {workload} order {order} recorded, final accuracy "
                  f"{100 * runs[-1]['accuracy'][-1]:.2f} %", flush=True)
        losses = oracle_loss(workload)
        rows = []
        for signal, every in itertools.product(SIGNALS, INTERVALS):
            changes = [interval_changes(r, signal, every) for r in runs]
            for threshold, patience, gate in itertools.product(SIGNALS[signal], PATIENCES,
                                                               LOSS_GATES):
                epochs = [body_frozen_epoch(replay(ch, threshold, patience,
                                                   gate_step(r["losses"], every, gate)),
                                            hidden, r["steps_per_epoch"])
                          for ch, r in zip(changes, runs, strict=True)]
                rows.append({"signal": signal, "threshold": threshold, "every": every,
                             "patience": patience, "loss_gate": gate,
                             "body_frozen_in_epoch": epochs,
                             "oracle_loss_points": [cost(losses, e) for e in epochs]})
        final = [100 * statistics.mean(r["accuracy"][-5:]) for r in runs]
        results[workload] = {"no_freezing_accuracy": round(statistics.mean(final), 2),
                             "epochs": args.epochs,
                             # per epoch, median over orders: how the two kinds of run learn
                             "test_accuracy": [round(statistics.median(a), 4) for a in
                                               zip(*(r["accuracy"] for r in runs), strict=True)],
                             "train_loss": [round(statistics.median(v), 4) for v in
                                            zip(*(r["train_loss"] for r in runs), strict=True)],
                             "steps_per_epoch": runs[0]["steps_per_epoch"], "settings": rows}
    safe = summary(results)
    print(f"freeze replay: {len(safe)} settings cost at most {SAFE_POINTS} points trained "
          f"from random weights; the earliest on the fine-tuning bodies:")
    for entry in safe[:8]:
        print("  " + json.dumps(entry), flush=True)
    out = write_result(RESULTS, "freeze_replay", {"epochs": args.epochs, "orders": args.orders,
                                         "safe_points": SAFE_POINTS,
                                         "safe_from_random_weights": safe, "workloads": results})
    print(f"freeze replay: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
