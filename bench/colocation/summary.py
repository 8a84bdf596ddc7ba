"""What a benchmark run's rows say: per-repetition ratios, fairness, how far apart a job's
ranks ran, idle device time, the headline keys and the README table.

Functions of the rows `makespan.py` builds and of the traces its runs write (no
runs of their own); `paired_vs_best`, `idle_gaps` and `headline` are table-tested in
tests/test_bench_order.py.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.harness.jobs import makespan
from crossover import trace


def paired_vs_best(solos: list[list[dict]], plain: list[list[dict]],
                   auto: list[list[dict]]) -> list[float]:
    """Per repetition: the better baseline of that repetition (its solos' sum or its
    plain-together makespan) over its auto makespan.

    The arms of one repetition run minutes apart, the repetitions up to an hour apart,
    and the VM's speed drifts between them (the same arm ran 42-49 s within fifteen
    minutes): a row whose ratio is low in every repetition loses; one whose median of
    medians is low while some repetitions win is within the noise.

    Args:
        solos: per repetition, each job's solo result.
        plain, auto: per repetition, the jobs' results together.
    """
    if not len(solos) == len(plain) == len(auto):
        raise ValueError(f"need one run of each arm per repetition; got {len(solos)} solo, "
                         f"{len(plain)} plain-together and {len(auto)} auto runs")
    return [min(sum(r["seconds"] for r in s), makespan(p)) / makespan(a)
            for s, p, a in zip(solos, plain, auto, strict=True)]


def jain(xs: list[float]) -> float:
    """Jain's fairness index of `xs`: 1 when all are equal, 1/n when one gets everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def apart_note(row: dict) -> str:
    """The runs' shares of holds a job's ranks started more than half a hold apart, if
    any job had ranks on two devices."""
    shares = {arm: [f"{100 * x:.0f}%" for x in runs if x is not None]
              for arm, runs in row["ranks_apart"].items()}
    shown = [f"{arm} {'/'.join(xs)}" for arm, xs in shares.items() if xs]
    return "; ranks apart " + ", ".join(shown) if shown else ""


def rank_skew(trace_dir: Path) -> tuple[float, float] | None:
    """The medians over jobs of `trace.rank_skew`'s median (ms) and `apart` share: how far
    apart a job's ranks on different devices start their holds in one traced run (None:
    no job had ranks on two devices). Served concurrently, a rank holds its device
    throughout."""
    skews = trace.rank_skew([ev for path in sorted(trace_dir.glob("*.json"))
                             for ev in trace.load(path)])
    if not skews:
        return None
    return (statistics.median(s["median_ms"] for s in skews.values()),
            statistics.median(s["apart"] for s in skews.values()))


def idle_gaps(events: list[dict]) -> dict:
    """From a merged trace: per device, the time some job held it (`held_s`, holds that
    overlap counted once: concurrent grants) and the time no job held it while some job
    waited for it (`idle_while_waiting_s`)."""
    holds = trace.holds_by_device(events)
    out = {}
    for dev, spans in holds.items():
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name") == "slot wait" and e.get("ph") == "X"
                 and e.get("args", {}).get("device") == dev]
        spans = sorted(spans)
        busy = gaps = 0.0
        covered = spans[0][0]  # the end of the holds so far (their union)
        for start, end, *_ in spans:
            if start > covered and any(ws < start and we > covered for ws, we in waits):
                gaps += start - covered
            busy += max(end, covered) - max(start, covered)
            covered = max(covered, end)
        out[dev] = {"held_s": busy / 1e6, "idle_while_waiting_s": gaps / 1e6,
                    "span_s": (covered - spans[0][0]) / 1e6}
    return {"devices": out}


def headline(rows: list[dict]) -> dict:
    """The headline keys. Do no harm: the worst row of the default policy (auto) against
    the better of sequential and plain together. Win where there is a gap: medians over
    the comm-heavy rows (comm >= compute, a link between the ranks)."""
    heavy = [r for r in rows if r["comm_s"] >= r["compute_s"] and r["mbit"]]
    med = statistics.median
    out = {
        "worst_vs_best_baseline": min(r["auto_vs_best_baseline"] for r in rows),
        "worst_row": min(rows, key=lambda r: r["auto_vs_best_baseline"])["workload"],
        # sequential counted as run back to back (the next job's launch and start-up in
        # it, as the second job's start-up is inside every together arm's makespan)
        "worst_vs_best_baseline_wall": min(r["auto_vs_best_baseline_wall"] for r in rows),
        # rows where auto lost to the better baseline (below 0.98) in every repetition
        "rows_below_in_every_rep": [
            f"{r['workload']}@{r['mbit']:g}" for r in rows
            if max(r.get("auto_vs_best_baseline_reps") or [1.0]) < 0.98],
        "single_job_overhead": med(r["single_job_overhead"] for r in rows),
        # the decision's cost on rows with a link (one host's jobs are served
        # concurrently with cores of their own: neither fixed mode)
        "auto_vs_best_fixed_mode": min((r["auto_vs_best_fixed_mode"] for r in rows
                                        if r["mbit"] and "auto_vs_best_fixed_mode" in r),
                                       default=None),
        "headline_rows": [f"{r['workload']}@{r['mbit']:g}" for r in heavy],
    }
    if heavy:
        out.update({
            "link_bound_fraction": med(r["bound_with_link_fraction"] for r in heavy),
            "crossover_vs_plain": med(r["auto_vs_plain"] for r in heavy),
            "auto_vs_sequential": med(r["auto_vs_sequential"] for r in heavy),
            "always_antiphase_vs_plain": med(r["crossover_vs_plain_uncoordinated"]
                                             for r in heavy),
        })
    return out


def print_table(rows: list[dict]) -> None:
    """The README table, in Markdown."""
    print("| workload | setting | compute/comm (s) | sequential (s) | plain together (s) | "
          "always antiphase (s) | auto (s) | bound with link (s) | auto x best baseline | "
          "auto x plain | of bound | Jain auto / plain | overhead |")
    print("|" + "---|" * 13)
    for r in rows:
        where = f"{r['mbit']:g} Mbit/s" if r["mbit"] else "one host"
        jain_ = r["jain_speedups"]
        print(f"| {r['workload']} | {where} | {r['compute_s']:.2f}/{r['comm_s']:.2f} | "
              f"{r['sequential_s']:.2f} | {r['plain_uncoordinated_s']:.2f} | "
              f"{r['crossover_s']:.2f} | {r['auto_s']:.2f} | {r['bound_with_link_s']:.2f} | "
              f"{r['auto_vs_best_baseline']:.2f} | {r['auto_vs_plain']:.2f} | "
              f"{100 * r['bound_with_link_fraction']:.0f}% | "
              f"{jain_['auto']:.3f} / {jain_['plain_together']:.3f} | "
              f"{100 * r['single_job_overhead']:+.1f}% |")
