"""How far one pair of probe windows is from the truth, from benchmark results.

Each emulated repetition of `makespan.py` records the auto daemon's decisions
(`auto_decisions`); their running means ("antiphase 1.12x concurrent after 2 pairs")
give every pair's speedup. The truth a pair estimates is the row's speedup of always
antiphase over plain together, end to end (median makespans). Prints each run's pairs
and the mean and standard deviation of the error over all pairs: what `pair_noise`
(crossover/scheduler/mode.py) should be compared with.

    .venv/bin/python -m bench.colocation.pair_noise bench/results/colocation/crossover.json \
        [more.json ...]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

MEAN = re.compile(r"antiphase ([0-9.]+)x concurrent")


def pairs_of(reasons: list[str]) -> list[float]:
    """Each pair's speedup, from the running means of one repetition's decisions (the
    means are rounded to 0.01, so later pairs carry up to n times that)."""
    start = max((i for i, r in enumerate(reasons) if "joined" in r), default=0)
    means = [float(m) for r in reasons[start:] for m in MEAN.findall(r)]
    pairs: list[float] = []
    for n, mean in enumerate(means, 1):
        pairs.append(mean * n - sum(pairs))
    return pairs


def main(paths: list[str]) -> None:
    errors = []
    for path in paths:
        try:
            rows = json.loads(Path(path).read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"{path}: not a makespan result ({exc!r}); pass the JSON files "
                     f"bench/colocation/makespan.py writes, e.g. "
                     f"bench/results/colocation/crossover.json")
        for row in rows:
            if not row["mbit"]:
                continue  # one host: no probe
            truth = row["plain_uncoordinated_s"] / row["crossover_s"]
            for rep, reasons in enumerate(row["auto_decisions"]):
                pairs = pairs_of(reasons)
                errors += [p - truth for p in pairs]
                print(f"{Path(path).name} {row['workload']} {row['mbit']:g} r{rep}: pairs "
                      f"{', '.join(f'{p:.2f}' for p in pairs)}; always antiphase x plain "
                      f"{truth:.2f}")
    if len(errors) < 2:
        sys.exit("fewer than two pairs found: pass makespan result files")
    print(f"{len(errors)} pairs: error mean {statistics.mean(errors):+.3f}, "
          f"standard deviation {statistics.pstdev(errors):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench/results/colocation/crossover.json"])
