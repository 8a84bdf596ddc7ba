"""Freezing on the graph pipeline: time to a target accuracy, with and without freezing.

    .venv/bin/python -m bench.freeze.time_to_accuracy [--reps 3] [--epochs 20] [--target 0.96]
    .venv/bin/python -m bench.freeze.time_to_accuracy --workload finetune-glyphs --epochs 15

Each arm trains examples/pipeline_digits.py on 2 ranks under mpirun, same seed and
data, planned from op times measured once for all arms, and records after every epoch
the training seconds so far and the test accuracy. Workloads: `digits` (default), an MLP
with four hidden layers of 256 trained from random weights on scikit-learn's digits (SGD
lr 0.05 with momentum; freezing judged every 15 steps at threshold 0.1); `finetune`, an
MLP with six hidden layers of 256 pretrained on drawn stroke glyphs (cached) fine-tuned
with a new head on the digits 5-9 (lr 0.05; judged every 5 steps at 0.1);
`finetune-wide`, the same with layers of 1024, where a step's arithmetic outweighs the
pipeline's own costs (its body takes some minutes to pretrain, once);
`finetune-glyphs`, that wide body fine-tuned with a new head on 50 glyph classes it was
not pretrained on (5000 images to train on, 5000 to test; freezing by weight drift under
0.04 of the weights' norm over 14 steps, twice, once the training loss is down to 0.05
of its first interval's). Arms (run interleaved, rep by rep, so drift hits all alike):

    graph             the graph pipeline, no freezing
    graph_freeze      the same with freezing (the workload's flags: the default
                      threshold 0.05 freezes nothing on digits), static partition
    graph_freeze_repartition
                      the same freezing, and after every freeze decision a re-plan
                      with frozen layers at 1/6 of their cost, stages migrating between
                      the ranks in flight (--repartition)
    graph_freeze_cache
                      the same, but the frozen front stops running: its outputs are
                      cached per sample and the rest is re-planned over the ranks,
                      leaving out a rank it does not need (--repartition --cache)
    sequential        the sequential (chain) partitioner, no freezing

`time_to_accuracy_speedup` is graph / graph_freeze_cache time to the target (the
full freeze + re-partition + caching arm), `accuracy_loss_points` that arm's final
accuracy below graph's; `repartition_over_freeze` is graph_freeze /
graph_freeze_repartition time to the target and `cache_over_freeze` graph_freeze /
graph_freeze_cache; `fixed_epochs_speedup` is graph / graph_freeze_cache for all
epochs' time, `frozen_epoch_speedup` for the last five (when that arm runs frozen),
and the `frozen_*_over_freeze` keys compare the last five epochs with static freezing;
`spare_device_s` the device-seconds the cache arm's plans left free (a rank that runs
no stage takes no device slot: with --slots a co-located job gets that time). The
target accuracy is 0.96 on digits and, on the fine-tuning workloads, the lowest of the
no-freezing arm's last five epochs (median over reps). Written to
bench/results/freeze/freeze.json (digits) or freeze_<workload>.json (medians over reps) with a
plot of accuracy against training time per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness.common import REPO, area_results, write_result
from crossover.launch.local import mpi_env, mpirun

RESULTS = area_results("freeze")

# per workload: the example's model and training flags, and the freezing flags
WORKLOADS = {
    "finetune": (["--finetune", "--depth", "6", "--width", "256", "--lr", "0.05"],
                 ["--freeze-every", "5", "--freeze-threshold", "0.1"]),
    "finetune-wide": (["--finetune", "--depth", "6", "--width", "1024", "--lr", "0.05"],
                      ["--freeze-every", "5", "--freeze-threshold", "0.1"]),
    # chosen on this workload by bench/freeze/replay.py (and safe there on digits)
    "finetune-glyphs": (["--finetune", "glyphs", "--depth", "6", "--width", "1024",
                         "--lr", "0.05"],
                        ["--freeze-signal", "weight-drift", "--freeze-threshold", "0.04",
                         "--freeze-every", "14", "--freeze-loss-gate", "0.05"]),
    "digits": (["--depth", "4", "--width", "256", "--lr", "0.05"],
               ["--freeze-every", "15", "--freeze-threshold", "0.1"]),
}
ARMS = {  # arm -> flags after the workload's model flags (FREEZE: its freezing flags)
    "graph": [],
    "graph_freeze": ["FREEZE"],
    "graph_freeze_repartition": ["FREEZE", "--repartition"],
    "graph_freeze_cache": ["FREEZE", "--repartition", "--cache"],
    "sequential": ["--partitioner", "sequential"],
}


def arm_flags(workload: str, arm: str, criterion: dict[str, object] | None = None
              ) -> list[str]:
    """The example's flags for `arm` on `workload`; `criterion`: freezing flags (such as
    "--freeze-threshold") -> values instead of the workload's (None: the workload's)."""
    model, freeze = WORKLOADS[workload]
    settings = dict(zip(freeze[::2], freeze[1::2], strict=True))
    settings.update({k: str(v) for k, v in (criterion or {}).items() if v is not None})
    freeze = [f for pair in settings.items() for f in pair]
    return model + [f for a in ARMS[arm] for f in (freeze if a == "FREEZE" else [a])]


def criterion_flags(args: argparse.Namespace) -> dict[str, object]:
    """The freezing flags given on the command line (None: the workload's)."""
    return {"--freeze-threshold": args.freeze_threshold, "--freeze-every": args.freeze_every,
            "--freeze-signal": args.freeze_signal, "--freeze-loss-gate": args.freeze_loss_gate}


def example_cmd(flags: list[str], epochs: int, tmp: Path, name: str, history: Path
                ) -> list[str]:
    """examples/pipeline_digits.py on 2 ranks, its plot in `tmp`, its epochs' rows to
    `history`; op times measured by the first run in `tmp` and read by the others, so
    every arm starts from the same plan."""
    return mpirun(2, sys.executable, str(REPO / "examples/pipeline_digits.py"), "--epochs",
                  str(epochs), "--plot", str(tmp / f"{name}.png"), "--history", str(history),
                  "--profile", str(tmp / "costs.pkl"), *flags)


def run(workload: str, arm: str, epochs: int, tmp: Path, rep: int,
        criterion: dict[str, object] | None = None) -> list[dict]:
    history = tmp / f"{arm}.{rep}.json"
    cmd = example_cmd(arm_flags(workload, arm, criterion), epochs, tmp, arm, history)
    res = subprocess.run(cmd, env={**os.environ, **mpi_env(),
                                   "CROSSOVER_ENABLE": "0"},
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"{arm} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(history.read_text())


def time_to(rows: list[dict], target: float) -> float | None:
    return next((r["seconds"] for r in rows if r["accuracy"] >= target), None)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either arm never reached the target."""
    return a / b if a and b else None


def median_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) == len(values) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--workload", default="digits", choices=sorted(WORKLOADS))
    ap.add_argument("--target", type=float, default=None,
                    help="test accuracy to time (default: 0.96 on digits; fine-tuning: the "
                         "lowest of the no-freezing arm's last five epochs, median over "
                         "reps: what it holds once converged)")
    ap.add_argument("--freeze-threshold", type=float, default=None,
                    help="the criterion's threshold (default: the workload's)")
    ap.add_argument("--freeze-every", type=int, default=None, metavar="N",
                    help="steps between the criterion's evaluations (default: the "
                         "workload's)")
    ap.add_argument("--freeze-signal", choices=("gradient", "weight-drift"), default=None,
                    help="what the criterion judges a layer by (default: gradient)")
    ap.add_argument("--freeze-loss-gate", type=float, default=None, metavar="G",
                    help="the criterion's loss gate (default: none)")
    args = ap.parse_args()
    criterion = criterion_flags(args)
    tmp = Path(tempfile.mkdtemp(prefix="crossover-freeze-"))
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in ARMS}
    for rep in range(args.reps):
        for arm in ARMS:
            rows = run(args.workload, arm, args.epochs, tmp, rep, criterion)
            runs[arm].append(rows)
            print(f"freeze bench: rep {rep + 1}/{args.reps} {arm}: {rows[-1]['seconds']:.1f} s,"
                  f" accuracy {rows[-1]['accuracy']:.3f}, frozen {rows[-1]['frozen']}",
                  flush=True)
    target = args.target
    if target is None:
        target = 0.96 if args.workload == "digits" else statistics.median(
            min(e["accuracy"] for e in r[-5:]) for r in runs["graph"])
    arms = {}
    for arm, reps in runs.items():
        arms[arm] = {
            "seconds": statistics.median(r[-1]["seconds"] for r in reps),
            "final_accuracy": statistics.median(r[-1]["accuracy"] for r in reps),
            # one epoch's test accuracy on 297 images moves by +-1 point: also the mean
            "last5_accuracy": statistics.median(statistics.mean(e["accuracy"] for e in r[-5:])
                                                for r in reps),
            "time_to_target_s": median_or_none([time_to(r, target) for r in reps]),
            "frozen_at_end": reps[0][-1]["frozen"],
            "repartitions": reps[0][-1].get("repartitions", 0),
            "devices_at_end": reps[0][-1]["devices"],
            "last_epochs_s": statistics.median(r[-1]["seconds"] - r[-6]["seconds"]
                                               for r in reps),
            "spare_device_s": statistics.median(r[-1]["spare_device_s"] for r in reps),
        }
    base, frz = arms["graph"], arms["graph_freeze"]
    rep, cache = arms["graph_freeze_repartition"], arms["graph_freeze_cache"]
    result = {
        "workload": args.workload, "flags": {a: arm_flags(args.workload, a, criterion)
                                              for a in ARMS},
        "target_accuracy": target, "reps": args.reps, "epochs": args.epochs,
        "arms": arms,
        "freeze_static_speedup": ratio(base["time_to_target_s"], frz["time_to_target_s"]),
        "time_to_accuracy_speedup": ratio(base["time_to_target_s"],
                                          cache["time_to_target_s"]),
        "fixed_epochs_speedup": base["seconds"] / cache["seconds"],
        # once frozen: the last 5 epochs' time, no freezing / freeze + cache
        "frozen_epoch_speedup": base["last_epochs_s"] / cache["last_epochs_s"],
        "frozen_repartition_over_freeze": frz["last_epochs_s"] / rep["last_epochs_s"],
        "frozen_cache_over_freeze": frz["last_epochs_s"] / cache["last_epochs_s"],
        "repartition_over_freeze": ratio(frz["time_to_target_s"], rep["time_to_target_s"]),
        "cache_over_freeze": ratio(frz["time_to_target_s"], cache["time_to_target_s"]),
        "accuracy_loss_points": round(
            100 * (base["final_accuracy"] - cache["final_accuracy"]), 2),
        "accuracy_loss_points_last5": round(
            100 * (base["last5_accuracy"] - cache["last5_accuracy"]), 2),
        "accuracy_loss_points_repartition": round(
            100 * (base["final_accuracy"] - rep["final_accuracy"]), 2),
        "accuracy_loss_points_static": round(
            100 * (base["final_accuracy"] - frz["final_accuracy"]), 2),
    }
    name = "freeze" if args.workload == "digits" else \
        f"freeze_{args.workload.replace('-', '_')}"
    # beside the workload's own figures: freeze_finetune_wide_t0.04_weight-drift_every14_gate0.2
    for flag, tag in (("--freeze-threshold", "t"), ("--freeze-signal", ""),
                      ("--freeze-every", "every"), ("--freeze-loss-gate", "gate")):
        if criterion[flag] is not None:
            name += f"_{tag}{criterion[flag]:g}" if tag else f"_{criterion[flag]}"
    plot(runs, RESULTS / f"{name}.png", TITLES[args.workload])
    out = write_result(RESULTS, name, result)
    print(json.dumps({k: result[k] for k in ("arms", "freeze_static_speedup",
                                              "time_to_accuracy_speedup",
                                              "fixed_epochs_speedup",
                                              "frozen_epoch_speedup",
                                              "frozen_repartition_over_freeze",
                                              "frozen_cache_over_freeze",
                                              "repartition_over_freeze", "cache_over_freeze",
                                              "accuracy_loss_points")}, indent=1))
    print(f"freeze bench: wrote {out} and {RESULTS / (name + '.png')}")
    return 0


TITLES = {"digits": "digits MLP (4 x 256) from random weights, 2 ranks",
          "finetune": "6 x 256 MLP, stroke glyphs to digits 5-9, 2 ranks",
          "finetune-wide": "6 x 1024 MLP, stroke glyphs to digits 5-9, 2 ranks",
          "finetune-glyphs": "6 x 1024 MLP, stroke glyphs to 50 new glyphs, 2 ranks"}


def plot(runs: dict[str, list[list[dict]]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, reps in runs.items():
        rows = sorted(reps, key=lambda r: r[-1]["seconds"])[len(reps) // 2]  # median run
        ax.plot([r["seconds"] for r in rows], [r["accuracy"] for r in rows], marker=".",
                label=arm)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
